"""The parts of a job as separate processes over a real Mosquitto: `edge-fl aggregator`, two
`edge-fl fleet` shards and one `edge-fl device`, as a deployment would run them."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.broker

EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))


def test_aggregator_fleet_shards_and_a_device(mosquitto, tmp_path):
    job = f"proc-{uuid.uuid4().hex[:6]}"
    common = [
        "--broker", mosquitto.url, "--job", job, "--devices", "5", "--rounds", "3",
        "--clients-per-round", "5", "--deadline", "20",
    ]  # fmt: skip
    out = tmp_path / "run"
    agg = subprocess.Popen(
        [EDGE_FL, "aggregator", *common, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers = [
        subprocess.Popen([EDGE_FL, "fleet", *common, "--shard", "0/2"], stderr=subprocess.PIPE),
        subprocess.Popen([EDGE_FL, "fleet", *common, "--shard", "1/2"], stderr=subprocess.PIPE),
    ]
    try:
        stdout, stderr = agg.communicate(timeout=120)
        for w in workers:
            w.wait(timeout=30)
    finally:
        for p in (agg, *workers):
            if p.poll() is None:
                p.kill()
    assert agg.returncode == 0, stderr
    lines = [line for line in stdout.splitlines() if line.startswith("round")]
    assert len(lines) == 3 and all("closed" in line for line in lines)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["received"] for r in records] == [5, 5, 5]
    assert (out / "model.onnx").stat().st_size > 0
    assert all(w.returncode == 0 for w in workers)


def test_single_device_process_and_config_digest(mosquitto, tmp_path):
    """A device whose config disagrees with the aggregator's refuses to train (digest check)."""
    job = f"dev-{uuid.uuid4().hex[:6]}"
    common = ["--broker", mosquitto.url, "--job", job, "--devices", "2", "--rounds", "2"]
    common += ["--clients-per-round", "2", "--deadline", "3", "--min-updates", "1"]
    agg = subprocess.Popen(
        [EDGE_FL, "aggregator", *common],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    good = subprocess.Popen(
        [EDGE_FL, "device", *common, "--device-index", "0"], stderr=subprocess.PIPE, text=True
    )
    bad = subprocess.Popen(
        [EDGE_FL, "device", *common, "--device-index", "1", "--lr", "0.01"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, _ = agg.communicate(timeout=120)
        _, good_err = good.communicate(timeout=30)
        _, bad_err = bad.communicate(timeout=30)
    finally:
        for p in (agg, good, bad):
            if p.poll() is None:
                p.kill()
    assert agg.returncode == 0
    assert "2 updates sent" in good_err
    assert "config digest" in bad_err and "0 updates sent" in bad_err
    rounds = [line for line in stdout.splitlines() if line.startswith("round")]
    assert len(rounds) == 2 and all("recv 1/2" in line for line in rounds)
