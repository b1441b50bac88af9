"""Secure aggregation wired end to end (issue 21): config and refusals, the ``sa`` map, and
SecAgg+ sync rounds over a real Mosquitto, with a SecureSum implemented here (a plain clipped,
stochastically rounded mean) so the wiring is tested apart from any shipped mechanism."""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

import numpy as np
import pytest

from edge_fl.config import load_config
from edge_fl.mechanisms import register_mechanism
from edge_fl.mechanisms.base import local_update
from edge_fl.mechanisms.none import NoPrivacy
from edge_fl.mechanisms.base import Guarantee
from edge_fl.mechanisms.secure import SecureJob, SecureLayout, secure_sum
from edge_fl.privacy.events import pure_privacy_event

STEP = 2.0**-8
CLIP = 4.0  # L2 bound of a delta
EPS = 0.5  # what one secure contribution costs a device (basic composition: adds up)


class SecureMean(NoPrivacy):
    """A test-local SecureSum: clip the delta to L2 norm CLIP, quantise with step STEP by
    stochastic rounding, and decode the sum to the mean. ``submitted`` records each device's
    integers (what the test compares the secure sum with)."""

    name = "test-secure-mean"
    guarantee = Guarantee("device", "replace_one", "pure")  # charged EPS per secure round
    submitted: dict[tuple[str, int], np.ndarray] = {}  # noqa: RUF012 - a test's record

    def secure_layout(self, job: SecureJob) -> SecureLayout:
        step = job.step or STEP
        q = math.ceil(CLIP / step)
        return SecureLayout(job.n_params, q, (job.selected * q).bit_length() + 1)

    def secure_encode(self, device: Any, msg: Any, layout: SecureLayout, round_seed: bytes):
        delta = local_update(device, msg)
        norm = float(np.linalg.norm(delta))
        if norm > CLIP:
            delta = delta * (CLIP / norm)
        step = CLIP / layout.max_int
        x = delta / step
        low = np.floor(x)
        values = low + (device.rng.random(x.shape) < (x - low))
        values = np.clip(values, -layout.max_int, layout.max_int).astype(np.int64)
        SecureMean.submitted[(device.device_id, msg.round)] = values.copy()
        return values

    def secure_decode(self, total, contributors: int, layout: SecureLayout, round_seed: bytes):
        step = CLIP / layout.max_int
        return (np.asarray(total, np.float64) * step / contributors).astype(np.float32)

    def secure_events(self, job: SecureJob) -> list:
        return [pure_privacy_event(EPS, self.name)]


register_mechanism(SecureMean.name, SecureMean)


def config(mosquitto: Any = None, **overrides: Any):
    values: dict[str, Any] = {
        "job": f"sa-{uuid.uuid4().hex[:8]}",
        "data.devices": 10,
        "rounds.rounds": 3,
        "rounds.clients_per_round": 10,
        "rounds.deadline_s": 30,
        "privacy.mechanism": SecureMean.name,
        "secure_aggregation.enabled": True,
        "secure_aggregation.phase_timeout_s": 5.0,
        "reproducible": True,
    }
    if mosquitto is not None:
        values["broker.url"] = mosquitto.url
    values.update(overrides)
    return load_config(None, values)


def test_the_test_mechanism_is_a_secure_sum():
    assert secure_sum(SecureMean(None, None)) is not None


# ------------------------------------------------------------------ over a real Mosquitto


class Crash(Exception):
    """Raised inside the aggregator's ingest: the process dies at that point."""


