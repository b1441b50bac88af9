"""Secure aggregation with sharded ingest (issue 21 item 3) over a real Mosquitto: two ingest
workers check and sum the devices' masked inputs modulo 2^b, the coordinator merges their
modular partial sums and unmasks. The sum is bit for bit the contributors' integers and what one
aggregator computes; the ledger charges exactly the masked inputs' senders; a worker killed
mid-round fails the round with a record, never a wrong model (edge_fl/server/sharding.py,
docs/protocol.md "Ingest workers")."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from typing import Any

import numpy as np
import pytest
from helpers import answer_inbox, mechanisms_registered, relay_control, relay_update
from test_secagg_wiring import SecureMean, config, contributions

from edge_fl.secagg.primitives import ring_mask
from edge_fl.server.aggregator import SECURE_RELEASE
from edge_fl.server.sharding import Coordinator

SIGNER: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with mechanisms_registered(SecureMean):
        yield


class Watched(Coordinator):
    """The coordinator, recording which worker summed which masked input when a round's (or a
    FedBuff cohort's) masked phase ends and its U2 (the devices asked to mask), and calling
    ``on_progress_hook(self, worker)`` after each progress."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.owners: dict[int, dict[str, str]] = {}
        self.u2: dict[int, frozenset[str]] = {}
        self.on_progress_hook: Any = None

    def merge_masked(self, secure_round: Any, now: float) -> tuple[list[Any], str | None]:
        assert self.round is not None
        self.owners[self.round.number] = dict(self.round.owner)
        self.u2[self.round.number] = secure_round.forwarded
        return super().merge_masked(secure_round, now)

    def merge_cohort(self, number: int, secure_round: Any, now: float):
        self.owners[number] = dict(self.cohort_rounds[number].owner)
        self.u2[number] = secure_round.forwarded
        return super().merge_cohort(number, secure_round, now)

    def on_progress(self, payload: bytes, topic_worker: str | None = None) -> None:
        super().on_progress(payload, topic_worker)
        if self.on_progress_hook is not None:
            self.on_progress_hook(self, topic_worker)


async def run_job(
    job, out, *, vanish, workers=0, hook=None, state=None, hashed=False, timeout=120.0,
    secret=None, on_sum=None,
) -> dict[str, Any]:  # fmt: skip
    """One aggregator (with ``workers`` in-process ingest workers on the same broker, each its
    own MQTT session, and a :class:`Watched` coordinator) and a fleet; returns the run, the
    coordinator and the sums the sessions unmasked, in the order they were unmasked. ``state``
    gets the worker services and their tasks (``ingest``, ``tasks``). ``secret``: the workers
    are other processes, started by the caller with keys from this secret (none started here).
    ``hashed``: the device-id hash partition instead of a shared subscription. ``on_sum``:
    called with the service when a sum is unmasked."""
    from edge_fl.protocol.signing import Signer
    from edge_fl.server.ingest import IngestService
    from edge_fl.server.sharding import IngestWorker
    from edge_fl.simulation import open_run
    from edge_fl.transport.url import parse_broker_url

    broker = parse_broker_url(job.cfg.broker.url)
    signer = SIGNER.setdefault("key", Signer.generate())
    run = open_run(job, out)
    names = [f"w{i}" for i in range(workers)]
    coordinator = Watched(run.core, names, dealt=not hashed, secret=secret) if workers else None
    if coordinator is not None:
        coordinator.on_progress_hook = hook
    service = run.make_service(broker, signer=signer, sharding=coordinator)
    sums: list[tuple[int, np.ndarray]] = []

    def observe(label: str, v: Any) -> None:
        if label == "sum":
            sums.append((run.core.round_number, np.array(v)))
            if on_sum is not None:
                on_sum(service)

    service.secure_observer = observe
    ingest = {
        name: IngestService(
            IngestWorker(name, job.aggregator_core()),
            broker,
            job.topics,
            group=job.cfg.ingest.group,
            hash_partition=(i, workers) if hashed else None,
        )
        for i, name in enumerate(names if secret is None else ())
    }
    tasks = {name: asyncio.create_task(svc.run()) for name, svc in ingest.items()}
    if state is not None:
        state.update(ingest=ingest, tasks=tasks)
    fleet = job.fleet_runtime(broker, trust=job.trust(signer.verifier))
    fleet.secure_vanish = dict(vanish)
    aggregator = asyncio.create_task(service.run())
    await service.connected.wait()
    fleet_task = asyncio.create_task(fleet.run())
    try:
        await asyncio.wait_for(aggregator, timeout)
    finally:
        run.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(fleet_task, 10)
        done = await asyncio.gather(
            *(asyncio.wait_for(t, 10) for t in tasks.values()), return_exceptions=True
        )
    return {"run": run, "coordinator": coordinator, "sums": sums, "workers_ended": done}


