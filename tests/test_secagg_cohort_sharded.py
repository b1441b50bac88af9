"""Secure FedBuff cohorts with sharded ingest (issue 21 item 3) over a real Mosquitto: two ingest
workers sum each in-flight cohort's masked inputs modulo 2^b separately (keyed by the cohort's
number), the coordinator merges the partial sums per cohort and unmasks. The model and the
ledger are bit for bit the unsharded job's; a cohort that fails (too few survivors) is charged
the same; a worker killed mid-cohort fails the cohorts it held, never a wrong sum; hostile masked
inputs get a sync round's rejection reasons (edge_fl/server/sharding.py, docs/protocol.md
"Ingest workers", docs/specs/secagg.md section 11)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np
import pytest
from helpers import answer_inbox, mechanisms_registered, relay_control, relay_update
from test_secagg_fedbuff import fedbuff, members
from test_secagg_sharded import kill, run_job
from test_secagg_wiring import SecureMean

from edge_fl.server.aggregator import SECURE_RELEASE
from edge_fl.server.sharding import Coordinator


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with mechanisms_registered(SecureMean):
        yield


def first_cohort(job: Any) -> frozenset[str]:
    """The first cohort the job's seeded selection dispatches (every device online)."""
    from edge_fl.protocol import Status, encode_status

    core = job.aggregator_core()
    for i in range(job.cfg.data.devices):
        core.on_status(f"d{i:05d}", encode_status(Status(f"d{i:05d}", True, 10)))
    made = core.open_cohort(0.0)
    assert made is not None
    return made[0].selected


#: 12 devices, K = 4, 30% dropout: cohorts of K' = 6, two in flight, min_survivors 5
JOB = {"rounds.rounds": 4, "rounds.deadline_s": 10, "secure_aggregation.phase_timeout_s": 3.0}


def open_two_cohorts(core: Any, coordinator: Any, control: Any) -> list[Any]:
    """Dispatch two cohorts at once, each announced to the workers (``control``) before its
    devices could answer; the first's session is held back meanwhile (out of its keys phase,
    so the second can open), then restored."""
    from edge_fl.protocol import encode_global

    cohorts, held = [], []
    for _ in range(2):
        made = core.open_cohort(0.0)
        assert made is not None
        cohort, msg = made
        control(coordinator.open_cohort_message(cohort.number, encode_global(msg)))
        cohorts.append(cohort)
        held.append(cohort.session)
        cohort.session = None
    for cohort, session in zip(cohorts, held, strict=True):
        cohort.session = session
    return cohorts


def kill_w1_holding_a_cohort(state: dict[str, Any], kill: Any) -> Any:
    """A coordinator hook that calls ``kill()`` once, the first time worker w1 holds a masked
    input an open cohort's sum needs (``state["killed"]``: that cohort)."""

    def hook(coordinator: Coordinator, worker: str | None) -> None:
        if state.get("killed") or worker != "w1":
            return
        for number, cr in coordinator.cohort_rounds.items():
            if "w1" in cr.owner.values():
                state["killed"] = number
                kill()
                return

    return hook