async def run_secure(job, out, *, vanish=None, observer=None, resume=False, fleet=None,
                     timeout=120.0):  # fmt: skip
    """One aggregator (with its output directory) and a fleet on this loop; returns
    (run, service, fleet, error): ``error`` is what ended the aggregator, if it failed."""
    from edge_fl.protocol.signing import Signer
    from edge_fl.simulation import open_run

    spec = job.cfg.broker
    from edge_fl.transport.url import parse_broker_url

    broker = parse_broker_url(spec.url)
    signer = SIGNER.setdefault("key", Signer.generate())
    run = open_run(job, out, resume=resume)
    service = run.make_service(broker, signer=signer)
    service.secure_observer = observer
    own_fleet = fleet is None
    if own_fleet:
        fleet = job.fleet_runtime(broker, trust=job.trust(signer.verifier))
        fleet.secure_vanish = dict(vanish or {})
    aggregator = asyncio.create_task(service.run())
    await service.connected.wait()
    fleet_task = FLEETS.get(id(fleet))
    if fleet_task is None:
        fleet_task = FLEETS[id(fleet)] = asyncio.create_task(fleet.run())
    error = None
    try:
        await asyncio.wait_for(aggregator, timeout)
    except Crash as exc:
        error = exc
    finally:
        run.close()
    if error is None:
        with __import__("contextlib").suppress(TimeoutError):
            await asyncio.wait_for(fleet_task, 10)
    return run, service, fleet, error


SIGNER: dict[str, Any] = {}
FLEETS: dict[int, asyncio.Task] = {}


def contributions(rnd: int, devices) -> np.ndarray:
    return sum(SecureMean.submitted[(d, rnd)] for d in devices)


def test_devices_vanishing_at_each_phase_leave_exactly_the_contributors_sum(mosquitto, tmp_path):
    """12 devices, one round: two vanish before advertising, one before sharing, two before
    masking, two before unmasking (7 of 12 gone, more than calibrated for, at every phase):
    the sum is exactly the sum of the integers of the devices that delivered a masked input,
    and no vector the aggregator holds is any device's input."""
    from edge_fl.job import build_job

    vanish = {
        "d00000": "advertise", "d00001": "advertise", "d00002": "share",
        "d00003": "mask", "d00004": "mask", "d00005": "unmask", "d00006": "unmask",
    }  # fmt: skip
    job = build_job(config(
        mosquitto, **{"data.devices": 12, "rounds.clients_per_round": 12, "rounds.rounds": 1,
                      "secure_aggregation.min_survivors": 4,
                      "secure_aggregation.neighbours": 11, "secure_aggregation.threshold": 3}
    ))  # fmt: skip
    seen: list[tuple[str, np.ndarray]] = []
    before = job.aggregator_core().params.copy()
    run, service, _, error = asyncio.run(
        run_secure(job, tmp_path / "run", vanish=vanish,
                   observer=lambda label, v: seen.append((label, v)))  # fmt: skip
    )
    assert error is None
    record = run.recorder.records[-1]
    assert record["status"] == "closed", record
    sa = record["secure"]
    assert sa["outcome"] == "summed"
    assert sa["phases"] == {"keys": 10, "shares": 9, "masked": 7, "unmask": 5}
    contributors = sorted([d for d in
                          (f"d{i:05d}" for i in range(12)) if vanish.get(d) not in
                          ("advertise", "share", "mask")])  # fmt: skip
    assert record["received"] == len(contributors) == 7
    expected = contributions(1, contributors)
    totals = [v for label, v in seen if label == "sum"]
    assert len(totals) == 1 and np.array_equal(totals[0], expected)
    # the model moved by exactly the decoded mean of those integers
    layout = job.secure_plan.layout
    mean = SecureMean(None, None).secure_decode(expected, 7, layout, b"")
    assert np.array_equal(run.core.params, (before + np.float32(1.0) * mean).astype(np.float32))
    # no vector the session held is one device's input (mod 2^b), masked or not
    bits = layout.bits
    inputs = [SecureMean.submitted[(d, 1)] for d in contributors]
    for label, v in seen:
        if label == "sum":
            continue
        ring = np.asarray(v).astype(np.int64) & ((1 << bits) - 1)
        for x in inputs:
            assert not np.array_equal(ring, x & ((1 << bits) - 1)), label
    # every device whose masked input arrived was charged, and only those
    charged = sorted(d for d, r, n in run.core.releases if r == 1)
    assert charged == contributors