def kill(ingest: Any, task: asyncio.Task) -> None:
    """A worker dies: its connection drops without a DISCONNECT (the broker publishes its last
    will, as after kill -9) and its process stops."""
    ingest.tap.shutdown(socket.SHUT_RDWR)
    task.cancel()


SMALL = {
    "data.devices": 12,
    "rounds.clients_per_round": 12,
    "rounds.rounds": 1,
    "rounds.deadline_s": 6,
    "secure_aggregation.phase_timeout_s": 3.0,
    "secure_aggregation.min_survivors": 4,
    "secure_aggregation.neighbours": 11,
    "secure_aggregation.threshold": 3,
}


def test_two_workers_sum_exactly_what_one_aggregator_sums(mosquitto, tmp_path):
    """12 devices, one round: one vanishes before advertising, one before sharing, two after
    their shares went out but before masking (their pairwise masks must be removed), two after
    masking (before unmasking). Two jobs at once on one broker, one with one aggregator, one
    with 2 ingest workers (shared subscription): the devices submit the same integers (recorded
    per job), both unmask the same sum, bit
    for bit the sum of the contributors' integers, the models are equal bit for bit and the
    ledger charges exactly the devices whose masked input arrived (once each)."""
    from edge_fl.job import build_job

    vanish = {
        "d00000": "advertise", "d00002": "share", "d00003": "mask", "d00004": "mask",
        "d00005": "unmask", "d00006": "unmask",
    }  # fmt: skip
    contributors = sorted(
        d for d in (f"d{i:05d}" for i in range(12))
        if vanish.get(d) not in ("advertise", "share", "mask")
    )  # fmt: skip
    jobs = {
        name: build_job(
            config(
                mosquitto,
                **SMALL,
                **{
                    "job": f"sas-{name[:2]}-{uuid.uuid4().hex[:6]}",  # one length: same bytes
                    "ingest.workers": workers,
                },
            )
        )
        for name, workers in (("single", 0), ("sharded", 2))
    }
    submitted: dict[tuple[str, str, int], np.ndarray] = {}  # (job, device, round) -> integers
    encode = SecureMean.secure_encode

    def recording(self, device, msg, layout, seed):
        values = encode(self, device, msg, layout, seed)
        submitted[(msg.job, device.device_id, msg.round)] = values.copy()
        return values

    async def both():  # at once: the two jobs' deadlines run concurrently
        return await asyncio.gather(*(
            run_job(job, tmp_path / name, vanish=vanish, workers=job.cfg.ingest.workers)
            for name, job in jobs.items()
        ))  # fmt: skip

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SecureMean, "secure_encode", recording)
        results = dict(zip(jobs, asyncio.run(both()), strict=True))
    inputs = {
        name: {(d, r): v for (j, d, r), v in submitted.items() if j == job.cfg.job}
        for name, job in jobs.items()
    }
    single, sharded = results["single"], results["sharded"]
    # the same inputs (reproducible), so the two runs are comparable bit for bit
    assert sorted(inputs["single"]) == sorted(inputs["sharded"])
    for key, values in inputs["single"].items():
        assert np.array_equal(values, inputs["sharded"][key]), key
    expected = sum(inputs["sharded"][(d, 1)] for d in contributors)
    record = sharded["run"].recorder.records[-1]
    assert record["status"] == "closed", record
    assert record["secure"]["outcome"] == "summed"
    assert record["secure"]["phases"] == {"keys": 11, "shares": 10, "masked": 8, "unmask": 6}
    assert record["received"] == len(contributors) == 8
    assert record["workers"] == 2 and record["workers_missing"] == []
    # both workers summed some of the masked inputs: the merge is of two partial sums
    owners = sharded["coordinator"].owners[1]
    assert sorted(owners) == contributors and set(owners.values()) == {"w0", "w1"}, owners
    (rnd, total), = sharded["sums"]  # fmt: skip
    assert rnd == 1 and total.dtype == np.int64 and np.array_equal(total, expected)
    (_, alone), = single["sums"]  # fmt: skip
    assert np.array_equal(total, alone)
    alone_record = single["run"].recorder.records[-1]
    assert alone_record["secure"] == record["secure"]
    for key in ("received", "bytes_up", "bytes_down", "rejected", "late"):
        assert record[key] == alone_record[key], key
    assert np.array_equal(sharded["run"].core.params, single["run"].core.params)
    # exactly the masked inputs' senders charged, once each, with the secure events
    for result in (single, sharded):
        releases = [(d, r, n) for d, r, n in result["run"].core.releases if r == 1]
        assert sorted(d for d, _, _ in releases) == contributors
        assert {n for _, _, n in releases} == {SECURE_RELEASE}
    epsilon = [r["run"].core.privacy.report()["epsilon"] for r in (single, sharded)]
    assert epsilon[0] == epsilon[1]


