"""The fleet runtime: thousands of device agents in one asyncio process, one MQTT session each.

Each device keeps its own connection open across rounds (with its own last will, so the aggregator
sees a crash as a real broker-published ``offline``), while the global model is received ONCE per
process on a shared downlink connection and handed to every local agent: 10,000 simulated devices
must not each decode a copy (``notes/mqtt.md``). Training runs in a worker thread so keepalives and
acknowledgements keep flowing.

On a secured broker every device connects as its own MQTT user (``device_specs``, from the file
``broker/mint-credentials.sh`` prints): the ACL lets a user write only its own update topic and
Mosquitto allows one connection per username. Without a fleet user of its own, the downlink then
rides on the first device's session (any user may read the global model).

Wire bytes (``edge_fl.transport.wire``): every device session counts its MQTT packets (CONNECT,
statuses, updates, PUBACKs, PINGs, DISCONNECT, reconnects). A device here does not subscribe to
the global model itself (the shared downlink does), so by default each device is charged what its
own subscription would cost: SUBSCRIBE/SUBACK per session and, per global model the downlink
receives, the PUBLISH packet at the QoS it arrived with (QoS 0 as devices subscribe: topic and
payload, no packet id, no PUBACK), sized exactly by ``mqtt_packet_bytes``. With
``device_downlink=True`` every device subscribes and receives the model on its own session instead
(everything measured; the broker sends one copy per device).

Dispatch messages (FedBuff/FedAsync with a concurrency limit: who trains on the current version,
without the model) come on the same downlink once the fleet has seen an asynchronous model, and go
to the local devices they name; each device is charged the message as its own subscription would
receive it. A device asked by a dispatch already holds the model (it came when the version was
published), so its training starts without a modelled download.

What each device does with a model is its own policy's call (``DeviceAgent.handle``,
:mod:`edge_fl.device.policy`, the same rules as a single device's runtime); the fleet carries out
the effects in modelled time. A device session that drops while the downlink stays up (a cluster
node died under it) is re-opened on its own (``_watch_sessions``) and handed the newest model
again, as its own subscription would get the retained one: a selected device re-sends its update.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import aiomqtt

from edge_fl.device.agent import PHASE_OF, DeviceAgent
from edge_fl.device.dispatch import receive_dispatch
from edge_fl.device.policy import (
    Disconnected,
    DispatchArrived,
    Effect,
    Event,
    InboxArrived,
    JobEnded,
    ModelArrived,
    Publish,
    PublishStatus,
    Resend,
    Train,
    Trained,
    Upload,
    Uploaded,
)
from edge_fl.device.trust import Trust
from edge_fl.fleet.clock import SimClock, VirtualClock
from edge_fl.fleet.counts import FleetTotals, RoundCounts
from edge_fl.fleet.keepalive import SharedKeepalive
from edge_fl.fleet.profiles import AlwaysAvailable, DeviceProfile
from edge_fl.logs import tally
from edge_fl.protocol import GlobalModel, Topics
from edge_fl.protocol.clock import (
    UPS_MAX,
    ClockMessage,
    ClockMessageError,
    clock_topic,
    decode_clock,
)
from edge_fl.protocol.messages import Dispatch
from edge_fl.transport import client_adapter
from edge_fl.transport.limits import ensure_open_files
from edge_fl.transport.url import BrokerSpec
from edge_fl.transport.wire import (
    DEFAULT_LINK,
    LinkModel,
    WireCounter,
    attach,
    ip_bytes,
    mqtt_packet_bytes,
    packet_counts,
)

#: the second half of a device's timer key: its availability changes (statuses) come before its
#: own work (download, compute, upload) at the same simulated time
STATUS, WORK = 0, 1

log = logging.getLogger("edge_fl.fleet")

#: the ``i.stopped`` of a device whose training raised (:meth:`Fleet._training_failed`)
TRAINING_FAILED = "training_failed"
T = TypeVar("T")
R = TypeVar("R")

#: MQTT's largest keepalive (a 16-bit count of seconds): device sessions under virtual time
MAX_KEEPALIVE_S = 65535

# Refusals that retrying cannot fix (MQTT CONNACK reasons and TLS failures, as paho words them).
_FATAL = ("not authori", "bad user name or password", "certificate verify failed")


def is_fatal(exc: BaseException) -> bool:
    """Whether a connection error is a refused login or a TLS failure (wrong CA, host name)."""
    text = str(exc).lower()
    return any(word in text for word in _FATAL)


class DeviceConnectError(aiomqtt.MqttError):
    """A device's own session could not connect (named: with per-device credentials, which
    device's login the broker refused matters)."""

    def __init__(self, device: str, spec: BrokerSpec, cause: BaseException) -> None:
        super().__init__(str(cause) or type(cause).__name__)
        self.device = device
        self.spec = spec
        self.cause = cause