def test_too_many_vanishing_fails_the_round_cleanly(mosquitto, tmp_path):
    """Fewer masked inputs than min_survivors: the round fails with its reason, the model is
    unchanged, and the devices whose masked input arrived are charged all the same."""
    from edge_fl.job import build_job

    vanish = {f"d{i:05d}": "mask" for i in range(5)}
    job = build_job(config(
        mosquitto, **{"data.devices": 8, "rounds.clients_per_round": 8, "rounds.rounds": 1,
                      "secure_aggregation.min_survivors": 4}
    ))  # fmt: skip
    before = job.aggregator_core().params.copy()
    run, *_ = asyncio.run(run_secure(job, tmp_path / "run", vanish=vanish))
    record = run.recorder.records[-1]
    assert record["status"] == "skipped"
    assert record["secure"]["failed"]["phase"] == "masked"
    assert "3 masked inputs arrived; 4 needed" in record["secure"]["failed"]["reason"]
    assert np.array_equal(run.core.params, before)
    assert sorted(d for d, r, _ in run.core.releases) == ["d00005", "d00006", "d00007"]
    assert run.summary is None or True
    assert run.core.privacy.ledger is not None


def test_a_crash_between_masked_inputs_and_unmasking_skips_the_round(mosquitto, tmp_path):
    """The aggregator dies once every masked input of round 1 is in, before any unmask request
    (kill at the last ``masked_sum``). ``--resume``: round 1 is recorded skipped (never summed
    from what survived), its charges stay, the next rounds use new nonces and sum exactly."""
    from edge_fl.job import build_job

    cfg = config(mosquitto, **{"data.devices": 6, "rounds.clients_per_round": 6,
                               "rounds.rounds": 3})  # fmt: skip
    job = build_job(cfg)
    before = job.aggregator_core().params.copy()
    count = {"masked": 0}

    def crash(label: str, _v: np.ndarray) -> None:
        if label == "masked_sum":
            count["masked"] += 1
            if count["masked"] == 6:
                raise Crash("killed between the masked inputs and the unmasking")

    async def both():
        run, service, fleet, error = await run_secure(job, tmp_path / "run", observer=crash)
        assert isinstance(error, Crash)
        assert run.core.current is not None and run.core.current.number == 1
        nonce1 = run.core.current.nonce
        job2 = build_job(cfg)
        sums: list[np.ndarray] = []
        run2, *_ = await run_secure(
            job2, tmp_path / "run", resume=True, fleet=fleet,
            observer=lambda label, v: sums.append(v) if label == "sum" else None,
        )  # fmt: skip
        return run2, nonce1, sums

    run2, nonce1, sums = asyncio.run(both())
    records = run2.recorder.records
    assert [r["round"] for r in records] == [1, 2, 3]
    first = records[0]
    assert first["status"] == "skipped" and first["version"] == 0
    assert first["secure"]["failed"]["reason"] == "the aggregator restarted mid-round"
    assert [r["status"] for r in records[1:]] == ["closed", "closed"]
    # every device delivered round 1's masked input: charged once, kept across the restart
    devices = [f"d{i:05d}" for i in range(6)]
    for rnd in (1, 2, 3):
        assert sorted(d for d, r, _ in run2.core.releases if r == rnd) == devices
    eps = run2.core.privacy.report()["epsilon"]
    assert eps == pytest.approx(3 * EPS, rel=1e-3)  # the tightest accountant rounds a little
    # rounds 2 and 3: exact sums of what was submitted then, under new nonces
    assert len(sums) == 2
    for rnd, total in zip((2, 3), sums, strict=True):
        assert np.array_equal(total, contributions(rnd, devices))
    assert run2.core.history[2][0] != nonce1
    assert not np.array_equal(run2.core.params, before)  # rounds 2 and 3 applied




def test_a_secure_simulation_learns(mosquitto, tmp_path):
    from edge_fl.simulation import simulate

    summary = simulate(config(mosquitto), tmp_path / "run")
    print(summary)