def test_a_worker_killed_mid_round_fails_the_round_and_the_next_one_sums(mosquitto, tmp_path):
    """Worker w1 dies (its connection drops, the broker sends its will) right after it reported
    its first summed masked input of round 1. Round 1 is recorded skipped, failed in its masked
    phase naming w1, the model unchanged and every device that masked charged; round 2 runs on
    w0 alone and unmasks exactly its contributors' sum, which is all the model ever moved by."""
    from edge_fl.job import build_job

    job = build_job(config(mosquitto, **{
        "data.devices": 8, "rounds.clients_per_round": 8, "rounds.rounds": 2,
        "rounds.deadline_s": 8, "secure_aggregation.phase_timeout_s": 3.0,
        "ingest.workers": 2,
    }))  # fmt: skip
    before = job.aggregator_core().params.copy()
    SecureMean.submitted.clear()
    state: dict[str, Any] = {}

    def hook(coordinator: Coordinator, worker: str | None) -> None:
        sr = coordinator.round
        if state.get("killed") or worker != "w1" or sr is None or sr.number != 1:
            return
        if "w1" in sr.owner.values():  # it holds a masked input the sum needs
            state["killed"] = True
            kill(state["ingest"]["w1"], state["tasks"]["w1"])

    result = asyncio.run(
        run_job(job, tmp_path / "run", vanish={}, workers=2, hook=hook, state=state)
    )
    assert state.get("killed"), "w1 never reported a masked input"
    run = result["run"]
    first, second = run.recorder.records
    assert first["status"] == "skipped", first
    assert first["secure"]["outcome"] == "failed"
    assert first["secure"]["failed"]["phase"] == "masked"
    assert "w1" in first["secure"]["failed"]["reason"]
    assert first["workers_missing"] == ["w1"]
    assert second["status"] == "closed" and second["secure"]["outcome"] == "summed"
    assert second["workers"] == 1 and second["workers_missing"] == []
    devices = [f"d{i:05d}" for i in range(8)]
    (rnd, total), = result["sums"]  # fmt: skip
    assert rnd == 2 and np.array_equal(total, contributions(2, devices))
    layout = job.secure_plan.layout
    mean = SecureMean(None, None).secure_decode(total, 8, layout, b"")
    assert np.array_equal(run.core.params, (before + np.float32(1.0) * mean).astype(np.float32))
    for r in (1, 2):  # every device masked in both rounds: charged once each
        assert sorted(d for d, rr, _ in run.core.releases if rr == r) == devices


