"""A secure job with two spawned ingest workers, as separate processes over a real Mosquitto
(`edge-fl aggregator --workers 2 --out DIR`, `edge-fl fleet`): the aggregator is killed with
SIGKILL while a secure round collects masked inputs, then `--resume`d to the job's end. Two jobs:
a FedBuff one (`rounds.mode: fedbuff`, each buffer one SecAgg+ cohort, several in flight) and a
synchronous one (`rounds.mode: sync`, each round one SecAgg+ round of the whole fleet).

What docs/protocol.md ("Secure aggregation", "Secure FedBuff cohorts", "Ingest workers") and
docs/specs/secagg.md (sections 9 and 11) promise for that crash: the job finishes; the rounds
(cohorts) open at the crash are recorded skipped ("the aggregator restarted mid-round", or
"mid-cohort"), never summed from what survived; every record's round number appears once and
the version rises by one per summed round; every summed round had at least `sa.ms` masked
inputs; and the ledger charges every device once for every round whose masked input (`mx`)
reached the aggregator or one of its workers, the interrupted ones included, never twice.

The auditor is an independent MQTT subscriber to everything under `edgefl/<job>/`: it sees
each round's (cohort's) global message (number, nonce, roster: a sync round's come from it as a
cohort's do), each `mx` a device published (a payload on `up/<device>` whose map starts with
`v` then `k` = "mx", naming `r` and `nc`) and each worker's `progress` on
`ingest/progress/<w>` (its `rel`: the masked inputs the worker charged, with samples -1, before
it acknowledged them to the broker).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import pytest
from mqtt_tap import UpdateTap
from processes import stop_all, wait_for

pytestmark = pytest.mark.broker

ROOT = str(Path(__file__).resolve().parent.parent)  # this checkout's edge_fl, not an install
ENTRY = "import sys; from edge_fl.cli import main; sys.argv[0] = 'edge-fl'; main()"
ENV = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}


class Job(NamedTuple):
    rounds: int  # rounds (FedBuff: cohorts) before the job ends
    what: str  # how the records and the logs name one
    stall_on: str  # the ``stalled`` case stops the aggregator at the first of these it sends
    overrides: dict[str, Any]


JOBS = {
    "fedbuff": Job(6, "cohort", "sf", {
        "data.devices": 12,
        "rounds.mode": "fedbuff",
        "rounds.buffer_size": 4,  # K' = 6 (dropout 0.3), two cohorts in flight (C = 12)
        "rounds.concurrency": 12,
        "fleet.time_scale": 1.0,  # wall time: a cohort takes ~1 s
    }),
    # stopped at a sync round's first sf, the coordinator had sent no other (one device
    # answered, when tried); at its first mx, every device had its sf and answers
    "sync": Job(4, "round", "mx", {
        "data.devices": 10,  # every device selected (clients_per_round's default, clamped)
        "rounds.mode": "sync",
        "fleet.time_scale": 5.0,  # wall time: a round takes ~0.5 s
    }),
}  # fmt: skip


class MissedCharge(AssertionError):
    """A masked input that reached the aggregator's side is not in the ledger."""


def edge_fl(*args: str) -> list[str]:
    return [sys.executable, "-c", ENTRY, *args]


class Auditor(UpdateTap):
    """Every message under ``edgefl/<job>/#`` with the time it arrived; ``on_message(topic,
    payload)`` is called in the tap's thread as each arrives (to act at once on one)."""

    def __init__(self, url: str, topics: Any, job: str) -> None:
        super().__init__(url, topics, identifier=f"audit-{uuid.uuid4().hex[:6]}",
                         topic=f"edgefl/{job}/#")  # fmt: skip
        self.job = job
        self.times: list[float] = []
        self.on_message: Any = None

    async def _read(self, client: Any) -> None:
        async for msg in client.messages:
            topic, payload = str(msg.topic), bytes(msg.payload)
            with self.arrived:
                self.payloads.append((topic, payload))
                self.times.append(time.monotonic())
                self.arrived.notify_all()
            if self.on_message is not None:
                self.on_message(topic, payload)

    def snapshot(self) -> list[tuple[str, bytes, float]]:
        with self.arrived:
            return [(t, p, s) for (t, p), s in zip(self.payloads, self.times, strict=True)]

    def wait(self, predicate: Any, timeout: float, what: str, procs: tuple = ()) -> None:
        until = time.monotonic() + timeout
        with self.arrived:
            while not predicate():
                for p in procs:
                    if p.poll() is not None:
                        raise AssertionError(f"{what}: {p.args[3]} exited early ({p.poll()})")
                if time.monotonic() > until:
                    raise AssertionError(f"timed out waiting for {what}")
                self.arrived.wait(0.2)


