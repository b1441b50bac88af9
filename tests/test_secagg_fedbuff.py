"""Secure aggregation for FedBuff buffers (issue 21; docs/specs/secagg.md section 11): each
buffer a SecAgg+ cohort fixed at dispatch, several in flight, each applied with one staleness
weight, over a real Mosquitto with the test mechanism of tests/test_secagg_wiring.py."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from helpers import mechanisms_registered
from test_secagg_wiring import EPS, Crash, SecureMean, config, run_secure

from edge_fl.server.aggregator import SECURE_RELEASE
from edge_fl.server.cohorts import CohortPolicy, cohort_size
from edge_fl.server.staleness import Staleness

#: the vanish phases before which a device's masked input never leaves it
NO_MASKED_INPUT = ("advertise", "share", "mask")


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with mechanisms_registered(SecureMean):
        yield


def fedbuff(mosquitto: Any = None, **overrides: Any):
    """12 devices, K = 4, 30% dropout: cohorts of K' = 6, two in flight (C = 12)."""
    values = {
        "data.devices": 12,
        "rounds.mode": "fedbuff",
        "rounds.buffer_size": 4,
        "rounds.concurrency": 12,
        "rounds.rounds": 6,
        "rounds.deadline_s": 20,
        "secure_aggregation.phase_timeout_s": 5.0,
    }
    values.update(overrides)
    return config(mosquitto, **values)


def members(core: Any, number: int) -> frozenset[str]:
    return core.history[number][1]


def masked_by(core: Any, number: int, vanish: dict[str, str]) -> list[str]:
    """The cohort's members whose masked input left them (the fleet's forced vanishing)."""
    return sorted(d for d in members(core, number) if vanish.get(d) not in NO_MASKED_INPUT)


def replay_model(job: Any, core: Any, records: list[dict], vanish: dict[str, str]) -> np.ndarray:
    """The model the records claim, recomputed from the submitted integers: each applied
    cohort's exact sum decoded to the mean and applied with weight f(version now - base)."""
    params = job.aggregator_core().params.copy()
    layout = job.secure_plan.layout
    staleness = Staleness(job.cfg.rounds.staleness, job.cfg.rounds.staleness_a,
                          job.cfg.rounds.staleness_b)  # fmt: skip
    lr = job.cfg.rounds.server_lr
    version = 0
    for record in records:
        if record["status"] != "closed":
            continue
        number = record["round"]
        contributors = masked_by(core, number, vanish)
        assert record["received"] == len(contributors)
        total = sum(SecureMean.submitted[(d, number)] for d in contributors)
        s = version - record["secure"]["base_version"]
        assert record["staleness_max"] == s
        mean = SecureMean(None, None).secure_decode(total, len(contributors), layout, b"")
        params = params + np.float32(lr * staleness.weight(s)) * np.asarray(mean, np.float32)
        params = params.astype(np.float32)
        version += 1
        assert record["version"] == version
    return params


def test_the_cohort_size_is_k_over_one_minus_dropout():
    assert cohort_size(4, 0.3) == 6  # 5.71 -> 6
    assert cohort_size(7, 0.3) == 10  # 7 / 0.7 = 10 exactly, not 11 by rounding error
    assert cohort_size(10, 0.0) == 10
    assert cohort_size(9, 0.1) == 10