def test_hash_partitioned_workers_check_device_signatures_and_sum_exactly(mosquitto, tmp_path):
    """``ingest.partition: hash`` and ``security.device_keys``: each worker checks the masked
    inputs' signatures against the commitments the coordinator's ``masked`` message carries;
    two rounds sum every device's integers exactly and charge each device once a round."""
    from edge_fl.job import build_job
    from edge_fl.protocol.device_keys import mint_device_keys

    devices = [f"d{i:05d}" for i in range(6)]
    directory = mint_device_keys(tmp_path / "keys", devices)
    job = build_job(config(mosquitto, **{
        "data.devices": 6, "rounds.clients_per_round": 6, "rounds.rounds": 2,
        "rounds.deadline_s": 8, "secure_aggregation.phase_timeout_s": 3.0,
        "secure_aggregation.min_survivors": 3, "security.device_keys": str(directory),
        "secure_aggregation.neighbours": 4, "secure_aggregation.threshold": 3,
        "ingest.workers": 2, "ingest.partition": "hash",
    }))  # fmt: skip
    SecureMean.submitted.clear()
    result = asyncio.run(run_job(job, tmp_path / "run", vanish={}, workers=2, hashed=True))
    run = result["run"]
    for rnd, record in enumerate(run.recorder.records, start=1):
        assert record["status"] == "closed", record
        assert record["secure"]["outcome"] == "summed" and record["received"] == 6
        assert record["secure"]["rejected_by_reason"] == {}
        assert record["workers"] == 2 and record["workers_missing"] == []
        assert set(result["coordinator"].owners[rnd].values()) == {"w0", "w1"}
        assert sorted(d for d, r, _ in run.core.releases if r == rnd) == devices
    assert [r for r, _ in result["sums"]] == [1, 2]
    for rnd, total in result["sums"]:
        assert np.array_equal(total, contributions(rnd, devices))


# ------------------------------------------------------------------ pure: the masked phase split


def replay_split(vanish: dict[str, str], seed: int) -> None:
    """One SecAgg+ round run by one session (recorded), then replayed into a second session
    whose masked inputs are dealt at random to two :class:`MaskedShare` (one device's input to
    both: the copy is taken back) and merged: the same outcome, bit for bit."""
    import edge_fl.secagg.messages as M
    from edge_fl.secagg import AggregatorSession, RoundParams, Summed
    from edge_fl.secagg.aggregator import MaskedShare
    from edge_fl.secagg.driver import run_round

    roster = tuple(f"d{i:03d}" for i in range(10))
    p = RoundParams("job1", 3, bytes(range(16)), roster, 6, 3, 20, 32, 100, min_survivors=4)
    rng = np.random.default_rng(seed)
    xs = {d: rng.integers(-p.max_int, p.max_int + 1, p.dim) for d in roster}
    trace = run_round(p, xs, vanish, record=True)
    assert isinstance(trace.outcome, Summed)
    ups = [(d, b) for way, d, b in trace.sent if way == "up"]
    kind = {d_b: M.decode(d_b[1], p.max_bytes, p.neighbours).kind for d_b in ups}
    session = AggregatorSession(p)

    def feed(k: str) -> None:
        for d, b in ups:
            if kind[(d, b)] == k:
                session.receive(d, b)

    feed("ak")
    if session.phase == "keys":
        session.close_phase()
    feed("sh")
    if session.phase == "shares":
        session.close_phase()
    assert session.phase == "masked"
    shares = [MaskedShare(p, session.forwarded, session.commitments()) for _ in range(2)]
    masked = [(d, b) for d, b in ups if kind[(d, b)] == "mx"]
    for i, (d, b) in enumerate(masked):
        assert shares[int(rng.integers(2))].receive(d, b) is None
        if i == 0:  # a copy on the other worker too: a duplicate there, until taken back
            other = next(s for s in shares if d not in s.devices)
            assert other.receive(d, b) is None
            assert other.receive(d, b).reason == "duplicate"
            assert other.take_back(d) and not other.take_back(d)
    total = (shares[0].sum + shares[1].sum) & ring_mask(p.bits)
    devices = shares[0].devices + shares[1].devices
    assert sorted(devices) == sorted(d for d, _ in masked)
    session.merge_masked(devices, total)
    if session.phase == "masked":
        session.close_phase()
    feed("ua")
    if session.phase == "unmask":
        session.close_phase()
    assert isinstance(session.outcome, Summed)
    assert session.outcome.contributors == trace.outcome.contributors
    assert np.array_equal(session.outcome.total, trace.outcome.total)
    expected = sum(xs[d] for d in trace.outcome.contributors)
    assert np.array_equal(session.outcome.total, expected)


