"""Privacy end to end over Mosquitto: the ledger's total over all rounds, and devices that spend
their budget stop uploading while the run reports it."""

from __future__ import annotations

import itertools
import json
import uuid

import pytest

from edge_fl.config import load_config
from edge_fl.simulation import simulate

pytestmark = pytest.mark.broker


def run(tmp_path, **overrides):
    cfg = load_config(
        None,
        {
            "job": f"p-{uuid.uuid4().hex[:6]}",
            "data.devices": 10,
            "rounds.clients_per_round": 5,
            "rounds.min_updates": 2,
            "rounds.deadline_s": 10,
            **overrides,
        },
    )
    summary = simulate(cfg, tmp_path)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def test_budget_exhausted_devices_stop_and_are_reported(tmp_path):
    # Laplace: eps 0.5 per round (3 / 6 rounds); a budget of 1.0 affords two releases per device
    summary, records = run(
        tmp_path,
        **{
            "rounds.rounds": 6,
            "privacy.mechanism": "laplace",
            "privacy.epsilon": 3.0,
            "privacy.budget_epsilon": 1.0,
        },
    )
    assert summary["stopped_devices"] > 0
    assert records[-1]["stopped_devices"] > 0
    # no device released more than its budget: the reported worst-device epsilon stays <= 1
    assert all(r["epsilon"] <= 1.0 + 1e-9 for r in records)
    assert 0.99 <= summary["privacy"]["epsilon"] <= 1.0 + 1e-9  # PLD may be a hair tighter
    assert summary["privacy"]["unit"] == "example"
    # stopped devices never upload again: accepted updates <= 2 per device
    assert summary["total_received"] <= 2 * 10


def test_epsilon_is_cumulative_never_per_round(tmp_path):
    summary, records = run(
        tmp_path,
        **{"rounds.rounds": 4, "privacy.mechanism": "gaussian", "privacy.noise_multiplier": 2.0},
    )
    eps = [r["epsilon"] for r in records]
    assert all(b >= a for a, b in itertools.pairwise(eps))
    assert eps[-1] > eps[0] * 1.3  # more rounds spent more: the total, not one round's value
    p = summary["privacy"]
    assert p["delta"] == 1e-5 and p["neighbouring_relation"] == "replace_one"
    assert p["composition"].startswith("all recorded releases")