def secagg(payload: bytes) -> dict[str, Any] | None:
    """A SecAgg+ message (its map starts with ``v`` then ``k``), else None."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:
        return None
    if not isinstance(obj, dict) or list(obj)[:2] != ["v", "k"]:
        return None
    return obj


def rounds_seen(messages: list[tuple[str, bytes, float]], job: str) -> dict[int, dict]:
    """Each secure round's (cohort's) global message: number -> {nonce, roster, version}."""
    from edge_fl.protocol import decode_global

    out: dict[int, dict] = {}
    for topic, payload, _ in messages:
        if topic != f"edgefl/{job}/global" or not payload:
            continue
        msg = decode_global(payload)
        if msg.done or msg.secure is None:
            continue
        seen = {"nonce": msg.nonce, "roster": frozenset(msg.selected or ()), "ver": msg.version}
        assert out.setdefault(msg.round, seen) == seen, f"round {msg.round} dispatched twice"
    return out


def masked_published(messages: list, job: str) -> list[tuple[str, int, bytes, float]]:
    """Every ``mx`` a device published: (device, round number, nonce, when)."""
    prefix = f"edgefl/{job}/up/"
    out = []
    for topic, payload, when in messages:
        if topic.startswith(prefix):
            obj = secagg(payload)
            if obj is not None and obj.get("k") == "mx":
                out.append((topic[len(prefix) :], obj["r"], bytes(obj["nc"]), when))
    return out


def shares_sent(messages: list, job: str) -> set[tuple[str, int]]:
    """Every ``sf`` (a device's forwarded shares) the aggregator sent: (device, round)."""
    prefix = f"edgefl/{job}/inbox/"
    out = set()
    for topic, payload, _ in messages:
        if topic.startswith(prefix):
            obj = secagg(payload)
            if obj is not None and obj.get("k") == "sf":
                out.add((topic[len(prefix) :], obj["r"]))
    return out


def worker_releases(messages: list, job: str) -> set[tuple[str, int]]:
    """The masked inputs the workers reported charged (``rel`` entries with samples -1)."""
    prefix = f"edgefl/{job}/ingest/progress/"
    out = set()
    for topic, payload, _ in messages:
        if topic.startswith(prefix) and payload:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            for device, rnd, samples in obj.get("rel") or ():
                if samples == -1:
                    out.add((device, rnd))
    return out


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def ledger(out: Path, job: str) -> list[tuple[str, int, int]]:
    """The release rows of the run's checkpoint ledger (one file at the job's end)."""
    files = sorted(out.glob("checkpoint-ledger-*.jsonl"))
    assert len(files) == 1, files
    lines = [json.loads(x) for x in files[0].read_text().splitlines() if x.strip()]
    assert lines[0][:3] == ["edge-fl ledger", 1, job], lines[0]
    return [(d, r, n) for kind, d, r, n in lines[1:] if kind == "r"]


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (its spawned ingest workers)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        path = task / "children"
        if path.exists():
            found += [int(x) for x in path.read_text().split()]
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def workers_online_since(messages: list, job: str, since: float) -> float | None:
    """When both workers of the resumed aggregator had announced themselves (``live`` with
    ``on`` true on ``ingest/worker/<w>``, sent once subscribed), or None."""
    prefix = f"edgefl/{job}/ingest/worker/"
    first: dict[str, float] = {}
    for topic, payload, when in messages:
        if topic.startswith(prefix) and payload and when > since:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            if obj.get("on") is True:
                first.setdefault(topic[len(prefix) :], when)
    return max(first.values()) if len(first) == 2 else None


@pytest.mark.parametrize("crash", ["kill", "stalled"])
@pytest.mark.parametrize("mode", list(JOBS))
def test_resume_after_sigkill_mid_secure_round_with_workers(mosquitto, tmp_path, mode, crash):
    """``kill``: SIGKILL the aggregator the moment the auditor sees a masked input (after the
    job's first record), as a crash would. ``stalled``: the aggregator is stopped (SIGSTOP: a
    hung or swapped-out process) the moment the auditor sees a cohort's first ``sf`` (a sync
    round's first ``mx``), so the round's masked inputs reach the workers, which charge, sum and
    acknowledge them and report them in ``progress``; once the auditor saw every one reported,
    SIGKILL (a crash after the workers acknowledged masked inputs and before the coordinator
    read their reports, the window the ``kill`` case lands in by timing).

    Then ``--resume`` to the job's end. The ledger's completeness is checked last (it failed
    before the resumed aggregator charged an abandoned round's or cohort's selection: the
    progress reports of the dead process's workers are sealed with its run secret, so they are
    refused)."""
    from edge_fl.config import load_config
    from edge_fl.job import build_job
    from edge_fl.protocol import Topics
    from edge_fl.secagg import ddg

    job = JOBS[mode]
    job_id = f"scr-{uuid.uuid4().hex[:6]}"
    cfg = load_config(None, {
        "job": job_id,
        "broker.url": mosquitto.url,
        "model.name": "logreg",
        "rounds.rounds": job.rounds,
        "rounds.deadline_s": 20,
        "secure_aggregation.enabled": True,
        "secure_aggregation.phase_timeout_s": 5.0,
        "privacy.mechanism": "distributed-gaussian",
        "privacy.epsilon": 8.0,
        **job.overrides,
    })  # fmt: skip
    plan = build_job(cfg).secure_plan
    ms = plan.min_survivors
    calibration = plan.mechanism.calibration(plan.job).params
    config = tmp_path / "job.json"
    config.write_text(json.dumps(cfg.model_dump(mode="json", exclude_unset=True)))
    out = tmp_path / "run"
    logs = tmp_path / "logs"
    logs.mkdir()
    agg_cmd = edge_fl("aggregator", "--config", str(config), "--workers", "2", "--out", str(out))

    auditor = Auditor(mosquitto.url, Topics(job_id), job_id)
    auditor.thread.start()
    assert auditor.ready.wait(10)
    state: dict[str, Any] = {}

    def start_agg(name: str, *more: str) -> subprocess.Popen:
        return subprocess.Popen([*agg_cmd, *more], env=ENV,
                                stdout=(logs / f"{name}.out").open("w"),
                                stderr=(logs / f"{name}.err").open("w"))  # fmt: skip

    agg = start_agg("agg1")
    fleet = subprocess.Popen(edge_fl("fleet", "--config", str(config)), env=ENV,
                             stdout=subprocess.DEVNULL,
                             stderr=(logs / "fleet.err").open("w"))  # fmt: skip
    agg2 = None
    t0 = time.monotonic()
    trigger = job.stall_on if crash == "stalled" else "mx"
    try:
        wait_for(lambda: len(children(agg.pid)) == 2, 30, "the two spawned workers")
        workers = children(agg.pid)

        def on_message(topic: str, payload: bytes) -> None:
            # the first sf / mx after the first record: act at once, in the auditor's thread
            if "armed" not in state or "hit" in state:
                return
            if "/up/" not in topic and "/inbox/" not in topic:
                return
            obj = secagg(payload)
            if obj is None or obj.get("k") != trigger:
                return
            state["hit"] = (topic.rsplit("/", 1)[1], obj["r"])
            state["at"] = time.monotonic()
            os.kill(agg.pid, signal.SIGSTOP if crash == "stalled" else signal.SIGKILL)

        auditor.on_message = on_message
        wait_for(lambda: bool(records(out)) or agg.poll() is not None, 60, "a first record")
        assert agg.poll() is None, (logs / "agg1.err").read_text()[-3000:]
        state["armed"] = True
        auditor.wait(lambda: "hit" in state, 60, f"an {trigger} after the first record", (agg,))
        hit_round = state["hit"][1]
        if crash == "stalled":
            # the devices answer the sf they got with mx; the workers charge, sum, acknowledge
            # and report each (rel), the coordinator stopped: wait until every device sent an
            # sf of the round published its mx and all were reported
            def reported() -> bool:
                msgs = auditor.snapshot()
                sent = {(d, r) for d, r, _, _ in masked_published(msgs, job_id)
                        if r == hit_round}  # fmt: skip
                asked = {(d, r) for d, r in shares_sent(msgs, job_id) if r == hit_round}
                return bool(sent) and asked <= sent <= worker_releases(msgs, job_id)

            auditor.wait(reported, 30, "the workers' reports of the round's masked inputs")
            state["at"] = time.monotonic()
            os.kill(agg.pid, signal.SIGKILL)
        agg.wait(10)
        assert agg.returncode == -signal.SIGKILL
        # a kill -9 leaves the spawned workers (their own session, not the aggregator's process
        # group) to their parent-death signal (SIGTERM, edge_fl/cli/ingest_cmd.py LocalWorkers):
        # they must be gone, without anyone else killing them, before the resume
        wait_for(lambda: not any(alive(w) for w in workers), 20, "the orphaned workers' exit")
        done_before = records(out)
        agg2 = start_agg("agg2", "--resume")
        agg2.wait(150)
        fleet.wait(60)
    finally:
        stop_all(agg, fleet, *(p for p in (agg2,) if p is not None))
        auditor.stop.set()
        auditor.thread.join(10)
    elapsed = time.monotonic() - t0
    err2 = (logs / "agg2.err").read_text()
    out2 = (logs / "agg2.out").read_text()
    msgs = auditor.snapshot()
    killed_at = state["at"]
    published = masked_published(msgs, job_id)
    open_at_crash = sorted({r for _, r, _, when in published if when <= killed_at}
                           - {r["round"] for r in done_before})  # fmt: skip
    print(f"{mode} {crash}: job took {elapsed:.1f} s; killed at {job.what} {hit_round} "
          f"({trigger} of {state['hit'][0]}), {killed_at - t0:.1f} s in; "
          f"with masked inputs open: {open_at_crash}\n{out2}")  # fmt: skip

    # 1. the job finishes, without a traceback, and so does the fleet
    assert agg2.returncode == 0, err2[-4000:]
    assert "Traceback" not in err2, err2[-4000:]
    assert fleet.returncode == 0, (logs / "fleet.err").read_text()[-3000:]
    assert "job finished: " in out2, out2

    # 2. numbering: every dispatched round has one record; versions rise by one per sum
    rows = records(out)
    assert rows[: len(done_before)] == done_before  # nothing before the crash rewritten
    numbers = [r["round"] for r in rows]
    dispatched = rounds_seen(msgs, job_id)
    assert sorted(numbers) == list(range(1, job.rounds + 1)), numbers
    # a round journaled by the dead process whose global message it never published (the
    # journal is written first) has a record, skipped, and reached no device
    unpublished = set(numbers) - set(dispatched)
    assert set(dispatched) <= set(numbers), (sorted(dispatched), numbers)
    version = 0
    for row in rows:
        version += row["status"] == "closed"
        assert row["version"] == version, rows
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_closed"] == version >= 1

    # 3. never a sum from what survived the crash; every sum of at least ms masked inputs
    by_number = {r["round"]: r for r in rows}
    assert hit_round in open_at_crash or crash == "stalled"
    for number in {*open_at_crash, hit_round, *unpublished}:
        row = by_number[number]
        assert row["status"] == "skipped", row
        why = row["secure"]["failed"]["reason"]
        assert why == f"the aggregator restarted mid-{job.what}", row
    for row in rows:
        sec = row["secure"]
        if row["round"] in unpublished:
            assert row["secure"]["phases"].get("masked", 0) == 0, row
            continue
        sent = dispatched[row["round"]]
        assert row["selected"] == len(sent["roster"])
        if mode == "sync":  # a round trains on the last one's model
            assert sent["ver"] == row["version"] - (row["status"] == "closed"), row
            assert len(sent["roster"]) == cfg.data.devices
        if row["status"] == "closed":
            assert sec["outcome"] == "summed" and "failed" not in sec, row
            assert sec["phases"]["masked"] >= ms and row["received"] >= ms, row
            if mode == "fedbuff":
                assert sec["base_version"] == sent["ver"]
            assert row["workers"] == 2 and row["workers_missing"] == [], row
        else:
            assert sec.get("failed") or sec.get("stale"), row

    # 4. the ledger: only masked inputs of members, never twice, and summary.json's epsilon
    # is the calibration's at the worst device's number of charged rounds
    charged = ledger(out, job_id)
    pairs = {(d, r) for d, r, _ in charged}
    assert len(pairs) == len(charged), f"a device charged twice for one {job.what}"
    assert all(n == -1 for _, _, n in charged)
    assert all(d in dispatched[r]["roster"] for d, r in pairs)
    counts: dict[str, int] = {}
    for d, _ in pairs:
        counts[d] = counts.get(d, 0) + 1
    want = ddg.epsilon(calibration, max(counts.values()), cfg.privacy.delta)
    assert summary["privacy"]["epsilon"] == pytest.approx(want, rel=1e-9)
    assert rows[-1]["epsilon"] == pytest.approx(want, rel=1e-9)
    # every round that summed: each contributor charged (received = its masked inputs)
    for row in rows:
        if row["status"] == "closed":
            assert sum(r == row["round"] for _, r in pairs) >= row["received"], row

    # 5. ... and every masked input that reached the aggregator's side charged for its round:
    # each one a worker reported in its progress (charged there, then acknowledged), and each
    # one a device published once the resumed aggregator's workers were subscribed. (Those
    # published between the crash and then reached no subscriber of the aggregator: workers
    # hold clean sessions. They are listed, not required.)
    valid = {(d, r): when for d, r, nc, when in published
             if r in dispatched and nc == dispatched[r]["nonce"]
             and d in dispatched[r]["roster"]}  # fmt: skip
    resumed_at = workers_online_since(msgs, job_id, killed_at)
    assert resumed_at is not None, "the resumed aggregator's workers never came online"
    reported = worker_releases(msgs, job_id)
    required = reported | {k for k, when in valid.items() if when > resumed_at}
    unseen = sorted(k for k, when in valid.items() if killed_at < when <= resumed_at
                    and k not in reported)  # fmt: skip
    print(f"mx published {len(valid)}, reported by workers {len(reported)}, charged "
          f"{len(pairs)}; published while no worker listened: {unseen}")  # fmt: skip
    lost = sorted(required - pairs)
    if lost:
        when = {}
        prefix = f"edgefl/{job_id}/ingest/progress/"
        for topic, payload, t in msgs:
            if topic.startswith(prefix) and payload:
                obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
                for d, r, _ in obj.get("rel") or ():
                    when.setdefault((d, r), round(t - killed_at, 3))
        raise MissedCharge(
            f"masked inputs that reached the aggregator's side but are not in the ledger: "
            f"{[(k, when.get(k)) for k in lost]} ((device, {job.what}), when a worker reported "
            f"it, s after the SIGKILL); the resumed coordinator's refusals:\n"
            + "\n".join(x for x in err2.splitlines() if "refused" in x)[:3000]
        )
