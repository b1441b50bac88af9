"""Sync, FedBuff and FedAsync end to end over a real Mosquitto, on a small heterogeneous fleet in
modelled time: a sync round waits for its slow devices, async applications do not."""

from __future__ import annotations

import json
import uuid

import pytest
from helpers import TWO_SPEED_PROFILE

from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.simulation import simulate

pytestmark = pytest.mark.broker

# Two tiers 50x apart in compute, always available, no dropout, so the modelled times (not luck)
# decide who is late: 12 devices share digits' ~1440 training samples (IID), ~120 each.
PROFILE = TWO_SPEED_PROFILE
SLOW_SAMPLES_PER_S = 100
TIME_SCALE = 0.5  # real s per simulated s: keeps real overheads small against modelled times


def config(profile_path, mode: str, **overrides):
    base = {
        "job": f"ta-{mode}-{uuid.uuid4().hex[:6]}",
        "seed": 3,
        "data.dataset": "digits",
        "data.devices": 12,
        "model.name": "logreg",
        "training.epochs": 2,
        "rounds.mode": mode,
        "rounds.clients_per_round": 6,
        "rounds.deadline_s": 10.0,  # simulated seconds
        "rounds.wait_for_devices_s": 20.0,
        "fleet.profile": str(profile_path),
        "fleet.time_scale": TIME_SCALE,
    }
    return load_config(None, {**base, **overrides})


def slow_training_s(cfg) -> float:
    """Modelled training time of the slowest-tier device with the fewest samples (simulated s)."""
    job = build_job(cfg)
    fewest = min(len(ix) for ix in job.dataset.device_indices)
    return fewest * cfg.training.epochs / SLOW_SAMPLES_PER_S


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "two-speed.yaml"
    path.write_text(PROFILE)
    return path


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sync_rounds_wait_for_slow_devices(profile_path, tmp_path):
    cfg = config(profile_path, "sync", **{"rounds.rounds": 3, "rounds.min_updates": 6})
    slow = slow_training_s(cfg)
    assert slow > 2.0
    summary = simulate(cfg, tmp_path)
    recs = records(tmp_path)
    assert summary["rounds_closed"] == 3
    assert [r["version"] for r in recs] == [1, 2, 3]
    assert all(r["received"] == 6 and r["selected"] == 6 for r in recs)
    assert all("staleness_mean" not in r for r in recs)  # no staleness in sync rounds
    # 6 of 12 selected: a round without a slow device has probability 1/924, so at least two of
    # the three rounds lasted at least a slow device's training time
    sim = [r["sim_time_s"] for r in recs]
    assert sim == sorted(sim)
    assert sim[-1] >= 2 * slow
    assert summary["final_accuracy"] > 0.5


@pytest.mark.parametrize(
    ("mode", "applications", "overrides"),
    [
        ("fedbuff", 8, {"rounds.buffer_size": 3}),
        ("fedasync", 12, {"rounds.server_lr": 0.5}),
    ],
)
def test_async_modes_apply_stale_updates_and_version_up(
    profile_path, tmp_path, mode, applications, overrides
):
    cfg = config(
        profile_path,
        mode,
        # no concurrency limit: every available device trains on every version
        **{
            "rounds.rounds": applications,
            "rounds.max_staleness": 50,
            "rounds.concurrency": 0,
            **overrides,
        },
    )
    slow = slow_training_s(cfg)
    summary = simulate(cfg, tmp_path)
    recs = records(tmp_path)
    closed = [r for r in recs if r["status"] == "closed"]
    assert len(recs) == applications  # one record per window
    assert summary["rounds_closed"] == len(closed) >= applications - 1
    assert [r["round"] for r in recs] == list(range(1, applications + 1))
    # every application makes a new model version
    assert [r["version"] for r in closed] == list(range(1, len(closed) + 1))
    for r in closed:
        assert r["received"] >= 1
        assert 0 <= r["staleness_mean"] <= r["staleness_max"]
        assert sum(r["staleness_hist"].values()) == r["received"]
        assert all(int(s) <= 50 for s in r["staleness_hist"])  # max_staleness holds
    if mode == "fedbuff":
        assert all(r["received"] >= 3 for r in closed[:-1])  # K = 3 (the last may be a deadline)
    # six fast devices train concurrently on each version: some finish after a newer one is out
    assert max(r["staleness_max"] for r in closed) >= 1
    # the first application does not wait for any slow device
    assert recs[0]["sim_time_s"] < slow
    sim = [r["sim_time_s"] for r in recs]
    assert sim == sorted(sim)
    assert summary["final_accuracy"] > 0.5
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["config"]["rounds"]["mode"] == mode


@pytest.mark.parametrize(
    ("mode", "applications", "overrides"),
    [
        ("fedbuff", 5, {"rounds.buffer_size": 2}),
        ("fedasync", 8, {"rounds.server_lr": 0.5}),
    ],
)
def test_async_with_a_concurrency_limit_keeps_at_most_c_devices_training(
    profile_path, tmp_path, mode, applications, overrides
):
    c = 3
    cfg = config(
        profile_path,
        mode,
        **{
            "rounds.rounds": applications,
            "rounds.max_staleness": 50,
            "rounds.concurrency": c,
            **overrides,
        },
    )
    summary = simulate(cfg, tmp_path)
    recs = records(tmp_path)
    closed = [r for r in recs if r["status"] == "closed"]
    assert len(recs) == applications and len(closed) >= applications - 1
    assert [r["version"] for r in closed] == list(range(1, len(closed) + 1))
    for r in recs:
        assert r["concurrency"] == c
        assert r["in_flight"] <= c
        # a window selects C devices when it opens plus the replacements sent while it fills
        # (for devices that answered, timed out or left): never more training than C at once
        assert r["selected"] <= r["dispatched"]
        assert r["rejected_by_reason"].get("not_selected", 0) == 0
    last = recs[-1]
    # devices train only when selected: every update the aggregator saw was asked for, and the
    # fleet published no more than was dispatched (12 devices, far fewer than 12 x versions)
    assert last["dispatched"] >= c
    assert summary["after_last_round"]["device_updates"] <= last["dispatched"]
    assert summary["fleet_published"] <= last["dispatched"]
    assert summary["fleet_published"] < 12 * applications / 2
    assert [r["device_updates"] for r in recs] == sorted(r["device_updates"] for r in recs)
    assert summary["final_accuracy"] > 0.3
