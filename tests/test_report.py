"""edge-fl report: reading run files, CSV export, figures and the errors on broken files.

Every run here is a few hand-written metrics.jsonl lines; no simulation runs.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edge_fl.cli.report_cmds import report as report_cmd
from edge_fl.report import (
    CSV_FIRST_COLUMNS,
    EpsilonPoint,
    RunFileError,
    accuracy_vs_epsilon_points,
    default_label,
    make_report,
    plot_accuracy,
    plot_accuracy_vs_epsilon,
    read_metrics,
    read_run,
    run_labels,
    write_csv,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
C0 = (0x1F, 0x77, 0xB4)  # matplotlib's first and second cycle colours
C1 = (0xFF, 0x7F, 0x0E)


def _record(rnd: int, mechanism: str = "none", **extra) -> dict:
    base = {
        "round": rnd,
        "version": rnd,
        "status": "closed",
        "accuracy": 0.2 + 0.1 * rnd,
        "loss": 2.0 / rnd,
        "selected": 10,
        "received": 9,
        "late": 1,
        "rejected": 0,
        "rejected_by_reason": {},
        "bytes_up": 1000 * rnd,
        "bytes_down": 5000,
        "mechanism": mechanism,
        "epsilon": None,
        "wall_time_s": 0.25,
        "extended": False,
    }
    base.update(extra)
    return base


def _write_run(
    directory: Path,
    records: list[dict],
    *,
    mechanism: str = "none",
    target_epsilon: float | None = None,
    summary: dict | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    privacy_cfg = {"mechanism": mechanism, "epsilon": target_epsilon, "delta": 1e-5}
    (directory / "run.json").write_text(json.dumps({"config": {"privacy": privacy_cfg}}))
    if summary is not None:
        (directory / "summary.json").write_text(json.dumps(summary))
    return directory


def _private_run(directory: Path, eps_target: float = 4.0) -> Path:
    records = [
        _record(r, "laplace", epsilon=0.8 * r, delta=1e-5, accountant="basic") for r in (1, 2, 3)
    ]
    summary = {
        "final_accuracy": records[-1]["accuracy"],
        "mechanism": "laplace",
        "privacy": {
            "epsilon": 2.4,
            "delta": 1e-5,
            "accountant": "basic",
            "unit": "example",
            "neighbouring_relation": "replace_one",
        },
    }
    return _write_run(
        directory, records, mechanism="laplace", target_epsilon=eps_target, summary=summary
    )


def _png_pixels(path: Path) -> np.ndarray:
    """The image as uint8 RGB after checking it is a real PNG."""
    from matplotlib import image

    raw = path.read_bytes()
    assert raw[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    rgba = image.imread(path)
    assert rgba.ndim == 3 and rgba.shape[0] > 100 and rgba.shape[1] > 100
    return np.round(rgba[..., :3] * 255).astype(np.int16)


def _colour_pixels(pixels: np.ndarray, colour: tuple[int, int, int], tol: int = 12) -> int:
    return int(np.all(np.abs(pixels - np.array(colour)) <= tol, axis=-1).sum())


def _assert_drawn(path: Path, *colours: tuple[int, int, int]) -> None:
    """Not blank: ink on the canvas, and each data line's colour in it (axes alone have none)."""
    assert colours, "name at least one line colour: empty axes also have ink"
    pixels = _png_pixels(path)
    non_white = np.any(pixels < 245, axis=-1).mean()
    assert non_white > 0.02, f"{path} looks blank ({non_white:.1%} non-white pixels)"
    for colour in colours:
        assert _colour_pixels(pixels, colour) > 50, f"{path}: no line drawn in colour {colour}"


# ------------------------------------------------------------------------------------ reading


def test_read_run_uses_summary_and_run_json(tmp_path: Path) -> None:
    run = read_run(_private_run(tmp_path / "lap"))
    assert len(run.records) == 3
    assert run.mechanism == "laplace"
    assert run.target_epsilon == 4.0
    assert run.reported_epsilon == 2.4
    assert run.final_accuracy == pytest.approx(0.5)
    assert default_label(run) == "laplace eps=4"


