"""The aggregator service: drives the rounds of one job over MQTT around an AggregatorCore.

Ingest: aiomqtt connects, subscribes and publishes; received PUBLISH packets do not go through
its queue: an :class:`~edge_fl.transport.tap.IngestTap` on paho's socket parses them from large
reads and the service dispatches each into the core at once (``on_update``/``on_status``); a
:class:`~edge_fl.server.group_commit.GroupCommit` acknowledges them after one journal fsync
(BENCHMARKS.md, ``tools/bench_ingest.py``); :class:`~edge_fl.server.acks.AckPolicy` decides the
replies on ``ack/<device>``.

It subscribes to updates and statuses, feeds payload bytes to :class:`AggregatorCore`, drives
round deadlines with the event loop's clock, publishes the retained global model and one metrics
record per round. If the broker vanishes it reconnects with a persistent session (QoS 1 updates
queued by the broker meanwhile are delivered then) and republishes the open round; the core's
state, and so every accepted update, survives the outage.

Crash safety (with ``checkpoint_dir`` and a :class:`~edge_fl.server.journal.Journal`): every
accepted update, every other ledger release and every round opened is journaled before the MQTT
message that caused it is acknowledged (the service acknowledges QoS 1 messages itself, after the
journal's fsync, instead of paho doing it on receipt); a round is committed by its checkpoint, then
its metrics line, then a fresh journal. A ``kill -9`` at any point loses nothing: what was
journaled is replayed on ``--resume``, what was not was not acknowledged and the broker delivers it
again to the persistent session.

Clean stop: :meth:`request_stop` (SIGTERM/SIGINT through
:class:`~edge_fl.server.signals.StopSignals`) closes the open round at once with what arrived (or
records it skipped), publishes the done marker so devices stop releasing, charges what was
already on its way (until each device it asked answered or left, at most :data:`STOP_GRACE_S`),
commits the round, runs ``on_finish`` (summary, model) and ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiomqtt

from edge_fl.clocksync import AggregatorClock, arrival_order
from edge_fl.protocol import PayloadRejected, Reject, Topics, decode_global, encode_global
from edge_fl.protocol.clock import (
    UPS_MAX,
    ClockMessage,
    ClockMessageError,
    clock_topic,
    decode_clock,
)
from edge_fl.protocol.dispatch import encode_dispatch
from edge_fl.protocol.messages import Dispatch
from edge_fl.protocol.secure import masked_head, secure_head, up_kind
from edge_fl.transport import client_adapter
from edge_fl.transport.tap import IngestTap
from edge_fl.transport.url import BrokerSpec

from .acks import AckPolicy
from .aggregator import SECURE_RELEASE, AggregatorCore
from .group_commit import ACK_BATCH, GroupCommit
from .rounds import Decision
from .signals import StopSignals

if TYPE_CHECKING:  # SecAgg+ (and its cryptography) only for jobs that run secure rounds
    import paho.mqtt.client as paho

    from edge_fl.secagg import Deliver
    from edge_fl.server.secure import SecureRound

__all__ = ["ACK_BATCH", "AggregatorService", "BrokerUnavailable", "IngestTap", "StopSignals"]

log = logging.getLogger("edge_fl.aggregator")

RecordCallback = Callable[[dict[str, Any]], None]
#: a round that could end early because its remaining devices went offline waits this long first:
#: a dying broker publishes every device's last will just before the connection drops, and those
#: "offline" statuses must not skip a round the devices are still working on
STATUS_SETTLE_S = 0.5
#: after the aggregator itself reconnected (a broker restart, a cluster node lost), devices are
#: reconnecting too and their last wills say "offline": no round ends early on statuses for this
#: long (the deadline still applies). Measured: a NATS node kill skipped an open round without it.
RECONNECT_SETTLE_S = 10.0
#: sharded ingest: how long the coordinator waits for the workers' answers to freeze and commit
#: (a worker that went offline is not waited for); a share that does not come is reported lost
SHARD_ANSWER_S = 10.0
#: on a stop, after the done marker: how long the service still listens for updates devices
#: had already sent (each is a release to charge); a fleet that leaves ends it at once
STOP_GRACE_S = 1.0
#: virtual time: how often (real seconds) a wait for the fleet's clock report says it still waits
VT_NOTE_S = 30.0
#: virtual time: a grant unanswered for this long (real seconds) is published again (the fleet
#: answers a repeated grant with its report again): a lost clock message must not stall the run
VT_RESEND_S = 5.0


class NothingPending(RuntimeError):
    """Virtual time: neither the aggregator nor the fleet has any event left, so nothing the
    job waits for can ever happen (no device will become available, no deadline is set)."""


def _retrieved(task: asyncio.Task) -> None:
    """Done callback of a publish nobody awaits: its failure (the broker went away) is expected
    and reported once by the reconnect, not as "exception was never retrieved"."""
    if not task.cancelled():
        task.exception()


class BrokerUnavailable(RuntimeError):
    """The broker could not be reached within the retry budget."""


class AggregatorService:
    #: acknowledge QoS 1 messages after they are processed and journaled (False: paho acks on
    #: receipt, the pre-journal behaviour; only the chaos tool's comparison sets it)
    ack_after_processing = True

    def __init__(
        self,
        core: AggregatorCore,
        spec: BrokerSpec,
        topics: Topics,
        *,
        wait_for_devices_s: float = 60.0,
        expected_devices: int | None = None,
        on_record: RecordCallback | None = None,
        reconnect_attempts: int = 10,
        client_id: str | None = None,
        checkpoint_dir: str | None = None,
        journal: Any = None,  # edge_fl.server.journal.Journal
        on_finish: Callable[[], None] | None = None,
        signals: StopSignals | None = None,
        resumed_payload: bytes | None = None,
        signer: Any = None,  # edge_fl.protocol.signing.Signer: signs every global message
        acks: str = "off",  # off | rejections | all: replies on ack/<device>
        job_document: bytes | None = None,  # retained on <prefix>/<job>/job while the job runs
        sharding: Any = None,  # edge_fl.server.sharding.Coordinator: ingest by workers
        virtual_time: bool = False,  # simulated time in lock-step with one fleet (clocksync)
        virtual_limit_s: float | None = None,  # virtual time: stop after this many simulated s
    ) -> None:
        if virtual_time and sharding is not None:
            raise ValueError("virtual time runs without ingest workers (ingest.workers = 0)")
        if virtual_time and core.current is not None:
            raise ValueError("virtual time cannot resume an open round (run it again instead)")
        #: secure aggregation (``core.secure_round``): ``secure_observer(label, vector)`` sees
        #: every vector a session holds (tests)
        self.secure_observer: Callable[[str, Any], None] | None = None
        self.sharding = sharding
        #: virtual time (``edge_fl.clocksync``): None = the event loop's clock
        self.vclock: AggregatorClock | None = AggregatorClock() if virtual_time else None
        self._vt_held: list[tuple[str, bytes, int, int, bool]] = []  # until their report
        self._vt_ready: ClockMessage | None = None
        #: the job stopped because the broker went away under virtual time (the fleet, which
        #: cannot be told, is then stopped by its caller)
        self.broker_lost = False
        self._vt_gone = False
        self._vt_released: float | None = None  # loop time virtual time gave way to real time
        self._vt_event = asyncio.Event()
        self._clock_in = clock_topic(topics.base, "fleet")
        self._clock_out = clock_topic(topics.base, "agg")
        self._vt_limit_s = virtual_limit_s
        self._vt_end = math.inf  # the simulated time the limit ends the job at
        self._open_control: bytes | None = None  # the open round's message to the workers
        self.signer = signer
        self.job_document = job_document
        core.wall = time.time  # every global message's ts: Unix seconds (docs/protocol.md)
        self.acks = AckPolicy(acks)
        self._live_status: set[str] = set()
        self.core = core
        self.spec = spec
        self.topics = topics
        self.wait_for_devices_s = wait_for_devices_s
        self.expected_devices = expected_devices
        self.on_record = on_record or (lambda _r: None)
        self.reconnect_attempts = reconnect_attempts
        self.checkpoint_dir = checkpoint_dir
        self.journal = journal
        self.on_finish = on_finish
        self.signals = signals
        self.client_id = client_id or f"edgefl-{topics.job}-aggregator"
        self._wake = asyncio.Event()
        #: when the last round closed, on this service's clock (the last round's record is
        #: written after the drain, which may wait up to a deadline for late uploads)
        self.closed_at: float | None = None
        if resumed_payload is not None and not _signed_by(resumed_payload, signer):
            # signed by an earlier process's key (simulate makes one per process): the open
            # round's message is encoded and signed again when the round is re-published
            resumed_payload = None
        self._global_payload: bytes | None = resumed_payload
        self._dispatch_payload: bytes | None = None  # the open window's last dispatch message
        #: secure FedBuff: cohorts' global messages still to publish, and when each opened
        self._cohort_payloads: list[tuple[bytes | None, bytes]] = []  # (workers' open, global)
        self._cohort_started: dict[int, float] = {}
        self._client: aiomqtt.Client | None = None
        self._round_started = 0.0
        self._settle_until: float | None = None
        self._grace_until = 0.0  # after a reconnect: no early close on statuses before this
        self.commit = GroupCommit(journal, on_error=self._fail)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ingest_failed: asyncio.Future[None] | None = None
        self._paho: aiomqtt.Client | None = None  # the current client (acks on receipt)
        self.tap: IngestTap | None = None  # the current connection's (diverted/passed counts)
        self._resumed_round = core.current is not None  # rebuilt from the journal
        self._finished = False
        self._settled = False  # the last record carries the final ledger: no update is taken
        self.stopped: str | None = None  # the signal (or reason) a clean stop was asked for
        self.done_published = False
        self.stats: Counter = Counter()  # journaled, duplicates (re-deliveries absorbed), ...
        self.connected = asyncio.Event()
        self._ever_connected = False

    # ---------------------------------------------------------------- plumbing

    def request_stop(self, reason: str = "stop") -> None:
        """Stop cleanly: decide the open round, commit it, finish and publish the done marker."""
        if self.stopped is None:
            log.warning("%s: deciding the open round and stopping", reason)
            self.stopped = reason
        self._wake.set()
        self._vt_event.set()

    def _ack(self, device: str, payload: bytes, reason: Reject | str | None, held: bool) -> None:
        """Tell the device what became of its update (docs/protocol.md, Ack), as the
        :class:`AckPolicy` decides. Fire and forget (QoS 1, not retained): ingest never waits."""
        if self._client is None or not self.acks.enabled:
            return
        reply = self.acks.reply(self.core, device, payload, reason, held=held)
        if reply is not None:
            self._send_ack(device, reply)

    def _send_ack(self, device: str, reply: bytes) -> None:
        client = self._client
        if client is None:
            return
        task = asyncio.get_running_loop().create_task(
            client.publish(self.topics.ack(device), reply, qos=1)
        )
        task.add_done_callback(_retrieved)

    def _ack_held(self) -> None:
        """A window opened: ack what it decided about updates held for it."""
        for device, reply in self.acks.held_verdicts(self.core):
            self._send_ack(device, reply)

    def _dispatch(self, message: Any) -> None:
        """One received message (anything with ``topic``, ``payload`` and ``retain``)."""
        payload = message.payload if isinstance(message.payload, bytes | bytearray) else b""
        self._ingest(str(message.topic), payload, bool(message.retain))

    def _ingest(self, topic: str, payload: bytes | bytearray, retain: bool) -> None:
        if (device := self.topics.device_of(topic, "up")) is not None:
            core = self.core
            if core.secure is not None and up_kind(bytes(payload)) is not None:
                self._secure_in(device, bytes(payload))
                return
            before = len(core.releases)
            window = core.current
            counted = window.count if window is not None else None
            data = bytes(payload)
            reason = core.on_update(device, data)
            new = core.releases[before:]
            if self.journal is not None:
                if reason is None:  # replaying the bytes re-folds it and re-records its release
                    rec = core.devices.get(device)
                    declared = rec.n_samples if rec is not None else None
                    self.journal.append("accept", d=device, p=bytes(payload), dn=declared)
                    self.stats["journaled"] += 1
                for d, r, n in new if reason is not None else ():
                    self.journal.append("release", d=d, r=int(r), n=int(n))
                    self.stats["journaled"] += 1
            if reason is not None:
                if new and core.finished:
                    self._wake.set()  # the drain after the last round waits for these
                if not new and reason in (Reject.DUPLICATE, Reject.LATE):
                    # (device, round) is in the ledger already: a QoS 1 re-delivery, typically
                    # of a message journaled but not acknowledged before a restart
                    self.stats["duplicates"] += 1
                    log.info("update from %s already in the ledger (%s)", device, reason)
                else:
                    log.debug("update from %s rejected: %s", device, reason)
            else:
                # any accepted update may end the round: the target, or the last one that can
                # still come (decide() knows which devices stopped or went offline)
                self._wake.set()
            held = reason is None and (core.current is None or core.current.count == counted)
            self._ack(device, data, reason, held)
        elif (device := self.topics.device_of(topic, "status")) is not None:
            self.core.on_status(device, bytes(payload))
            if not retain:
                self._live_status.add(device)  # said during this run, not left by an earlier one
            self._wake.set()
        elif self.vclock is not None and topic == self._clock_in:
            self._on_clock(bytes(payload))
        elif self.sharding is not None:
            self._from_worker(topic, bytes(payload))

    # ---------------------------------------------------------------- secure rounds

    def _secure_open(self) -> None:
        """The round just opened is a SecAgg+ round: its session; the keys phase starts now."""
        self.core.open_secure(self._now(), observer=self.secure_observer)

    def _secure_in(self, device: str, payload: bytes) -> None:
        """A SecAgg+ message on ``up/<device>``: to the open round's session. A masked input
        that names a round which asked this device, with its nonce, is charged (journaled like
        every release) before it is acknowledged, whatever the session makes of it: late, or
        for a round skipped after a restart (the broker redelivers to the persistent session
        what the dead process never acknowledged), it is charged and never summed."""
        core = self.core
        core.tally.bytes_up += len(payload)
        core.tally.messages_up += 1
        head = masked_head(payload)
        if head is not None:
            facts = core.round_facts(head[0])
            if facts is not None and facts[0] == head[1] and device in facts[1]:
                self._secure_charge(device, head[0], payload)
        if self.sharding is not None and head is not None:
            return  # a masked input a worker handed over (of a cohort it did not hold): charged
        sr = core.secure_round
        cohorts = core.cohorts
        if cohorts is not None:  # secure FedBuff: the cohort its r and nc name
            head = secure_head(payload)
            cohort = None if head is None else cohorts.route(*head)
            sr = None if cohort is None else cohort.session
            if sr is not None:
                self._secure_receive(sr, device, payload)
            else:  # no open cohort of that r and nc: a closed one's, or none (counted, as a
                core.tally.rejected[Reject.LATE] += 1  # worker counts it; an mx: charged above)
            return
        if sr is None or core.current is None:
            return  # between rounds: a late message, nothing to take it
        self._secure_receive(sr, device, payload)

    def _shorten_if_gone(self, sr: SecureRound) -> bool:
        """A secure round's phase waiting only for devices whose status says offline ends after
        the status settle time, not at its timeout (not right after a reconnect, when every
        status is stale, nor in a masked phase the workers hold)."""
        now = self._now()
        if now < self._grace_until or self._masked_by_workers(sr):
            return False
        return sr.shorten_if_gone(self.core.is_online, now, STATUS_SETTLE_S)

    def _secure_receive(self, sr: SecureRound, device: str, payload: bytes) -> None:
        """One SecAgg+ message into its round's session; a phase deadline it brought forward, or
        a cohort now waiting only for members on probation (another may be dispatched), wakes
        the round loop, which may be asleep until the old deadline."""
        deadline = sr.deadline
        self._secure_deliver(sr, sr.receive(device, payload, self._now()))
        if sr.deadline < deadline or (sr.probation and sr.phase == "keys"):
            self._wake.set()

    def _secure_charge(self, device: str, rnd: int, payload: bytes) -> None:
        if self.core.charge_secure(device, rnd, payload) and self.journal is not None:
            self.journal.append("release", d=device, r=rnd, n=SECURE_RELEASE)
            self.stats["journaled"] += 1

    def _secure_deliver(self, sr: SecureRound, deliveries: list[Deliver]) -> None:
        """Publish a secure round's inbox messages (QoS 1, not awaited); a phase that moved or
        ended wakes the round loop."""
        client = self._client
        sharding = self.sharding
        if sharding is not None and sr.phase == "masked" and self._wants_masked(sr):
            # the workers learn U2 before any device can send a masked input (same connection).
            # Queued now, not from a task: its sequence number ``q`` is drawn now, and a control
            # message published before it ran (another cohort's ``freeze`` or ``open``, with a
            # higher ``q``) would make the workers refuse it as a replay
            control = self._masked_control(sr)
            self._hand_to_workers(sr)
            if client is not None:
                client_adapter.publish_nowait(client, self.topics.ingest_control, control, qos=1)
        for effect in deliveries:
            self.core.tally.bytes_down += len(effect.payload)
            if client is not None:
                task = asyncio.get_running_loop().create_task(
                    client.publish(self.topics.inbox(effect.device), effect.payload, qos=1)
                )
                task.add_done_callback(_retrieved)
                self._vt_published()  # virtual time: the fleet counts it on the device's session
        if deliveries or sr.finished:
            self._wake.set()

    def _secure_close(self, now: float | None = None, why: str | None = None) -> dict[str, Any]:
        """Close the open secure round on its outcome (``why``: it ends unfinished, e.g. a
        stop or a restart: the model is unchanged) and return its record, not yet committed."""
        core = self.core
        wall = time.perf_counter() - self._round_started
        self.closed_at = self._now() if now is None else now
        record = core.close_secure(self.closed_at, wall, why)
        if self.sharding is not None:
            record.update(self.sharding.end_secure())
        return self._secure_record(record, "round")

    def _secure_record(self, record: dict[str, Any], what: str) -> dict[str, Any]:
        """A closed secure round's or cohort's record: its failure logged, a stop noted."""
        failed = record.get("secure", {}).get("failed")
        if failed:
            log.warning("%s %d: secure aggregation failed in phase %s: %s",
                        what, record["round"], failed["phase"], failed["reason"])  # fmt: skip
        if self.stopped is not None:
            record["stopped"] = self.stopped
        return record

    def _from_worker(self, topic: str, payload: bytes) -> None:
        """Sharded ingest: a worker's progress, partial or liveness; the worker is the one its
        topic names (the coordinator checks the message is sealed with that worker's key)."""
        topics = self.topics
        core = self.core
        before = len(core.releases)
        try:
            for kind in ("progress", "partial", "worker"):
                if (worker := topics.device_of(topic, f"ingest/{kind}")) is not None:
                    self.sharding.on_message(kind, worker, payload)  # refusals: counted, logged
                    break
        except Exception:  # a bug of ours must not stop the coordinator either
            log.exception("message from an ingest worker on %s: unexpected error; ignored", topic)
        if self.journal is not None:  # releases reported by workers, as for our own ingest
            for d, r, n in core.releases[before:]:
                self.journal.append("release", d=d, r=int(r), n=int(n))
                self.stats["journaled"] += 1
        for device, data in self.sharding.take_secure():  # keys, shares, unmask answers
            self._secure_in(device, data)
        self._wake.set()

    def _flush(self) -> None:
        """Journal to disk, then acknowledge the messages whose effects it holds."""
        self.commit.flush()

    @property
    def _pending_acks(self) -> list[tuple[int, int]]:
        """Message ids waiting for the next journal sync (tests/test_journal.py appends here)."""
        return self.commit.pending

    def _on_publish(self, topic: str, payload: bytes, mid: int, qos: int, retain: bool) -> None:
        """A message off the wire (from :class:`IngestTap`, or paho for what it leaves to paho):
        dispatched at once; acknowledged by :meth:`_flush` after the journal's fsync, which runs
        once the socket has nothing more buffered (group commit) or after :data:`ACK_BATCH`."""
        if self._ingest_failed is not None and self._ingest_failed.done():
            return  # ingest failed (the journal cannot be written): nothing more is accepted
        try:
            if qos and not self.ack_after_processing and self._paho is not None:
                client_adapter.ack(self._paho, mid, 1)  # the chaos tool's ack-on-receipt
                qos = 0
            if self.vclock is not None and self._vt_hold(topic, payload, mid, qos, retain):
                return
            self._take(topic, payload, mid, qos, retain)
        except Exception as exc:  # handed to the reader task, which raises it
            self._fail(exc)

    def _take(
        self, topic: str, payload: bytes, mid: int, qos: int, retain: bool, acked: bool = False
    ) -> None:
        if self._settled and self.topics.device_of(topic, "up") is not None:
            return  # settled: not taken, not acknowledged (a resume gets it)
        self._ingest(topic, payload, retain)
        if qos > 0 and not acked:
            self.commit.add(mid, qos, self._loop)

    # ---------------------------------------------------------------- virtual time

    def _vt_hold(self, topic: str, payload: bytes, mid: int, qos: int, retain: bool) -> bool:
        """Virtual time: count every live update and status from the fleet's devices and, once
        the clock runs, hold it until the report that covers it (True: held)."""
        vc = self.vclock
        assert vc is not None
        topics = self.topics
        if topics.device_of(topic, "up") is None and topics.device_of(topic, "status") is None:
            return False
        if retain:
            return False  # delivered on subscribing: state left before this run's clock
        vc.received_one()
        self._vt_event.set()
        if not vc.started or self._vt_released is not None:
            return False
        self._vt_held.append((topic, payload, mid, qos, retain))
        if qos > 0:
            # acknowledged now, not after it is journaled: the broker sends a session only so
            # many unacknowledged QoS 1 messages, and the report that releases what is held
            # queues behind them (a deadlock at ~100 statuses in one step). Virtual time does
            # not resume (--resume is refused), so no journal replay depends on the later ack.
            self.commit.add(mid, qos, self._loop)
        return True

    def _vt_take_held(self) -> None:
        """Hand what arrived for the time just reached to the engine: by device, each device's
        own messages in their order (``arrival_order``), never in the order sessions raced."""
        held, self._vt_held = self._vt_held, []

        def device(m: tuple[str, bytes, int, int, bool]) -> str:
            topics = self.topics
            return topics.device_of(m[0], "up") or topics.device_of(m[0], "status") or ""

        for topic, payload, mid, qos, retain in arrival_order(held, device):
            self._take(topic, payload, mid, qos, retain, acked=True)

    def _on_clock(self, payload: bytes) -> None:
        try:
            msg = decode_clock(payload)
        except ClockMessageError as exc:
            log.warning("clock message ignored: %s", exc)
            return
        vc = self.vclock
        if vc is None:
            return
        if msg.kind == "ready" and self._vt_ready is None:
            self._vt_ready = msg
        elif msg.kind == "report":
            cut = msg.ups is not None and len(msg.ups) >= UPS_MAX
            vc.on_report(msg.g, msg.t, msg.next, msg.n, msg.ups, msg.st, cut)
        elif msg.kind == "gone":
            self._vt_gone = True
        self._vt_event.set()

    @property
    def virtual(self) -> bool:
        """Simulated time is virtual and still in lock-step with the fleet."""
        vc = self.vclock
        return vc is not None and vc.started and self._vt_released is None

    def sim_now(self) -> float:
        """The aggregator's time: simulated seconds (virtual time), else the loop's clock."""
        return self._now()

    def _vt_release(self, why: str) -> None:
        """Virtual time ends (a stop, the fleet left): from here on time passes in real
        seconds from the simulated time reached, and what is held is taken."""
        if self.virtual:
            log.info("virtual time ends at %.3f s: %s", self._now(), why)
            self._vt_released = asyncio.get_running_loop().time()
            self._vt_take_held()

    async def _vt_wait(
        self, done: Callable[[], bool], what: str, again: Callable[[], None] | None = None
    ) -> bool:
        """Until ``done()``; False when a stop or the fleet's leaving came first. ``again``:
        called every :data:`VT_RESEND_S` of waiting (the grant is published again)."""
        loop = asyncio.get_running_loop()
        note = loop.time() + VT_NOTE_S
        resend = loop.time() + VT_RESEND_S
        while not done():
            if self.stopped is not None or self._vt_gone:
                return False
            self._vt_event.clear()
            if done():
                break
            wake = min(note, resend) if again is not None else note
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._vt_event.wait(), max(0.0, wake - loop.time()))
            if again is not None and loop.time() >= resend and not done():
                resend = loop.time() + VT_RESEND_S
                self.stats["clock_resent"] += 1
                again()
            if loop.time() >= note:
                note = loop.time() + VT_NOTE_S
                log.warning("virtual time: still waiting for %s", what)
        return True

    async def _vt_start(self) -> None:
        """Virtual time starts when the fleet says ready and every status it counts is here."""
        vc = self.vclock
        if vc is None or vc.started:
            return

        def ready() -> bool:
            r = self._vt_ready
            return r is not None and vc.received >= r.n

        what = (
            f"the fleet to say ready on {self._clock_in} (fleet.clock is virtual: a simulated "
            "fleet keeps the time; devices in real time need --clock wall)"
        )
        if not await self._vt_wait(ready, what):
            if self._vt_gone:
                raise RuntimeError("virtual time: the fleet left before it was ready")
            return
        r = self._vt_ready
        assert r is not None
        vc.start(r.t, r.next, r.n)
        if self._vt_limit_s is not None:
            self._vt_end = r.t + self._vt_limit_s
        log.info("virtual time starts at %.3f s (%d statuses counted)", r.t, r.n)

    async def _vt_step(
        self, deadline: float | None, through: bool = False, arrivals: int | None = None
    ) -> None:
        """One step of virtual time towards ``deadline`` (None: the next event anywhere):
        grant, wait for the fleet's report and everything it counts, move, take it.
        ``through``: straight to ``deadline``; ``arrivals``: no decision changes before that
        many more updates or a status (``AggregatorClock.next_time``)."""
        vc = self.vclock
        client = self._client
        assert vc is not None and vc.now is not None
        own = min(math.inf if deadline is None else deadline, self._vt_end)
        if vc.now >= self._vt_end:
            self.request_stop(f"the simulated time limit ({self._vt_limit_s:g} s)")
            return
        if self._wake.is_set():
            self._wake.clear()
            return
        if not vc.must_exchange() and own <= vc.now:
            return  # already due
        grant = vc.grant(own, through, arrivals)
        if grant is None:
            raise NothingPending(
                f"virtual time {vc.now:.1f} s: nothing is pending on either side (no device "
                "can become available and no deadline is set): nothing more can happen"
            )
        if client is None:
            raise aiomqtt.MqttError("no connection to send the clock grant on")
        msg = ClockMessage("grant", g=grant.g, t=grant.t, n=grant.n).encode()

        def publish() -> None:
            # not awaited (its PUBACK is a broker round trip on every step): the report
            # answers it
            task = asyncio.get_running_loop().create_task(
                client.publish(self._clock_out, msg, qos=1)
            )
            task.add_done_callback(_retrieved)

        publish()
        answered = await self._vt_wait(
            lambda: vc.ready,
            f"the fleet's report for t = {grant.t:.3f} s (grant {grant.g})",
            again=publish,
        )
        if not answered:
            self._vt_release("stopped" if self.stopped is not None else "the fleet left")
            return
        vc.advance()
        self._vt_take_held()
        self._wake.clear()

    def _vt_published(self) -> None:
        if self.virtual:
            assert self.vclock is not None
            self.vclock.published_one()

    def _on_paho_message(self, message: paho.MQTTMessage) -> None:
        """paho's callback, for the packets the tap leaves to paho (and without a tap)."""
        try:
            topic = message.topic
        except UnicodeDecodeError:  # brokers refuse such topics; never dispatchable
            log.warning("message on a topic that is not UTF-8 ignored")
            if message.qos and self._client is not None:
                client_adapter.ack(self._client, message.mid, message.qos)
            return
        payload = message.payload if isinstance(message.payload, bytes | bytearray) else b""
        self._on_publish(topic, bytes(payload), message.mid, message.qos, bool(message.retain))

    def _fail(self, exc: Exception) -> None:
        """Ingest cannot go on (e.g. the journal's disk failed): the reader task raises ``exc``
        and the service stops as it did when the reader itself raised; nothing more is acked."""
        log.error("ingest failed: %s", exc)
        self.commit.failed = True
        if self._ingest_failed is not None and not self._ingest_failed.done():
            self._ingest_failed.set_exception(exc)

    async def _reader(self, client: aiomqtt.Client) -> None:
        """Ends with :class:`aiomqtt.MqttError` when the connection drops, or raises the error
        that stopped ingest. Messages are dispatched by the tap as they are read, not here;
        aiomqtt's queue stays empty (its ``on_message`` is replaced), but is drained anyway."""
        assert self._ingest_failed is not None
        failed = self._ingest_failed

        async def queued() -> None:
            async for message in client.messages:
                payload = message.payload
                data = bytes(payload) if isinstance(payload, bytes | bytearray) else b""
                self._on_publish(str(message.topic), data, message.mid, message.qos,
                                 message.retain)  # fmt: skip

        drain = asyncio.ensure_future(queued())
        try:
            await asyncio.wait({drain, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain.cancel()
        if failed.done():
            failed.result()
        drain.result()

    def _install_tap(self, client: aiomqtt.Client) -> None:
        """Route received PUBLISH packets past aiomqtt's queue: every socket paho opens is
        wrapped in an :class:`IngestTap` before aiomqtt registers it with the event loop."""
        self._paho = client
        client_adapter.manual_acks(client, self._on_paho_message)  # acked in _flush (see above)
        client_adapter.quiet_on_loss(client)  # a lost broker is the one line run() logs
        if self.virtual:  # PUBACKs and grants written as they are queued (BENCHMARKS.md 23)
            client_adapter.write_through(client)
        mqtt5 = client_adapter.is_mqtt5(client)

        def wrap(sock: Any) -> IngestTap:
            tap = IngestTap(sock, self._on_publish, mqtt5=mqtt5)
            self.tap = tap
            return tap

        client_adapter.wrap_sockets(client, wrap)

    async def _publish_global(self, client: aiomqtt.Client) -> None:
        if self._global_payload is None:
            return
        if self.sharding is not None and self.core.current is not None:
            # the workers mirror the round before any device can answer it (same connection,
            # so the broker delivers the open before updates caused by the global message)
            if self._open_control is None or self.sharding.round is None:
                self._open_control = self.sharding.open_message(self._global_payload)
            await client.publish(self.topics.ingest_control, self._open_control, 1, retain=True)
            sr = self.core.secure_round
            if sr is not None and sr.outcome is None and self._masked_by_workers(sr):
                # a reconnect in the masked phase: what the workers missed (a worker drops a
                # copy it has)
                await client.publish(self.topics.ingest_control, self._masked_control(sr), 1)
        await client.publish(self.topics.global_model, self._global_payload, qos=1, retain=True)
        self._vt_published()

    async def _collect_shares(self, client: aiomqtt.Client | None) -> None:
        """Sharded ingest: freeze the round on every worker, then commit it (with what each
        must leave out) and wait for their partials; :meth:`_close` merges what came."""
        sharding = self.sharding
        sr = sharding.round if sharding is not None else None
        if sr is None or client is None or self.core.secure is not None:
            return  # (a secure round's workers are asked only at its masked phase's end)
        await self._freeze_and_commit(client)

    async def _freeze_and_commit(self, client: aiomqtt.Client) -> None:
        """Sharded ingest: freeze the open round on every worker, commit it, and wait for their
        partials (a lost broker: what came is merged)."""
        sharding = self.sharding
        assert sharding is not None and sharding.round is not None
        shard = sharding.round
        control = self.topics.ingest_control
        with contextlib.suppress(aiomqtt.MqttError):
            await client.publish(control, sharding.freeze_message(), qos=1)
            await self._await_workers(shard.unfrozen)
            await client.publish(control, sharding.commit_message(), qos=1)
            await self._await_workers(shard.unmerged)

    def _masked_control(self, sr: SecureRound) -> bytes:
        """Sharded ingest: the ``masked`` control message of the secure round (U2, and the
        seed commitments when devices sign)."""
        commitments = sr.commitments() if self.core.secure.device_key is not None else {}
        if self.core.cohorts is not None:
            return self.sharding.cohort_masked_message(sr.number, sr.forwarded, commitments)
        return self.sharding.masked_message(sr.forwarded, commitments)

    def _wants_masked(self, sr: SecureRound) -> bool:
        """Sharded ingest: whether the workers are still to learn the round's (or cohort's) U2."""
        if self.core.cohorts is not None:
            return bool(self.sharding.cohort_wants_masked(sr.number))
        return bool(self.sharding.wants_masked())

    def _masked_by_workers(self, sr: SecureRound) -> bool:
        """Sharded ingest: the secure round is in its masked phase, which the workers hold."""
        return self.sharding is not None and sr.phase == "masked"

    async def _collect_masked(self, client: aiomqtt.Client, sr: SecureRound) -> str | None:
        """A secure round's masked phase ends (every U2 device's masked input summed by some
        worker, or its deadline): freeze and commit the round on the workers, merge their
        modular partial sums into the session (its unmask requests go out), or return why the
        round fails (a worker's share lost)."""
        sharding = self.sharding
        if sharding.round is not None:
            await self._freeze_and_commit(client)
            deliveries, why = sharding.merge_masked(sr, self._now())
        else:
            deliveries, why = [], "the round's workers were not asked (no sharded round)"
        self._secure_deliver(sr, deliveries)
        return why

    async def _await_workers(self, pending: Callable[[], set[str]]) -> None:
        """Until every worker of the round answered or was lost (went offline), or a timeout."""
        until = self._now() + SHARD_ANSWER_S
        while pending() and self._now() < until:
            await self._sleep_until(until)
        if pending():
            log.error("ingest workers %s did not answer within %.0f s", sorted(pending()),
                      SHARD_ANSWER_S)  # fmt: skip

    async def _wait_for_workers(self) -> None:
        """Sharded ingest: start when every worker is subscribed (else its share of the first
        round would queue in a session nobody reads yet), or after the wait for devices."""
        if self.sharding is None:
            return
        want, online = set(self.sharding.workers), self.sharding.online
        until = self._now() + self.wait_for_devices_s
        while not want <= online and self._now() < until and self.stopped is None:
            await self._sleep_until(until)
        if not want <= online:
            log.warning("ingest workers %s are not online; starting without them",
                        sorted(want - online))  # fmt: skip

    async def _sleep_until(
        self, deadline: float | None, through: bool = False, arrivals: int | None = None
    ) -> None:
        """Wait for a wake-up (update, status, stop) or until ``deadline`` on the loop clock.

        A wake-up that came since the last one was consumed (e.g. a stop signal during the
        global publish, before this sleep began) returns at once: the event is cleared when it
        is consumed, never before waiting, so none is lost; every caller re-checks its state.

        Under virtual time: one step of the clock (``_vt_step``); a stop or the fleet's leaving
        turns virtual time into real time from the simulated time reached; ``through`` and
        ``arrivals``: see ``_vt_step``."""
        if self.virtual:
            if self.stopped is not None or self._vt_gone:
                self._vt_release("stopped" if self.stopped is not None else "the fleet left")
            else:
                await self._vt_step(deadline, through, arrivals)
                return
        timeout = None if deadline is None else max(0.0, deadline - self._now())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        self._wake.clear()

    def _now(self) -> float:
        vc = self.vclock
        if vc is not None and vc.now is not None:
            if self._vt_released is None:
                return vc.now
            return vc.now + (asyncio.get_running_loop().time() - self._vt_released)
        return asyncio.get_running_loop().time()

    # ---------------------------------------------------------------- rounds

    async def _wait_for_devices(self) -> None:
        """Start when every expected device has reported a status and enough are available, or
        after the wait with whoever is there. A retained OFFLINE status may be an earlier run's
        last will (the same job id): it does not count as reported until this run confirms it
        live, so a fleet still connecting is waited for instead of running round 1 short."""
        if self.virtual:
            # between rounds, too few devices available (a night): the next event anywhere,
            # however far in simulated time; the caller tries to open the round again
            await self._sleep_until(None)
            return
        want = self.expected_devices or self.core.settings.n_select
        need = min(want, self.core.settings.n_select)
        if self.core.cohorts is not None:  # secure FedBuff: a cohort of K' opens the job
            need = min(want, self.core.cohorts.size)
        if self.vclock is not None and not self.vclock.started:
            # virtual time about to start: every device's status is what is waited for here;
            # availability (a fleet that starts at night) is waited for in simulated time
            need = 0
        until = self._now() + self.wait_for_devices_s

        def reported() -> int:
            return sum(
                1 for d, r in self.core.devices.items() if r.online or d in self._live_status
            )

        def all_reported() -> bool:
            # O(1) while devices are still missing: a scan of every record on each status that
            # woke this loop was 5% of a 10,000-device simulation's samples (while connecting)
            return len(self.core.devices) >= want and reported() >= want

        log.info(
            "waiting up to %.0fs for %d devices to report on %s%s",
            self.wait_for_devices_s,
            want,
            self.topics.all_status,
            f" (a round needs {need})" if need else " (virtual time starts then)",
        )
        next_note = self._now() + 5.0
        while (
            self.stopped is None
            and self._now() < until
            and (not all_reported() or len(self.core.available()) < need)
        ):
            if all_reported() and len(self.core.available()) >= min(
                need, max(1, self.core.settings.min_updates)
            ):
                break  # everyone reported; fewer are available than we would like: go
            if self._now() >= next_note:
                next_note = self._now() + 5.0
                log.info(
                    "still waiting: %d of %d devices reported, %d available; %.0fs left",
                    reported(),
                    want,
                    len(self.core.available()),
                    until - self._now(),
                )
            await self._sleep_until(min(until, next_note))
        short = len(self.core.available()) < self.core.settings.min_updates
        if self.stopped is None and short and (self.vclock is None or self.vclock.started):
            raise RuntimeError(
                f"only {len(self.core.available())} devices online after "
                f"{self.wait_for_devices_s:.0f}s; a round needs at least "
                f"{self.core.settings.min_updates}"
            )

    async def _await_statuses(self) -> None:
        """A round rebuilt from the journal decides on device availability: first let the
        retained statuses arrive (each device's is delivered on subscribing)."""
        want = self.expected_devices or self.core.settings.n_select
        until = self._now() + min(self.wait_for_devices_s, 10.0)
        while self.stopped is None and len(self.core.devices) < want and self._now() < until:
            await self._sleep_until(until)

    def _commit(self, record: dict[str, Any]) -> None:
        """Make a closed round durable: checkpoint (the commit point, carrying the record), then
        the metrics line, then a fresh journal. Synchronous: nothing is dispatched in between."""
        if self.checkpoint_dir is not None:
            from .checkpoint import save_checkpoint

            seq = self.journal.seq if self.journal is not None else 0
            save_checkpoint(self.core, self.checkpoint_dir, journal_seq=seq, last_record=record)
        self.on_record(record)
        if self.journal is not None:
            self.journal.rotate()
        self._flush()  # whatever the journal held is in the checkpoint: acknowledge it

    def _open_round(self, now: float, paced: bool = True) -> bool:
        """Open the next round and journal it (on disk before any device can see it)."""
        msg = self.core.open_round(now, paced)
        if msg is None:
            return False
        self._global_payload = encode_global(msg, signer=self.signer)
        self._dispatch_payload = None  # the retained one is an earlier window's
        self._open_control = None  # made from this round's global message when published
        if self.journal is not None:
            self.journal.append("open", **self.core.round_spec(self._global_payload))
            self.journal.sync()
        self._round_started = time.perf_counter()
        if self.core.secure is not None:
            self._secure_open()
        self._ack_held()  # async: what the new window did with the updates held for it
        return True

    def _close(self, skipped: bool, now: float | None = None) -> dict[str, Any]:
        """Close the open round and commit it; the job's last round is settled first."""
        record = self._close_round(skipped, now)
        if self.core.finished:
            self._settle(record)
        self._commit(record)
        return record

    def _settle(self, record: dict[str, Any]) -> None:
        """No update is taken from now on; the last record carries the ledger's final total."""
        self._settled = True
        self.core.settle(record)

    async def _drain(self) -> None:
        """After the last round: keep listening while devices asked for an update may still
        send it (at most one deadline). Each is a release, charged as it arrives; the done
        marker, published after this, stops the devices, so nothing is released unseen."""
        core = self.core
        until = self._now() + core.settings.deadline_s
        waiting = core.outstanding()
        if waiting:
            log.info("last round closed: waiting up to %.0fs for %d devices still training",
                     until - self._now(), len(waiting))  # fmt: skip
        while core.outstanding() and self._now() < until and self.stopped is None:
            await self._sleep_until(until)
        if core.outstanding():
            log.warning("the job ends while %d devices may still be training: what they send "
                        "now is not charged", len(core.outstanding()))  # fmt: skip

    def _close_round(self, skipped: bool, now: float | None = None) -> dict[str, Any]:
        """Close the open round (merging the workers' shares) and return its record, not yet
        committed."""
        core = self.core
        wall = time.perf_counter() - self._round_started
        shards: dict[str, Any] = {}
        if self.sharding is not None and self.sharding.round is None:
            shards = self.sharding.charge_lost_before_resume()
        elif self.sharding is not None:
            shards = self.sharding.merge()
            rnd = core.current
            if not skipped and rnd is not None and rnd.count < max(rnd.min_updates, 1):
                skipped = True  # a lost share took it below its minimum
        self.closed_at = self._now() if now is None else now
        record = core.close_round(self.closed_at, wall, skipped=skipped)
        record.update(shards)
        if self.stopped is not None:
            record["stopped"] = self.stopped
        return record

    def _decide_on_stop(self, commit: bool = True) -> dict[str, Any] | None:
        """Close the open round if it has what it needs (its minimum, and at least one update),
        else record it skipped; then the job ends. ``commit=False``: the record is settled and
        committed by the caller, after it charged what was already on its way."""
        core = self.core
        record = None
        rnd = core.current
        core.ended_early = f"stopped by {self.stopped}"  # first: closing knows it is the last
        cohorts = core.cohorts
        if cohorts is not None:  # secure FedBuff: every open cohort skipped, with its record
            why = f"stopped by {self.stopped}"
            for cohort in [*cohorts.abandoned, *cohorts.open_cohorts()]:
                record = self._close_cohort(cohort, why=why)
                if commit:
                    if core.finished:
                        self._settle(record)
                    self._commit(record)
        elif rnd is not None and self.core.secure is not None:
            record = self._secure_close(why=f"stopped by {self.stopped}")
            if commit:
                if core.finished:
                    self._settle(record)
                self._commit(record)
        elif rnd is not None:
            enough = rnd.count >= max(rnd.min_updates, 1)
            record = self._close(skipped=not enough) if commit else self._close_round(not enough)
            log.warning(
                "round %d %s on %s with %d updates",
                record["round"],
                record["status"],
                self.stopped,
                rnd.count,
            )
        else:  # between async windows: what waits for one is released all the same
            core.charge_held()
        return record

    async def _end_on_stop(self, client: aiomqtt.Client) -> None:
        """A stop: tell the devices the job ended now (they stop training and releasing), then
        charge what they had already sent: listen until every device the last round asked has
        answered or left (its offline status comes after its update on its own connection), for
        at most :data:`STOP_GRACE_S`. A lost broker ends the wait; the record is still committed."""
        with contextlib.suppress(aiomqtt.MqttError):
            await self._publish_done(client)
            until = self._now() + STOP_GRACE_S
            while self._in_flight() and self._now() < until:
                await self._sleep_until(until)
            if self._in_flight():
                log.warning(
                    "stopped while %d devices may still be sending: what they send now is not "
                    "charged",
                    len(self._in_flight()),
                )

    def _in_flight(self) -> frozenset[str]:
        """Devices that may have released an update the ledger has not seen yet: those the last
        round asked (under Poisson selection every available device: the coins are secret)."""
        core = self.core
        if core.secure is not None:  # a masked input after its round is unreadable: no release
            return frozenset()
        if core.settings.sample_rate is not None:
            return frozenset(core.available())
        return core.outstanding()

    async def _publish_done(self, client: aiomqtt.Client) -> None:
        """The done marker (retained, signed like every global message), once."""
        if self.done_published:
            return
        final = self.core.global_message(done=True)
        await client.publish(
            self.topics.global_model, encode_global(final, signer=self.signer), 1, retain=True
        )
        self.done_published = True

    async def _publish_record(self, client: aiomqtt.Client | None, record: dict) -> None:
        if client is None:
            return
        public = self.core.public_record(record)
        with contextlib.suppress(aiomqtt.MqttError):
            await client.publish(self.topics.metrics, json.dumps(public, default=str), qos=0)

    # ---------------------------------------------------------------- secure FedBuff cohorts

    def _open_cohorts(self) -> int:
        """Dispatch cohorts while there is room (``CohortPolicy.can_open``) and devices; each
        journaled (on disk) before its global message can reach a device. How many opened."""
        core = self.core
        cohorts = core.cohorts
        assert cohorts is not None
        cohorts.observer = self.secure_observer
        opened = 0
        while self.stopped is None and (made := core.open_cohort(self._now())) is not None:
            cohort, msg = made
            payload = encode_global(msg, signer=self.signer)
            if self.journal is not None:
                self.journal.append("cohort", **cohorts.cohort_record(cohort))
                self.journal.sync()
            self._global_payload = payload
            control = None
            if self.sharding is not None:  # the workers learn the cohort before its devices
                control = self.sharding.open_cohort_message(cohort.number, payload)
            self._cohort_payloads.append((control, payload))
            opened += 1
        return opened

    async def _publish_cohorts(self, client: aiomqtt.Client) -> None:
        """The global messages of the cohorts just dispatched, in order (retained: the newest
        stays on the topic; every device reads each live)."""
        core = self.core
        while self._cohort_payloads:
            control, payload = self._cohort_payloads.pop(0)
            if control is not None:  # same connection: the broker delivers it first
                await client.publish(self.topics.ingest_control, control, 1, retain=True)
            await client.publish(self.topics.global_model, payload, qos=1, retain=True)
            self._vt_published()  # virtual time: the fleet counts each cohort's model
            core.tally.bytes_down += len(payload) * core.online_count

    def _close_cohort(self, cohort: Any, why: str | None = None) -> dict[str, Any]:
        """A cohort's record (its sum applied, or skipped), not yet committed."""
        core = self.core
        started = self._cohort_started.pop(cohort.number, time.perf_counter())
        self.closed_at = self._now()
        record = core.close_cohort(cohort, self.closed_at, time.perf_counter() - started, why)
        if self.sharding is not None:
            record.update(self.sharding.end_cohort(cohort.number))
        return self._secure_record(record, "cohort")

    async def _collect_cohort(self, client: aiomqtt.Client, cohort: Any) -> str | None:
        """Sharded ingest: a cohort's masked phase ends (every U2 device's masked input summed
        by some worker, or its deadline): freeze and commit the cohort on the workers, merge
        their modular partial sums into its session (its unmask requests go out), or return why
        the cohort fails (a worker's share lost), as :meth:`_collect_masked` for a sync round."""
        sharding, sr, number = self.sharding, cohort.session, cohort.number
        shard = sharding.cohort_rounds.get(number)
        if shard is not None:
            control = self.topics.ingest_control
            with contextlib.suppress(aiomqtt.MqttError):
                await client.publish(control, sharding.cohort_freeze_message(number), qos=1)
                await self._await_workers(shard.unfrozen)
                await client.publish(control, sharding.cohort_commit_message(number), qos=1)
                await self._await_workers(shard.unmerged)
        deliveries, why = sharding.merge_cohort(number, sr, self._now())
        self._secure_deliver(sr, deliveries)
        return why

    async def _commit_cohort(self, client: aiomqtt.Client, record: dict[str, Any]) -> None:
        if self.core.finished:
            self._settle(record)
        self._commit(record)
        await self._publish_record(client, record)

    async def _close_abandoned(self, client: aiomqtt.Client) -> None:
        """Resumed: the cohorts that were open when the process died are skipped (their
        sessions died with it; a new cohort has a new nonce), each with its record."""
        cohorts = self.core.cohorts
        if cohorts is None or not cohorts.abandoned:
            return
        await self._await_statuses()
        for cohort in list(cohorts.abandoned):
            self._charge_lost_to_restart(cohort.number, cohort.handed_to_workers, "cohort")
            record = self._close_cohort(cohort, why="the aggregator restarted mid-cohort")
            await self._commit_cohort(client, record)

    def _hand_to_workers(self, sr: SecureRound) -> None:
        """Before the workers learn a secure round's U2 (from then on they may charge its masked
        inputs, and their charges reach only this process's journal through their progress
        reports): U2 is journaled, and kept with an open cohort for its checkpoint."""
        if self.journal is not None:
            self.journal.append("masked", r=sr.number, u=sorted(sr.forwarded))
            self.journal.sync()
        cohorts = self.core.cohorts
        cohort = cohorts.by_number(sr.number) if cohorts is not None else None
        if cohort is not None:
            cohort.handed_to_workers = sr.forwarded

    def _charge_lost_to_restart(self, number: int, handed: Any, what: str) -> None:
        """Sharded ingest, resumed: the dead process's workers may have charged masked inputs of
        this round (or cohort) and acknowledged them, but the charges reached only that
        process's journal through their progress reports, which this process cannot verify (a
        new run secret). So every device of the U2 they were handed (``handed``; none if they
        never were: no masked input could reach them) not yet charged for it is charged: over-
        rather than under-counted, as when a worker is lost."""
        core = self.core
        if self.sharding is None:
            return  # one process: every charge was journaled before its mx was acknowledged
        charged = 0
        for device in sorted(handed):
            if not core.is_released(device, number):
                core.record_release(device, number, SECURE_RELEASE)
                if self.journal is not None:
                    self.journal.append("release", d=device, r=number, n=SECURE_RELEASE)
                charged += 1
        if charged:
            if self.journal is not None:
                self.journal.sync()
            log.error("%s %d was open when the aggregator restarted with ingest workers: the "
                      "charges its workers held are lost, so %d devices of its U2 are charged",
                      what, number, charged)  # fmt: skip

    async def _run_cohorts(self, client: aiomqtt.Client) -> None:
        """Secure FedBuff: keep cohorts in flight, end each one's phases on its answers or
        deadlines, and close it (one record, one buffer) when its session ends."""
        core = self.core
        cohorts = core.cohorts
        assert cohorts is not None
        while not core.finished:
            if self.stopped is not None:
                core.ended_early = f"stopped by {self.stopped}"
                records = [self._close_cohort(c, why=f"stopped by {self.stopped}")
                           for c in cohorts.open_cohorts()]  # fmt: skip
                await self._end_on_stop(client)
                for record in records:
                    await self._commit_cohort(client, record)
                break
            now = self._now()
            for cohort in cohorts.open_cohorts():
                sr = cohort.session
                if sr is None or sr.outcome is not None:
                    continue
                if self._masked_by_workers(sr):
                    # sharded: the workers hold the masked inputs; ends on all U2 or deadline
                    done = self.sharding.cohort_masked_complete(cohort.number, sr.forwarded)
                    if now < sr.deadline and not done:
                        continue
                    why = await self._collect_cohort(client, cohort)
                    if why is not None:  # a worker's share lost: the cohort fails
                        await self._commit_cohort(client, self._close_cohort(cohort, why=why))
                    now = self._now()
                else:
                    self._shorten_if_gone(sr)
                    if now >= sr.deadline:
                        self._secure_deliver(sr, sr.tick(now))
            for cohort in cohorts.finished_cohorts():
                await self._commit_cohort(client, self._close_cohort(cohort))
            if core.finished:
                break
            if self._open_cohorts():
                for cohort in cohorts.open_cohorts():
                    self._cohort_started.setdefault(cohort.number, time.perf_counter())
                await self._publish_cohorts(client)
                continue
            if not cohorts.cohorts:  # nothing in flight and none could open
                if not cohorts.can_open():
                    break  # (ended early: every record is written)
                reason = core.hopeless()
                if reason is not None:
                    log.warning("ending the job after cohort %d: %s", core.round_number, reason)
                    core.ended_early = reason
                    break
                await self._wait_for_devices()
                continue
            await self._sleep_until(core.deadline)

    async def _run_rounds(self, client: aiomqtt.Client) -> None:
        core = self.core
        if core.cohorts is not None:
            await self._run_cohorts(client)
            return
        while not core.finished:
            if self.stopped is not None:
                await self._collect_shares(client)
                if core.current is None and core.records:
                    # between rounds (async: windows): releases still arrive (held updates,
                    # answers on their way); a round opened for the record, never published,
                    # is decided now and carries the final ledger, so the last metrics line
                    # agrees with the summary
                    self._open_round(self._now(), paced=False)
                record = self._decide_on_stop(commit=False)
                await self._end_on_stop(client)
                if record is not None:
                    self._settle(record)
                    self._commit(record)
                    await self._publish_record(client, record)
                break
            if core.current is None:
                if self._now() < core.opens_at():
                    # the round period: no round is open and nothing decides before the next
                    # opening (statuses only update availability, a late update is charged
                    # whenever it is taken), so virtual time goes there in one step
                    await self._sleep_until(core.opens_at(), through=True)
                    continue
                if not self._open_round(self._now()):
                    reason = core.hopeless()
                    if reason is None and self._vt_gone:
                        # the simulated fleet was the only source of devices and it left: no
                        # device can answer in any time (waiting here would spin)
                        reason = "the simulated fleet left (virtual time)"
                    if reason is not None:
                        log.warning("ending the job after round %d: %s", core.round_number, reason)
                        core.ended_early = reason
                        break
                    await self._wait_for_devices()
                    continue
                await self._publish_global(client)
                payload = self._global_payload
                assert payload is not None  # _open_round encoded it
                # every online device receives the retained broadcast
                core.tally.bytes_down += len(payload) * core.online_count
            sr = core.secure_round
            if sr is not None:  # a SecAgg+ round: phases end on answers or their deadline
                why = None
                if sr.outcome is None and self._masked_by_workers(sr):
                    # sharded: the workers hold the masked inputs; ends on all U2 or deadline
                    if self._now() < sr.deadline and not self.sharding.masked_complete(
                        sr.forwarded
                    ):
                        await self._sleep_until(sr.deadline)
                        continue
                    why = await self._collect_masked(client, sr)
                if sr.outcome is None and why is None:
                    self._shorten_if_gone(sr)
                    if self._now() >= sr.deadline:
                        self._secure_deliver(sr, sr.tick(self._now()))
                        continue
                    await self._sleep_until(sr.deadline)
                    continue
                record = self._secure_close(why=why)
                if core.finished:
                    self._settle(record)
                self._commit(record)
                await self._publish_record(client, record)
                continue
            decision = core.decide(self._now())
            if decision in (Decision.WAIT, Decision.EXTEND):
                await self._send_replacements(client)
            if decision in (Decision.CLOSE, Decision.SKIP) and self._early(core):
                now = self._now()
                if self._settle_until is None:
                    self._settle_until = max(now + STATUS_SETTLE_S, self._grace_until)
                if now < self._settle_until:
                    await self._sleep_until(min(self._settle_until, core.deadline or math.inf))
                    continue
            self._settle_until = None
            if decision in (Decision.WAIT, Decision.EXTEND):
                if decision is Decision.EXTEND:
                    log.info("round %d short of updates; deadline extended", core.round_number)
                await self._sleep_until(core.deadline, arrivals=core.arrivals_to_decide())
                continue
            await self._collect_shares(client)
            record = self._close_round(skipped=decision is Decision.SKIP)
            if core.finished:  # the job's last round: charge what is still on its way first
                if self.sharding is None and core.secure is None:
                    await self._drain()
                if self.stopped is not None:  # during the drain: what is in flight, at once
                    await self._end_on_stop(client)
                self._settle(record)
            self._commit(record)
            await self._publish_record(client, record)

    async def _send_replacements(self, client: aiomqtt.Client) -> None:
        """Async with a concurrency limit: publish the devices chosen to replace those that
        answered, timed out or left, so C keep training while a window fills, as a dispatch
        message (the version, its nonce, the devices; not the model, which every device got
        with the window). Journaled (and on disk) before any device can see it, like a round's
        opening; retained, so a device that reconnects finds it beside the model."""
        msg = self.core.dispatch(self._now())
        if msg is None:
            return
        payload = encode_dispatch(Dispatch.of(msg), signer=self.signer)
        if self.journal is not None:
            self.journal.append("dispatch", v=msg.version, sel=list(msg.selected or ()), d=payload)
            self.journal.sync()
        self._dispatch_payload = payload
        await client.publish(self.topics.dispatch, payload, qos=1, retain=True)
        self._vt_published()
        self.core.tally.bytes_down += len(payload) * self.core.online_count

    def _early(self, core: AggregatorCore) -> bool:
        """The round could end before its target and deadline: only on device statuses."""
        rnd = core.current
        return rnd is not None and rnd.count < rnd.target and self._now() < rnd.deadline

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            if self.on_finish is not None:
                self.on_finish()

    async def _session(self) -> None:
        client = aiomqtt.Client(
            **self.spec.aiomqtt_kwargs(),
            identifier=self.client_id,
            clean_session=False,
            max_inflight_messages=100,
        )
        # a secure round's phase sends one QoS 1 message to every selected device's inbox at
        # once: hundreds in flight are the protocol working, not a stuck client (aiomqtt warns
        # on every publish beyond 10)
        client.pending_calls_threshold = 1 << 30
        self._install_tap(client)
        self._loop = asyncio.get_running_loop()
        self._ingest_failed = self._loop.create_future()
        self.commit.forget()  # message ids of an earlier connection mean nothing now
        self.commit.acknowledge = self.ack_after_processing
        async with client:
            self._client = client
            self.commit.acker = lambda mid, qos: client_adapter.ack(client, mid, qos)
            self._flush()  # what arrived while connecting (the persistent session's queue)
            self._settle_until = None
            if self._ever_connected:  # a reconnect: the devices' statuses are stale for a while
                if self.vclock is not None and self.vclock.started:
                    raise RuntimeError(
                        "virtual time cannot continue after the broker was lost: messages "
                        "counted by the clock may be gone (run the simulation again)"
                    )
                self._grace_until = self._now() + RECONNECT_SETTLE_S
            if self.core.round_number == 0 and self.core.current is None:
                # forget the retained model of an earlier run of this job id
                await client.publish(self.topics.global_model, b"", qos=1, retain=True)
                if self.core.settings.mode != "sync":  # and its last dispatch
                    await client.publish(self.topics.dispatch, b"", qos=1, retain=True)
                if self.sharding is not None:  # and its last round's open, for the workers
                    await client.publish(self.topics.ingest_control, b"", qos=1, retain=True)
            # each round's model is published right after the last round's record and waits
            # for its PUBACK: with Nagle on, that publish waited for the broker's delayed ACK
            # (40 ms of every round of the default job); under virtual time every step is such
            # a round trip
            client_adapter.no_delay(client)
            if self.vclock is not None:
                await client.subscribe(self._clock_in, qos=1)
            await client.subscribe(self.topics.all_status, qos=1)
            if self.sharding is None:
                await client.subscribe(self.topics.all_updates, qos=1)
            else:  # the workers take the updates; their answers and liveness come here
                for kind in ("progress", "partial", "worker"):
                    await client.subscribe(self.topics.all_ingest(kind), qos=1)
            # after the subscriptions: a fleet under virtual time waits for the document, so
            # every status it publishes reaches this session live (and is counted)
            if self.job_document is not None and not self.core.finished:
                await client.publish(
                    self.topics.job_document, self.job_document, qos=1, retain=True
                )
            self.connected.set()
            self._ever_connected = True
            self._attempt = 0
            reader = asyncio.create_task(self._reader(client))
            runner: asyncio.Task | None = None
            try:
                await self._close_abandoned(client)  # secure FedBuff, resumed
                if self.core.current is not None and self._resumed_round and self.core.secure:
                    # a secure round is never resumed: its session (the shares' state, the
                    # running sum) died with the process; skip it, a new round has a new nonce
                    self._resumed_round = False
                    await self._await_statuses()
                    number = self.core.current.number
                    handed = self.core.handed_to_workers.pop(number, frozenset())
                    self._charge_lost_to_restart(number, handed, "secure round")
                    record = self._secure_close(why="the aggregator restarted mid-round")
                    if self.core.finished:
                        self._settle(record)
                    self._commit(record)
                    await self._publish_record(client, record)
                if self.core.current is not None:  # reconnected or resumed mid-round
                    resumed = self._resumed_round
                    if resumed:
                        self._resumed_round = False
                        if self.sharding is not None:
                            # the workers of the process that died held this round's shares
                            self.sharding.lost_before_resume = True
                            await self._wait_for_workers()  # devices re-send when it reappears
                        await self._await_statuses()
                        self.core.current.opened_at = self._now()  # a fresh deadline
                        self._round_started = time.perf_counter()
                    if self._global_payload is None:
                        self._global_payload = encode_global(
                            self.core.open_message(), signer=self.signer
                        )
                    if self.stopped is None:
                        await self._publish_global(client)
                        if self._dispatch_payload is not None:  # after its model
                            await client.publish(
                                self.topics.dispatch, self._dispatch_payload, qos=1, retain=True
                            )
                        if resumed:  # the round's tally restarted with this process
                            payload = self._global_payload or b""
                            self.core.tally.bytes_down += len(payload) * self.core.online_count
                elif not self.core.finished:
                    await self._wait_for_workers()
                    await self._wait_for_devices()
                    await self._vt_start()
                runner = asyncio.create_task(self._run_rounds(client))
                done, _ = await asyncio.wait({reader, runner}, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # re-raise a reader MqttError or a round error
                self._flush()
                self._finish()  # summary and model on disk before devices hear the job ended
                await self._publish_done(client)  # (a stop published it first)
                if self.sharding is not None:  # the workers' job is over too
                    # retained (it replaces the last open): a worker that reconnects or
                    # starts after this learns the end too; a new run clears it first
                    end = self.sharding.end_message()
                    await client.publish(self.topics.ingest_control, end, qos=1, retain=True)
                if self.job_document is not None:  # the job ended: no device should join it
                    await client.publish(self.topics.job_document, b"", qos=1, retain=True)
            finally:
                reader.cancel()
                if runner is not None:
                    runner.cancel()
                self._client = None
                self.commit.acker = None

    async def _backoff(self, delay: float) -> None:
        """Sleep before reconnecting; a stop request ends the wait."""
        if self.stopped is None:
            await self._sleep_until(self._now() + delay)

    async def run(self) -> list[dict[str, Any]]:
        """Run all rounds; reconnect on broker loss with exponential backoff."""
        self._attempt = 0
        if self.signals is not None:
            self.signals.attach(asyncio.get_running_loop(), self.request_stop)
        try:
            while True:
                try:
                    await self._session()
                    return self.core.records
                except aiomqtt.MqttError as exc:
                    self.connected.clear()
                    self._attempt += 1
                    attempt = self._attempt
                    if self.vclock is not None and self._vt_released is None:
                        # the fleet's clock session went with the broker and is not re-opened:
                        # virtual time could not move again (a reconnect waited forever, or
                        # its backoff, in virtual time, failed with a traceback)
                        self.broker_lost = True
                        log.warning(
                            "lost the broker %s under virtual time (%s): the fleet's clock "
                            "session went with it, so the job stops here",
                            self.spec.redacted(),
                            exc,
                        )
                        self.request_stop("losing the broker under virtual time")
                    if self.stopped is not None:
                        return self._stop_offline(exc)
                    if not self._ever_connected and attempt > min(3, self.reconnect_attempts):
                        # never reached it: a wrong URL or a stopped broker, not a blip
                        raise BrokerUnavailable(
                            f"cannot reach the broker at {self.spec.redacted()}: {exc} (is it "
                            "running, and is the URL right?)"
                        ) from exc
                    if attempt > self.reconnect_attempts:
                        raise BrokerUnavailable(
                            f"lost the broker at {self.spec.redacted()} and could not reconnect "
                            f"after {self.reconnect_attempts} attempts: {exc}"
                        ) from exc
                    delay = min(0.2 * 2**attempt, 10.0)
                    # one line per outage: the first failure says it, the retries are debug
                    log.log(
                        logging.WARNING if attempt == 1 else logging.DEBUG,
                        "broker %s unavailable (%s); reconnecting in %.1fs (attempt %d/%d)",
                        self.spec.redacted(),
                        exc,
                        delay,
                        attempt,
                        self.reconnect_attempts,
                    )
                    await self._backoff(delay)
                    if self.stopped is not None:
                        return self._stop_offline(exc)
        finally:
            if self.signals is not None:
                self.signals.detach()
            self.commit.close()

    def _stop_offline(self, exc: Exception) -> list[dict[str, Any]]:
        """Asked to stop while the broker is away: commit and finish; devices cannot be told."""
        if not self.core.finished:
            self._decide_on_stop()
        self._finish()
        log.warning(
            "stopped while the broker %s is unreachable (%s): the done marker was not published",
            self.spec.redacted(),
            exc,
        )
        return self.core.records


def _signed_by(payload: bytes, signer: Any) -> bool:
    """Whether a journaled global message verifies under ``signer``'s key (True unsigned)."""
    if signer is None:
        return True
    try:
        decode_global(payload, verifier=signer.verifier)
    except PayloadRejected:
        return False
    return True