@pytest.mark.parametrize("case", ["fails", "stale"])
def test_two_workers_give_the_unsharded_cohort_jobs_model_and_ledger(case, mosquitto, tmp_path):
    """The same secure FedBuff job (same seed, reproducible) with 0 and with 2 ingest workers
    (shared subscription), at once on one broker. ``fails``: two devices of the first cohort
    vanish before masking, so that cohort (and any cohort with both) fails in its masked phase
    (4 masked inputs, 5 needed) at its deadline while the other group's three cohorts sum.
    ``stale``: one vanishes, so the first cohort sums at its deadline, after three others were
    applied: staleness 3 > max_staleness 2, recorded skipped (stale). Both jobs write the same
    records, unmask the same sums per cohort (bit for bit the survivors' integers), end with
    the same model bytes and the same ledger: every masked input's sender charged once per
    cohort, summed, failed or stale."""
    from edge_fl.job import build_job

    jobs = {}
    for name, workers in (("single", 0), ("sharded", 2)):
        job_id = f"csh-{name[:2]}-{uuid.uuid4().hex[:6]}"  # one length: the same bytes
        more = {"ingest.workers": workers, "rounds.max_staleness": 2}
        jobs[name] = build_job(fedbuff(mosquitto, **JOB, job=job_id, **more))
    group = sorted(first_cohort(jobs["single"]))
    assert sorted(first_cohort(jobs["sharded"])) == group
    vanish = {d: "mask" for d in group[: 2 if case == "fails" else 1]}
    submitted: dict[tuple[str, str, int], np.ndarray] = {}  # (job, device, cohort) -> integers
    encode = SecureMean.secure_encode

    def recording(self, device, msg, layout, seed):
        values = encode(self, device, msg, layout, seed)
        submitted[(msg.job, device.device_id, msg.round)] = values.copy()
        return values

    async def both():
        return await asyncio.gather(*(
            run_job(job, tmp_path / name, vanish=vanish, workers=job.cfg.ingest.workers, timeout=150)
            for name, job in jobs.items()
        ))  # fmt: skip

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SecureMean, "secure_encode", recording)
        results = dict(zip(jobs, asyncio.run(both()), strict=True))
    single, sharded = results["single"]["run"], results["sharded"]["run"]
    inputs = {
        name: {(d, r): v for (j, d, r), v in submitted.items() if j == job.cfg.job}
        for name, job in jobs.items()
    }
    assert sorted(inputs["single"]) == sorted(inputs["sharded"])
    for key, values in inputs["single"].items():
        assert np.array_equal(values, inputs["sharded"][key]), key
    # the same cohorts, with the same outcomes, in the same order
    keys = ("round", "status", "version", "selected", "received", "staleness_max")
    rows = {n: [{k: r[k] for k in keys} | {"secure": {k: v for k, v in r["secure"].items()}}
                for r in run.recorder.records]
            for n, run in (("single", single), ("sharded", sharded))}  # fmt: skip
    assert rows["single"] == rows["sharded"]
    records = sharded.recorder.records
    assert sorted(r["round"] for r in records) == [1, 2, 3, 4]
    skipped = [r for r in records if r["status"] == "skipped"]
    assert skipped and len(skipped) < len(records), records
    for record in skipped:
        assert set(vanish) <= members(sharded.core, record["round"])
        if case == "fails":
            assert record["secure"]["failed"]["phase"] == "masked"
            assert "4 masked inputs arrived; 5 needed" in record["secure"]["failed"]["reason"]
        else:
            assert record["secure"]["outcome"] == "summed" and record["received"] == 5
            assert record["secure"]["stale"] == "staleness 3 > max_staleness 2"
    for record in records:
        assert record["workers"] == 2 and record["workers_missing"] == []
    # every cohort's masked phase ended with both workers' partial sums merged
    owners = results["sharded"]["coordinator"].owners
    assert sorted(owners) == [1, 2, 3, 4]
    assert all(set(o.values()) == {"w0", "w1"} for o in owners.values()), owners
    # each applied sum is bit for bit its survivors' integers, the same in both jobs (the
    # sums are observed in the order the cohorts close, as their records are written)
    for name, result in results.items():
        records_of = result["run"].recorder.records
        closed = [r["round"] for r in records_of if r["secure"]["outcome"] == "summed"]
        sums = [total for _, total in result["sums"]]
        assert len(sums) == len(closed)
        for number, total in zip(closed, sums, strict=True):
            survivors = [d for d in members(result["run"].core, number) if d not in vanish]
            expected = sum(inputs[name][(d, number)] for d in survivors)
            assert np.array_equal(total, expected), (name, number)
    assert [t.tobytes() for _, t in results["single"]["sums"]] == [
        t.tobytes() for _, t in results["sharded"]["sums"]
    ]
    # the final model, byte for byte, and the ledger
    assert single.core.params.tobytes() == sharded.core.params.tobytes()
    assert not np.array_equal(sharded.core.params, jobs["sharded"].aggregator_core().params)
    ledger = {n: sorted(run.core.releases) for n, run in (("single", single),
                                                          ("sharded", sharded))}  # fmt: skip
    assert ledger["single"] == ledger["sharded"]
    expected_charges = sorted(
        (d, r["round"], SECURE_RELEASE)
        for r in records
        for d in members(sharded.core, r["round"])
        if d not in vanish
    )
    assert ledger["sharded"] == expected_charges
    assert single.core.privacy.report()["epsilon"] == sharded.core.privacy.report()["epsilon"]