def test_run_without_summary_falls_back_to_the_last_round(tmp_path: Path) -> None:
    records = [_record(1, "gaussian", epsilon=1.5, delta=1e-5, accountant="rdp")]
    run = read_run(_write_run(tmp_path / "cut", records, mechanism="gaussian"))
    assert run.summary is None
    assert run.reported_epsilon == 1.5
    assert run.privacy == {"epsilon": 1.5, "delta": 1e-5, "accountant": "rdp"}
    assert default_label(run) == "gaussian"  # no target epsilon in run.json


def test_duplicate_default_labels_get_the_directory_name(tmp_path: Path) -> None:
    a = read_run(_private_run(tmp_path / "a"))
    b = read_run(_private_run(tmp_path / "b"))
    assert run_labels([a, b]) == ["laplace eps=4 (a)", "laplace eps=4 (b)"]
    assert run_labels([a, b], ["x", "y"]) == ["x", "y"]
    with pytest.raises(ValueError, match=r"got 1 label\(s\) for 2 run\(s\)"):
        run_labels([a, b], ["x"])


def test_blank_lines_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_record(1)) + "\n\n" + json.dumps(_record(2)) + "\n\n")
    assert [r["round"] for r in read_metrics(path)] == [1, 2]


# ------------------------------------------------------------------------------------ CSV


def test_csv_columns_and_values(tmp_path: Path) -> None:
    records = [
        _record(1, rejected_by_reason={"stale": 2}),
        _record(2, epsilon=0.125, accountant="rdp", extra_list=[1, 2]),
    ]
    path = write_csv(records, tmp_path / "metrics.csv")
    with path.open(newline="") as fh:
        rows = list(csv.reader(fh))
    header, body = rows[0], rows[1:]
    # known columns first, in the documented order; then the rest in first-seen order
    known = [c for c in CSV_FIRST_COLUMNS if c in header]
    assert header[: len(known)] == known
    assert known[:5] == ["round", "version", "status", "accuracy", "loss"]
    assert header[len(known) :] == [
        "rejected_by_reason.stale",
        "mechanism",
        "extended",
        "extra_list",
    ]
    assert len(body) == 2
    row1, row2 = (dict(zip(header, r, strict=True)) for r in body)
    assert row1["round"] == "1" and row2["round"] == "2"
    assert float(row1["accuracy"]) == records[0]["accuracy"]  # full precision round trip
    assert float(row2["loss"]) == records[1]["loss"]
    assert row1["bytes_up"] == "1000" and row2["bytes_up"] == "2000"
    assert row1["epsilon"] == "" and row2["epsilon"] == "0.125"  # null -> empty cell
    assert row1["accountant"] == "" and row2["accountant"] == "rdp"  # absent -> empty cell
    assert row1["rejected_by_reason.stale"] == "2" and row2["rejected_by_reason.stale"] == ""
    assert row1["extended"] == "false"
    assert json.loads(row2["extra_list"]) == [1, 2]


# ------------------------------------------------------------------------------------ figures


