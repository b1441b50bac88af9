"""Fleet scale over the embedded Mosquitto (slow: run with EDGE_FL_SLOW=1 tools/test.sh).

CI runs the 50-device end-to-end tests; this one proves thousands of real MQTT sessions in one
process (BENCHMARKS.md has the 10,000-device figures from tools/bench_scale.py)."""

from __future__ import annotations

import uuid

import pytest

from edge_fl.config import load_config
from edge_fl.simulation import simulate

pytestmark = [pytest.mark.slow, pytest.mark.broker]


@pytest.mark.parametrize("mode", ["sync", "fedbuff"])
def test_three_thousand_devices(mode, tmp_path):
    cfg = load_config(
        None,
        {
            "job": f"scale-{uuid.uuid4().hex[:6]}",
            "data.devices": 3000,
            "data.dataset": "synthetic",
            "model.name": "logreg",
            "rounds.rounds": 3,
            "rounds.clients_per_round": 300,
            "rounds.buffer_size": 100,
            "rounds.mode": mode,
            "rounds.deadline_s": 300,
        },
    )
    summary = simulate(cfg, tmp_path)
    assert summary["rounds_closed"] == 3
    assert summary["fleet_publish_failures"] == 0
    if mode == "sync":
        assert summary["total_received"] == 900