def test_a_worker_killed_mid_cohort_fails_the_cohorts_it_held_never_a_wrong_sum(
    mosquitto, tmp_path
):
    """Worker w1's connection drops without a DISCONNECT (the broker publishes its last will,
    as after kill -9) right after it reported its first summed masked input. Every cohort it
    held a share of is recorded skipped, failed in its masked phase naming w1, every device of
    its U2 charged, the model unchanged by it; cohorts dispatched later run on w0 alone and sum
    exactly; the model is exactly the summed cohorts' sums."""
    from edge_fl.job import build_job

    job = build_job(fedbuff(mosquitto, **{**JOB, "ingest.workers": 2}))
    SecureMean.submitted.clear()
    state: dict[str, Any] = {}

    hook = kill_w1_holding_a_cohort(
        state, lambda: kill(state["ingest"]["w1"], state["tasks"]["w1"])
    )

    result = asyncio.run(
        run_job(job, tmp_path / "run", vanish={}, workers=2, hook=hook, state=state, timeout=150)
    )
    assert state.get("killed"), "w1 never reported a masked input"
    check_worker_lost(job, result, state["killed"], lambda d, r: SecureMean.submitted[(d, r)])


def test_hash_partitioned_workers_check_signed_cohorts_and_sum_exactly(mosquitto, tmp_path):
    """``ingest.partition: hash`` and ``security.device_keys``: each worker checks every
    cohort's masked inputs' signatures against the commitments of that cohort's ``masked``
    message; every cohort sums its members' integers exactly, with both workers' shares, and
    charges each member once."""
    from edge_fl.job import build_job
    from edge_fl.protocol.device_keys import mint_device_keys

    keys = mint_device_keys(tmp_path / "keys", [f"d{i:05d}" for i in range(12)])
    job = build_job(fedbuff(mosquitto, **{**JOB, "ingest.workers": 2, "ingest.partition": "hash",
                                          "security.device_keys": str(keys)}))  # fmt: skip
    SecureMean.submitted.clear()
    result = asyncio.run(
        run_job(job, tmp_path / "run", vanish={}, workers=2, hashed=True, timeout=150)
    )
    core = result["run"].core
    records = result["run"].recorder.records
    assert [r["status"] for r in records] == ["closed"] * 4, records
    for record, (_, total) in zip(records, result["sums"], strict=True):
        number = record["round"]
        devices = sorted(members(core, number))
        assert record["received"] == 6 and record["secure"]["rejected_by_reason"] == {}
        assert record["workers"] == 2 and record["workers_missing"] == []
        assert set(result["coordinator"].owners[number].values()) == {"w0", "w1"}
        assert np.array_equal(total, sum(SecureMean.submitted[(d, number)] for d in devices))
        assert sorted(d for d, r, _ in core.releases if r == number) == devices


def test_the_cli_runs_secure_cohorts_with_two_spawned_workers(mosquitto, tmp_path):
    """`edge-fl aggregator --mode fedbuff --secure-aggregation --workers 2` (workers spawned,
    with their keys) and `edge-fl fleet`, as separate processes: every cohort sums on both
    workers' shares."""
    from processes import secure_records_with_workers

    args = ["--job", f"csc-{uuid.uuid4().hex[:6]}", "--devices", "12", "--rounds", "3"]
    args += ["--mode", "fedbuff", "--buffer-size", "4", "--concurrency", "12"]
    args += ["--model", "logreg", "--reproducible", "--mechanism", "none", "--deadline", "10"]
    got = secure_records_with_workers(mosquitto.url, args, tmp_path / "out", timeout=150)
    assert got == [("closed", "summed", 6, 2)] * 3, got