class Fleet:
    def __init__(
        self,
        agents: list[DeviceAgent],
        spec: BrokerSpec,
        topics: Topics,
        *,
        connect_concurrency: int = 64,
        train_workers: int = 1,
        machine_samples_per_s: float | None = None,
        keepalive_s: int = 60,
        client_prefix: str | None = None,
        profiles: dict[str, DeviceProfile] | None = None,
        clock: SimClock | VirtualClock | None = None,
        dropout: float | None = None,
        digest: str = "",
        trust: Trust | None = None,
        device_specs: dict[str, BrokerSpec] | None = None,
    ) -> None:
        self.agents = {a.device_id: a for a in agents}
        self.device_specs: dict[str, BrokerSpec] = {}
        self.downlink_device: str | None = None
        if device_specs:
            self.use_credentials(device_specs)
        self.trust = trust or Trust()  # one downlink for the whole fleet: one window
        self.n_params = agents[0].model.n_params if agents else 0
        self.spec = spec
        self.topics = topics
        self.connect_concurrency = connect_concurrency
        self.keepalive_s = keepalive_s
        self.client_prefix = client_prefix or f"edgefl-{topics.job}"
        #: the shared downlink session's client id (a fleet split over processes: one each)
        self.downlink_id = f"{self.client_prefix}-downlink"
        self.clients: dict[str, aiomqtt.Client] = {}
        self.crashed: set[str] = set()
        self.published = 0  # distinct updates that reached the broker (first send or re-send)
        self.publish_failures = 0
        self.resent = 0  # updates published again (the round came again, a session re-opened)
        self._delivered_round: dict[str, int] = {}  # device: round of its last delivered update
        #: trainings that raised (``DeviceAgent.on_global``): in all, since the last
        #: :meth:`failures_round`, and per distinct error (``"RuntimeError: boom"``: count)
        self.device_failures = 0
        self._failures_since = 0
        self.failure_errors: dict[str, int] = {}
        self._repeats_since: dict[str, int] = {}
        self.connected = asyncio.Event()
        self.profiles = profiles or {}
        self.clock: SimClock | VirtualClock = clock or SimClock(None)
        if isinstance(self.clock, VirtualClock):
            # Keepalive PINGs follow real time, which virtual time must not let into any record
            # (the wire counters would depend on the machine's speed): the longest keepalive
            # MQTT allows, so no device session pings during a run; keepalive traffic (4 bytes
            # per idle keepalive period) is left out of the wire counts under virtual time.
            self.keepalive_s = keepalive_s = MAX_KEEPALIVE_S
        self.dropout = dropout  # overrides the profiles' training dropout when set
        #: modelled compute from the real training (``fleet.machine_samples_per_s``): the
        #: training's thread CPU seconds, scaled by this / the device's profile speed
        self.machine_samples_per_s = machine_samples_per_s
        self._train_cpu_s: dict[str, float] = {}  # device: its last training's thread CPU
        #: the last training's thread CPU per sample and epoch: a device whose training it
        #: predicts under ``INLINE_TRAIN_S`` trains on the event loop (the first in the pool)
        self._train_cpu_per_sample = math.inf
        #: set once the job's first training (in the pool) has measured the cost per sample;
        #: the trainings that start meanwhile wait for it instead of each going to the pool
        self._first_training: asyncio.Event | None = None
        self.inline_trainings = 0
        self.dropouts = 0
        #: secure aggregation: devices subscribe to their own inbox; a device that drops out of
        #: a secure round (the dropout above, or a profile's) vanishes before a protocol phase
        #: drawn uniformly; ``secure_vanish[device] = phase`` forces it (tests)
        self.secure = any(a.secure is not None for a in agents)
        self.secure_vanish: dict[str, str] = {}
        self._vanish: dict[str, tuple[int, int]] = {}  # device -> (round, first phase not sent)
        self.unavailable: set[str] = set()  # devices outside their availability window
        self._closing = False
        self.digest = digest
        self.max_reconnects = 10
        self.reconnect_attempt = 0
        #: virtual time ended because the broker went away: the clock session is not re-opened
        #: (the aggregator stops its job there too), so the fleet stops rather than reconnect
        self.broker_lost = False
        self._pool = ThreadPoolExecutor(max_workers=train_workers, thread_name_prefix="train")
        # every session's keepalive on one timer, not one aiomqtt task waking each second per
        # session (docs/bench/profile-10k.md); a PINGREQ goes out at most a quarter of the
        # keepalive late, well within the 1.5x the broker allows before it drops a silent session
        self.keepalive = SharedKeepalive(period_s=max(0.25, keepalive_s / 4))
        self._tasks: set[asyncio.Task] = set()
        self._work: set[asyncio.Task] = set()  # devices' download, training and upload
        self.link: LinkModel = DEFAULT_LINK
        self.device_downlink = False  # True: each device subscribes to the model on its session
        self.wire: dict[str, WireCounter] = {}  # per device, across its reconnects
        self.downlink_wire = WireCounter()  # the shared downlink session (not a device's)
        # Per-device reconnect while the downlink is up (a cluster node died under some device
        # sessions, not under the downlink): checked every `session_check_s` and at once when a
        # publish fails; a device's retries back off from 0.5 s to `max_session_backoff_s`.
        self.session_check_s = 1.0
        self.max_session_backoff_s = 10.0
        self.reopened = 0  # device sessions re-opened by the per-device reconnect
        self._downlink_up = False
        self._session_lost = asyncio.Event()
        self._reopening: set[str] = set()
        #: devices whose update is out on their session, awaiting its PUBACK (their task), and
        #: those of them whose session was found lost meanwhile (:meth:`abandon_upload`)
        self._uploading: dict[str, asyncio.Task] = {}
        self._abandoned: set[str] = set()
        self._retry_at: dict[str, tuple[float, int]] = {}  # device: (next try, failures)
        self._last_msg: GlobalModel | None = None  # the newest model handed out
        self._last_model_bytes = 0
        self._last_dispatch: Dispatch | None = None  # the newest dispatch handed out
        #: an asynchronous model was seen: the downlink (and every device's own subscription, as
        #: charged or with ``device_downlink``) takes the ``dispatch`` topic too
        self.asynchronous = False
        # Virtual time (``VirtualClock``): the aggregator's grants move the clock
        # (``_clock_driver``); models and dispatches wait for the grant that covers them.
        self.virtual = isinstance(self.clock, VirtualClock)
        #: updates and statuses the devices' sessions published (the connect statuses included)
        self.vt_published = 0
        #: the aggregator's global and dispatch messages received live since the clock started
        self.vt_seen = 0
        self.vt_cycles = 0  # grants answered
        self.vt_train_s = 0.0  # wall time training blocked the clock (devices in the pool)
        #: ``edge-fl fleet``: before connecting, wait until the aggregator is subscribed (its
        #: retained job document), so it receives every status live and can count it
        self.wait_for_aggregator = False
        self._vt_deliveries: list[tuple[str, object, int]] = []  # (kind, message, model bytes)
        self._vt_seen_changed = asyncio.Event()
        self._downlink_subscribed = asyncio.Event()
        self._clocked: set[asyncio.Task] = set()  # availability loops (blocked on the clock)

    @property
    def leaving(self) -> bool:
        """The fleet has stopped serving and its devices are leaving (or have left)."""
        return self._closing

    def use_credentials(self, device_specs: dict[str, BrokerSpec]) -> None:
        """Connect each device with its own spec (its MQTT user); before `run`."""
        missing = [d for d in self.agents if d not in device_specs]
        if missing:
            raise ValueError(f"no broker credentials for devices {missing[:5]}")
        self.device_specs = dict(device_specs)
        # One connection per username on a secured broker: without a user of its own, the
        # downlink subscribes on the first device's session instead of opening another.
        self.downlink_device = next(iter(self.agents), None) if self.spec.username is None else None

    # ------------------------------------------------------------ connections

    def _client(self, agent: DeviceAgent) -> aiomqtt.Client:
        will = aiomqtt.Will(
            self.topics.status(agent.device_id), agent.status(online=False), qos=1, retain=True
        )
        spec = self.device_specs.get(agent.device_id, self.spec)
        client = aiomqtt.Client(
            **spec.aiomqtt_kwargs(),
            identifier=f"{self.client_prefix}-{agent.device_id}",
            will=will,
            clean_session=True,
            keepalive=self.keepalive_s,
        )
        counter = self.wire.get(agent.device_id)
        if counter is None:
            counter = self.wire[agent.device_id] = WireCounter(self.link)
        attach(client, counter)
        if self.virtual:
            # statuses dominate a simulated day: each packet written as it is queued (a
            # wall-clock round was no faster so, its uploads interleaved with training:
            # BENCHMARKS.md section 23)
            client_adapter.write_through(client)
        client_adapter.replace_misc_loop(client, self.keepalive.misc_loop)
        return client

    def _tls(self, device: str) -> bool:
        return self.device_specs.get(device, self.spec).tls

    def _downlink_topics(self) -> list[str]:
        """What a device subscribes to on a new session (``edge_fl.device.runtime``): the model,
        and the dispatch messages once the job is known to be asynchronous."""
        if self.asynchronous:
            return [self.topics.global_model, self.topics.dispatch]
        return [self.topics.global_model]

    def _charge_subscription(self, device: str, topics: list[str] | None = None) -> None:
        """SUBSCRIBE/SUBACK of the subscription a real device makes on its session (``topics``:
        the model's, and the dispatch topic's when known asynchronous)."""
        topics = topics if topics is not None else self._downlink_topics()
        sub = mqtt_packet_bytes("subscribe", topics=topics)
        suback = mqtt_packet_bytes("suback", topics=topics)
        self.wire[device].add(packet_counts([sub], [suback], self._tls(device), self.link))

    def _charge_model(self, message: aiomqtt.Message) -> None:
        """Charge every device with a session the global model its own subscription would get."""
        payload = message.payload
        size = mqtt_packet_bytes(
            "publish",
            topic=message.topic.value,
            payload=len(payload) if isinstance(payload, bytes | bytearray) else 0,
            qos=min(message.qos, 1),
        )
        acks = [mqtt_packet_bytes("puback")] if message.qos else []
        costs = {tls: packet_counts(acks, [size], tls, self.link) for tls in (False, True)}
        for device in self.clients:
            if device == self.downlink_device or device in self.crashed:
                continue  # the downlink device receives it for real; a crashed one is gone
            if device not in self.unavailable:
                self.wire[device].add(costs[self._tls(device)])

    async def _drain(self, client: aiomqtt.Client, agent: DeviceAgent | None = None) -> None:
        """Read what a device's own subscription delivers (its bytes are counted): its inbox
        goes to the device, the rest is dropped (the shared downlink hands the model out)."""
        with contextlib.suppress(aiomqtt.MqttError, asyncio.CancelledError):
            async for message in client.messages:
                if agent is not None:
                    self._inbox(agent, message)

    def _inbox(self, agent: DeviceAgent, message: aiomqtt.Message) -> bool:
        """A message on ``agent``'s inbox, handed to it (True), or not one (False). Virtual
        time: counted on arrival (the aggregator counts what it publishes) and handed over at
        the simulated time of the grant that counts it."""
        if not message.topic.matches(self.topics.inbox(agent.device_id)):
            return False
        payload = message.payload
        if not isinstance(payload, bytes | bytearray) or not payload:
            return True
        if self.virtual:
            if message.retain:
                return True  # none are retained; an earlier run's would not be this run's
            self.vt_seen += 1
            self._vt_seen_changed.set()
            self._vt_deliveries.append(("inbox", (agent, bytes(payload)), 0))
            return True
        self._hand_inbox(agent, bytes(payload))
        return True

    def _hand_inbox(self, agent: DeviceAgent, payload: bytes) -> None:
        device = agent.device_id
        if device not in self.crashed and device not in self.unavailable:
            self._hand(agent, InboxArrived(payload), 0)

    def resume_devices(self, released: dict[str, tuple[int, int]]) -> None:
        """A resumed job: each device of this fleet goes on from its releases so far
        (``device: (releases, last round)``, from the aggregator's ledger;
        :meth:`DeviceAgent.resume`)."""
        for device, (count, last_round) in released.items():
            agent = self.agents.get(device)
            if agent is not None:
                agent.resume(count, last_round)

    def take_round(self) -> RoundCounts:
        """This fleet's counts since the previous take (a round's record; merged with other
        processes' shares by :func:`~edge_fl.fleet.counts.round_fields`): every device's wire
        bytes that moved, with the link model's TCP/IP estimate (TLS and TCP/IP included), the
        trainings that failed (:meth:`failures_round`) and the dropouts so far."""
        ups: list[int] = []
        downs: list[int] = []
        up_ip = down_ip = 0
        for counter in self.wire.values():
            counts = counter.take()
            if not (counts["up"] or counts["down"]):
                continue
            ups.append(counts["up"])
            downs.append(counts["down"])
            u, d = ip_bytes(counts, self.link)
            up_ip += u
            down_ip += d
        return RoundCounts(
            tuple(ups), tuple(downs), up_ip, down_ip, self.failures_round(), self.dropouts
        )

    def totals(self) -> FleetTotals:
        """This fleet's run totals (the summary's; merged across processes by
        :func:`~edge_fl.fleet.counts.merge_totals`)."""
        downlink = self.downlink_wire.totals()
        return FleetTotals(
            published=self.published,
            publish_failures=self.publish_failures,
            # on their own account (a budget spent); those whose training failed: apart
            stopped_devices=sum(
                1
                for a in self.agents.values()
                if a.state.stopped_reason and a.state.stopped_reason != TRAINING_FAILED
            ),
            device_failures=self.device_failures,
            failure_errors=dict(self.failure_errors),
            downlink_up=downlink["up"],
            downlink_down=downlink["down"],
        )

    async def _connect(self, agent: DeviceAgent, gate: asyncio.Semaphore) -> None:
        async with gate:  # Mosquitto's listen backlog is 100: pace the connects
            client = self._client(agent)
            try:
                await client_adapter.connect(client)  # aiomqtt's __aenter__ minus a thread hop
            except aiomqtt.MqttError as exc:
                if not self.device_specs:
                    raise
                spec = self.device_specs[agent.device_id]
                raise DeviceConnectError(agent.device_id, spec, exc) from exc
            client_adapter.no_delay(client)  # a publish right after a PUBACK must not wait
            self.clients[agent.device_id] = client
            if self.secure:  # before its status: it may be selected at once
                await client.subscribe(self.topics.inbox(agent.device_id), qos=1)
            if self.device_downlink and agent.device_id != self.downlink_device:
                await client.subscribe([(t, 0) for t in self._downlink_topics()])
                self._spawn(self._drain(client, agent))
            elif self.secure and agent.device_id != self.downlink_device:
                self._spawn(self._drain(client, agent))
            elif agent.device_id != self.downlink_device:
                self._charge_subscription(agent.device_id)
            profile = self.profiles.get(agent.device_id)
            online = not (
                self.clock.modelled
                and profile is not None
                and not profile.availability.available_at(self.clock.now())
            )
            await client.publish(
                self.topics.status(agent.device_id), agent.status(online), qos=1, retain=True
            )

    async def connect_all(self) -> None:
        ensure_open_files(len(self.agents) + 1)
        gate = asyncio.Semaphore(self.connect_concurrency)
        started = time.perf_counter()
        with without_collector(freeze=len(self.agents) >= FREEZE_SESSIONS):
            await asyncio.gather(*(self._connect(a, gate) for a in self.agents.values()))
        #: wall seconds until every device's session was up with its status retained
        self.connect_s = time.perf_counter() - started
        self.connected.set()

    async def disconnect_all(self) -> None:
        async def leave(device: str, client: aiomqtt.Client) -> None:
            with contextlib.suppress(Exception):
                if device not in self.crashed:
                    agent = self.agents[device]
                    await client.publish(
                        self.topics.status(device), agent.status(online=False), qos=1, retain=True
                    )
                await client.__aexit__(None, None, None)

        with without_collector(freeze=False):
            await asyncio.gather(*(leave(d, c) for d, c in self.clients.items()))
        self.clients.clear()

    def crash(self, devices: Iterable[str]) -> None:
        """Kill devices abruptly: no DISCONNECT packet, so the broker publishes their last wills."""
        for device in devices:
            self.crashed.add(device)
            client = self.clients.get(device)
            sock = client_adapter.raw_socket(client) if client is not None else None
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    # ------------------------------------------------------------ rounds

    def _drops(self, agent: DeviceAgent, profile: DeviceProfile | None) -> bool:
        """Whether the device drops out of this round (battery, network, user), drawn per round."""
        if self.dropout is not None:
            return bool(agent.rng.random() < self.dropout)
        return profile is not None and profile.draw_dropout(agent.rng) is not None

    def _hand(self, agent: DeviceAgent, event: Event, model_bytes: int) -> None:
        """Give one device an event; carry out what its policy answers in a task of its own."""
        effects = agent.handle(event)
        if effects:
            task = asyncio.create_task(self._carry_out(agent, deque(effects), model_bytes))
            self._work.add(task)
            task.add_done_callback(self._work.discard)
            task.add_done_callback(self._poke)

    async def settled(self) -> None:
        """Wait until no device is downloading, training or uploading."""
        while self._work:
            await asyncio.gather(*list(self._work), return_exceptions=True)

    async def _carry_out(self, agent: DeviceAgent, todo: deque[Effect], model_bytes: int) -> None:
        """The device's effects, in modelled time (download, train, upload), and those their
        outcomes bring (the next queued model); the device's policy keeps it to one at a time."""
        try:
            while todo:
                effect = todo.popleft()
                if isinstance(effect, Train):
                    todo.extend(agent.handle(await self._train(agent, effect.msg, model_bytes)))
                elif isinstance(effect, Upload):
                    todo.extend(agent.handle(await self._upload(agent, effect)))
                elif isinstance(effect, Resend):
                    await self._resend(agent, effect)
                elif isinstance(effect, PublishStatus):
                    await self._publish_status(agent, effect.online)
                elif isinstance(effect, Publish):
                    await self._publish_secure(agent, effect)
        except aiomqtt.MqttError as exc:
            agent.handle(Disconnected())  # what it released is kept, to re-send
            if self._closing:
                return  # the job is over and connections are closing
            self.publish_failures += 1
            self._session_lost.set()  # re-open the session now; the update is re-sent then
            log.warning(
                "device %s could not publish (re-sent if the round is re-broadcast): %s",
                agent.device_id,
                exc,
            )
        except BaseException:
            agent.handle(Disconnected())
            raise

    async def _train(self, agent: DeviceAgent, msg: GlobalModel, model_bytes: int) -> Trained:
        """Download (modelled), then train in the pool: the Train effect's outcome."""
        device = agent.device_id
        profile = self.profiles.get(device)
        if profile is not None:
            # nothing is published before the compute and the upload's latency are over (a
            # measured compute is known only after the training: then the latency alone)
            lead = profile.upload_time(0)
            if self.machine_samples_per_s is None:
                lead += profile.compute_time(agent.n_samples, agent.training.epochs)
            await self.clock.sleep(
                profile.download_time(model_bytes), key=(device, WORK), lead=lead
            )
        if device in self.unavailable or device in self.crashed:
            return Trained(msg, None)  # gone before it could train: the round stays unanswered
        loop = asyncio.get_running_loop()
        work = agent.n_samples * agent.training.epochs
        first = self._first_training
        if first is not None:  # the cost is being measured: then the same choice as later
            await first.wait()  # rounds make, not a pool hand-off each
        elif math.isinf(self._train_cpu_per_sample):
            first = self._first_training = asyncio.Event()
        t0 = loop.time()
        try:
            if self._train_cpu_per_sample * work < INLINE_TRAIN_S:
                payload, cpu_s = _timed(agent.on_global, msg)
                self.inline_trainings += 1
            else:
                payload, cpu_s = await loop.run_in_executor(
                    self._pool, _timed, agent.on_global, msg
                )
            self.vt_train_s += loop.time() - t0
            self._train_cpu_s[device] = cpu_s
            self._train_cpu_per_sample = cpu_s / max(work, 1)
        except Exception as exc:
            self._training_failed(agent, msg.round, exc)
            return Trained(msg, None)
        finally:
            if first is not None and first is self._first_training:  # this one measured
                self._first_training = None
                first.set()
        if device in self.crashed:
            return Trained(msg, None)
        return Trained(msg, payload)

    def _training_failed(self, agent: DeviceAgent, rnd: int, exc: Exception) -> None:
        """A device's training raised (a model's ``grad`` that raises or returns the wrong
        shape, say): counted, and the device stops, as a device that cannot run the job's
        mechanism does (docs/protocol.md, implementation note 16): its status says
        ``i.stopped = "training_failed"`` (:class:`~edge_fl.device.policy.Trained` publishes it),
        so the aggregator stops selecting it and a round that waits only for such devices is
        decided at once, not at its deadline; when no device can contribute any more, the job
        ends early saying so. Why stop rather than try again next round: such an error is a
        bug in the model or the device's data, which the next round repeats (every device,
        every round, each waiting out a deadline for updates that cannot come).

        Logged once per distinct error (type and message) with its traceback; repeats are
        counted, summed up in one line per record (:meth:`failures_round`) and at the end."""
        self.device_failures += 1
        self._failures_since += 1
        what = f"{type(exc).__name__}: {exc}"
        if len(what) > 200:  # a message quoting arrays: the key, and the lines, stay short
            what = what[:197] + "..."
        seen = self.failure_errors.get(what, 0)
        self.failure_errors[what] = seen + 1
        if agent.state.stopped_reason is None:
            agent.state.stopped_reason = TRAINING_FAILED
        if seen == 0:
            log.error(
                "device %s: training failed in round %d (%s); the device stops (status "
                "stopped: %s); the same error on other devices is counted, not logged again",
                agent.device_id,
                rnd,
                what,
                TRAINING_FAILED,
                exc_info=exc,
            )
        else:
            self._repeats_since[what] = self._repeats_since.get(what, 0) + 1
            log.debug("device %s: training failed in round %d (%s)", agent.device_id, rnd, what)

    def failures_round(self) -> int:
        """Trainings that failed since the previous call (a round's record); the repeats of
        errors already logged are summed up in one line."""
        n, self._failures_since = self._failures_since, 0
        if self._repeats_since:
            more = sum(self._repeats_since.values())
            log.warning("training failed on %d more devices (%s)", more, tally(self._repeats_since))
            self._repeats_since = {}
        return n

    def _compute_time(self, agent: DeviceAgent, profile: DeviceProfile) -> float:
        """The device's modelled local training time: from its profile, or from the real
        training's CPU time on this machine (``machine_samples_per_s``)."""
        speed = self.machine_samples_per_s
        if speed is None:
            return profile.compute_time(agent.n_samples, agent.training.epochs)
        cpu_s = self._train_cpu_s.pop(agent.device_id, 0.0)
        return cpu_s * speed / profile.compute_samples_per_s

    async def _upload(self, agent: DeviceAgent, effect: Upload) -> Uploaded:
        """Compute and upload (modelled), a dropout drawn per round, then publish."""
        device = agent.device_id
        profile = self.profiles.get(device)
        if profile is not None:
            await self.clock.sleep(
                self._compute_time(agent, profile),
                key=(device, WORK),
                lead=profile.upload_time(0),  # the upload's latency, at least, comes next
            )
        if self._drops(agent, profile) or device in self.unavailable:
            self.dropouts += 1
            return Uploaded(effect.round, dropped=True)
        if profile is not None:
            await self.clock.sleep(profile.upload_time(len(effect.payload)), key=(device, WORK))
        if device in self.crashed:
            return Uploaded(effect.round, dropped=True)
        client = self.clients.get(device)
        if client is None:  # its session is being re-opened: re-sent then
            self._session_lost.set()
            return Uploaded(effect.round)
        task = asyncio.current_task()
        assert task is not None
        self._uploading[device] = task
        try:
            await client.publish(self.topics.update(device), effect.payload, qos=1)
        except asyncio.CancelledError:
            if device not in self._abandoned:
                raise
            self._abandoned.discard(device)
            task.uncancel()  # not the job's cancellation: the lost session's (re-sent)
            raise aiomqtt.MqttError("session lost before the broker acknowledged it") from None
        finally:
            self._uploading.pop(device, None)
        self.vt_published += 1
        self._delivered(device, effect.round)
        return Uploaded(effect.round)

    async def abandon_upload(self, device: str) -> None:
        """Stop waiting for the PUBACK of an update that went out on a session now lost: that
        session will never bring it, and aiomqtt would wait out its timeout (10 s, a round's
        deadline), holding the device so that it re-sent only after its round had closed
        without it. The device then re-sends on its new session, as after any failed publish
        (the aggregator counts a copy it already has as a duplicate)."""
        stuck = self._uploading.get(device)
        if stuck is None or stuck.done():
            return
        self._abandoned.add(device)
        stuck.cancel()
        with contextlib.suppress(BaseException):
            await stuck
        self._abandoned.discard(device)

    async def _publish_secure(self, agent: DeviceAgent, effect: Publish) -> None:
        """A SecAgg+ message, unless the device vanished from the round before its phase."""
        # the phases a device can vanish before (the driver imports both SecAgg+ state machines
        # and their cryptography: only for jobs that run secure rounds)
        from edge_fl.secagg.driver import VANISH as PHASES

        device = agent.device_id
        phase = PHASES.index(PHASE_OF.get(effect.kind, "unmask"))
        if effect.kind == "ak":  # a new session: does the device vanish in this round, when?
            forced = self.secure_vanish.get(device)
            if forced is not None:
                self._vanish[device] = (effect.round, PHASES.index(forced))
            elif self._drops(agent, self.profiles.get(device)):
                self._vanish[device] = (effect.round, int(agent.rng.integers(len(PHASES))))
            else:
                self._vanish.pop(device, None)
        vanish = self._vanish.get(device)
        if vanish is not None and vanish[0] == effect.round and phase >= vanish[1]:
            if phase == vanish[1]:
                self.dropouts += 1
            return
        client = self.clients.get(device)
        if client is None or device in self.crashed or device in self.unavailable:
            return
        await client.publish(self.topics.update(device), effect.payload, qos=1)
        self.vt_published += 1
        if effect.kind == "mx":  # the masked input is this device's update of the round
            self._delivered(device, effect.round)

    async def _resend(self, agent: DeviceAgent, effect: Resend) -> None:
        """Publish this round's update again: the aggregator re-broadcast the round (not while
        the device is outside its availability window: it receives models then, does no work)."""
        device = agent.device_id
        client = self.clients.get(device)
        if client is None or device in self.crashed or device in self.unavailable:
            return
        await client.publish(self.topics.update(agent.device_id), effect.payload, qos=1)
        self.vt_published += 1
        self.resent += 1
        self._delivered(agent.device_id, effect.round)

    def _delivered(self, device: str, rnd: int) -> None:
        """Count an update the first time it reaches the broker, by its first send or a re-send
        (one whose first publish failed counts when a re-send gets it through)."""
        if self._delivered_round.get(device) != rnd:
            self._delivered_round[device] = rnd
            self.published += 1

    async def _publish_status(self, agent: DeviceAgent, online: bool) -> None:
        client = self.clients.get(agent.device_id)
        if client is None or agent.device_id in self.crashed:
            return
        status = agent.status(online)
        await self._publish_status_on(client, self.topics.status(agent.device_id), status)
        self.vt_published += 1

    async def _publish_status_on(self, client: aiomqtt.Client, topic: str, status: bytes) -> None:
        """A device's status on its own session, QoS 1, retained. Under virtual time its PUBACK
        is not awaited: paho queues it, writes it at once and keeps it in flight until the
        broker acknowledges it, the same packets as an awaited publish. What it saved: a future,
        a ``wait_for`` task and a wake-up of the device's task per status (20,506 in a simulated
        day of 1,000 phones). Nothing waits on that PUBACK under virtual time: the aggregator
        counts the status itself (the report's ``n``) before it takes anything of that time."""
        if not self.virtual:
            await client.publish(topic, status, qos=1, retain=True)
            return
        info = client_adapter.paho_client(client).publish(topic, status, qos=1, retain=True)
        if info.rc != 0:  # not connected: what aiomqtt's publish raises
            raise aiomqtt.MqttCodeError(info.rc, "Could not publish message")

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def hand_dispatch(self, dispatch: Dispatch) -> None:
        """Hand an admitted dispatch to the local devices it names (a device it does not name
        does nothing with it: its policy's first rule); they already hold the model."""
        self._last_dispatch = dispatch
        event = DispatchArrived(dispatch)
        for device in dispatch.selected:
            agent = self.agents.get(device)
            if agent is None or device in self.crashed or device in self.unavailable:
                continue
            self._hand(agent, event, 0)

    async def _listen_for_dispatch(self, downlink: aiomqtt.Client) -> None:
        """The job is asynchronous: take ``dispatch`` on the downlink, and charge (or, with
        ``device_downlink``, make) each device's own subscription to it."""
        self.asynchronous = True
        if not self.virtual:  # virtual time subscribed to it from the start
            await downlink.subscribe(self.topics.dispatch, qos=0)
        for device, client in list(self.clients.items()):
            if device == self.downlink_device or device in self.crashed:
                continue
            if self.device_downlink:
                with contextlib.suppress(aiomqtt.MqttError):  # a lost session re-subscribes
                    await client.subscribe(self.topics.dispatch, qos=0)
            else:
                self._charge_subscription(device, [self.topics.dispatch])

    def hand_out(self, msg: GlobalModel, model_bytes: int) -> None:
        """Hand an admitted model to every device that is there to receive it (what the shared
        downlink does with each; ``model_bytes``: its size, for the modelled download).

        A device outside its availability window still holds its session and receives the model
        (it does not train: ``_train``), so when it is back and a dispatch asks it to train on
        this version, it has the model, as a real device would."""
        self._last_msg = msg
        self._last_model_bytes = model_bytes
        event = ModelArrived(msg)
        for device, agent in self.agents.items():
            if device in self.crashed:
                continue
            self._hand(agent, event, model_bytes)

    async def _availability(self, agent: DeviceAgent, profile: DeviceProfile) -> None:
        """Follow the device's availability model: offline status outside its windows."""
        model = profile.availability
        topic = self.topics.status(agent.device_id)
        while agent.device_id not in self.crashed:
            t = self.clock.now()
            available = model.available_at(t)
            was = agent.device_id not in self.unavailable
            if available != was:
                if available:
                    self.unavailable.discard(agent.device_id)
                else:
                    self.unavailable.add(agent.device_id)
                # the current session (a re-opened one announces the status it finds anyway)
                client = self.clients.get(agent.device_id)
                try:
                    if client is not None:
                        await self._publish_status_on(client, topic, agent.status(available))
                        self.vt_published += 1
                except aiomqtt.MqttError:
                    self._session_lost.set()
            # key: a device's availability change comes before its own work at the same time
            await self.clock.sleep_until(model.next_change(t), key=(agent.device_id, STATUS))

    def _start_availability(self) -> None:
        if not self.clock.modelled:
            return
        for device, profile in self.profiles.items():
            if device in self.clients and not isinstance(profile.availability, AlwaysAvailable):
                if not profile.availability.available_at(self.clock.now()):
                    self.unavailable.add(device)
                task = asyncio.create_task(self._availability(self.agents[device], profile))
                self._tasks.add(task)
                self._clocked.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(self._clocked.discard)
                task.add_done_callback(self._poke)

    async def _downlink_or_clock(self, driver: asyncio.Task | None) -> bool:
        """One downlink session (True when the job is done); under virtual time it ends too
        when the clock driver does, whose session a broker loss takes (MqttError)."""
        if driver is None:
            return await self._downlink()
        downlink = asyncio.create_task(self._downlink(), name="fleet-downlink")
        try:
            await asyncio.wait({downlink, driver}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not downlink.done():
                downlink.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiomqtt.MqttError):
                    await downlink
        if downlink.done() and not downlink.cancelled():
            return downlink.result()
        exc = driver.exception()
        raise (
            exc
            if isinstance(exc, aiomqtt.MqttError)
            else aiomqtt.MqttError(f"the virtual-time clock session ended ({exc!r})")
        )

    async def _downlink(self) -> bool:
        """One downlink session; True when the job is done."""
        if self.downlink_device is not None:
            device = self.downlink_device
            client = self.clients.get(device)
            if client is None or not client_adapter.is_connected(client):
                self.clients.pop(device, None)
                await self._connect(self.agents[device], asyncio.Semaphore(1))
                client = self.clients[device]
            return await self._serve_downlink(client)
        downlink = aiomqtt.Client(**self.spec.aiomqtt_kwargs(), identifier=self.downlink_id)
        attach(downlink, self.downlink_wire)
        async with downlink:
            return await self._serve_downlink(downlink)

    async def _serve_downlink(self, downlink: aiomqtt.Client) -> bool:
        """Receive global models on ``downlink`` and hand them out; True when the job is done."""
        if self.virtual:  # both from the start: every message the aggregator counts comes live
            await downlink.subscribe([(self.topics.global_model, 0), (self.topics.dispatch, 0)])
        elif self.asynchronous:
            await downlink.subscribe([(t, 0) for t in self._downlink_topics()])
        else:
            await downlink.subscribe(self.topics.global_model, qos=0)
        self._downlink_subscribed.set()
        self.trust.window.rejoin()  # rounds may have passed while the downlink was away
        self.reconnect_attempt = 0
        self._downlink_up = True
        try:
            return await self._receive(downlink)
        finally:
            self._downlink_up = False

    async def _receive(self, downlink: aiomqtt.Client) -> bool:
        async for message in downlink.messages:
            owner = self.downlink_device
            if self.secure and owner is not None and self._inbox(self.agents[owner], message):
                continue
            if not self.device_downlink:
                self._charge_model(message)
            payload = message.payload
            if not isinstance(payload, bytes | bytearray) or not payload:
                continue  # cleared retained message: no model yet
            if self.virtual:
                if message.retain:
                    continue  # an earlier run's: this run's messages all come live
                self.vt_seen += 1  # counted whatever becomes of it: the aggregator counts it
                self._vt_seen_changed.set()
            if message.topic.matches(self.topics.dispatch):
                asked = receive_dispatch(self.trust, bytes(payload), self.topics)
                if asked is not None:
                    self._deliver("dispatch", asked.dispatch, 0)
                continue
            event = self.trust.receive(
                bytes(payload),
                self.topics,
                self.n_params,
                retained=bool(message.retain),
                digest=self.digest,
            )
            if event is None:
                continue
            if isinstance(event, JobEnded):
                return True  # every device says offline when the fleet leaves
            if event.msg.mode != "sync" and not self.asynchronous:
                await self._listen_for_dispatch(downlink)
            self._deliver("model", event.msg, len(payload))
        return False

    def _deliver(self, kind: str, msg: object, model_bytes: int) -> None:
        """Hand a model or dispatch to the devices now, or (virtual time) at the simulated time
        of the grant that counts it."""
        if self.virtual:
            self._vt_deliveries.append((kind, msg, model_bytes))
            return
        self._hand_over(kind, msg, model_bytes)

    def _hand_over(self, kind: str, msg: object, model_bytes: int) -> None:
        if kind == "inbox":
            assert isinstance(msg, tuple)
            agent, payload = msg
            self._hand_inbox(agent, payload)
        elif kind == "model":
            assert isinstance(msg, GlobalModel)
            self.hand_out(msg, model_bytes)
        else:
            assert isinstance(msg, Dispatch)
            self.hand_dispatch(msg)

    # ------------------------------------------------------------ virtual time

    def _poke(self, _task: object = None) -> None:
        if self.virtual:
            assert isinstance(self.clock, VirtualClock)
            self.clock.changed.set()

    def quiescent(self) -> bool:
        """Every device task (download, training, upload, availability) is blocked on the
        virtual clock: nothing more happens until the clock moves."""
        assert isinstance(self.clock, VirtualClock)
        # a task leaves its set in its first done callback and pokes the clock in a later one,
        # so a finished task still counted here is re-checked when that poke comes (counting
        # live tasks in the sets instead was a scan of every availability loop per change)
        return self.clock.waiting >= len(self._work) + len(self._clocked)

    async def _quiet(self) -> None:
        assert isinstance(self.clock, VirtualClock)
        changed = self.clock.changed
        while True:
            changed.clear()
            if self.quiescent():
                return
            await changed.wait()

    async def advance_to(self, t: float) -> None:
        """Carry out every device event up to simulated time ``t``: timers in time order (each
        time until quiescent), the aggregator's messages counted by the grant at ``t`` (after
        the fleet's own events of that time), then what they set off at ``t``."""
        clock = self.clock
        assert isinstance(clock, VirtualClock)
        await self._quiet()
        while True:
            if clock.fire_due(t):
                await self._quiet()
                continue
            if self._vt_deliveries:
                clock.move_to(t)
                deliveries, self._vt_deliveries = _in_order(self._vt_deliveries), []
                for kind, msg, model_bytes in deliveries:
                    self._hand_over(kind, msg, model_bytes)
                await self._quiet()
                continue
            break
        clock.move_to(t)

    def _report(self, kind: str, g: int, t: float) -> bytes:
        """A clock report, with its lookahead: when each pending piece of device work can
        publish its update at the earliest (download, compute and upload timers: key
        ``(device, WORK)``), and the next status (availability timers: ``(device, STATUS)``)."""
        clock = self.clock
        assert isinstance(clock, VirtualClock)
        earliest, bounds = clock.lookahead(_kind, UPS_MAX)
        statuses = bounds.get(STATUS)
        return ClockMessage(
            kind,
            g=g,
            t=t,
            n=self.vt_published,
            next=earliest,
            seen=self.vt_seen,
            ups=tuple(bounds.get(WORK, ())),
            st=statuses[0] if statuses else math.inf,
        ).encode()

    async def _await_seen(self, n: int) -> None:
        while self.vt_seen < n:
            self._vt_seen_changed.clear()
            if self.vt_seen >= n:
                return
            await self._vt_seen_changed.wait()

    def _clock_client(self) -> aiomqtt.Client:
        gone = ClockMessage("gone").encode()
        client = aiomqtt.Client(
            **self.spec.aiomqtt_kwargs(),
            identifier=f"{self.client_prefix}-clock",
            will=aiomqtt.Will(clock_topic(self.topics.base, "fleet"), gone, qos=1),
            clean_session=True,
            keepalive=self.keepalive_s,
        )
        client_adapter.write_through(client)  # its reports: no writer per packet
        return client

    async def _await_aggregator(self, client: aiomqtt.Client) -> None:
        """Until the job's retained document is there: the aggregator publishes it once it has
        subscribed to statuses and updates (``edge-fl fleet`` under virtual time)."""
        await client.subscribe(self.topics.job_document, qos=1)
        async for message in client.messages:
            if message.topic.matches(self.topics.job_document) and message.payload:
                break
        await client.unsubscribe(self.topics.job_document)

    async def _clock_driver(self, client: aiomqtt.Client) -> None:
        """Virtual time, the fleet's side: say ready, then answer each grant (wait for the
        aggregator's messages it counts, carry out every event up to its time, report)."""
        out = clock_topic(self.topics.base, "fleet")
        await self._downlink_subscribed.wait()
        await client.publish(out, self._report("ready", 0, self.clock.now()), qos=1)
        answered, report = 0, b""
        async for message in client.messages:
            payload = message.payload
            if not isinstance(payload, bytes | bytearray):
                continue
            try:
                grant = decode_clock(bytes(payload))
            except ClockMessageError as exc:
                log.warning("fleet: clock message ignored: %s", exc)
                continue
            if grant.kind != "grant" or grant.g < answered:
                continue
            if grant.g == answered:  # published again: the aggregator missed the report
                task = asyncio.create_task(client.publish(out, report, qos=1))
                task.add_done_callback(_retrieved)
                continue
            await self._await_seen(grant.n)
            await self.advance_to(grant.t)
            self.vt_cycles += 1
            # not awaited: its PUBACK would cost a broker round trip per step (QoS 1 all the same)
            report = self._report("report", grant.g, grant.t)
            answered = grant.g
            task = asyncio.create_task(client.publish(out, report, qos=1))
            task.add_done_callback(_retrieved)

    async def _reconnect_devices(self) -> None:
        """Re-open the sessions the broker dropped (their wills marked them offline)."""
        gate = asyncio.Semaphore(self.connect_concurrency)
        lost = [
            d
            for d in self.agents
            if d not in self.crashed
            and (d not in self.clients or not client_adapter.is_connected(self.clients[d]))
        ]
        lost = [d for d in lost if d not in self._reopening]  # the session watcher has these
        await asyncio.gather(*(self.abandon_upload(d) for d in lost))
        for device in lost:
            self.clients.pop(device, None)
        self._reopening.update(lost)
        try:
            await asyncio.gather(
                *(self._connect(self.agents[d], gate) for d in lost), return_exceptions=True
            )
        finally:
            self._reopening.difference_update(lost)

    def _lost_sessions(self) -> list[str]:
        """Devices whose own session is gone (not crashed on purpose, not being re-opened, not
        the downlink's session, which the downlink loop re-opens)."""
        return [
            d
            for d in self.agents
            if d not in self.crashed
            and d != self.downlink_device
            and d not in self._reopening
            and (d not in self.clients or not client_adapter.is_connected(self.clients[d]))
        ]

    async def _reopen(self, device: str, gate: asyncio.Semaphore) -> None:
        """Re-open one device's session, then re-send its update for the newest round, as a
        device re-sends when the retained model arrives on its new session (the aggregator
        counts a copy it already has as a duplicate)."""
        self._reopening.add(device)
        try:
            await self.abandon_upload(device)
            self.clients.pop(device, None)
            try:
                await self._connect(self.agents[device], gate)
            except aiomqtt.MqttError as exc:
                _, failures = self._retry_at.get(device, (0.0, 0))
                delay = min(0.5 * 2**failures, self.max_session_backoff_s)
                self._retry_at[device] = (asyncio.get_running_loop().time() + delay, failures + 1)
                log.warning(
                    "device %s: reconnect failed (%s); next try in %.1fs", device, exc, delay
                )
                return
            self._retry_at.pop(device, None)
            self.reopened += 1
            log.info("device %s: session re-opened", device)
            msg = self._last_msg
            if msg is not None and device not in self.unavailable and not self._closing:
                # what its own subscription would get on the new session: the retained model
                # (and the retained dispatch, when it names this device)
                self._hand(self.agents[device], ModelArrived(msg), self._last_model_bytes)
                asked = self._last_dispatch
                if asked is not None and asked.selects(device):
                    self._hand(self.agents[device], DispatchArrived(asked), 0)
        finally:
            self._reopening.discard(device)

    async def _watch_sessions(self) -> None:
        """Re-open device sessions that dropped while the downlink stayed connected: with a
        cluster, a node can die under some devices' sessions and not under the downlink's, and
        nothing else would bring those devices back. While the downlink itself is down, `run`
        re-opens every session after it (no connect storm against a broker that is away)."""
        gate = asyncio.Semaphore(self.connect_concurrency)
        loop = asyncio.get_running_loop()
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._session_lost.wait(), self.session_check_s)
            self._session_lost.clear()
            if self._closing or not self._downlink_up:
                continue
            now = loop.time()
            due = [d for d in self._lost_sessions() if self._retry_at.get(d, (0.0, 0))[0] <= now]
            if due:
                log.warning("fleet: re-opening %d dropped device sessions", len(due))
                await asyncio.gather(*(self._reopen(d, gate) for d in due))

    async def run(self) -> None:
        """Connect every device, serve global models until the job is done, then leave cleanly.

        If the broker goes away, the fleet reconnects (downlink first, then every dropped device
        session) with exponential backoff, up to ``max_reconnects`` attempts in a row."""
        clock_client: aiomqtt.Client | None = None
        driver: asyncio.Task | None = None
        try:
            if self.virtual:
                clock_client = self._clock_client()
                await clock_client.__aenter__()
                client_adapter.no_delay(clock_client)
                await clock_client.subscribe(clock_topic(self.topics.base, "agg"), qos=1)
                if self.wait_for_aggregator:
                    await self._await_aggregator(clock_client)
            await self.connect_all()
            if self.virtual:
                self.vt_published += len(self.clients)  # each session announced its status
            self._start_availability()
            self._spawn(self._watch_sessions())
            if clock_client is not None:
                driver = asyncio.create_task(self._clock_driver(clock_client), name="fleet-clock")
                driver.add_done_callback(_report_driver_end)
            self.reconnect_attempt = 0
            while True:
                try:
                    if await self._downlink_or_clock(driver):
                        break
                except aiomqtt.MqttError as exc:
                    if is_fatal(exc):
                        raise  # a refused login or certificate: retrying cannot fix it
                    if self.virtual:
                        self.broker_lost = True
                        log.warning(
                            "fleet: lost the broker %s under virtual time (%s): the clock "
                            "session went with it and the aggregator stops its job there, so "
                            "the fleet stops too",
                            self.spec.redacted(),
                            exc,
                        )
                        break
                    self.reconnect_attempt += 1
                    if self.reconnect_attempt > self.max_reconnects:
                        raise RuntimeError(
                            f"fleet lost the broker at {self.spec.redacted()} and could not "
                            f"reconnect after {self.max_reconnects} attempts: {exc}"
                        ) from exc
                    delay = min(0.2 * 2**self.reconnect_attempt, 10.0)
                    log.warning("fleet: broker unavailable (%s); retrying in %.1fs", exc, delay)
                    await asyncio.sleep(delay)
                    try:
                        await self._reconnect_devices()
                    except aiomqtt.MqttError:
                        continue
            for task in [*self._tasks, *self._work]:
                task.cancel()  # availability loops and stragglers: the job is over
        finally:
            self._closing = True
            if driver is not None:
                driver.cancel()
            if clock_client is not None:
                with contextlib.suppress(Exception):
                    gone = ClockMessage("gone").encode()
                    await clock_client.publish(clock_topic(self.topics.base, "fleet"), gone, qos=1)
                    await clock_client.__aexit__(None, None, None)
            await self.disconnect_all()
            await self.keepalive.close()
            if self.device_failures:
                log.error(
                    "fleet: %d trainings failed (%s); the first of each error is logged above "
                    "with its traceback",
                    self.device_failures,
                    tally(self.failure_errors),
                )
            self._pool.shutdown(wait=False, cancel_futures=True)