def test_fedbuff_cohorts_in_flight_apply_exact_sums_with_one_staleness_weight(mosquitto, tmp_path):
    """Six cohorts of 6 (two in flight), one device vanishing before its masked input and one
    after it in every cohort it joins (within the 30% dropout): every cohort closes, each
    applied buffer is bit for bit the sum of its survivors' integers, the model is the
    sequence of those sums weighted by their staleness, no vector the aggregator held is one
    device's input, and the ledger charged exactly the masked inputs that arrived."""
    from edge_fl.job import build_job

    vanish = {"d00000": "mask", "d00001": "unmask"}
    # a cohort holding d00000 waits out its deadline for that masked input: 12 s, not 20
    job = build_job(fedbuff(mosquitto, **{"rounds.deadline_s": 12}))
    assert isinstance(job.aggregator_core().policy, CohortPolicy)
    seen: list[tuple[str, np.ndarray]] = []

    def observe(label: str, v: Any) -> None:
        seen.append((label, np.array(v)))

    run, _, _, error = asyncio.run(
        run_secure(job, tmp_path / "run", vanish=vanish, observer=observe)
    )
    assert error is None
    core = run.core
    records = run.recorder.records
    assert sorted(r["round"] for r in records) == [1, 2, 3, 4, 5, 6]
    assert [r["status"] for r in records] == ["closed"] * 6, records
    assert all(r["selected"] == 6 and r["secure"]["outcome"] == "summed" for r in records)
    # several cohorts in flight: some buffer was applied on a model that had moved since
    assert max(r["staleness_max"] for r in records) >= 1
    assert any(r["cohorts_in_flight"] >= 1 for r in records)
    # each applied buffer is exactly the sum of its survivors' integers
    sums = [v for label, v in seen if label == "sum"]
    assert len(sums) == 6
    for record in records:
        number = record["round"]
        expected = sum(SecureMean.submitted[(d, number)] for d in masked_by(core, number, vanish))
        assert any(np.array_equal(total, expected) for total in sums), number
    # the model is those sums, each with the weight of its staleness
    assert np.array_equal(core.params, replay_model(job, core, records, vanish))
    # no vector the sessions held is one device's input (mod 2^b)
    bits = job.secure_plan.layout.bits
    ring = (1 << bits) - 1
    inputs = [x & ring for x in SecureMean.submitted.values()]
    for label, v in seen:
        if label != "sum":
            held = np.asarray(v).astype(np.int64) & ring
            assert not any(np.array_equal(held, x) for x in inputs), label
    # the ledger: one charge per masked input that reached the aggregator, once per cohort
    charged = sorted((d, r) for d, r, n in core.releases if n == SECURE_RELEASE)
    expected_charges = sorted((d, r["round"]) for r in records
                              for d in masked_by(core, r["round"], vanish))  # fmt: skip
    assert charged == expected_charges
    assert len(core.releases) == len(charged)
    per_device: dict[str, int] = {}
    for d, _ in charged:
        per_device[d] = per_device.get(d, 0) + 1
    # pure EPS per secure contribution, basic composition: the worst device's count x EPS
    assert core.privacy.report()["epsilon"] == pytest.approx(
        EPS * max(per_device.values()), rel=1e-3
    )
    assert "d00000" not in per_device  # vanished before masking in every cohort: no release


def test_a_cohort_beyond_the_threshold_is_skipped_charged_and_others_still_apply(
    mosquitto, tmp_path
):
    """Two devices of a cohort of 6 vanish before masking (min_survivors 5): that cohort
    fails in its masked phase, is recorded skipped with its reason, the model is unchanged by
    it, and its 4 masked inputs are charged; cohorts without both devices apply."""
    from edge_fl.job import build_job

    vanish = {"d00000": "mask", "d00001": "mask"}
    job = build_job(fedbuff(mosquitto, **{"rounds.rounds": 4, "data.devices": 8,
                                          "rounds.concurrency": 8, "rounds.clients_per_round": 8,
                                          "rounds.deadline_s": 6}))  # fmt: skip
    run, _, _, error = asyncio.run(run_secure(job, tmp_path / "run", vanish=vanish))
    assert error is None
    core = run.core
    records = run.recorder.records
    assert len(records) == 4
    both = [r for r in records if {"d00000", "d00001"} <= members(core, r["round"])]
    for record in records:
        lost = len(members(core, record["round"]) & {"d00000", "d00001"})
        if lost == 2:
            assert record["status"] == "skipped", record
            failed = record["secure"]["failed"]
            assert failed["phase"] == "masked"
            assert "4 masked inputs arrived; 5 needed" in failed["reason"]
        else:
            assert record["status"] == "closed", record
    # the seeded selection put both devices in some cohort and not in others: both outcomes
    assert both and len(both) < len(records)
    charged = sorted((d, r) for d, r, n in core.releases if n == SECURE_RELEASE)
    assert charged == sorted((d, r["round"]) for r in records
                             for d in masked_by(core, r["round"], vanish))  # fmt: skip
    assert np.array_equal(core.params, replay_model(job, core, records, vanish))


