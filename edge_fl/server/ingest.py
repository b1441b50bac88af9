"""An ingest worker process: the I/O edge of :class:`~edge_fl.server.sharding.IngestWorker`.

It takes its share of the update stream in one of three ways (``ingest.partition``): from an
MQTT 5 shared subscription (``$share/<group>/<prefix>/<job>/up/+``: the broker deals each update
to one worker); on engines without shared subscriptions, from ``up/+`` keeping only the devices
whose id hashes to its index (every worker receives every update; a device always lands on the
same worker); or, as a site aggregator, every update on its own site broker, which a bridge joins
to the root broker (docs/scale.md, hierarchical aggregation).
Received PUBLISH packets go through the service's :class:`IngestTap` straight into the worker's
core; after each socket burst the worker acknowledges them and reports progress. Control messages
from the coordinator (open, freeze, commit, end) arrive on ``ingest/ctl``; answers go out on
``ingest/progress/<name>`` and ``ingest/partial/<name>``; ``ingest/worker/<name>`` is its retained
liveness (a last will says ``offline``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from typing import Any

import aiomqtt

from edge_fl.device.runtime import retry_broker
from edge_fl.protocol import Topics
from edge_fl.transport import client_adapter
from edge_fl.transport.tap import IngestTap
from edge_fl.transport.url import BrokerSpec

from .sharding import IngestWorker, ShardingError

log = logging.getLogger("edge_fl.ingest")


def hash_share(device: str, index: int, count: int) -> bool:
    """Whether ``device`` is worker ``index``'s of ``count`` in hash mode (stable everywhere)."""
    digest = hashlib.blake2b(device.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % count == index


class IngestService:
    """Runs one worker until the coordinator ends the job (or a stop is requested)."""

    def __init__(
        self,
        worker: IngestWorker,
        spec: BrokerSpec,
        topics: Topics,
        *,
        group: str = "edgefl-ingest",
        hash_partition: tuple[int, int] | None = None,  # (index, count): no shared subscription
        whole_stream: bool = False,  # a site aggregator: every update on its broker
        clean_session: bool = True,  # False only for tools/bench_ingest.py (pre-queued updates)
        client_id: str | None = None,
    ) -> None:
        self.worker = worker
        self.clean_session = clean_session
        self.client_id = client_id or f"edgefl-{topics.job}-ingest-{worker.name}"
        self.spec = spec
        self.topics = topics
        self.group = group
        self.hash_partition = hash_partition
        self.whole_stream = whole_stream
        self.ended = asyncio.Event()
        self.stopping = asyncio.Event()  # SIGINT/SIGTERM: say offline, leave
        self._joined = False  # has taken part in a round of this run of the job
        self._connected = False  # inside a session (a stop can say goodbye on it)
        self.tap: IngestTap | None = None
        self._paho: aiomqtt.Client | None = None  # the current client (acks, sends from callbacks)
        self._pending: list[tuple[int, int]] = []
        self._flush_handle: asyncio.Handle | None = None
        self._live = worker.connection_liveness()  # (online, offline), sealed, per connection
        self.stats = {"updates": 0, "skipped_other_share": 0, "control_errors": 0}

    # ------------------------------------------------------------------ per message

    def _on_publish(self, topic: str, payload: bytes, mid: int, qos: int, retain: bool) -> None:
        worker, topics = self.worker, self.topics
        try:
            if (device := topics.device_of(topic, "up")) is not None:
                part = self.hash_partition
                if part is None or hash_share(device, *part):
                    worker.on_update(device, payload)
                    self.stats["updates"] += 1
                else:
                    self.stats["skipped_other_share"] += 1
            elif (device := topics.device_of(topic, "status")) is not None:
                worker.on_status(device, payload)
            elif topic == topics.ingest_control:
                self._on_control(payload, retain)
        except Exception:  # never let one message stop ingest; the core already never raises
            log.exception("message on %s: unexpected error; ignored", topic)
        if qos:
            self._pending.append((mid, qos))
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _on_control(self, payload: bytes, retain: bool = False) -> None:
        if not payload:  # the coordinator cleared its retained control: a new run starts
            self.worker.reset()  # what the earlier run left unreported is not this run's
            self._joined = False
            return
        try:
            msg = self.worker.verify_control(payload)  # the coordinator's, sealed, fresh
            kind = msg["k"]
        except ShardingError as exc:
            self.stats["control_errors"] += 1
            log.error("control message refused: %s", exc)
            return
        if kind == "end":
            if retain and not self._joined:  # the end of an earlier run, kept by the broker
                log.info("ingest worker %s: the last run of job %r has ended; waiting for a "
                         "new one", self.worker.name, self.topics.job)  # fmt: skip
                return
            log.info("ingest worker %s: the aggregator ended the job", self.worker.name)
            self.ended.set()
            return
        if kind == "open" and not self._joined:
            self._joined = True
            log.info("ingest worker %s: taking part from round %s on", self.worker.name,
                     msg.get("r"))  # fmt: skip
        self._send_progress()  # what was accepted before a freeze goes out before its answer
        try:
            answers = self.worker.apply_control(msg)
        except (ShardingError, ValueError) as exc:
            self.stats["control_errors"] += 1
            log.error("control message %s refused: %s", kind, exc)
            return
        for what, data in answers:
            self._publish(self.topics.ingest(what, self.worker.name), data)

    def _publish(self, topic: str, payload: bytes) -> None:
        if self._paho is not None:
            client_adapter.publish_nowait(self._paho, topic, payload, qos=1)

    def _send_progress(self) -> None:
        progress = self.worker.progress()
        if progress is not None:
            self._publish(self.topics.ingest("progress", self.worker.name), progress)

    def _flush(self) -> None:
        """After a burst: tell the coordinator what was folded and released, then acknowledge it
        (in that order on the socket: an update is never acknowledged before its release is on
        its way to the ledger)."""
        self._flush_handle = None
        self._send_progress()
        if self._paho is not None:
            for mid, qos in self._pending:
                client_adapter.ack(self._paho, mid, qos)
        self._pending.clear()

    # ------------------------------------------------------------------ connection

    def _client(self) -> aiomqtt.Client:
        name = self.worker.name
        self._live = self.worker.connection_liveness()
        will = aiomqtt.Will(self.topics.ingest("worker", name), self._live[1], qos=1, retain=True)
        client = aiomqtt.Client(
            **self.spec.aiomqtt_kwargs(),
            identifier=self.client_id,
            # clean: a lost worker's session ends with it, so the broker stops dealing it
            # updates (a persistent one would keep taking its share into a queue nobody
            # reads); the coordinator counts its share of the round as lost
            clean_session=self.clean_session,
            max_inflight_messages=100,
            will=will,
        )
        self._paho = client
        client_adapter.quiet_on_loss(client)  # a lost broker is one line, not asyncio tracebacks
        client_adapter.manual_acks(
            client,
            lambda m: self._on_publish(m.topic, bytes(m.payload), m.mid, m.qos, bool(m.retain)),
        )

        def wrap(sock: Any) -> IngestTap:
            tap = IngestTap(sock, self._on_publish)
            self.tap = tap
            return tap

        client_adapter.wrap_sockets(client, wrap)
        return client

    async def _session(self) -> None:
        try:
            await self._connected_session()
        finally:
            self._paho = None
            self._connected = False

    async def _connected_session(self) -> None:
        topics = self.topics
        async with self._client() as client:
            self._connected = True
            share = ("its device-id hash share" if self.hash_partition is not None
                     else "every update" if self.whole_stream
                     else f"shared group {self.group!r}")  # fmt: skip
            log.info("ingest worker %s connected (%s); waiting for the aggregator's rounds",
                     self.worker.name, share)  # fmt: skip
            await client.subscribe(topics.ingest_control, qos=1)
            await client.subscribe(topics.all_status, qos=1)
            if self.hash_partition is None and not self.whole_stream:
                await client.subscribe(topics.shared_updates(self.group), qos=1)
            else:
                await client.subscribe(topics.all_updates, qos=1)
            await client.publish(topics.ingest("worker", self.worker.name), self._live[0], 1,
                                 retain=True)  # fmt: skip
            drain = asyncio.ensure_future(self._drain(client))
            ended = asyncio.ensure_future(self.ended.wait())
            stopping = asyncio.ensure_future(self.stopping.wait())
            try:
                done, _ = await asyncio.wait(
                    {drain, ended, stopping}, return_when=asyncio.FIRST_COMPLETED
                )
                if drain in done:
                    drain.result()  # a lost connection raises MqttError here
                self._flush()
                # stopped: offline at once (a clean disconnect sends no last will), so the
                # coordinator counts this worker's share lost now instead of waiting for it
                stopped = self.stopping.is_set() and not self.ended.is_set()
                status = self._live[1] if stopped else b""
                topic = topics.ingest("worker", self.worker.name)
                await client.publish(topic, status, 1, retain=True)
            finally:
                for task in (drain, ended, stopping):
                    task.cancel()

    async def _drain(self, client: aiomqtt.Client) -> None:
        """aiomqtt's queue stays empty (the tap dispatches); waiting on it notices a lost link."""
        async for message in client.messages:
            payload = message.payload if isinstance(message.payload, bytes | bytearray) else b""
            self._on_publish(str(message.topic), bytes(payload), message.mid, message.qos,
                             bool(message.retain))  # fmt: skip

    async def run(self) -> dict[str, Any]:
        """Until the coordinator ends the job. A lost broker is retried with backoff for as long
        as it takes (the coordinator counts a worker's absence); a refusal retrying cannot fix
        (a wrong password, a certificate) ends it with a RuntimeError naming it."""

        async def once() -> bool | None:
            await self._session()
            return True if self.ended.is_set() or self.stopping.is_set() else None

        retrying = asyncio.ensure_future(retry_broker(self.spec, once))
        stopping = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({retrying, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not retrying.done() and self._connected:  # connected: say offline
                with contextlib.suppress(TimeoutError, aiomqtt.MqttError, RuntimeError):
                    await asyncio.wait_for(asyncio.shield(retrying), 5.0)
            if retrying.done():
                retrying.result()  # a refusal retrying cannot fix: RuntimeError
        finally:
            stopping.cancel()
            if not retrying.done():  # stopped while (re)connecting: nothing to say goodbye on
                retrying.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await retrying
        return dict(self.stats)

    def request_stop(self) -> None:
        """SIGINT/SIGTERM: publish this worker offline and leave (its share of the open round
        is lost; the coordinator charges it)."""
        self.stopping.set()
