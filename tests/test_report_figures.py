"""Properties of the report's matplotlib figures (not their pixels): the epsilon axis goes log
when mechanisms differ by orders of magnitude, every line is in its legend, and async runs are
plotted against the model version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_fl.report import (
    LOG_SCALE_SPAN,
    accuracy_figure,
    bytes_figure,
    device_costs_figure,
    epsilon_figure,
    frontier_figure,
    make_report,
    read_run,
)


def _run(
    directory: Path,
    epsilons: list[float] | None = None,
    *,
    mode: str = "sync",
    mechanism: str = "dpsgd",
    wired: bool = False,
    versions: list[int] | None = None,
) -> Path:
    n = len(epsilons or versions or [0, 0, 0])
    records = []
    for i in range(n):
        r = {
            "round": i + 1,
            "version": (versions or list(range(1, n + 1)))[i],
            "status": "closed",
            "accuracy": 0.3 + 0.1 * i,
            "loss": 1.0,
            "bytes_up": 1000,
            "bytes_down": 2000,
            "mechanism": mechanism,
            "epsilon": None if epsilons is None else epsilons[i],
            "accountant": "rdp",
            "delta": 1e-5,
        }
        if wired:
            r |= {"wire_up": 9000, "wire_down": 9000}
            r |= {"wire_up_p50": 100 + i, "wire_up_p95": 200 + i, "wire_up_max": 300 + i}
        records.append(r)
    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {"privacy": {"mechanism": mechanism, "epsilon": 8.0}, "rounds": {"mode": mode}}
    (directory / "run.json").write_text(json.dumps({"config": config}))
    return directory


def _legend_texts(ax) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None, "the axes have no legend"
    return [t.get_text() for t in legend.get_texts()]


def _labelled_lines(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


def test_epsilon_axis_is_log_when_series_span_more_than_two_orders(tmp_path: Path) -> None:
    signds = read_run(_run(tmp_path / "signds", [420.0, 840.0, 1260.0], mechanism="signds"))
    dpsgd = read_run(_run(tmp_path / "dpsgd", [2.0, 3.5, 5.0]))
    fig = epsilon_figure([signds, dpsgd])
    (ax,) = fig.axes
    assert ax.get_yscale() == "log"
    assert "log scale" in ax.get_ylabel()
    low, high = ax.get_ylim()
    assert low <= 2.0 and high >= 1260.0  # both curves inside the axes, none flattened
    assert sorted(_legend_texts(ax)) == ["dpsgd eps=8 (rdp)", "signds eps=8 (rdp)"]


def test_epsilon_axis_stays_linear_within_two_orders(tmp_path: Path) -> None:
    a = read_run(_run(tmp_path / "a", [1.0, 2.0, 3.0]))
    b = read_run(_run(tmp_path / "b", [10.0, 50.0, 99.0], mechanism="laplace"))
    assert LOG_SCALE_SPAN > 99.0 / 1.0
    (ax,) = epsilon_figure([a, b]).axes
    assert ax.get_yscale() == "linear"
    assert ax.get_ylim()[0] == 0.0
    # one run alone that grows by more than two orders goes log too (0 is not a magnitude)
    c = read_run(_run(tmp_path / "c", [0.0, 0.05, 8.0]))
    (ax,) = epsilon_figure([c]).axes
    assert ax.get_yscale() == "log"


def test_every_device_cost_line_is_in_the_legend(tmp_path: Path) -> None:
    runs = [
        read_run(_run(tmp_path / "dense", wired=True, mechanism="none")),
        read_run(_run(tmp_path / "q4", wired=True, mechanism="gaussian")),
    ]
    (ax,) = device_costs_figure(runs, labels=["dense", "q4"]).axes
    lines = _labelled_lines(ax)
    assert len(lines) == 6
    assert sorted(_legend_texts(ax)) == sorted(lines)
    assert set(lines) == {
        f"{run} {stat}" for run in ("dense", "q4") for stat in ("p50", "p95", "max")
    }
    # each run keeps one colour over its three statistics
    colours = {line.get_label(): line.get_color() for line in ax.get_lines()}
    assert colours["dense p50"] == colours["dense p95"] == colours["dense max"]
    assert colours["dense p50"] != colours["q4 p50"]


def test_every_figure_has_every_run_in_its_legend(tmp_path: Path) -> None:
    runs = [
        read_run(_run(tmp_path / "wire", [1.0, 2.0, 3.0], wired=True)),
        read_run(_run(tmp_path / "payload", [1.0, 2.0, 4.0], mechanism="laplace")),
    ]
    names = ["wire run", "payload run"]
    for make in (accuracy_figure, bytes_figure, frontier_figure, epsilon_figure):
        fig = make(runs, names)
        ax = fig.axes[0]
        texts = _legend_texts(ax)
        assert len(texts) == len(_labelled_lines(ax)) == 2, make.__name__
        for name in names:
            assert any(t.startswith(name) for t in texts), (make.__name__, texts)
    # wire and payload runs mixed on the frontier: every label says which it counts (before, the
    # first run's did not)
    (ax,) = frontier_figure(runs, names).axes
    assert sorted(_legend_texts(ax)) == ["payload run (payload)", "wire run (wire)"]


@pytest.mark.parametrize("mode", ["fedbuff", "fedasync"])
def test_async_runs_are_plotted_against_the_version(tmp_path: Path, mode: str) -> None:
    # a skipped window leaves the version where it was: x is the version, not the window number
    versions = [1, 2, 2, 3]
    run = read_run(
        _run(tmp_path / mode, [1.0, 2.0, 2.0, 3.0], mode=mode, wired=True, versions=versions)
    )
    assert run.mode == mode and run.step_key == "version"
    for make in (accuracy_figure, bytes_figure, device_costs_figure, epsilon_figure):
        fig = make([run])
        bottom = fig.axes[-1]
        assert bottom.get_xlabel() == "version", make.__name__
        for ax in fig.axes:
            for line in ax.get_lines():
                assert list(line.get_xdata()) == versions, make.__name__
    sync = read_run(_run(tmp_path / "sync", [1.0, 2.0, 3.0]))
    assert accuracy_figure([sync]).axes[0].get_xlabel() == "round"
    mixed = accuracy_figure([sync, run]).axes[0]
    assert mixed.get_xlabel() == "round (sync) / version (async)"


def test_make_report_writes_the_same_figures(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", [1.0, 2.0, 500.0], wired=True, mode="fedbuff")
    result = make_report([a], tmp_path / "out")
    assert sorted(p.name for p in result.written) == [
        "accuracy.png",
        "bytes.png",
        "device_costs.png",
        "epsilon.png",
        "frontier.png",
    ]