def test_a_stop_with_workers_records_every_open_cohort_skipped_and_keeps_its_charges(
    mosquitto, tmp_path
):
    """A stop (SIGTERM) when the first cohort's sum is unmasked, with 2 workers: every cohort
    still open gets a skipped record with the stop as its reason and its workers (never a
    partial sum), and every masked input that reached a worker stays charged for its cohort."""
    from edge_fl.job import build_job

    job = build_job(fedbuff(mosquitto, **{**JOB, "ingest.workers": 2, "rounds.rounds": 6}))

    def stop(service: Any) -> None:
        if service.stopped is None:
            service.request_stop("SIGTERM")

    result = asyncio.run(
        run_job(job, tmp_path / "run", vanish={}, workers=2, on_sum=stop, timeout=150)
    )
    core = result["run"].core
    records = result["run"].recorder.records
    assert sorted(r["round"] for r in records) == sorted(core.history)
    assert len(records) < 6 and core.ended_early == "stopped by SIGTERM"
    assert [r["status"] for r in records].count("closed") == 1
    for record in records:
        assert record["workers"] == 2 and record["workers_missing"] == []
        if record["status"] == "skipped":
            assert record["secure"]["failed"]["reason"] == "stopped by SIGTERM"
            assert record["stopped"] == "SIGTERM"
    assert not core.cohorts.cohorts and not result["coordinator"].cohort_rounds
    assert all(d in members(core, r) and n == SECURE_RELEASE for d, r, n in core.releases)
    summed = next(r["round"] for r in records if r["status"] == "closed")
    assert sorted(d for d, r, _ in core.releases if r == summed) == sorted(members(core, summed))


def check_worker_lost(job: Any, result: dict[str, Any], killed: int, inputs: Any) -> None:
    """What a lost worker w1 may leave: every cohort it held a share of recorded skipped naming
    it (phase masked: every U2 device charged; an earlier phase: what was dealt to it missing,
    nothing masked); every other cohort summed exactly (``inputs(device, cohort)``: the
    integers it submitted) and charged once a member; the model exactly those sums applied."""
    from edge_fl.server.staleness import Staleness

    run = result["run"]
    core = run.core
    records = run.recorder.records
    assert sorted(r["round"] for r in records) == [1, 2, 3, 4]
    lost = [r for r in records if r["status"] == "skipped"]
    summed = [r for r in records if r["status"] == "closed"]
    assert killed in [r["round"] for r in lost if r["secure"]["failed"]["phase"] == "masked"]
    assert summed, "no cohort summed after the worker was lost"
    for record in lost:
        failed = record["secure"]["failed"]
        assert record["workers_missing"] == ["w1"], record
        charged = sorted(d for d, r, _ in core.releases if r == record["round"])
        if failed["phase"] == "masked":
            assert "ingest worker share lost mid-round (w1: lost" in failed["reason"], record
            # every device of U2 charged once for it. U2 may be short of members although
            # none vanished: a device whose shares the broker dealt to w1 before it died was
            # never forwarded, never asked to mask, so it released nothing for the cohort
            u2 = result["coordinator"].u2[record["round"]]
            assert u2 <= members(core, record["round"]), record
            assert len(u2) == record["secure"]["phases"]["shares"], record
            assert charged == sorted(u2)
        else:  # the keys or shares the broker had dealt to w1 died with it: an earlier
            # phase is short of devices (nothing masked: nothing to charge)
            assert failed["phase"] in ("keys", "shares") and "needed" in failed["reason"]
            assert charged == []
    sums = [total for _, total in result["sums"]]
    assert len(sums) == len(summed)
    plan = job.secure_plan
    cfg = job.cfg.rounds
    weight = Staleness(cfg.staleness, cfg.staleness_a, cfg.staleness_b).weight
    params = job.aggregator_core().params.copy()
    for version, (record, total) in enumerate(zip(summed, sums, strict=True)):
        number = record["round"]
        assert record["secure"]["outcome"] == "summed" and record["workers_missing"] == []
        devices = sorted(members(core, number))
        assert np.array_equal(total, sum(inputs(d, number) for d in devices)), number
        assert sorted(d for d, r, _ in core.releases if r == number) == devices
        mean = plan.mechanism.secure_decode(total, len(devices), plan.layout, b"")
        s = version - record["secure"]["base_version"]
        params = (params + np.float32(cfg.server_lr * weight(s)) * mean).astype(np.float32)
    assert np.array_equal(core.params, params)


