"""Run records on disk -> CSV and figures (``edge-fl report``, the privacy benchmark).

Reads what :class:`edge_fl.metrics.RunRecorder` wrote. ``metrics.jsonl`` is the primary record and
the only required file: a run cut short has no ``summary.json`` but still has every round it
finished. A malformed file is an error that names the file and the line, never a silent gap in a
plot. matplotlib is imported only when a figure is drawn, and only its Agg canvas is used (no
pyplot, no global backend switch), so reading runs and writing CSV never pay for it and plotting
works on a headless device or inside a test process that has its own backend.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

__all__ = [
    "CSV_FIRST_COLUMNS",
    "EpsilonPoint",
    "ReportResult",
    "RunData",
    "RunFileError",
    "accuracy_figure",
    "accuracy_vs_epsilon_points",
    "bytes_figure",
    "csv_rows",
    "default_label",
    "device_costs_figure",
    "epsilon_figure",
    "frontier_figure",
    "make_report",
    "plot_accuracy",
    "plot_accuracy_vs_epsilon",
    "plot_bytes",
    "plot_device_costs",
    "plot_epsilon",
    "plot_frontier",
    "read_metrics",
    "read_run",
    "run_labels",
    "write_csv",
]

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
RUN_FILE = "run.json"
#: what ``edge-fl report`` writes into a run's directory (the CSV with --csv; the figures when
#: no --out is given): starting afresh there (``overwrite``) removes them with the run's own
#: files, so no figure or CSV of the earlier run passes for the new one's
REPORT_FILES = (
    "metrics.csv",
    "accuracy.png",
    "bytes.png",
    "frontier.png",
    "device_costs.png",
    "epsilon.png",
)

# the columns a reader looks for first; any other key follows in first-seen order
CSV_FIRST_COLUMNS = (
    "round",
    "version",
    "status",
    "accuracy",
    "loss",
    "selected",
    "target",
    "received",
    "late",
    "rejected",
    "bytes_up",
    "bytes_down",
    "wire_up",
    "wire_down",
    "messages_up",
    "epsilon",
    "delta",
    "accountant",
    "wall_time_s",
    "elapsed_s",
)

# numeric fields the figures use: each must be a number or null when present
_NUMERIC = (
    "accuracy",
    "loss",
    "bytes_up",
    "bytes_down",
    "wire_up",
    "wire_down",
    "wire_up_p50",
    "wire_up_p95",
    "wire_up_max",
    "epsilon",
    "delta",
)


class RunFileError(ValueError):
    """A run file that is missing or malformed; the message names the file (and the line)."""


# ------------------------------------------------------------------------------------ reading


def _is_number(value: Any) -> TypeGuard[float]:
    """An int or a float, not a bool (JSON's numbers)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_record(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise RunFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    rnd = record.get("round")
    if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 0:
        raise RunFileError(f"{where}: 'round' = {rnd!r} must be present, an integer >= 0")
    for key in _NUMERIC:
        value = record.get(key)
        if value is not None and not _is_number(value):
            raise RunFileError(f"{where}: {key!r} = {value!r} is not a number or null")
    return record


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The per-round records of ``metrics.jsonl``, validated; blank lines are ignored."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunFileError(
            f"{path}: not found (a run directory written by `edge-fl simulate --out DIR` "
            f"or `edge-fl aggregator --out DIR` holds {METRICS_FILE})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunFileError(f"{path}: cannot be read: {exc}") from None
    records: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RunFileError(
                f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from None
        records.append(_check_record(record, where))
    if not records:
        raise RunFileError(f"{path}: no rounds recorded (the file is empty)")
    return records


def _read_json_object(path: Path) -> dict[str, Any] | None:
    """An optional JSON object file: None when absent, an error naming the line when broken."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunFileError(f"{path}: cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RunFileError(
            f"{path} line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
        ) from None
    if not isinstance(data, dict):
        raise RunFileError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class RunData:
    """One run directory: its rounds, and its summary and metadata when they exist."""

    directory: Path
    records: list[dict[str, Any]]
    summary: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None

    def _privacy_config(self) -> dict[str, Any]:
        config = (self.meta or {}).get("config") or {}
        privacy = config.get("privacy") if isinstance(config, dict) else None
        return privacy if isinstance(privacy, dict) else {}

    @property
    def mechanism(self) -> str:
        for source in (self.summary or {}, self._privacy_config(), self.records[-1]):
            value = source.get("mechanism")
            if isinstance(value, str) and value:
                return value
        return "none"

    @property
    def mode(self) -> str:
        """``sync``, ``fedbuff`` or ``fedasync`` (run.json's config; sync when it does not say)."""
        config = (self.meta or {}).get("config") or {}
        rounds = config.get("rounds") if isinstance(config, dict) else None
        mode = rounds.get("mode") if isinstance(rounds, dict) else None
        return mode if isinstance(mode, str) and mode else "sync"

    @property
    def step_key(self) -> str:
        """The x of a per-round figure: the round, or in async modes the model version (a
        record there closes a window of updates; the version is what the devices trained on)."""
        return "round" if self.mode == "sync" else "version"

    @property
    def target_epsilon(self) -> float | None:
        """The job's configured epsilon (run.json), not what the accountant reported."""
        value = self._privacy_config().get("epsilon")
        return float(value) if _is_number(value) else None

    @property
    def final_accuracy(self) -> float | None:
        value = (self.summary or {}).get("final_accuracy", self.records[-1].get("accuracy"))
        return float(value) if _is_number(value) else None

    @property
    def privacy(self) -> dict[str, Any]:
        """The summary's privacy report, or what the last round recorded."""
        report = (self.summary or {}).get("privacy")
        if isinstance(report, dict) and report:
            return report
        last = self.records[-1]
        return {k: last[k] for k in ("epsilon", "delta", "accountant") if last.get(k) is not None}

    @property
    def reported_epsilon(self) -> float | None:
        value = self.privacy.get("epsilon")
        return float(value) if _is_number(value) else None


def read_run(directory: str | Path) -> RunData:
    """One run directory: ``metrics.jsonl`` required, ``summary.json`` and ``run.json`` optional."""
    directory = Path(directory)
    if not directory.exists():
        raise RunFileError(f"{directory}: run directory does not exist")
    if not directory.is_dir():
        raise RunFileError(f"{directory}: not a directory (pass the run's --out directory)")
    return RunData(
        directory,
        read_metrics(directory / METRICS_FILE),
        _read_json_object(directory / SUMMARY_FILE),
        _read_json_object(directory / RUN_FILE),
    )


def default_label(run: RunData) -> str:
    """``mechanism eps=E`` from the configured target, so overlaid runs tell themselves apart."""
    eps = run.target_epsilon
    if run.mechanism == "none" or eps is None:
        return run.mechanism
    return f"{run.mechanism} eps={eps:g}"


def run_labels(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> list[str]:
    """Explicit labels (one per run), else default labels made unique with the directory name."""
    if labels:
        if len(labels) != len(runs):
            raise ValueError(
                f"labels: got {len(labels)} label(s) for {len(runs)} run(s); give one --label per "
                "run directory, in the same order, or none"
            )
        return list(labels)
    names = [default_label(r) for r in runs]
    return [
        f"{name} ({run.directory.name})" if names.count(name) > 1 else name
        for name, run in zip(names, runs, strict=True)
    ]


# ------------------------------------------------------------------------------------ CSV


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested objects become dotted columns (``rejected_by_reason.late``)."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _cell(value: Any) -> str:
    """JSON spellings in the cells: empty for null, true/false, lists as JSON."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ""
    if isinstance(value, list | tuple):
        return json.dumps(value)
    return str(value)


def csv_rows(records: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(columns, rows): the known columns first, then the rest in first-seen order."""
    flat = [_flatten(r) for r in records]
    seen: dict[str, None] = {}
    for row in flat:
        seen.update(dict.fromkeys(row))
    columns = [c for c in CSV_FIRST_COLUMNS if c in seen]
    columns += [c for c in seen if c not in CSV_FIRST_COLUMNS]
    return columns, [[_cell(row.get(c)) for c in columns] for row in flat]


def write_csv(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """One row per round; a key missing from a round is an empty cell."""
    path = Path(path)
    columns, rows = csv_rows(records)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        writer.writerows(rows)
    return path


# ------------------------------------------------------------------------------------ figures


def _figure(rows: int = 1, height: float = 3.4) -> Any:
    """A bare Agg figure: no pyplot state, safe in any process and on a headless machine."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 0.6 + height * rows), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _series(records: Sequence[dict[str, Any]], key: str, scale: float = 1.0) -> list[float]:
    """Values per round (NaN where absent or null, so the line shows a gap, not a zero)."""
    out = []
    for r in records:
        v = r.get(key)
        out.append(float(v) / scale if _is_number(v) else math.nan)
    return out


def _steps(run: RunData) -> list[float]:
    """The x of every record: its round, or its model version in an async run (NaN if absent)."""
    return _series(run.records, run.step_key)


def _step_label(runs: Iterable[RunData]) -> str:
    """ "round", "version" (async runs), or both named when sync and async runs are overlaid."""
    keys = {run.step_key for run in runs}
    return keys.pop() if len(keys) == 1 else "round (sync) / version (async)"


#: epsilon series whose largest and smallest positive values differ by more than this factor
#: are drawn on a log scale (SignDS at ~1,000 would flatten a DP-SGD curve at ~5 to zero)
LOG_SCALE_SPAN = 100.0


def _needs_log_scale(values: Iterable[float]) -> bool:
    positive = [v for v in values if math.isfinite(v) and v > 0]
    return bool(positive) and max(positive) > LOG_SCALE_SPAN * min(positive)


def _integer_rounds(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _style(n_points: int) -> dict[str, Any]:
    return {"marker": "o", "markersize": 3} if n_points <= 40 else {}


def _check_labels(runs: Sequence[RunData], labels: Sequence[str] | None) -> list[str]:
    if not runs:
        raise ValueError("runs: need at least one run to plot")
    return run_labels(runs, labels)


def accuracy_figure(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> Any:
    """Test accuracy of the global model after each round (or version), runs overlaid."""
    names = _check_labels(runs, labels)
    fig = _figure()
    ax = fig.add_subplot()
    for run, name in zip(runs, names, strict=True):
        ax.plot(
            _steps(run),
            _series(run.records, "accuracy"),
            label=name,
            **_style(len(run.records)),
        )
    step = _step_label(runs)
    ax.set(xlabel=step, ylabel="test accuracy", title=f"Accuracy per {step}", ylim=(0.0, 1.0))
    _integer_rounds(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def plot_accuracy(
    runs: Sequence[RunData], path: str | Path, labels: Sequence[str] | None = None
) -> Path:
    """:func:`accuracy_figure` as a PNG."""
    return _save(accuracy_figure(runs, labels), path)


def bytes_figure(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> Any:
    """Uplink and downlink MQTT payload bytes per round (two panels, one legend), runs overlaid."""
    names = _check_labels(runs, labels)
    fig = _figure(rows=2, height=2.6)
    up, down = fig.subplots(2, 1, sharex=True)
    for run, name in zip(runs, names, strict=True):
        x, style = _steps(run), _style(len(run.records))
        up.plot(x, _series(run.records, "bytes_up", 1e6), label=name, **style)
        down.plot(x, _series(run.records, "bytes_down", 1e6), label=name, **style)
    step = _step_label(runs)
    up.set(ylabel="MB up (10^6 bytes)", title=f"Bytes per {step} (MQTT payloads)")
    down.set(xlabel=step, ylabel="MB down (10^6 bytes)")
    _integer_rounds(down)
    for ax in (up, down):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    up.legend(fontsize="small")
    return fig


def plot_bytes(
    runs: Sequence[RunData], path: str | Path, labels: Sequence[str] | None = None
) -> Path:
    """:func:`bytes_figure` as a PNG."""
    return _save(bytes_figure(runs, labels), path)


def _cumulative_bytes(records: Sequence[dict[str, Any]]) -> tuple[list[float], str]:
    """Cumulative bytes after each round, up and down: wire bytes when the run has them (what a
    data plan pays), else MQTT payload bytes; and which of the two it is."""
    wire = all(_is_number(r.get("wire_up")) and _is_number(r.get("wire_down")) for r in records)
    up, down = ("wire_up", "wire_down") if wire else ("bytes_up", "bytes_down")
    total, out = 0.0, []
    for r in records:
        total += float(r.get(up) or 0) + float(r.get(down) or 0)
        out.append(total)
    return out, "wire" if wire else "payload"


def frontier_figure(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> Any:
    """Accuracy against cumulative bytes (up + down), runs overlaid: the communication frontier
    on which codecs and mechanisms are compared (the run nearest the top left wins). When wire
    and payload runs are mixed, every label says which of the two its run counts."""
    names = _check_labels(runs, labels)
    fig = _figure()
    ax = fig.add_subplot()
    cumulative = [_cumulative_bytes(run.records) for run in runs]
    kinds = {kind for _, kind in cumulative}
    for run, name, (x, kind) in zip(runs, names, cumulative, strict=True):
        ax.plot(
            [v / 1e6 for v in x],
            _series(run.records, "accuracy"),
            label=f"{name} ({kind})" if len(kinds) > 1 else name,
            **_style(len(run.records)),
        )
    what = "wire bytes (MQTT)" if kinds == {"wire"} else "bytes (wire where recorded, else payload)"
    ax.set(
        xlabel=f"cumulative {what}, MB (10^6)",
        ylabel="test accuracy",
        title="Accuracy against bytes",
        ylim=(0.0, 1.0),
    )
    if any(v > 0 for x, _ in cumulative for v in x):  # records without bytes have no log axis
        ax.set_xscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return fig


def plot_frontier(
    runs: Sequence[RunData], path: str | Path, labels: Sequence[str] | None = None
) -> Path:
    """:func:`frontier_figure` as a PNG."""
    return _save(frontier_figure(runs, labels), path)


def device_costs_figure(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> Any:
    """Per-device wire bytes up per round: median, 95th percentile and max over every device
    session of the round (a device not selected sends only statuses and keep-alives, so with
    partial participation the median can sit near zero); None when no run recorded them. Every
    line is in the legend (run and statistic), each run in its own colour."""
    names = _check_labels(runs, labels)
    wired = [
        (run, name)
        for run, name in zip(runs, names, strict=True)
        if any(_is_number(r.get("wire_up_p50")) for r in run.records)
    ]
    if not wired:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for run, name in wired:
        x = _steps(run)
        (line,) = ax.plot(x, _series(run.records, "wire_up_p50", 1e3), label=f"{name} p50")
        colour = line.get_color()
        for key, ls, stat in (("wire_up_p95", "--", "p95"), ("wire_up_max", ":", "max")):
            ax.plot(x, _series(run.records, key, 1e3), ls=ls, color=colour, label=f"{name} {stat}")
    ax.set(
        xlabel=_step_label(run for run, _ in wired),
        ylabel="kB up per device (10^3 bytes)",
        title="Wire bytes up per device session: p50 (solid), p95 (dashed), max (dotted)",
    )
    ax.set_ylim(bottom=0)
    _integer_rounds(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncols=len(wired))  # a column per run: its p50, p95, max
    return fig


def plot_device_costs(
    runs: Sequence[RunData], path: str | Path, labels: Sequence[str] | None = None
) -> Path | None:
    """:func:`device_costs_figure` as a PNG; None (no file) when no run recorded the costs."""
    fig = device_costs_figure(runs, labels)
    return None if fig is None else _save(fig, path)


def epsilon_figure(runs: Sequence[RunData], labels: Sequence[str] | None = None) -> Any:
    """Cumulative reported epsilon per round; None when no run has privacy accounting. On a log
    scale when the values span more than :data:`LOG_SCALE_SPAN` (mechanisms that differ by orders
    of magnitude), so no curve is flattened to zero by another."""
    names = _check_labels(runs, labels)
    private = [
        (run, name)
        for run, name in zip(runs, names, strict=True)
        if any(_is_number(r.get("epsilon")) for r in run.records)
    ]
    if not private:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    deltas: set[float] = set()
    values: list[float] = []
    for run, name in private:
        last = run.records[-1]
        accountant = last.get("accountant")
        deltas.update(r["delta"] for r in run.records if _is_number(r.get("delta")))
        label = f"{name} ({accountant})" if accountant else name
        series = _series(run.records, "epsilon")
        values += series
        ax.plot(_steps(run), series, label=label, **_style(len(run.records)))
    at = f" at delta={deltas.pop():g}" if len(deltas) == 1 else ""
    log_scale = _needs_log_scale(values)
    ax.set(
        xlabel=_step_label(run for run, _ in private),
        ylabel="epsilon (worst device, all rounds)" + (", log scale" if log_scale else ""),
        title=f"Cumulative privacy loss{at}",
    )
    if log_scale:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    _integer_rounds(ax)
    ax.grid(alpha=0.3, which="both" if log_scale else "major")
    ax.legend(fontsize="small")
    return fig


def plot_epsilon(
    runs: Sequence[RunData], path: str | Path, labels: Sequence[str] | None = None
) -> Path | None:
    """:func:`epsilon_figure` as a PNG; None (no file) when no run has privacy accounting."""
    fig = epsilon_figure(runs, labels)
    return None if fig is None else _save(fig, path)


@dataclass(frozen=True)
class EpsilonPoint:
    """One point of an accuracy-vs-epsilon figure; ``epsilon=None`` is a non-private baseline.

    ``low``/``high`` (optional) draw an error bar, e.g. the min and max over repeated runs.
    """

    series: str
    epsilon: float | None
    accuracy: float
    low: float | None = None
    high: float | None = None


def accuracy_vs_epsilon_points(
    runs: Iterable[RunData], *, use: str = "reported", labels: Sequence[str] | None = None
) -> list[EpsilonPoint]:
    """One point per run: series = mechanism (or the label), x = reported or target epsilon."""
    if use not in ("reported", "target"):
        raise ValueError(f"use = {use!r}: must be 'reported' or 'target'")
    runs = list(runs)
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"labels: got {len(labels)} label(s) for {len(runs)} run(s)")
    points = []
    for i, run in enumerate(runs):
        acc = run.final_accuracy
        if acc is None:
            continue
        private = run.mechanism != "none"
        eps = (
            (run.reported_epsilon if use == "reported" else run.target_epsilon) if private else None
        )
        if private and eps is None:
            continue
        points.append(EpsilonPoint(labels[i] if labels else run.mechanism, eps, acc))
    return points


def plot_accuracy_vs_epsilon(
    points: Iterable[EpsilonPoint],
    path: str | Path,
    *,
    title: str = "Final accuracy vs privacy budget",
    xlabel: str = "epsilon",
) -> Path:
    """One line per series (sorted by epsilon, log x); baselines are dashed horizontal lines."""
    points = list(points)
    if not points:
        raise ValueError("points: nothing to plot (no run had an accuracy)")
    for p in points:
        if not math.isfinite(p.accuracy):
            raise ValueError(f"point {p}: accuracy must be finite")
        if p.epsilon is not None and not (math.isfinite(p.epsilon) and p.epsilon > 0):
            raise ValueError(f"point {p}: epsilon must be finite and > 0 (or None for a baseline)")
        if (p.low is None) != (p.high is None) or (
            p.low is not None and p.high is not None and not p.low <= p.accuracy <= p.high
        ):
            raise ValueError(f"point {p}: need both low and high, with low <= accuracy <= high")
    curves: dict[str, list[EpsilonPoint]] = {}
    baselines: dict[str, list[EpsilonPoint]] = {}
    for p in points:
        (curves if p.epsilon is not None else baselines).setdefault(p.series, []).append(p)
    legend_rows = math.ceil((len(curves) + len(baselines)) / 2)
    fig = _figure(height=4.0 + 0.2 * legend_rows)
    ax = fig.add_subplot()
    for series, pts in curves.items():
        pts = sorted(pts, key=lambda p: p.epsilon or 0.0)
        x = [p.epsilon for p in pts]
        y = [p.accuracy for p in pts]
        line = ax.plot(x, y, marker="o", markersize=4, label=series)[0]
        bars = [(p.low, p.high) for p in pts if p.low is not None and p.high is not None]
        if len(bars) == len(pts):
            err = [
                [a - lo for a, (lo, _) in zip(y, bars, strict=True)],
                [hi - a for a, (_, hi) in zip(y, bars, strict=True)],
            ]
            ax.errorbar(x, y, yerr=err, fmt="none", ecolor=line.get_color(), capsize=3, alpha=0.7)
    for i, (series, pts) in enumerate(baselines.items()):
        acc = sum(p.accuracy for p in pts) / len(pts)
        ax.axhline(
            acc,
            color="0.35",
            linestyle=("--", ":", "-.")[i % 3],
            linewidth=1,
            label=f"{series}, no privacy: {acc:.3f}",
        )
    if curves:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel="final test accuracy", title=title, ylim=(0.0, 1.0))
    ax.grid(alpha=0.3, which="both")
    # below the axes: inside, a legend of many series hides the low-accuracy points
    fig.legend(loc="outside lower center", ncols=2, fontsize="small")
    return _save(fig, path)


# ------------------------------------------------------------------------------------ report


@dataclass(frozen=True)
class ReportResult:
    written: list[Path]
    notes: list[str]


def make_report(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path | None = None,
    *,
    write_csvs: bool = False,
    labels: Sequence[str] | None = None,
) -> ReportResult:
    """Read every run (all errors before any file is written), then write the CSVs and figures.

    ``out_dir`` defaults to the run directory when there is exactly one run; overlaid figures of
    several runs need an explicit ``out_dir`` (they belong to none of the runs).
    """
    if not run_dirs:
        raise ValueError("run_dirs: give at least one run directory")
    runs = [read_run(d) for d in run_dirs]
    names = run_labels(runs, labels)
    if out_dir is None:
        if len(runs) > 1:
            raise ValueError(
                f"out: {len(runs)} runs are overlaid in one set of figures; pass --out DIR"
            )
        out_dir = runs[0].directory
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out = {str(out)!r}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    notes: list[str] = []
    if write_csvs:
        written += [write_csv(run.records, run.directory / "metrics.csv") for run in runs]
    written.append(plot_accuracy(runs, out / "accuracy.png", names))
    written.append(plot_bytes(runs, out / "bytes.png", names))
    written.append(plot_frontier(runs, out / "frontier.png", names))
    costs = plot_device_costs(runs, out / "device_costs.png", names)
    if costs is None:
        notes.append("device_costs.png not written: no run recorded per-device wire bytes")
    else:
        written.append(costs)
    eps_plot = plot_epsilon(runs, out / "epsilon.png", names)
    if eps_plot is None:
        notes.append("epsilon.png not written: no run recorded a privacy epsilon")
    else:
        written.append(eps_plot)
    return ReportResult(written, notes)
