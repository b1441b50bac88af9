"""The aggregator service: the core's I/O edge over aiomqtt (connection) and paho (packets).

Ingest: aiomqtt connects, subscribes and publishes; received PUBLISH packets do not go through
its queue: an :class:`IngestTap` on paho's socket parses them from large reads and the service
dispatches each into the core at once (``on_update``/``on_status``), then acknowledges a group of
them after one journal fsync (BENCHMARKS.md, ``tools/bench_ingest.py``).

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

Clean stop: :meth:`request_stop` (SIGTERM/SIGINT through :class:`StopSignals`) stops accepting,
closes the open round if it has what it needs (else records it skipped), commits it, runs
``on_finish`` (summary, model) and publishes the done marker, so devices see the end of the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import math
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiomqtt

from edge_fl.protocol import Reject, Topics, ack_for, encode_ack, encode_global
from edge_fl.transport import client_adapter
from edge_fl.transport.url import BrokerSpec

from .aggregator import AggregatorCore
from .rounds import Decision

if TYPE_CHECKING:
    import paho.mqtt.client as paho

log = logging.getLogger("edge_fl.aggregator")

RecordCallback = Callable[[dict[str, Any]], None]

#: at most this many received messages wait for one journal fsync before their acknowledgements
ACK_BATCH = 256
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


class BrokerUnavailable(RuntimeError):
    """The broker could not be reached within the retry budget."""


#: PUBLISH packet type (MQTT 3.1.1 section 2.2.1)
_PUBLISH = 0x30
#: bytes read from the socket per system call (paho reads a packet in 3-5 small reads)
TAP_CHUNK = 1 << 18
#: at most this many bytes are read and dispatched per call of the tap before paho runs again
TAP_BURST = 1 << 20

PublishHandler = Callable[[str, bytes, int, int, bool], None]


class IngestTap:
    """paho's socket, read in large chunks, with PUBLISH packets handed straight to a handler.

    Why: paho reads a packet in 3-5 ``recv`` calls and builds an ``MQTTMessage``, and aiomqtt
    then converts it, queues it and wakes a task for it: that plumbing cost more than decoding,
    validating and folding the update (BENCHMARKS.md). The tap reads up to :data:`TAP_CHUNK`
    bytes per call, parses each PUBLISH (QoS 0 or 1) itself and calls
    ``handler(topic, payload, mid, qos, retain)``; every other packet (CONNACK, SUBACK, PUBACK
    of our publishes, PINGRESP, a QoS 2 PUBLISH, a topic that is not UTF-8) goes to paho
    unchanged, in stream order: parsing pauses until paho has read it. paho still writes
    everything, acknowledges nothing by itself (manual acks) and keeps the connection state.

    ``pending()`` says whether a complete packet waits in the buffer, which aiomqtt's reader
    asks (as it does of a TLS socket) to call ``loop_read`` again before waiting on the socket.
    """

    def __init__(self, sock: Any, handler: PublishHandler, mqtt5: bool = False) -> None:
        self._sock = sock
        self._handler = handler
        self._mqtt5 = mqtt5
        self._buf = bytearray()  # read, not yet parsed
        self._out = bytearray()  # a packet for paho, not yet read by it
        self._eof = False
        self.diverted = 0  # PUBLISH packets handed to the handler
        self.passed = 0  # packets left to paho

    def __getattr__(self, name: str) -> Any:  # send, fileno, close, setblocking, ...
        return getattr(self._sock, name)

    def recv(self, n: int) -> bytes:
        if not self._out:
            self._fill()
        if self._out:
            chunk = bytes(self._out[:n])
            del self._out[:n]
            return chunk
        if self._eof:
            return b""  # paho: connection lost
        raise BlockingIOError(errno.EAGAIN, "no complete packet for paho yet")

    def pending(self) -> int:
        """Bytes that can be read without waiting on the socket (0 unless a whole packet)."""
        inner = getattr(self._sock, "pending", None)
        more = inner() if inner is not None else 0
        return len(self._out) + (1 if self._frame_end() is not None else 0) + more

    def _frame_end(self) -> tuple[int, int] | None:
        """(offset of the variable header, end) of the first buffered packet, if complete."""
        buf = self._buf
        length, mult, i = 0, 1, 1
        while True:
            if i >= len(buf):
                return None
            byte = buf[i]
            length += (byte & 0x7F) * mult
            i += 1
            if not byte & 0x80:
                break
            mult *= 128
            if i > 4:  # malformed: let paho see it and drop the connection
                return 1, len(buf)
        end = i + length
        return (i, end) if end <= len(buf) else None

    def _fill(self) -> None:
        """Parse buffered packets, reading the socket as needed, until one is for paho, the
        socket has nothing more or :data:`TAP_BURST` bytes were read."""
        read = 0
        while not self._out:
            frame = self._frame_end()
            if frame is None:
                if self._eof or read >= TAP_BURST:
                    return
                try:
                    data = self._sock.recv(TAP_CHUNK)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:  # TLS want-read/want-write and errors: paho handles them
                    if read:
                        return
                    raise
                if not data:
                    self._eof = True
                    return
                read += len(data)
                self._buf += data
                continue
            start, end = frame
            if not self._divert(start, end):
                self._out += self._buf[:end]
                self.passed += 1
            del self._buf[:end]

    def _divert(self, start: int, end: int) -> bool:
        """Hand a QoS 0/1 PUBLISH packet to the handler; False: paho reads it."""
        buf = self._buf
        cmd = buf[0]
        qos = (cmd >> 1) & 3
        if cmd & 0xF0 != _PUBLISH or qos > 1 or end - start < 2:
            return False
        tlen = (buf[start] << 8) | buf[start + 1]
        if tlen == 0:  # an MQTT 5 topic alias: paho resolves it
            return False
        i = start + 2 + tlen
        mid = 0
        if qos:
            if i + 2 > end:
                return False
            mid = (buf[i] << 8) | buf[i + 1]
            i += 2
        if self._mqtt5:  # skip the properties (variable byte integer length, then that many)
            plen, mult = 0, 1
            while i < end:
                byte = buf[i]
                i += 1
                plen += (byte & 0x7F) * mult
                mult *= 128
                if not byte & 0x80:
                    break
            i += plen
        if i > end:
            return False
        try:
            topic = buf[start + 2 : start + 2 + tlen].decode("utf-8")
        except UnicodeDecodeError:
            return False
        self.diverted += 1
        self._handler(topic, bytes(buf[i:end]), mid, qos, bool(cmd & 1))
        return True


class StopSignals:
    """SIGTERM and SIGINT as a clean-stop request, from process start to the end of the job.

    ``install()`` (before the event loop runs) only remembers a signal; ``attach(loop, stop)``
    hands it, and every later one, to ``stop(name)`` on the loop; ``restore()`` puts the previous
    handlers back. A second signal while stopping changes nothing: the stop is already bounded."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> StopSignals:
        for sig in self.SIGNALS:
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                self._previous[sig] = signal.signal(sig, self._remember)
        return self

    def _remember(self, signum: int, _frame: Any) -> None:
        self.received = self.received or signal.Signals(signum).name

    def attach(self, loop: asyncio.AbstractEventLoop, stop: Callable[[str], None]) -> None:
        def fire(sig: signal.Signals) -> None:
            self.received = self.received or sig.name
            stop(sig.name)

        for sig in self.SIGNALS:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(sig, fire, sig)
        self._loop = loop
        if self.received is not None:  # it came before the loop ran
            loop.call_soon(stop, self.received)

    def detach(self) -> None:
        if self._loop is not None:
            for sig in self.SIGNALS:
                with contextlib.suppress(Exception):
                    self._loop.remove_signal_handler(sig)
            self._loop = None
        for sig in self.SIGNALS:  # remove_signal_handler left SIG_DFL: keep remembering
            if sig in self._previous:
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(sig, self._remember)

    def restore(self) -> None:
        self.detach()
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, handler)
        self._previous.clear()


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
    ) -> None:
        self.sharding = sharding
        self._open_control: bytes | None = None  # the open round's message to the workers
        self.signer = signer
        self.job_document = job_document
        self.acks = acks
        self._acks_sent: Counter = Counter()  # per device in the current round (capped)
        self._acks_round = -1
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
        self._global_payload: bytes | None = resumed_payload
        self._client: aiomqtt.Client | None = None
        self._round_started = 0.0
        self._settle_until: float | None = None
        self._grace_until = 0.0  # after a reconnect: no early close on statuses before this
        self._pending_acks: list[tuple[int, int]] = []
        self._flush_handle: asyncio.Handle | None = None
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

    #: replies per device and round at most: a flooding device gets its reason, not a flood back
    MAX_ACKS_PER_ROUND = 5

    def _ack(self, device: str, reason: Reject | str | None) -> None:
        """Tell the device whether its update was accepted, and why not (docs/protocol.md, Ack).
        Fire and forget (QoS 1, not retained): ingest never waits for it."""
        if self.acks == "off" or (reason is None and self.acks != "all") or self._client is None:
            return
        if device not in self.core.devices:
            return  # never announced itself: no reply (a flood of strangers gets no flood back)
        if self.core.round_number != self._acks_round:
            self._acks_round, self._acks_sent = self.core.round_number, Counter()
        self._acks_sent[device] += 1
        if self._acks_sent[device] > self.MAX_ACKS_PER_ROUND:
            return
        rejection = self.core.last_rejection if reason is not None else None
        detail = rejection.detail if rejection is not None and rejection.reason == reason else None
        rnd = getattr(rejection, "round", None) if detail is not None else None
        payload = encode_ack(ack_for(device, reason, detail, rnd))
        client = self._client
        task = asyncio.get_running_loop().create_task(
            client.publish(self.topics.ack(device), payload, qos=1)
        )
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    def _dispatch(self, message: Any) -> None:
        """One received message (anything with ``topic``, ``payload`` and ``retain``)."""
        payload = message.payload if isinstance(message.payload, bytes | bytearray) else b""
        self._ingest(str(message.topic), payload, bool(message.retain))

    def _ingest(self, topic: str, payload: bytes | bytearray, retain: bool) -> None:
        if (device := self.topics.device_of(topic, "up")) is not None:
            core = self.core
            before = len(core.releases)
            reason = core.on_update(device, bytes(payload))
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
            self._ack(device, reason)
        elif (device := self.topics.device_of(topic, "status")) is not None:
            self.core.on_status(device, bytes(payload))
            if not retain:
                self._live_status.add(device)  # said during this run, not left by an earlier one
            self._wake.set()
        elif self.sharding is not None:
            self._from_worker(topic, bytes(payload))

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
        self._wake.set()

    def _flush(self) -> None:
        """Journal to disk, then acknowledge the messages whose effects it holds."""
        if self.journal is not None:
            self.journal.sync()
        client = self._client
        if client is None:
            return  # connecting (acknowledged once connected) or gone (ids are void then)
        if self.ack_after_processing:
            for mid, qos in self._pending_acks:
                client_adapter.ack(client, mid, qos)
        self._pending_acks.clear()

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
            if (self.stopped is not None or self._settled) and self.topics.device_of(
                topic, "up"
            ) is not None:
                return  # stopping or settled: not taken, not acknowledged (a resume gets it)
            self._ingest(topic, payload, retain)
            if qos > 0:
                self._pending_acks.append((mid, qos))
                if len(self._pending_acks) >= ACK_BATCH:
                    self._flush()
                elif self._flush_handle is None and self._loop is not None:
                    self._flush_handle = self._loop.call_soon(self._scheduled_flush)
        except Exception as exc:  # handed to the reader task, which raises it
            self._fail(exc)

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

    def _scheduled_flush(self) -> None:
        self._flush_handle = None
        if self._ingest_failed is not None and self._ingest_failed.done():
            return
        try:
            self._flush()
        except Exception as exc:  # handed to the reader task, which raises it
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        """Ingest cannot go on (e.g. the journal's disk failed): the reader task raises ``exc``
        and the service stops as it did when the reader itself raised; nothing more is acked."""
        log.error("ingest failed: %s", exc)
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
        await client.publish(self.topics.global_model, self._global_payload, qos=1, retain=True)

    async def _collect_shares(self, client: aiomqtt.Client | None) -> None:
        """Sharded ingest: freeze the round on every worker, then commit it (with what each
        must leave out) and wait for their partials; :meth:`_close` merges what came."""
        sharding = self.sharding
        sr = sharding.round if sharding is not None else None
        if sr is None or client is None:
            return
        control = self.topics.ingest_control
        with contextlib.suppress(aiomqtt.MqttError):  # a lost broker: merge what came
            await client.publish(control, sharding.freeze_message(), qos=1)
            await self._await_workers(sr.unfrozen)
            await client.publish(control, sharding.commit_message(), qos=1)
            await self._await_workers(sr.unmerged)

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

    async def _sleep_until(self, deadline: float | None) -> None:
        """Wait for a wake-up (update, status, stop) or until ``deadline`` on the loop clock.

        A wake-up that came since the last one was consumed (e.g. a stop signal during the
        global publish, before this sleep began) returns at once: the event is cleared when it
        is consumed, never before waiting, so none is lost; every caller re-checks its state."""
        timeout = None if deadline is None else max(0.0, deadline - self._now())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        self._wake.clear()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # ---------------------------------------------------------------- rounds

    async def _wait_for_devices(self) -> None:
        """Start when every expected device has reported a status and enough are available, or
        after the wait with whoever is there. A retained OFFLINE status may be an earlier run's
        last will (the same job id): it does not count as reported until this run confirms it
        live, so a fleet still connecting is waited for instead of running round 1 short."""
        want = self.expected_devices or self.core.settings.n_select
        need = min(want, self.core.settings.n_select)
        until = self._now() + self.wait_for_devices_s

        def reported() -> int:
            return sum(
                1 for d, r in self.core.devices.items() if r.online or d in self._live_status
            )

        log.info(
            "waiting up to %.0fs for %d devices to report on %s (a round needs %d)",
            self.wait_for_devices_s,
            want,
            self.topics.all_status,
            need,
        )
        next_note = self._now() + 5.0
        while (
            self.stopped is None
            and self._now() < until
            and (reported() < want or len(self.core.available()) < need)
        ):
            if reported() >= want and len(self.core.available()) >= max(
                1, self.core.settings.min_updates
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
        if self.stopped is None and len(self.core.available()) < self.core.settings.min_updates:
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

    def _open_round(self, now: float) -> bool:
        """Open the next round and journal it (on disk before any device can see it)."""
        msg = self.core.open_round(now)
        if msg is None:
            return False
        self._global_payload = encode_global(msg, signer=self.signer)
        self._open_control = None  # made from this round's global message when published
        if self.journal is not None:
            self.journal.append("open", **self.core.round_spec(self._global_payload))
            self.journal.sync()
        self._round_started = time.perf_counter()
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
        record = core.close_round(self._now() if now is None else now, wall, skipped=skipped)
        record.update(shards)
        if self.stopped is not None:
            record["stopped"] = self.stopped
        return record

    def _decide_on_stop(self) -> dict[str, Any] | None:
        """Close the open round if it has what it needs (its minimum, and at least one update),
        else record it skipped; then the job ends."""
        core = self.core
        record = None
        rnd = core.current
        core.ended_early = f"stopped by {self.stopped}"  # first: closing knows it is the last
        if rnd is not None:
            enough = rnd.count >= max(rnd.min_updates, 1)
            record = self._close(skipped=not enough)
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

    async def _publish_record(self, client: aiomqtt.Client | None, record: dict) -> None:
        if client is None:
            return
        public = self.core.public_record(record)
        with contextlib.suppress(aiomqtt.MqttError):
            await client.publish(self.topics.metrics, json.dumps(public, default=str), qos=0)

    async def _run_rounds(self, client: aiomqtt.Client) -> None:
        core = self.core
        while not core.finished:
            if self.stopped is not None:
                await self._collect_shares(client)
                record = self._decide_on_stop()
                if record is not None:
                    await self._publish_record(client, record)
                break
            if core.current is None:
                if not self._open_round(self._now()):
                    reason = core.hopeless()
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
                await self._sleep_until(core.deadline)
                continue
            await self._collect_shares(client)
            record = self._close_round(skipped=decision is Decision.SKIP)
            if core.finished:  # the job's last round: charge what is still on its way first
                if self.sharding is None:
                    await self._drain()
                self._settle(record)
            self._commit(record)
            await self._publish_record(client, record)

    async def _send_replacements(self, client: aiomqtt.Client) -> None:
        """Async with a concurrency limit: publish the devices chosen to replace those that
        answered, timed out or left, so C keep training while a window fills. Journaled (and on
        disk) before any device can see it, like a round's opening; it becomes the retained
        message a reconnect re-broadcasts."""
        msg = self.core.dispatch(self._now())
        if msg is None:
            return
        payload = encode_global(msg, signer=self.signer)
        if self.journal is not None:
            self.journal.append("dispatch", v=msg.version, sel=list(msg.selected or ()), g=payload)
            self.journal.sync()
        self._global_payload = payload
        await client.publish(self.topics.global_model, payload, qos=1, retain=True)
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
        self._install_tap(client)
        self._loop = asyncio.get_running_loop()
        self._ingest_failed = self._loop.create_future()
        self._pending_acks.clear()  # message ids of an earlier connection mean nothing now
        async with client:
            self._client = client
            self._flush()  # what arrived while connecting (the persistent session's queue)
            self._settle_until = None
            if self._ever_connected:  # a reconnect: the devices' statuses are stale for a while
                self._grace_until = self._now() + RECONNECT_SETTLE_S
            if self.core.round_number == 0 and self.core.current is None:
                # forget the retained model of an earlier run of this job id
                await client.publish(self.topics.global_model, b"", qos=1, retain=True)
                if self.sharding is not None:  # and its last round's open, for the workers
                    await client.publish(self.topics.ingest_control, b"", qos=1, retain=True)
            if self.job_document is not None and not self.core.finished:
                await client.publish(
                    self.topics.job_document, self.job_document, qos=1, retain=True
                )
            await client.subscribe(self.topics.all_status, qos=1)
            if self.sharding is None:
                await client.subscribe(self.topics.all_updates, qos=1)
            else:  # the workers take the updates; their answers and liveness come here
                for kind in ("progress", "partial", "worker"):
                    await client.subscribe(self.topics.all_ingest(kind), qos=1)
            self.connected.set()
            self._ever_connected = True
            self._attempt = 0
            reader = asyncio.create_task(self._reader(client))
            runner: asyncio.Task | None = None
            try:
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
                        if resumed:  # the round's tally restarted with this process
                            payload = self._global_payload or b""
                            self.core.tally.bytes_down += len(payload) * self.core.online_count
                elif not self.core.finished:
                    await self._wait_for_workers()
                    await self._wait_for_devices()
                runner = asyncio.create_task(self._run_rounds(client))
                done, _ = await asyncio.wait({reader, runner}, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # re-raise a reader MqttError or a round error
                self._flush()
                self._finish()  # summary and model on disk before devices hear the job ended
                final = self.core.global_message(done=True, now=time.time())
                await client.publish(
                    self.topics.global_model,
                    encode_global(final, signer=self.signer),
                    1,
                    retain=True,
                )
                self.done_published = True
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
                    log.warning(
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