@pytest.mark.parametrize(
    "vanish",
    [{}, {"d001": "mask", "d004": "unmask"}, {"d000": "share", "d002": "mask", "d007": "mask"}],
)
def test_masked_inputs_summed_in_two_shares_merge_to_one_sessions_sum(vanish):
    for seed in range(3):
        replay_split(vanish, seed)


def test_a_masked_share_refuses_what_the_session_refuses_and_a_bad_merge_changes_nothing():
    import edge_fl.secagg.messages as M
    from edge_fl.secagg import AggregatorSession, RoundParams
    from edge_fl.secagg.aggregator import MaskedShare
    from edge_fl.secagg.driver import run_round

    roster = tuple(f"d{i:03d}" for i in range(6))
    p = RoundParams("job1", 3, bytes(range(16)), roster, 4, 2, 16, 8, 50, min_survivors=3)
    xs = {d: np.arange(p.dim) for d in roster}
    trace = run_round(p, xs, {"d005": "share"}, record=True)
    mx = {d: b for way, d, b in trace.sent
          if way == "up" and M.decode(b, p.max_bytes, p.neighbours).kind == "mx"}  # fmt: skip
    u2 = frozenset(roster) - {"d005"}
    share = MaskedShare(p, u2, {})
    assert share.receive("d005", mx["d000"]).reason == "late"  # not forwarded (not in U2)
    assert share.receive("x", mx["d000"]).reason == "not_selected"
    # a neighbour of d005 would have masked against it too, had the aggregator forwarded
    # d005's shares: told so, its masked input has the wrong mask set
    near = p.graph.neighbours("d005")[0]
    wrong = MaskedShare(p, frozenset(roster), {})
    assert wrong.receive(near, mx[near]).reason == "bad_masked"
    assert share.receive("d000", mx["d000"]) is None
    assert share.receive("d000", mx["d000"]).reason == "duplicate"
    assert wrong.devices == [] and not wrong.sum.any()
    session = AggregatorSession(p)
    with pytest.raises(ValueError, match="while the round is in keys"):
        session.merge_masked(["d000"], share.sum)
    for way, d, b in trace.sent:
        if way == "up" and M.decode(b, p.max_bytes, p.neighbours).kind in ("ak", "sh"):
            session.receive(d, b)
    if session.phase == "shares":
        session.close_phase()
    assert session.phase == "masked" and session.forwarded == u2
    with pytest.raises(ValueError, match="not waited for"):
        session.merge_masked(["d005"], share.sum)
    with pytest.raises(ValueError, match="Z_2"):
        session.merge_masked(["d000"], share.sum.astype(np.int64))
    assert session.counts["masked"] == 0
    session.merge_masked(["d000"], share.sum)
    assert session.counts["masked"] == 1 and session.phase == "masked"


def test_the_cli_runs_a_secure_job_with_two_spawned_workers(mosquitto, tmp_path):
    """`edge-fl aggregator --secure-aggregation --workers 2` (workers spawned, with their keys)
    and `edge-fl fleet --secure-aggregation`, as separate processes: every round sums."""
    from processes import secure_records_with_workers

    args = ["--job", f"sac-{uuid.uuid4().hex[:6]}", "--devices", "8", "--rounds", "2"]
    args += ["--clients-per-round", "8", "--model", "logreg", "--reproducible"]
    args += ["--mechanism", "none", "--deadline", "10"]
    got = secure_records_with_workers(mosquitto.url, args, tmp_path / "out")
    assert got == [("closed", "summed", 8, 2)] * 2, got


