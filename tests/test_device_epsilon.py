"""Epsilon per device in every round's record (``epsilon_device_p50/_p95/_max``): the aggregator
core's values against an independent recomputation from the ledger's releases, and the ledger's
grouping against composing every device on its own."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.privacy.accountants import best_epsilon
from edge_fl.privacy.events import pure_privacy_event
from edge_fl.privacy.ledger import PrivacyLedger
from edge_fl.protocol import DenseUpdate, Status, encode_status, encode_update
from edge_fl.server.aggregator import PARTICIPATION_PREFIXES, weighted_rank

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

DEVICES = 12


def nearest_rank(values: list[float], q: float) -> float:
    """The textbook nearest-rank quantile of a sorted list (rank ceil(q N), 1-based)."""
    return values[max(1, math.ceil(q * len(values))) - 1]


def recompute(core) -> dict[str, float]:
    """Every device the core knows (fleet view and ledger), each composed from the ledger's
    entries on its own (its releases and the job-level ones) with the public accountant."""
    ledger, delta = core.privacy.ledger, core.privacy.delta
    devices = set(core.devices) | {e.device for e in ledger.entries if e.device is not None}
    values = sorted(
        best_epsilon([e.event for e in ledger.entries if e.device in (None, d)], delta).epsilon
        for d in devices
    )
    return {
        "epsilon_device_p50": nearest_rank(values, 0.50),
        "epsilon_device_p95": nearest_rank(values, 0.95),
        "epsilon_device_max": values[-1],
    }


def private_core(mechanism: dict):
    cfg = load_config(
        None,
        {
            "data.devices": DEVICES,
            "model.name": "logreg",
            "rounds.rounds": 4,
            "rounds.clients_per_round": 5,
            "rounds.min_updates": 1,
            "reproducible": True,
            **mechanism,
        },
    )
    job = build_job(cfg)
    core = job.aggregator_core()
    for i in range(DEVICES):
        dev = f"d{i:05d}"
        # dataset sizes differ (a mechanism whose events depend on them composes them apart)
        core.on_status(dev, encode_status(Status(dev, True, 20 + 5 * (i % 3))))
    return core


@pytest.mark.parametrize(
    "mechanism",
    [
        # events that differ by exposure (Laplace's budget split per upload)
        {"privacy.mechanism": "laplace", "privacy.epsilon": 4.0},
        # a job-level event every round (central noise) besides nothing per device
        {"privacy.mechanism": "gaussian-central", "privacy.noise_multiplier": 1.0},
    ],
    ids=lambda m: m["privacy.mechanism"],
)
def test_the_record_equals_a_recomputation_from_the_ledger(mechanism: dict) -> None:
    core = private_core(mechanism)
    name = mechanism["privacy.mechanism"]
    rng = np.random.default_rng(3)
    for r in range(1, 5):
        msg = core.open_round(float(r))
        answering = [d for d in msg.selected if rng.random() < 0.8]
        for dev in answering:
            n = core.devices[dev].n_samples
            delta = np.zeros(len(core.params), np.float32)
            payload = encode_update(
                DenseUpdate(dev, r, core.version, n, delta, mechanism=name, nonce=msg.nonce)
            )
            assert core.on_update(dev, payload) is None
        record = core.close_round(float(r) + 0.5, 0.1)
        expected = recompute(core)
        for key, value in expected.items():
            assert record[key] == pytest.approx(value, rel=1e-12), (r, key)
        assert record["epsilon_device_max"] == record["epsilon"]  # the same composition
        assert record["epsilon_device_p50"] <= record["epsilon_device_p95"] <= record["epsilon"]
    # the last record, settled, still agrees with the ledger's final word
    assert core.settle(record)["epsilon_device_max"] == core.privacy.report()["epsilon"]
    if name == "laplace":  # some devices never uploaded: they count at 0
        assert record["epsilon_device_p50"] < record["epsilon_device_max"]
    # never on the metrics topic with Poisson selection: they count releases
    assert any(k.startswith(PARTICIPATION_PREFIXES) for k in record)
    assert all(k.startswith(PARTICIPATION_PREFIXES) for k in expected)


def test_grouped_devices_equal_each_device_composed_alone() -> None:
    """Devices with the same releases in another order, devices joining after job-level events,
    devices without releases: the ledger's grouped distribution equals one composition per
    device, and its largest value is the job's."""
    ledger = PrivacyLedger()
    small, big, job_level = (pure_privacy_event(e, "t") for e in (0.5, 1.5, 0.25))
    ledger.add(small, device="a", round=0)
    ledger.add(big, device="a", round=0)
    ledger.add(big, device="b", round=0)
    ledger.add(small, device="b", round=0)  # a's multiset, other first order
    ledger.add(job_level, device=None, round=0)
    ledger.add(small, device="c", round=1)  # joins after the job-level event
    ledger.add(big, device="a", round=1)
    ledger.add(job_level, device=None, round=1)
    known = ["a", "b", "c", "idle-1", "idle-2", "idle-1"]
    dist = ledger.device_distribution(1e-5, known)
    alone = sorted(
        best_epsilon([e.event for e in ledger.entries if e.device in (None, d)], 1e-5).epsilon
        for d in dict.fromkeys(known)
    )
    flat = [value for value, n in dist for _ in range(n)]
    assert flat == pytest.approx(alone, rel=1e-12)
    assert dist[-1][0] == ledger.best(1e-5)[0].epsilon
    for q in (0.0, 0.2, 0.5, 0.95, 1.0):
        assert weighted_rank(dist, q) == nearest_rank(flat, q)