def _kind(key: tuple) -> object:
    """A device timer's kind, ``WORK`` or ``STATUS``: its key is ``(device, kind)``."""
    return key[1]


def _in_order(deliveries: list[tuple[str, object, int]]) -> list[tuple[str, object, int]]:
    """The aggregator's messages for one simulated time in an order no session race decides:
    the shared downlink's (one session: the broker's order) first, then the devices' inboxes
    by device id, each device's own in its session's order (a stable sort)."""

    def key(delivery: tuple[str, object, int]) -> tuple[int, str]:
        kind, msg, _ = delivery
        if kind != "inbox":
            return (0, "")
        assert isinstance(msg, tuple)
        return (1, msg[0].device_id)

    return sorted(deliveries, key=key)


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a lost broker is reported by the sessions, not per clock message


def _report_driver_end(task: asyncio.Task) -> None:
    """The fleet's clock driver only ends with the fleet (cancelled) or with its session (the
    run loop says that and stops); anything else stalls virtual time, so it is said at once."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, aiomqtt.MqttError):
        log.error("fleet: virtual-time driver failed: %r", exc)


def _timed(fn: Callable[[T], R], arg: T) -> tuple[R, float]:
    """``fn(arg)`` and the CPU seconds this thread spent on it (not the wall time: another
    thread or process on the machine does not lengthen it)."""
    t0 = time.thread_time()
    out = fn(arg)
    return out, time.thread_time() - t0


#: a training predicted shorter than this runs on the event loop, not in the training pool:
#: handing sub-millisecond work to a thread cost more than the work (the default job's
#: devices, 0.6 ms each alone, took 0.83 ms of thread CPU and 1.2 ms of wall in the pool while
#: the loop's I/O contended for the interpreter lock); this bounds how long the loop, and with
#: it every session's I/O, can be held by one device
INLINE_TRAIN_S = 0.003

#: from this many sessions on, the fleet's objects are frozen once connected (below it the
#: collector's passes are cheap, and a process running many small fleets, a test run, keeps
#: collecting their cycles)
FREEZE_SESSIONS = 1_000


@contextlib.contextmanager
def without_collector(*, freeze: bool) -> Iterator[None]:
    """Open or close thousands of sessions without the cyclic collector; with ``freeze``, then
    collect what the block made and move everything alive into the permanent generation.

    Why: 10,000 sessions are millions of long-lived objects that the collector's full passes
    walked again and again for nothing (measured at 10,000 sessions: about ten passes of up to
    0.3 s during the connects, then one of 0.35-0.56 s every few rounds, each collecting 0-54
    objects; as many again while the sessions left). Frozen objects are never walked again; one
    that dies later is still freed by reference counting, and a cycle among them stays until the
    process ends, bounded by memory the fleet already held.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.collect(0)  # the block's garbage (all of it young: nothing was collected)
            gc.freeze()
        if was_enabled:
            gc.enable()