# ------------------------------------------------------------------ pure: workers and coordinator


class Pipeline:
    """One secure round between SecAgg+ devices, two :class:`IngestWorker` and the coordinator,
    in memory: device messages go to the worker ``deal(device, kind)`` names, worker messages
    to the coordinator, inbox messages to the devices (what the broker does)."""

    def __init__(self, n: int = 6, deal=None, absent: tuple[str, ...] = ()) -> None:
        from edge_fl.job import build_job
        from edge_fl.protocol import Status, encode_global, encode_status
        from edge_fl.secagg import DeviceSession
        from edge_fl.server.sharding import IngestWorker

        self.job = build_job(config(None, **{
            "data.devices": n, "rounds.clients_per_round": n, "rounds.rounds": 1,
            "secure_aggregation.min_survivors": 3, "ingest.workers": 2,
            "secure_aggregation.neighbours": n - 1, "secure_aggregation.threshold": 2,
        }))  # fmt: skip
        self.core = self.job.aggregator_core()
        self.names = ["w0", "w1"]
        self.workers = {w: IngestWorker(w, self.job.aggregator_core()) for w in self.names}
        self.devices = [f"d{i:05d}" for i in range(n)]
        for core in (self.core, *(w.core for w in self.workers.values())):
            for d in self.devices:
                core.on_status(d, encode_status(Status(d, True, 10)))
        self.absent = set(absent)  # hash partition: offline workers (their share is unseen)
        self.coordinator = Coordinator(self.core, self.names, dealt=not absent)
        for w in self.names:
            if w not in self.absent:
                self.coordinator.worker_online(w)
        msg = self.core.open_round(0.0)
        self.control(self.coordinator.open_message(encode_global(msg)))
        self.sr = self.core.open_secure(0.0)
        params = self.sr.session.params
        self.sessions = {d: DeviceSession(d, params) for d in self.devices}
        rng = np.random.default_rng(1)
        self.x = {d: rng.integers(-50, 51, params.dim) for d in self.devices}
        self.deal = deal or (lambda device, kind: self.names[self.devices.index(device) % 2])
        self.masked_sent = False

    def control(self, payload: bytes) -> None:
        relay_control(self.workers, self.coordinator, payload, self.absent)

    def up(self, device: str, payload: bytes) -> None:
        from edge_fl.protocol.secure import up_kind

        worker = self.workers[self.deal(device, up_kind(payload))]
        if worker.name in self.absent:
            return  # its share reaches no one
        relay_update(worker, self.coordinator, device, payload)
        for d, data in self.coordinator.take_secure():
            self.inbox(self.sr.receive(d, data, 0.0))

    def inbox(self, deliveries) -> None:

        if self.sr.phase == "masked" and not self.masked_sent:
            self.masked_sent = True
            self.control(self.coordinator.masked_message(self.sr.forwarded, {}))
        answer_inbox(self.sessions, self.x, self.up, deliveries)

    def run(self, tamper=None) -> tuple[Any, str | None]:
        """Until the masked phase is merged (or fails) and the round ends; the outcome and
        the failure reason the coordinator gave, if any."""
        for d in self.devices:
            self.up(d, self.sessions[d].advertise().payload)
        later = 0.0
        while self.sr.outcome is None and self.sr.phase in ("keys", "shares"):
            later += 1e6  # devices missing: the phase ends at its deadline
            self.inbox(self.sr.tick(later))
        assert self.sr.phase == "masked" and self.coordinator.masked_complete(self.sr.forwarded)
        self.control(self.coordinator.freeze_message())
        self.control(self.coordinator.commit_message())
        if tamper is not None:
            tamper(self)
        deliveries, why = self.coordinator.merge_masked(self.sr, 0.0)
        self.inbox(deliveries)
        return self.sr.outcome, why