def test_a_worker_process_killed_with_sigkill_mid_cohort(mosquitto, tmp_path):
    """The workers are `edge-fl ingest` processes; w1 gets SIGKILL right after it reported its
    first summed masked input (the broker publishes its last will). As with a dropped
    connection: the cohorts it held are skipped naming it, never summed without its share,
    their senders charged; the later cohorts sum exactly on w0; the model is exactly theirs."""
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import edge_fl
    from edge_fl.job import build_job
    from edge_fl.mechanisms.none import NoPrivacy
    from edge_fl.server.sharding import worker_key

    job = build_job(fedbuff(mosquitto, **{**JOB, "ingest.workers": 2, "privacy.mechanism": "none"}))
    secret = os.urandom(32)
    root = str(Path(edge_fl.__file__).resolve().parent.parent)
    entry = "import sys; from edge_fl.cli import main; sys.argv[0] = 'edge-fl'; main()"
    (tmp_path / "job.json").write_text(json.dumps(job.cfg.model_dump(mode="json")))
    procs: dict[str, subprocess.Popen] = {}
    for i in range(2):
        key = tmp_path / f"w{i}.key"
        key.write_text(worker_key(secret, f"w{i}").hex())
        argv = [sys.executable, "-c", entry, "ingest", "--config", str(tmp_path / "job.json")]
        argv += ["--worker", str(i), "--key-file", str(key)]
        procs[f"w{i}"] = subprocess.Popen(
            argv, env={**os.environ, "PYTHONPATH": root}, stderr=subprocess.DEVNULL
        )
    submitted: dict[tuple[str, int], np.ndarray] = {}
    encode = NoPrivacy.secure_encode

    def recording(self, device, msg, layout, seed):
        values = encode(self, device, msg, layout, seed)
        submitted[(device.device_id, msg.round)] = np.array(values, copy=True)
        return values

    state: dict[str, Any] = {}

    hook = kill_w1_holding_a_cohort(state, lambda: os.kill(procs["w1"].pid, signal.SIGKILL))

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(NoPrivacy, "secure_encode", recording)
            result = asyncio.run(
                run_job(
                    job,
                    tmp_path / "run",
                    vanish={},
                    workers=2,
                    hook=hook,
                    secret=secret,
                    timeout=150,
                )
            )
        assert procs["w0"].wait(30) == 0  # the job's end ended it
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert state.get("killed"), "w1 never reported a masked input"
    assert procs["w1"].returncode == -signal.SIGKILL
    check_worker_lost(job, result, state["killed"], lambda d, r: submitted[(d, r)])


# ------------------------------------------------------------------ pure: a worker's cohorts


