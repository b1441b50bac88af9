"""``edge-fl report RUN_DIR ...``: CSV export and figures from recorded runs.

Registered lazily by the command group, so ``edge-fl --help`` never imports matplotlib; the report
module itself imports it only when a figure is drawn.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

__all__ = ["report"]


@click.command("report")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="directory for the figures (default: the run directory, when there is one run)",
)
@click.option("--csv", "write_csvs", is_flag=True, help="also write RUN_DIR/metrics.csv per run")
@click.option(
    "--label",
    "labels",
    multiple=True,
    help="legend name of each run, in RUN_DIR order (default: mechanism and target epsilon)",
)
def report(run_dirs: tuple[Path, ...], out: Path | None, write_csvs: bool, labels: tuple) -> None:
    """Plot accuracy, bytes up/down and epsilon per round of one or more runs (overlaid)."""
    from edge_fl.report import make_report

    try:
        result = make_report(run_dirs, out, write_csvs=write_csvs, labels=labels or None)
    except (ValueError, OSError) as exc:  # RunFileError is a ValueError
        click.echo(f"edge-fl: error: {exc}", err=True)
        sys.exit(2)
    for path in result.written:
        click.echo(f"wrote {path}")
    for note in result.notes:
        click.echo(note)
