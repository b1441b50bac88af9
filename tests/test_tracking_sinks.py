"""Record sinks of edge_fl.metrics and the Tracker's failure handling, without a job or a store."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_fl.metrics import RunRecorder, record_sinks
from edge_fl.tracking import Tracker, numeric_fields


@contextlib.contextmanager
def warnings_of(name: str) -> Iterator[list[str]]:
    """The messages logged to logger ``name``, through a handler of its own: an in-process CLI
    test earlier in the session may have put filters on the root handlers caplog relies on."""
    got: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: got.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield got
    finally:
        logger.removeHandler(handler)


class ListSink:
    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []

    def record(self, record: dict[str, Any]) -> None:
        self.got.append(record)


class BrokenSink:
    calls = 0

    def record(self, record: dict[str, Any]) -> None:
        self.calls += 1
        raise ConnectionError("tracking server went away")


def test_sinks_get_each_record_after_its_line_is_on_disk(tmp_path: Path) -> None:
    lines_seen: list[int] = []

    class FileChecker(ListSink):
        def record(self, record: dict[str, Any]) -> None:
            lines_seen.append(len((tmp_path / "metrics.jsonl").read_text().splitlines()))
            super().record(record)

    sink = FileChecker()
    with record_sinks(sink):
        recorder = RunRecorder(tmp_path)
    for rnd in (1, 2, 3):
        recorder.add({"round": rnd, "accuracy": 0.5})
    assert [r["round"] for r in sink.got] == [1, 2, 3]
    assert lines_seen == [1, 2, 3]  # never ahead of metrics.jsonl
    outside = RunRecorder(None)  # made outside the block: no sinks
    assert outside.sinks == []


def test_a_failing_sink_is_dropped_and_the_run_goes_on(tmp_path: Path) -> None:
    broken, good = BrokenSink(), ListSink()
    recorder = RunRecorder(tmp_path, sinks=(broken, good))
    with warnings_of("edge_fl.metrics") as said:
        for rnd in (1, 2, 3):
            recorder.add({"round": rnd})
    assert broken.calls == 1 and len(good.got) == 3
    assert len(said) == 1 and "tracking server went away" in said[0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_resumed_run_gives_its_earlier_records_first_once_they_agree_with_the_checkpoint(
    tmp_path: Path,
) -> None:
    first = RunRecorder(tmp_path)
    for rnd in (1, 2, 3):
        first.add({"round": rnd})
    # a crash: no close(), no summary
    sink = ListSink()
    resumed = RunRecorder(tmp_path, append=True, sinks=(sink,))
    assert sink.got == []  # not yet: the checkpoint may drop some
    resumed.reconcile(2, {"round": 2})  # round 3 was never checkpointed
    resumed.add({"round": 3, "replayed": True})
    assert [r["round"] for r in sink.got] == [1, 2, 3]
    assert sink.got[-1].get("replayed") is True
    resumed.close()
    assert len(sink.got) == 3  # close gives nothing twice


def test_close_alone_replays_a_resumed_run(tmp_path: Path) -> None:
    first = RunRecorder(tmp_path)
    first.add({"round": 1})
    first.close()
    sink = ListSink()
    RunRecorder(tmp_path, append=True, sinks=(sink,)).close()
    assert [r["round"] for r in sink.got] == [1]


class FlakyBackend:
    name = "flaky"

    def __init__(self, fail_at: int | None) -> None:
        self.fail_at = fail_at
        self.steps: list[int] = []
        self.ended: str | None = None

    def metrics(self, step: int, values: dict[str, float], wall_time: float) -> None:
        if step == self.fail_at:
            raise OSError("disk full")
        self.steps.append(step)

    def artifacts(self, files: list[Path], plots: list[Path]) -> None:
        self.files = [p.name for p in files]
        self.plots = [p.name for p in plots]

    def tags(self, tags: dict[str, str]) -> None:
        self.tags_got = tags

    def end(self, status: str) -> None:
        self.ended = status


def test_a_store_failing_mid_run_is_dropped_and_the_others_go_on() -> None:
    flaky, fine = FlakyBackend(fail_at=2), FlakyBackend(fail_at=None)
    tracker = Tracker([flaky, fine], "round")
    with warnings_of("edge_fl.tracking") as said:
        for rnd in (1, 2, 3):
            tracker.record(
                {"round": rnd, "accuracy": 0.1 * rnd, "epsilon": 1.0 * rnd, "bytes_up": 9}
            )
        tracker.flush()
    assert flaky.steps == [1] and fine.steps == [1, 2, 3]
    assert said == ["tracking: flaky failed (disk full); no more is sent to it"]
    summary = {"privacy": {"epsilon": 3.0, "delta": 1e-5, "accountant": "rdp"}}
    tracker.finish(summary, None)  # no run directory: summary and records are written for it
    assert fine.ended == "FINISHED" and flaky.ended is None
    assert sorted(fine.files) == ["metrics.jsonl", "summary.json"]
    assert "accuracy.png" in fine.plots and "epsilon.png" in fine.plots
    assert fine.tags_got["edge_fl.epsilon"] == "3.0"


def test_numeric_fields() -> None:
    record = json.loads(
        json.dumps(
            {
                "round": 2,
                "status": "closed",
                "accuracy": 0.5,
                "loss": None,
                "extended": True,
                "rejected_by_reason": {"norm bound!": 3},
                "epsilon_by_accountant": {"rdp": 1.5, "pld": None},
                "staleness_hist": {"0": 4},
                "selection": [1, 2],
            }
        )
    )
    assert numeric_fields(record) == {
        "round": 2.0,
        "accuracy": 0.5,
        "extended": 1.0,
        "rejected_by_reason.norm bound_": 3.0,
        "epsilon_by_accountant.rdp": 1.5,
        "staleness_hist.0": 4.0,
    }


@pytest.mark.parametrize("value", ["mlflow", "mlflow:./mlruns", "mlflow:http://host:5000"])
def test_parse_track(value: str) -> None:
    from edge_fl.tracking import parse_track

    assert parse_track(value) == value.partition(":")[2]