def test_a_crash_mid_cohort_skips_it_and_keeps_its_charges(mosquitto, tmp_path):
    """The aggregator dies when the first masked input of the job arrives (cohorts 1 and 2
    in flight). ``--resume``: both cohorts are recorded skipped (never summed from what
    survived), the masked inputs that arrived are charged, and the job's later cohorts sum
    exactly under new nonces."""
    from edge_fl.job import build_job

    cfg = fedbuff(mosquitto, **{"rounds.rounds": 4})
    job = build_job(cfg)
    state = {"n": 0}

    def crash(label: str, _v: Any) -> None:
        if label == "masked_sum":
            state["n"] += 1
            if state["n"] == 3:
                raise Crash("killed while cohorts were collecting masked inputs")

    async def both():
        run, _, fleet, error = await run_secure(job, tmp_path / "run", observer=crash)
        assert isinstance(error, Crash)
        open_before = sorted(c.number for c in run.core.cohorts.open_cohorts())
        job2 = build_job(cfg)
        sums: list[np.ndarray] = []
        run2, *_ = await run_secure(
            job2, tmp_path / "run", resume=True, fleet=fleet,
            observer=lambda label, v: sums.append(np.array(v)) if label == "sum" else None,
        )  # fmt: skip
        return run2, open_before, sums

    run2, open_before, sums = asyncio.run(both())
    assert open_before == [1, 2]
    records = run2.recorder.records
    by_round = {r["round"]: r for r in records}
    assert sorted(by_round) == [1, 2, 3, 4]
    for number in (1, 2):
        record = by_round[number]
        assert record["status"] == "skipped" and record["version"] == 0, record
        assert record["secure"]["failed"]["reason"] == "the aggregator restarted mid-cohort"
    core = run2.core
    assert [by_round[n]["status"] for n in (3, 4)] == ["closed", "closed"]
    for number in (3, 4):
        expected = sum(SecureMean.submitted[(d, number)] for d in members(core, number))
        assert any(np.array_equal(total, expected) for total in sums)
    # the masked inputs that reached the dead process were journaled and stay charged
    early = {(d, r) for d, r, n in core.releases if r in (1, 2)}
    assert len(early) >= 3
    assert all(d in members(core, r) for d, r in early)


def test_distributed_gaussian_calibrates_per_cohort_and_the_ledger_is_its_epsilon(
    mosquitto, tmp_path
):
    """``distributed-gaussian`` under cohorts: its noise is calibrated for a cohort of K' = 6
    and the survivors floor 5, every cohort sums, and the ledger's epsilon is a direct
    computation from the charges: ddg.epsilon of the calibration at the worst device's number
    of cohorts (each device charged once per cohort whose masked input it delivered)."""
    from edge_fl.job import build_job
    from edge_fl.secagg import ddg

    job = build_job(fedbuff(mosquitto, **{"privacy.mechanism": "distributed-gaussian",
                                          "privacy.epsilon": 8.0, "rounds.rounds": 4}))  # fmt: skip
    plan = job.secure_plan
    assert (plan.selected, plan.min_survivors, plan.job.selected) == (6, 5, 6)
    p = plan.mechanism.calibration(plan.job).params
    assert p.n_min == 5
    run, _, _, error = asyncio.run(run_secure(job, tmp_path / "run"))
    assert error is None
    core = run.core
    records = run.recorder.records
    assert [r["status"] for r in records] == ["closed"] * 4
    counts: dict[str, int] = {}
    for d, r, n in core.releases:
        assert n == SECURE_RELEASE and d in members(core, r)
        counts[d] = counts.get(d, 0) + 1
    assert sum(counts.values()) == 4 * 6  # every member of every cohort delivered
    delta = job.cfg.privacy.delta
    want = ddg.epsilon(p, max(counts.values()), delta)
    assert core.privacy.report()["epsilon"] == pytest.approx(want, rel=1e-6)
    assert records[-1]["epsilon"] == pytest.approx(want, rel=1e-6)


