"""Secure aggregation under virtual time, over the embedded Mosquitto: the aggregator's inbox
messages are counted like its models, the devices' SecAgg+ answers are taken at the simulated
time of the grant that counts them, and phase deadlines are simulated seconds. So the same
secure job, devices vanishing mid-protocol included, gives the same records beside a CPU hog."""

from __future__ import annotations

import uuid

import pytest
from helpers import TWO_SPEED_PROFILE, run_quiet_then_loaded

from edge_fl.clocksync import first_difference
from edge_fl.config import load_config

pytestmark = pytest.mark.broker

WALL_FIELDS = ("wall_time_s", "elapsed_s")


def config(tmp_path, **overrides):
    profile = tmp_path / "two-speed.yaml"
    profile.write_text(TWO_SPEED_PROFILE)
    base = {
        "job": f"vts-{uuid.uuid4().hex[:6]}",
        "seed": 3,
        "reproducible": True,
        "data.dataset": "digits",
        "data.devices": 12,
        "model.name": "logreg",
        "rounds.rounds": 4,
        "rounds.clients_per_round": 10,
        "rounds.deadline_s": 60.0,  # simulated seconds
        "secure_aggregation.enabled": True,
        "secure_aggregation.phase_timeout_s": 20.0,  # simulated seconds
        # every device the others' neighbour (the graph is seeded by the round's nonce)
        "secure_aggregation.neighbours": 9,
        "fleet.profile": str(profile),
        "fleet.clock": "virtual",
        "fleet.dropout": 0.25,  # devices vanish at a phase drawn per round
    }
    return load_config(None, {**base, **overrides})


@pytest.mark.parametrize(
    ("mechanism", "model_fields"),
    [
        ({}, ()),
        # its rotation is keyed by the round's nonce, which --reproducible derives from the
        # seed (it was random: the model differed), its noise by the devices' seeded generators
        ({"privacy.mechanism": "distributed-gaussian", "privacy.epsilon": 8.0}, ()),
    ],
    ids=["secure-sum", "distributed-gaussian"],
)
def test_a_secure_job_gives_the_same_records_with_and_without_a_cpu_hog(
    tmp_path, mechanism, model_fields
):
    cfg = config(tmp_path, **mechanism)
    assert cfg.fleet.virtual
    first, second, a, b = run_quiet_then_loaded(cfg, tmp_path)
    assert len(a) == 4
    assert first_difference(a, b, WALL_FIELDS + model_fields) is None
    assert (first.params == second.params).all()
    outcomes = [r["secure"]["outcome"] for r in a]
    assert outcomes.count("summed") >= 3, outcomes
    # devices vanished mid-protocol, and a round then waited for its phase deadline in
    # simulated time (20 s), not in the machine's
    phases = [r["secure"]["phases"] for r in a]
    assert any(p["masked"] < p["keys"] or p["unmask"] < p["masked"] for p in phases), phases
    vt = first.summary["virtual_time"]
    assert vt["same_time_grants"] > 0  # the inbox messages were exchanged at their own times
    # every inbox message counted on both sides (the fleet also saw the done marker, which
    # ends the job after the last grant)
    assert vt["fleet_seen"] == vt["aggregator_published"] + 1 > 4 * 10
    assert vt == {**second.summary["virtual_time"], "train_wall_s": vt["train_wall_s"]}
    assert first.summary["epsilon"] == second.summary["epsilon"]


def test_secure_fedbuff_cohorts_give_the_same_records_with_and_without_a_cpu_hog(tmp_path):
    """FedBuff cohorts (K = 4, cohorts of 6, two in flight) under virtual time: each cohort's
    model and inbox messages are counted like a round's, several sessions' phase deadlines are
    simulated seconds, and the same job gives the same records beside a CPU hog."""
    cfg = config(
        tmp_path,
        **{
            "rounds.mode": "fedbuff",
            "rounds.buffer_size": 4,
            "rounds.concurrency": 12,
            "rounds.rounds": 6,
            "secure_aggregation.neighbours": "auto",
            "fleet.dropout": 0.1,
        },
    )
    assert cfg.fleet.virtual
    first, second, a, b = run_quiet_then_loaded(cfg, tmp_path)
    assert len(a) == 6
    assert first_difference(a, b, WALL_FIELDS) is None
    assert (first.params == second.params).all()
    assert [r["secure"]["outcome"] for r in a].count("summed") >= 3
    assert max(r["staleness_max"] or 0 for r in a) >= 1  # cohorts overlapped
    vt = first.summary["virtual_time"]
    assert vt["fleet_seen"] == vt["aggregator_published"] + 1
    assert vt == {**second.summary["virtual_time"], "train_wall_s": vt["train_wall_s"]}
