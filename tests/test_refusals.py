"""Jobs that cannot do what they say are refused before they start, in one line: a run into a
directory that holds an earlier run, a budget nothing enforces, noise the decoder would refuse,
a round that can never close."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import edge_fl
from edge_fl.simulation import RunDirError

EDGE_FL = [str(Path(sys.executable).parent / "edge-fl")]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGE_FL, *args], capture_output=True, text=True, timeout=timeout)


def one_line_error(done: subprocess.CompletedProcess, *expected: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("edge-fl: error:")]
    assert len(errors) == 1, done.stderr
    for text in expected:
        assert text in errors[0], done.stderr
    return errors[0]


def hashes(directory: Path) -> dict[str, str]:
    """Every file's content hash (and its modification time: rewritten with the same bytes is
    still rewritten)."""
    return {
        p.name: f"{hashlib.sha256(p.read_bytes()).hexdigest()}:{p.stat().st_mtime_ns}"
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def small(**overrides):
    base = {
        "job": f"refuse-{uuid.uuid4().hex[:8]}",
        "model.name": "logreg",
        "data.devices": 6,
        "rounds.rounds": 2,
        "rounds.clients_per_round": 6,
    }
    return edge_fl.load_config(None, {**base, **overrides})


# ------------------------------------------------------------------ an earlier run's directory


def test_simulate_into_a_finished_run_leaves_it_byte_identical(tmp_path):
    out = tmp_path / "run"
    common = ["--model", "logreg", "--devices", "4", "--clients-per-round", "4", "--no-progress"]
    first = run("simulate", *common, "--rounds", "2", "--out", str(out))
    assert first.returncode == 0, first.stderr
    before = hashes(out)
    assert {"metrics.jsonl", "summary.json", "model.onnx"} <= set(before)
    again = run("simulate", *common, "--rounds", "1", "--out", str(out))
    one_line_error(again, f"{out} holds a finished run", "metrics.jsonl", "summary.json", "--out")
    assert hashes(out) == before


@pytest.mark.broker
def test_the_api_refuses_a_finished_runs_directory_unless_asked_to_overwrite(mosquitto, tmp_path):
    cfg = small(**{"broker.url": mosquitto.url})
    edge_fl.run_simulation(cfg, tmp_path)
    before = hashes(tmp_path)
    with pytest.raises(RunDirError, match=r"holds a finished run .*summary\.json.*--overwrite"):
        edge_fl.run_simulation(small(**{"broker.url": mosquitto.url}), tmp_path)
    assert hashes(tmp_path) == before
    again = edge_fl.run_simulation(
        small(**{"broker.url": mosquitto.url, "rounds.rounds": 1}), tmp_path, overwrite=True
    )
    assert again.summary["rounds_closed"] == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def _finished_or_interrupted(tmp_path: Path, kind: str) -> Path:
    out = tmp_path / kind
    out.mkdir()
    (out / "run.json").write_text('{"job": "earlier"}\n')
    (out / "metrics.jsonl").write_text('{"round": 1}\n')
    if kind == "finished":
        (out / "summary.json").write_text('{"rounds_closed": 1}\n')
        (out / "model.onnx").write_bytes(b"onnx")
    else:
        (out / "checkpoint.json").write_text("{}\n")
    return out


@pytest.mark.parametrize("kind", ["finished", "interrupted"])
def test_aggregator_without_resume_refuses_an_earlier_run(tmp_path, kind):
    out = _finished_or_interrupted(tmp_path, kind)
    before = hashes(out)
    done = run(
        "aggregator",
        "--broker",
        "mqtt://127.0.0.1:9",  # refused before any connection
        "--model",
        "logreg",
        "--out",
        str(out),
    )
    line = one_line_error(done, str(out), "metrics.jsonl", "run.json", "--overwrite")
    assert ("finished run" in line) == (kind == "finished")
    assert ("--resume" in line) == (kind == "interrupted")
    assert hashes(out) == before


def test_the_aggregator_refuses_resume_and_overwrite_together(tmp_path):
    done = run(
        "aggregator", "--broker", "mqtt://127.0.0.1:9", "--out", str(tmp_path), "--resume",
        "--overwrite",
    )  # fmt: skip
    one_line_error(done, "--resume and --overwrite")