def test_signed_cohorts_sum_and_a_forged_masked_input_is_not_charged(mosquitto, tmp_path):
    """With device signing keys (``security.device_keys``) every cohort's adverts and masked
    inputs are signed and checked, cohorts sum, and a masked input forged under a member's
    name for an open cohort is no release of that device (checked against the cohort's own
    seed commitments, while it runs)."""
    from edge_fl.job import build_job
    from edge_fl.protocol import Status, encode_status
    from edge_fl.protocol.device_keys import mint_device_keys

    keys = mint_device_keys(tmp_path / "keys", [f"d{i:05d}" for i in range(12)])
    cfg = fedbuff(mosquitto, **{"rounds.rounds": 4, "security.device_keys": str(keys)})
    job = build_job(cfg)
    plan = job.secure_plan
    k, t = plan.for_roster(plan.selected)
    assert 2 * t > k  # calibrated against an aggregator that lies about who dropped
    # in memory: a forgery for an open cohort is not charged
    core = job.aggregator_core()
    for i in range(12):
        device = f"d{i:05d}"
        core.on_status(device, encode_status(Status(device, True, 10)))
    made = core.open_cohort(0.0)
    assert made is not None
    cohort, msg = made
    assert msg.mode == "fedbuff" and msg.round == cohort.number == 1 and msg.nonce == cohort.nonce
    assert msg.secure is not None and msg.version == cohort.base_version == 0
    member = sorted(cohort.selected)[0]
    forged = b"\x85\xa1v\x01\xa1k\xa2mx\xa1r\x01\xa2nc\xc4\x10" + cohort.nonce + b"\xa1y\xc4\x00"
    assert not core.charge_secure(member, 1, forged)
    assert core.releases == []
    # over the broker: signed cohorts sum
    run, _, _, error = asyncio.run(run_secure(build_job(cfg), tmp_path / "run"))
    assert error is None
    records = run.recorder.records
    assert [r["status"] for r in records] == ["closed"] * 4
    assert sum(r["received"] for r in records) == 4 * 6