def test_cli_writes_csv_per_run_and_overlaid_pngs(tmp_path: Path) -> None:
    base = _write_run(tmp_path / "base", [_record(r) for r in range(1, 6)])
    lap = _private_run(tmp_path / "lap")
    out = tmp_path / "figures"
    result = CliRunner().invoke(
        report_cmd, [str(base), str(lap), "--out", str(out), "--csv"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    for name in ("accuracy.png", "bytes.png", "frontier.png", "epsilon.png"):
        assert f"wrote {out / name}" in result.output
    # two overlaid runs: both line colours on the accuracy and bytes figures
    _assert_drawn(out / "accuracy.png", C0, C1)
    _assert_drawn(out / "bytes.png", C0, C1)
    # only the private run has an epsilon line; it is the first (and only) line drawn
    _assert_drawn(out / "epsilon.png", C0)
    assert _colour_pixels(_png_pixels(out / "epsilon.png"), C1) == 0
    for run_dir, n in ((base, 5), (lap, 3)):
        with (run_dir / "metrics.csv").open(newline="") as fh:
            assert [int(r["round"]) for r in csv.DictReader(fh)] == list(range(1, n + 1))


def test_single_run_defaults_to_its_directory_and_skips_epsilon(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path / "none", [_record(r) for r in (1, 2)])
    result = make_report([run_dir])
    assert sorted(p.name for p in result.written) == ["accuracy.png", "bytes.png", "frontier.png"]
    assert all(p.parent == run_dir for p in result.written)
    assert not (run_dir / "metrics.csv").exists()  # only with --csv
    assert result.notes == [
        "device_costs.png not written: no run recorded per-device wire bytes",
        "epsilon.png not written: no run recorded a privacy epsilon",
    ]
    _assert_drawn(run_dir / "accuracy.png", C0)


def _wired(r: int, up: int, accuracy: float) -> dict:
    return _record(r, accuracy=accuracy) | {
        "wire_up": up * 10,
        "wire_down": 40_000,
        "wire_up_p50": up,
        "wire_up_p95": up * 1.2,
        "wire_up_max": up * 1.5,
    }


def test_frontier_and_device_costs_use_wire_bytes(tmp_path: Path) -> None:
    """Accuracy against cumulative wire bytes: a compressed run reaching the same accuracy with
    fewer bytes is drawn to the left; per-device costs are drawn only for runs that have them."""
    dense = _write_run(tmp_path / "dense", [_wired(r, 20_000, 0.2 * r) for r in (1, 2, 3, 4)])
    q4 = _write_run(tmp_path / "q4", [_wired(r, 2_700, 0.2 * r) for r in (1, 2, 3, 4)])
    plain = _write_run(tmp_path / "plain", [_record(r) for r in (1, 2)])
    result = make_report([dense, q4, plain], tmp_path / "out")
    names = sorted(p.name for p in result.written)
    assert "frontier.png" in names and "device_costs.png" in names
    _assert_drawn(tmp_path / "out" / "frontier.png", C0, C1)
    _assert_drawn(tmp_path / "out" / "device_costs.png", C0, C1)
    from edge_fl.report import _cumulative_bytes

    x_dense, kind = _cumulative_bytes(read_run(dense).records)
    x_q4, _ = _cumulative_bytes(read_run(q4).records)
    assert kind == "wire" and x_q4[-1] < x_dense[-1]
    assert x_dense == [240_000.0 * r for r in (1, 2, 3, 4)]
    assert _cumulative_bytes(read_run(plain).records)[1] == "payload"


def test_different_data_give_different_figures(tmp_path: Path) -> None:
    """The figure shows the data: another accuracy curve changes the pixels."""
    rising = read_run(_write_run(tmp_path / "a", [_record(r) for r in (1, 2, 3)]))
    flat = read_run(_write_run(tmp_path / "b", [_record(r, accuracy=0.3) for r in (1, 2, 3)]))
    a = _png_pixels(plot_accuracy([rising], tmp_path / "a.png"))
    b = _png_pixels(plot_accuracy([flat], tmp_path / "b.png"))
    assert a.shape == b.shape
    assert np.any(a != b)


def test_accuracy_vs_epsilon_plot(tmp_path: Path) -> None:
    points = [
        EpsilonPoint("laplace", 1.0, 0.1, 0.08, 0.12),
        EpsilonPoint("laplace", 16.0, 0.6, 0.5, 0.7),
        EpsilonPoint("laplace", 4.0, 0.3, 0.2, 0.4),
        EpsilonPoint("dpsgd", 2.0, 0.7),
        EpsilonPoint("dpsgd", 8.0, 0.85),
        EpsilonPoint("none", None, 0.93),
    ]
    path = plot_accuracy_vs_epsilon(points, tmp_path / "sub" / "acc_eps.png", xlabel="eps")
    _assert_drawn(path, C0, C1)


def test_accuracy_vs_epsilon_points_from_runs(tmp_path: Path) -> None:
    runs = [
        read_run(_private_run(tmp_path / "lap")),
        read_run(_write_run(tmp_path / "base", [_record(1)])),
    ]
    reported = accuracy_vs_epsilon_points(runs)
    assert reported == [
        EpsilonPoint("laplace", 2.4, pytest.approx(0.5)),
        EpsilonPoint("none", None, pytest.approx(0.3)),
    ]
    assert accuracy_vs_epsilon_points(runs, use="target")[0].epsilon == 4.0
    with pytest.raises(ValueError, match="use = 'x'"):
        accuracy_vs_epsilon_points(runs, use="x")


@pytest.mark.parametrize(
    ("point", "message"),
    [
        (EpsilonPoint("a", 0.0, 0.5), "epsilon must be finite and > 0"),
        (EpsilonPoint("a", float("inf"), 0.5), "epsilon must be finite and > 0"),
        (EpsilonPoint("a", 1.0, float("nan")), "accuracy must be finite"),
        (EpsilonPoint("a", 1.0, 0.5, 0.6, 0.7), "low <= accuracy <= high"),
        (EpsilonPoint("a", 1.0, 0.5, 0.4, None), "need both low and high"),
    ],
)
def test_accuracy_vs_epsilon_rejects_bad_points(
    tmp_path: Path, point: EpsilonPoint, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plot_accuracy_vs_epsilon([point], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_accuracy_vs_epsilon_needs_points(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_accuracy_vs_epsilon([], tmp_path / "x.png")


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"round": 1}', "{not json"], r"metrics\.jsonl line 2: not valid JSON"),
        (
            ['{"round": 1}', "", "[1, 2]"],
            r"metrics\.jsonl line 3: expected a JSON object, got list",
        ),
        (['{"accuracy": 0.5}'], r"metrics\.jsonl line 1: 'round' = None must be present"),
        (['{"round": "3"}'], r"metrics\.jsonl line 1: 'round' = '3' must be present"),
        (['{"round": 1, "accuracy": "high"}'], r"line 1: 'accuracy' = 'high' is not a number"),
        (['{"round": 1, "bytes_up": true}'], r"line 1: 'bytes_up' = True is not a number"),
        ([], r"metrics\.jsonl: no rounds recorded \(the file is empty\)"),
    ],
)
def test_malformed_metrics_name_file_and_line(tmp_path: Path, lines: list[str], message: str):
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    with pytest.raises(RunFileError, match=message) as info:
        read_run(tmp_path)
    assert str(tmp_path / "metrics.jsonl") in str(info.value)


def test_truncated_last_line_is_an_error(tmp_path: Path) -> None:
    """A run killed mid-write: the broken line is reported, not silently dropped."""
    text = json.dumps(_record(1)) + "\n" + json.dumps(_record(2))[:20]
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(RunFileError, match=r"line 2: not valid JSON"):
        read_run(tmp_path)


def test_missing_files_and_directories(tmp_path: Path) -> None:
    with pytest.raises(RunFileError, match=r"nope: run directory does not exist"):
        read_run(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunFileError, match=r"file: not a directory"):
        read_run(tmp_path / "file")
    with pytest.raises(RunFileError, match=r"metrics\.jsonl: not found"):
        read_run(tmp_path)


def test_malformed_summary_names_the_line(tmp_path: Path) -> None:
    _write_run(tmp_path, [_record(1)])
    (tmp_path / "summary.json").write_text('{\n  "rounds": 1,\n  "final_accuracy": ,\n}')
    with pytest.raises(RunFileError, match=r"summary\.json line 3: not valid JSON"):
        read_run(tmp_path)
    (tmp_path / "summary.json").write_text("[]")
    with pytest.raises(RunFileError, match=r"summary\.json: expected a JSON object, got list"):
        read_run(tmp_path)


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path: Path) -> None:
    runner = CliRunner()
    good = _write_run(tmp_path / "good", [_record(1)])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2,\n')
    cases = [
        ([str(bad)], f"edge-fl: error: {bad / 'metrics.jsonl'} line 2: not valid JSON"),
        ([str(good), str(good)], "pass --out DIR"),
        ([str(good), "--label", "a", "--label", "b"], "got 2 label(s) for 1 run(s)"),
        ([str(tmp_path / "missing")], "missing: run directory does not exist"),
    ]
    for args, message in cases:
        result = runner.invoke(report_cmd, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output
    # a broken run among good ones: nothing is written before every run has been read
    out = tmp_path / "out"
    result = runner.invoke(report_cmd, [str(good), str(bad), "--out", str(out), "--csv"])
    assert result.exit_code == 2
    assert not (good / "metrics.csv").exists() and not out.exists()