def test_the_pipeline_sums_exactly_and_a_copy_on_the_second_worker_is_taken_back():
    from edge_fl.secagg import Summed

    def deal(device: str, kind: str) -> str:
        return "w0" if kind != "mx" or device < "d00003" else "w1"

    pipe = Pipeline(deal=deal)
    w0, w1 = pipe.workers["w0"], pipe.workers["w1"]
    orig = pipe.up

    def up_twice(device: str, payload: bytes) -> None:  # d00004's mx reaches both workers
        from edge_fl.protocol.secure import up_kind

        orig(device, payload)
        if device == "d00004" and up_kind(payload) == "mx":
            w0.on_update(device, payload)
            pipe.coordinator.on_message("progress", "w0", w0.progress())

    pipe.up = up_twice
    outcome, why = pipe.run()
    assert why is None and isinstance(outcome, Summed)
    assert outcome.contributors == tuple(pipe.devices)
    assert np.array_equal(outcome.total, sum(pipe.x.values()))
    assert pipe.sr.rejected["duplicate"] == 1  # w0's copy, taken back there
    assert w0.core.releases and w1.core.releases  # each charged what it was dealt
    released = sorted((d, r, n) for d, r, n in pipe.core.releases)
    assert released == [(d, 1, SECURE_RELEASE) for d in pipe.devices]  # once each


@pytest.mark.parametrize("lie", ["claims w0's devices", "a sum of another width", "lost"])
def test_a_partial_that_does_not_reconcile_or_a_lost_worker_fails_the_round(lie):
    """w1's partial (as the coordinator holds it after the commit) claims devices the
    coordinator gave w0, or carries a sum of another ring; or w1's last will came: nothing is
    merged, the coordinator says why, and the session takes no masked input; every device of
    U2 is charged once."""

    def tamper(pipe: Pipeline) -> None:
        partial = pipe.coordinator.round.partials["w1"]
        if lie == "claims w0's devices":
            partial["a"] = list(pipe.devices)
        elif lie == "a sum of another width":
            partial["s"] = {"y": partial["s"]["y"][:-1], "b": partial["s"]["b"]}
        else:
            pipe.coordinator.worker_offline("w1")

    pipe = Pipeline()
    outcome, why = pipe.run(tamper=tamper)
    assert outcome is None and why is not None and "w1" in why, why
    assert pipe.sr.session.counts["masked"] == 0
    assert "w0" not in why
    released = sorted((d, r, n) for d, r, n in pipe.core.releases)
    assert released == [(d, 1, SECURE_RELEASE) for d in pipe.devices]


def test_a_hash_worker_offline_since_the_round_opened_only_drops_its_devices():
    """Hash partition, w1 offline when the round opens: its devices' messages reach no one, so
    they drop out of the round at its first phase; the round sums the other devices exactly
    (failing it would buy nothing) and the record names w1."""
    from edge_fl.secagg import Summed

    pipe = Pipeline(absent=("w1",))
    outcome, why = pipe.run()
    assert why is None and isinstance(outcome, Summed)
    mine = tuple(d for i, d in enumerate(pipe.devices) if i % 2 == 0)  # dealt to w0
    assert outcome.contributors == mine
    assert np.array_equal(outcome.total, sum(pipe.x[d] for d in mine))
    assert pipe.coordinator.end_secure()["workers_missing"] == ["w1"]


def test_a_device_flooding_early_masked_inputs_cannot_crowd_out_another_devices():
    """Masked inputs that reach a worker before the round's ``masked`` control message are
    held, at most two a selected device (red team: the cap was per round, so one device's
    copies could make an honest device's early input be refused); a device outside the
    selection has none held."""
    from edge_fl.secagg.messages import encode

    pipe = Pipeline()
    worker = pipe.workers["w0"]
    nonce, selected = worker.core.round_facts(1)
    assert "d00000" in selected and "d00001" in selected

    def early(device: str) -> None:
        worker.on_update(device, encode("mx", 1, nonce, d=device, y=b"\x00" * 8))

    for _ in range(10):
        early("d00000")  # the flood: two held, eight refused
    assert worker.secure_rejected["wrong_phase"] == 8
    early("d00001")  # an honest device's early input is still held
    assert worker.secure_rejected["wrong_phase"] == 8
    early("d99999")  # not selected: never held
    assert worker.secure_rejected["wrong_phase"] == 9