def test_a_stop_records_every_open_cohort_skipped_and_keeps_its_charges(
    mosquitto, tmp_path, monkeypatch
):
    """A stop (SIGTERM) when the first cohort's sum is applied: the job ends at once, every
    cohort still open gets a skipped record with the stop as its reason (never a partial sum),
    and what reached the aggregator stays charged."""
    from edge_fl.job import build_job
    from edge_fl.server.service import AggregatorService

    services: list[AggregatorService] = []
    init = AggregatorService.__init__

    def capture(self, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        services.append(self)

    monkeypatch.setattr(AggregatorService, "__init__", capture)

    def stop_on_first_sum(label: str, _v: Any) -> None:
        if label == "sum" and services[0].stopped is None:
            services[0].request_stop("SIGTERM")

    job = build_job(fedbuff(mosquitto, **{"rounds.rounds": 6}))
    run, _, _, error = asyncio.run(run_secure(job, tmp_path / "run", observer=stop_on_first_sum))
    assert error is None
    core = run.core
    records = run.recorder.records
    dispatched = sorted(core.history)
    assert sorted(r["round"] for r in records) == dispatched  # every dispatched cohort: a record
    assert len(dispatched) < 6 and core.ended_early == "stopped by SIGTERM"
    summed = [r for r in records if r["status"] == "closed"]
    assert len(summed) == 1
    for record in records:
        if record["status"] == "skipped":
            assert record["secure"]["failed"]["reason"] == "stopped by SIGTERM"
            assert record["stopped"] == "SIGTERM"
    assert not core.cohorts.cohorts  # nothing left open
    assert all(d in members(core, r) for d, r, _ in core.releases)


def test_sa_is_legal_in_a_fedbuff_cohort_and_refused_in_fedasync():
    """The wire: a cohort's global message is a secure round's with mode fedbuff (r the cohort,
    v its base version); fedasync with sa is out_of_range on both sides; every SecAgg+ message
    names its cohort by (r, nc) in its head (what the aggregator routes on)."""
    import edge_fl.secagg.messages as M
    from edge_fl.protocol import GlobalModel, PayloadRejected, decode_global, encode_global
    from edge_fl.protocol.secure import check_secure_params, secure_head

    sa = {"b": 16, "k": 4, "md": False, "ms": 3, "n": 8, "q": 256, "t": 2}
    sel = ("d00000", "d00001", "d00002", "d00003", "d00004")

    def cohort(mode: str) -> GlobalModel:
        return GlobalModel(job="demo", version=3, round=7, params=np.zeros(8, np.float32),
                           selected=sel, nonce=bytes(16), secure=sa, mode=mode)  # fmt: skip

    msg = decode_global(encode_global(cohort("fedbuff")))
    assert (msg.mode, msg.round, msg.version, msg.secure) == ("fedbuff", 7, 3, sa)
    with pytest.raises(ValueError, match="sa"):
        encode_global(cohort("fedasync"))
    with pytest.raises(PayloadRejected, match="only in sync or fedbuff rounds"):
        check_secure_params(sa, 5, mode="fedasync")
    nc = bytes(range(16))
    for kind, body in (("ak", {"ck": bytes(32), "sk": bytes(32), "bh": bytes(32)}),
                       ("mx", {"b": 12, "m": b"\x01", "y": bytes(6)})):  # fmt: skip
        assert secure_head(M.encode(kind, 7, nc, **body)) == (7, nc)
    assert secure_head(b"\x85garbage") is None


def test_a_checkpoint_written_while_cohorts_run_skips_them_on_restore():
    """In memory: a checkpoint's snapshot (JSON) lists the open cohort; a core restored from it
    holds it abandoned (recorded skipped on resume, never summed), remembers its nonce and
    roster (a late masked input is still charged), and continues the cohort numbers."""
    import json

    from edge_fl.job import build_job
    from edge_fl.protocol import Status, encode_status

    job = build_job(fedbuff())
    core = job.aggregator_core()
    for i in range(12):
        core.on_status(f"d{i:05d}", encode_status(Status(f"d{i:05d}", True, 10)))
    made = core.open_cohort(0.0)
    assert made is not None and core.open_cohort(0.0) is None  # the first still awaits keys
    cohort = made[0]
    state = json.loads(json.dumps(core.snapshot()))
    fresh = job.aggregator_core()
    fresh.restore(state, core.params)
    cohorts = fresh.cohorts
    assert [c.number for c in cohorts.abandoned] == [1] and not cohorts.cohorts
    assert fresh.round_facts(1) == (cohort.nonce, cohort.selected)
    assert not fresh.finished  # its record is still owed
    record = fresh.close_cohort(cohorts.abandoned[0], 0.0, 0.0, "the aggregator restarted")
    assert record["status"] == "skipped" and record["round"] == 1 and record["version"] == 0
    assert record["secure"]["failed"]["reason"] == "the aggregator restarted"
    assert np.array_equal(fresh.params, core.params) and not cohorts.abandoned
    assert fresh.round_number == 1