class Cohorts:
    """Two cohorts of a secure FedBuff job dispatched by a real core, one worker and the
    coordinator in memory."""

    def __init__(self) -> None:
        from edge_fl.job import build_job
        from edge_fl.protocol import Status, encode_status
        from edge_fl.server.sharding import IngestWorker

        self.job = build_job(fedbuff(None, **{"ingest.workers": 1}))
        self.core = self.job.aggregator_core()
        for i in range(12):
            self.core.on_status(f"d{i:05d}", encode_status(Status(f"d{i:05d}", True, 10)))
        self.worker = IngestWorker("w0", self.job.aggregator_core())
        self.coordinator = Coordinator(self.core, ["w0"])
        self.coordinator.worker_online("w0")
        self.cohorts = open_two_cohorts(self.core, self.coordinator, self.control)

    def control(self, payload: bytes) -> list[tuple[str, bytes]]:
        out = self.worker.on_control(payload)
        for kind, data in out:
            self.coordinator.on_message(kind, "w0", data)
        return out

    def mx(self, device: str, number: int, nonce: bytes) -> bytes:
        """A well-formed masked input (mask set: none) naming cohort ``number`` and ``nonce``."""
        from edge_fl.secagg.messages import encode

        p = self.cohorts[0].session.session.params
        k = p.neighbours  # (the same for every device of a roster of one size)
        return encode("mx", number, nonce, b=p.bits, m=bytes((k + 7) // 8),
                      y=bytes(p.dim * ((p.bits + 7) // 8)))  # fmt: skip


def test_hostile_masked_inputs_at_a_worker_get_a_sync_rounds_reasons():
    """A masked input for a cohort the worker does not hold is ``late`` (and handed to the
    coordinator, which charges nothing: no such cohort); before its cohort's ``masked``, one
    from a device outside the cohort, or beyond two copies, is ``wrong_phase``; one naming
    cohort 1 with cohort 2's nonce (a replay into another cohort) is ``wrong_nonce`` and not
    charged; one for a frozen cohort is ``late`` (charged if it is the device's). The refusals
    reach the cohort's record through its partial's ``j``, as a sync round's do; a sync
    round's share gives the same reasons for the same inputs."""
    import msgpack

    from edge_fl.secagg.aggregator import MaskedShare

    env = Cohorts()
    first, second = env.cohorts
    worker = env.worker
    assert not first.selected & second.selected
    a, b = sorted(first.selected)[:2]
    outsider = sorted(second.selected)[0]
    # a cohort this worker does not hold: late, handed over to the coordinator
    worker.on_update(a, env.mx(a, 99, first.nonce))
    progress = worker.progress()
    assert progress is not None
    env.coordinator.on_message("progress", "w0", progress)
    assert env.coordinator.take_secure() == [(a, env.mx(a, 99, first.nonce))]
    # before the cohort's masked phase: held (two a device), else wrong_phase
    for _ in range(3):
        worker.on_update(a, env.mx(a, 1, first.nonce))
    worker.on_update(outsider, env.mx(outsider, 1, first.nonce))
    # a replay into another cohort: cohort 1's number, cohort 2's nonce
    worker.on_update(b, env.mx(b, 1, second.nonce))
    share = worker.cohorts[1]
    assert share.rejected == {"wrong_phase": 2} and len(share.early) == 3
    # its own cohort's nonce: charged once; the replay is not
    assert [(d, r) for d, r, _ in worker.core.releases] == [(a, 1)]
    env.control(env.coordinator.cohort_masked_message(1, first.selected, {}))
    # held inputs are checked now: a's two (mask set: none, not its neighbours), b's replay
    assert share.rejected == {"wrong_phase": 2, "bad_masked": 2, "wrong_nonce": 1}
    assert share.masked is not None and share.masked.devices == []
    env.control(env.coordinator.cohort_freeze_message(1))
    worker.on_update(b, env.mx(b, 1, first.nonce))  # frozen: late, charged (b's cohort, nonce)
    assert share.rejected["late"] == 1
    assert [(d, r) for d, r, _ in worker.core.releases] == [(a, 1), (b, 1)]
    (kind, partial), = env.control(env.coordinator.cohort_commit_message(1))  # fmt: skip
    assert kind == "partial"
    j = msgpack.unpackb(partial, raw=False)["j"]
    assert j == {"bad_masked": 2, "late": 2, "wrong_nonce": 1, "wrong_phase": 2}
    # after its commit: a member's masked input is still charged (late), counted in the
    # next partial's j
    c = sorted(first.selected)[2]
    worker.on_update(c, env.mx(c, 1, first.nonce))
    assert (c, 1) in [(d, r) for d, r, _ in worker.core.releases]
    (_, later), = env.control(env.coordinator.cohort_commit_message(2))  # fmt: skip
    assert msgpack.unpackb(later, raw=False)["j"] == {"late": 1}
    # the coordinator counts them in cohort 1's record (its session never reached its masked
    # phase here, so nothing merges)
    sr = first.session
    deliveries, why = env.coordinator.merge_cohort(1, sr, 0.0)
    assert deliveries == [] and why is not None
    assert {k: sr.rejected[k] for k in j} == j
    # a sync round's share: the same reasons for the same inputs
    sync = MaskedShare(sr.session.params, first.selected, {})
    assert sync.receive(b, env.mx(b, 1, second.nonce)).reason == "wrong_nonce"
    assert sync.receive(a, env.mx(a, 1, first.nonce)).reason == "bad_masked"
    assert sync.receive(outsider, env.mx(outsider, 1, first.nonce)).reason == "not_selected"


def test_a_cohort_open_drops_the_shares_of_cohorts_no_longer_open():
    """``o`` in a cohort's ``open``: a cohort held by the worker and no longer listed ended
    without asking for its share (failed, or stopped): dropped. The worker's core keeps every
    cohort's facts (a late masked input is still charged)."""
    from edge_fl.protocol import encode_global

    env = Cohorts()
    worker = env.worker
    assert sorted(worker.cohorts) == [1, 2]
    env.coordinator.end_cohort(1)  # cohort 1 closed without a merge
    cohort = env.cohorts[0]
    msg = env.core.global_message(selected=tuple(sorted(cohort.selected)), round_number=3,
                                  nonce=bytes(16))  # fmt: skip
    env.control(env.coordinator.open_cohort_message(3, encode_global(msg)))
    assert sorted(worker.cohorts) == [2, 3]
    assert worker.core.round_facts(1) == (cohort.nonce, cohort.selected)


class CohortPipeline:
    """Two cohorts in flight between SecAgg+ devices, two :class:`IngestWorker` and the
    coordinator, in memory: a device's messages go to worker w0 or w1 by its index, worker
    messages to the coordinator, inbox messages to the devices of the cohort (the broker)."""

    def __init__(self) -> None:
        from edge_fl.job import build_job
        from edge_fl.protocol import Status, encode_status
        from edge_fl.secagg import DeviceSession
        from edge_fl.server.sharding import IngestWorker

        self.job = build_job(fedbuff(None, **{"ingest.workers": 2}))
        self.core = self.job.aggregator_core()
        self.names = ["w0", "w1"]
        self.workers = {w: IngestWorker(w, self.job.aggregator_core()) for w in self.names}
        devices = [f"d{i:05d}" for i in range(12)]
        for core in (self.core, *(w.core for w in self.workers.values())):
            for d in devices:
                core.on_status(d, encode_status(Status(d, True, 10)))
        self.coordinator = Coordinator(self.core, self.names)
        for w in self.names:
            self.coordinator.worker_online(w)
        self.lost: set[str] = set()
        self.mute: set[str] = set()  # workers whose messages no longer reach the coordinator
        self.mute_at_masked: set[str] = set()  # ... from the first masked phase on
        self.cohorts = open_two_cohorts(self.core, self.coordinator, self.control)
        self.sessions, self.x = {}, {}
        rng = np.random.default_rng(7)
        for cohort in self.cohorts:
            params = cohort.session.session.params
            for d in cohort.selected:
                self.sessions[d] = DeviceSession(d, params)
                self.x[d] = rng.integers(-50, 51, params.dim)

    def control(self, payload: bytes) -> None:
        relay_control(self.workers, self.coordinator, payload, self.lost)

    def up(self, device: str, payload: bytes) -> None:
        worker = self.workers[self.names[int(device[1:]) % 2]]
        if worker.name in self.lost:
            return  # dealt to a dead worker: gone
        relay_update(worker, self.coordinator, device, payload, worker.name in self.mute)
        from edge_fl.protocol.secure import secure_head

        for d, data in self.coordinator.take_secure():
            head = secure_head(data)
            cohort = self.core.cohorts.route(*head) if head is not None else None
            if cohort is not None:
                self.inbox(cohort, cohort.session.receive(d, data, 0.0))

    def inbox(self, cohort: Any, deliveries: list[Any]) -> None:

        sr = cohort.session
        if sr.phase == "masked" and self.coordinator.cohort_wants_masked(cohort.number):
            self.control(self.coordinator.cohort_masked_message(cohort.number, sr.forwarded, {}))
            if all(c.session.phase == "masked" for c in self.cohorts):
                self.mute |= self.mute_at_masked  # (keys and shares all went through)
        answer_inbox(self.sessions, self.x, self.up, deliveries)

    def run(self, before_merge: Any = None) -> dict[int, tuple[Any, str | None]]:
        """Every device of both cohorts advertises (the cohorts' messages interleave), both
        masked phases end with freeze, commit and merge (cohort 2 first); the outcomes."""
        for pair in zip(*(sorted(c.selected) for c in self.cohorts), strict=True):
            for d in pair:
                self.up(d, self.sessions[d].advertise().payload)
        out = {}
        for cohort in sorted(self.cohorts, key=lambda c: -c.number):
            sr, n = cohort.session, cohort.number
            assert sr.phase == "masked", sr.phase
            done = self.coordinator.cohort_masked_complete(n, sr.forwarded)
            assert done or self.mute  # (else: its deadline)
            if before_merge is not None:
                before_merge(self)
            self.control(self.coordinator.cohort_freeze_message(n))
            self.control(self.coordinator.cohort_commit_message(n))
            deliveries, why = self.coordinator.merge_cohort(n, sr, 0.0)
            self.inbox(cohort, deliveries)
            out[n] = (sr.outcome, why)
        return out


def test_two_cohorts_in_flight_merge_per_cohort_exactly_in_memory():
    """Two cohorts' masked inputs interleave at both workers: each cohort's merged sum is its
    members' integers exactly (not the other cohort's), both workers summed part of each, and
    every member is charged once for its own cohort only."""
    from edge_fl.secagg import Summed

    pipe = CohortPipeline()
    owners = {}
    merge = pipe.coordinator.merge_cohort

    def watched(number, sr, now):
        owners[number] = set(pipe.coordinator.cohort_rounds[number].owner.values())
        return merge(number, sr, now)

    pipe.coordinator.merge_cohort = watched
    outcomes = pipe.run()
    for cohort in pipe.cohorts:
        outcome, why = outcomes[cohort.number]
        assert why is None and isinstance(outcome, Summed)
        assert outcome.contributors == tuple(sorted(cohort.selected))
        assert np.array_equal(outcome.total, sum(pipe.x[d] for d in cohort.selected))
        assert owners[cohort.number] == {"w0", "w1"}
    released = sorted((d, r, n) for d, r, n in pipe.core.releases)
    assert released == sorted(
        (d, c.number, SECURE_RELEASE) for c in pipe.cohorts for d in c.selected
    )


def test_a_worker_lost_before_the_merge_fails_every_cohort_it_held_and_charges_its_u2():
    """w1 takes the masked inputs dealt to it (the broker has them acknowledged) but, from
    the moment both cohorts are in their masked phase, its progress messages no longer reach
    the coordinator; then it goes offline (its last
    will): neither cohort merges (a sum without w1's share would keep masks the unmasking
    removes), each says why naming w1 and takes no masked input, and every device of each
    cohort's U2 is charged for that cohort once, also those whose release only w1 saw."""
    pipe = CohortPipeline()
    pipe.mute_at_masked = {"w1"}

    def lose(p: CohortPipeline) -> None:
        if "w1" not in p.lost:
            p.lost.add("w1")
            p.coordinator.worker_offline("w1")

    outcomes = pipe.run(before_merge=lose)
    for cohort in pipe.cohorts:
        outcome, why = outcomes[cohort.number]
        assert outcome is None and why is not None and "w1: lost (went offline)" in why
        assert cohort.session.session.counts["masked"] == 0
    released = sorted((d, r, n) for d, r, n in pipe.core.releases)
    assert released == sorted(
        (d, c.number, SECURE_RELEASE) for c in pipe.cohorts for d in c.selected
    )