def test_the_ledger_answers_as_before_after_growing() -> None:
    """Signatures are cached per device and dropped on change: a device's epsilon follows every
    release, and a job-level event reaches devices recorded before and after it."""
    ledger = PrivacyLedger()
    ev = pure_privacy_event(1.0, "t")
    ledger.add(ev, device="a", round=0)
    assert ledger.epsilon(1e-5, "basic", device="a") == pytest.approx(1.0)
    ledger.add(ev, device="a", round=1)
    assert ledger.epsilon(1e-5, "basic", device="a") == pytest.approx(2.0)
    ledger.add(ev, device=None, round=1)
    ledger.add(ev, device="b", round=2)
    assert ledger.epsilon(1e-5, "basic", device="a") == pytest.approx(3.0)
    assert ledger.epsilon(1e-5, "basic", device="b") == pytest.approx(2.0)
    assert ledger.epsilon(1e-5, "basic", device="never") == pytest.approx(1.0)
    assert ledger.epsilon(1e-5, "basic") == pytest.approx(3.0)
    assert ledger.epsilon_by_device(1e-5, "basic") == pytest.approx({"a": 3.0, "b": 2.0})


@pytest.mark.bench
def test_cost_per_round_with_10000_devices() -> None:
    """The ledger fields of a round's record (``epsilon`` and the rest, then the per-device
    quantiles) with 10,000 devices in the fleet view and 1,000 releases a round: seconds per
    round, one JSON line each (``pytest -m bench -s -k cost``)."""
    import json
    import time

    from edge_fl.server.aggregator import PrivacyAccounting

    devices, per_round, rounds = 10_000, 1_000, 10
    cfg = load_config(
        None,
        {
            "data.devices": devices,
            "data.dataset": "synthetic",
            "model.name": "logreg",
            "rounds.rounds": rounds,
            "rounds.clients_per_round": per_round,
            "privacy.mechanism": "gaussian",
            "privacy.epsilon": 50.0,
        },
    )
    job = build_job(cfg)
    accounting = PrivacyAccounting(job.mechanism, cfg.privacy.delta)
    names = [f"d{i:05d}" for i in range(devices)]
    sizes = list(job.facts.dataset_sizes)
    rng = np.random.default_rng(0)
    for r in range(1, rounds + 1):
        for i in rng.choice(devices, per_round, replace=False):
            accounting.record_upload(names[i], int(sizes[i]), r)
        t0 = time.perf_counter()
        epsilon = accounting.metrics()
        t1 = time.perf_counter()
        quantiles = accounting.device_metrics(names)
        t2 = time.perf_counter()
        assert quantiles["epsilon_device_max"] == epsilon["epsilon"]
        line = {"round": r, "metrics_s": round(t1 - t0, 4), "device_fields_s": round(t2 - t1, 4)}
        print(json.dumps({**line, **quantiles, "ledger_entries": r * per_round}))
