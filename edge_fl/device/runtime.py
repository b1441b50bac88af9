"""A single device agent's I/O edge (e.g. on a Raspberry Pi), over aiomqtt.

Reconnects with backoff when the network or broker goes away: a Pi on Wi-Fi loses its connection
routinely. The agent core remembers which round it answered, so a redelivered or re-read retained
global model never produces a second update.

The agent counts its own wire bytes (``edge_fl.transport.wire``: every MQTT packet its sessions
send and receive, reconnects included) and logs them per round and in total at exit, with the
link model's IP estimate (TLS and TCP/IP headers), so a device's data bill can be checked against
them and against the aggregator's records.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiomqtt

from edge_fl.device.agent import DeviceAgent
from edge_fl.device.dispatch import receive_dispatch
from edge_fl.device.policy import (
    Disconnected,
    Effect,
    InboxArrived,
    Publish,
    PublishStatus,
    Resend,
    Stop,
    Train,
    Trained,
    Upload,
    Uploaded,
)
from edge_fl.device.trust import Trust
from edge_fl.protocol import GlobalModel, Topics
from edge_fl.transport.url import BrokerSpec
from edge_fl.transport.wire import WireCounter, attach, ip_bytes

__all__ = ["Trust", "log_wire", "permanent_refusal", "retry_broker", "run_device"]

log = logging.getLogger("edge_fl.device")
T = TypeVar("T")


def log_wire(wire: WireCounter, what: str, counts: dict[str, int] | None = None) -> None:
    """One line of MQTT-layer bytes (``counts``: a ``take()``; default: the totals) and the IP
    estimate."""
    counts = counts if counts is not None else wire.totals()
    up_ip, down_ip = ip_bytes(counts, wire.link)
    log.info(
        "%s: wire up %d B, down %d B (MQTT, %d/%d packets); IP estimate up %d B, down %d B",
        what,
        counts["up"],
        counts["down"],
        counts["up_packets"],
        counts["down_packets"],
        up_ip,
        down_ip,
    )


async def _session(
    agent: DeviceAgent,
    spec: BrokerSpec,
    topics: Topics,
    digest: str,
    trust: Trust,
    wire: WireCounter | None = None,
) -> bool:
    """One connection; returns True when the job is done."""
    wire = wire if wire is not None else WireCounter()
    will = aiomqtt.Will(topics.status(agent.device_id), agent.status(False), qos=1, retain=True)
    client = aiomqtt.Client(
        **spec.aiomqtt_kwargs(), identifier=f"edgefl-{topics.job}-{agent.device_id}", will=will
    )
    attach(client, wire)
    training: set[asyncio.Task[None]] = set()  # at most one (the policy trains one at a time)
    done = False
    try:
        done = await _listen(agent, client, topics, digest, trust, wire, training, spec.redacted())
        return done
    finally:
        # the job is over: what is training is abandoned. The session was lost: the training
        # finishes (its thread cannot be stopped) and its publish fails, so its release is kept
        # (Disconnected) and re-sent when the next session receives the round again
        for task in training:
            if done:
                task.cancel()
        await asyncio.gather(*training, return_exceptions=True)


async def _listen(
    agent: DeviceAgent,
    client: aiomqtt.Client,
    topics: Topics,
    digest: str,
    trust: Trust,
    wire: WireCounter,
    training: set[asyncio.Task[None]],
    where: str,
) -> bool:
    """Read the session's messages until the job is done (True). Training runs beside the
    reading (``training``), so the device answers its inbox while it trains: a secure round's
    key and share phases go on during local training, however slow the device."""
    run = _Runner(agent, client, topics, training, wire)
    async with client:
        # subscribed before announcing itself: the aggregator may open a round the moment this
        # device counts as online, and the round's model must not arrive before the subscription.
        # QoS 0: a clean session queues nothing across a disconnect and the retained model comes
        # again on every subscribe, so QoS 1 buys nothing here; and on a NATS cluster a QoS 1
        # subscription made right after a node died sometimes received nothing (docs/brokers.md).
        # ``dispatch`` (who trains on the current version, without the model) once the job is
        # known to be asynchronous: a sync job's traffic stays what it was
        listening = agent.policy.uses_dispatch
        if listening:  # one SUBSCRIBE; the two retained copies may come in either order
            await client.subscribe([(topics.global_model, 0), (topics.dispatch, 0)])
        else:
            await client.subscribe(topics.global_model, qos=0)
        inbox = topics.inbox(agent.device_id)
        if agent.secure is not None:  # secure aggregation: the aggregator's SecAgg+ messages
            await client.subscribe(inbox, qos=1)
        await client.publish(topics.status(agent.device_id), agent.status(True), qos=1, retain=True)
        log.info("device %s connected to %s", agent.device_id, where)
        trust.window.rejoin()  # rounds may have passed while this device was away
        async for message in client.messages:
            payload = message.payload
            if not isinstance(payload, bytes | bytearray) or not payload:
                continue
            if message.topic.matches(inbox):
                await run.execute(agent.handle(InboxArrived(bytes(payload))))
                continue
            if message.topic.matches(topics.dispatch):
                asked = receive_dispatch(trust, bytes(payload), topics)
                if asked is not None:
                    await run.execute(agent.handle(asked))
                continue
            event = trust.receive(
                bytes(payload),
                topics,
                agent.model.n_params,
                retained=bool(message.retain),
                digest=digest,
            )
            if event is None:
                continue
            if not listening and event.msg.mode != "sync":
                await client.subscribe(topics.dispatch, qos=0)  # an asynchronous job
                listening = True
            effects = agent.handle(event)
            if await run.execute(effects):
                return True
            if not any(isinstance(e, Train) for e in effects):  # a model it does not train on
                log_wire(wire, f"round {event.msg.round}", wire.take())
    return False


class _Runner:
    """Carries out the policy's effects on one session; a :class:`Train` in a task of its own
    (its outcome's effects follow in that task), everything else in the caller's order."""

    def __init__(
        self,
        agent: DeviceAgent,
        client: aiomqtt.Client,
        topics: Topics,
        training: set[asyncio.Task[None]],
        wire: WireCounter,
    ) -> None:
        self.agent, self.client, self.topics, self.training = agent, client, topics, training
        self.wire = wire

    async def execute(self, effects: list[Effect]) -> bool:
        """Carry out ``effects`` (and those their outcomes bring); True on Stop."""
        try:
            return await self._carry_out(deque(effects))
        except BaseException:  # the session dropped mid-way: what was released is kept
            self.agent.handle(Disconnected())
            raise

    async def _train(self, msg: GlobalModel) -> None:
        try:
            payload = await asyncio.to_thread(self.agent.on_global, msg)
        except Exception:  # e.g. a model with extreme values: skip the round, stay up
            log.exception("round %d: training failed; this round is skipped", msg.round)
            payload = None
        try:
            await self.execute(self.agent.handle(Trained(msg, payload)))
        except aiomqtt.MqttError as exc:  # the reading side sees the lost session too
            log.warning("round %d: could not publish: %s", msg.round, exc)
        # the round's line once its update is out: since the previous line, this round's model,
        # its update and acks (the update's PUBACK, still on its way, falls into the next line;
        # a secure round's later phases too)
        log_wire(self.wire, f"round {msg.round}", self.wire.take())

    async def _carry_out(self, todo: deque[Effect]) -> bool:
        agent, client, topics = self.agent, self.client, self.topics
        while todo:
            effect = todo.popleft()
            if isinstance(effect, Train):
                task = asyncio.create_task(self._train(effect.msg))
                self.training.add(task)
                task.add_done_callback(self.training.discard)
            elif isinstance(effect, Upload):
                await client.publish(topics.update(agent.device_id), effect.payload, qos=1)
                todo.extend(agent.handle(Uploaded(effect.round)))
                log.info("round %d: sent %d bytes", effect.round, len(effect.payload))
            elif isinstance(effect, Resend):  # released before, the round came again: deliver it
                await client.publish(topics.update(agent.device_id), effect.payload, qos=1)
                log.info(
                    "round %d: re-sent %d bytes (round re-broadcast)",
                    effect.round,
                    len(effect.payload),
                )
            elif isinstance(effect, Publish):  # a SecAgg+ message of a secure round
                await client.publish(topics.update(agent.device_id), effect.payload, qos=1)
                log.info(
                    "round %d: sent %s (%d bytes)", effect.round, effect.kind, len(effect.payload)
                )
            elif isinstance(effect, PublishStatus):
                if effect.online and agent.state.stopped_reason:
                    log.warning("device %s stops: %s", agent.device_id, agent.state.stopped_reason)
                status = agent.status(effect.online)
                await client.publish(topics.status(agent.device_id), status, qos=1, retain=True)
            elif isinstance(effect, Stop):
                return True
        return False


def permanent_refusal(exc: BaseException) -> str | None:
    """What to fix, if ``exc`` is a refusal that retrying cannot cure."""
    text = str(exc).lower()
    if "not authori" in text or "bad user name or password" in text:
        return "check the device's username/password in the broker URL and the broker's ACL"
    if "certificate" in text or "ssl" in text:
        return "check the CA file (?ca=...) and that the broker's certificate names this host"
    return None


async def run_device(
    agent: DeviceAgent,
    spec: BrokerSpec,
    topics: Topics,
    digest: str = "",
    max_backoff_s: float = 60.0,
    trust: Trust | None = None,
    retry_forever: bool = False,
    wire: WireCounter | None = None,
) -> int:
    """Serve rounds until the job is done; returns the number of updates sent.

    A lost network or broker is retried with backoff. A refusal that retrying cannot fix (bad
    credentials, a certificate that does not verify) ends the run with a RuntimeError naming it,
    unless ``retry_forever`` (a service that must come back once the operator fixes the broker).
    ``wire``: counts every session's bytes (logged per round and in total at exit)."""
    trust = trust or Trust()
    wire = wire if wire is not None else WireCounter()
    try:
        return await _serve(agent, spec, topics, digest, max_backoff_s, trust, retry_forever, wire)
    finally:
        log_wire(wire, f"device {agent.device_id} total ({wire.connections} connections)")


async def _serve(
    agent: DeviceAgent,
    spec: BrokerSpec,
    topics: Topics,
    digest: str,
    max_backoff_s: float,
    trust: Trust,
    retry_forever: bool,
    wire: WireCounter,
) -> int:
    async def until_done() -> int | None:
        done = await _session(agent, spec, topics, digest, trust, wire)
        return agent.state.updates_sent if done else None

    return await retry_broker(
        spec, until_done, retry_forever=retry_forever, max_backoff_s=max_backoff_s
    )


async def retry_broker(
    spec: BrokerSpec,
    once: Callable[[], Awaitable[T | None]],
    *,
    retry_forever: bool = False,
    max_backoff_s: float = 60.0,
) -> T:
    """``once()`` until it returns a value; a lost network or broker is retried with backoff (a
    Pi on Wi-Fi loses its connection routinely), None (a session that ended) at once. A refusal
    that retrying cannot fix ends with a RuntimeError naming it, unless ``retry_forever``."""
    attempt = 0
    while True:
        try:
            result = await once()
        except aiomqtt.MqttError as exc:
            hint = permanent_refusal(exc)
            if hint is not None and not retry_forever:
                raise RuntimeError(
                    f"broker {spec.redacted()} refused this device: {exc} ({hint})"
                ) from None
            attempt += 1
            delay = min(0.5 * 2**attempt, max_backoff_s)
            log.warning("broker %s: %s; retrying in %.1fs", spec.redacted(), exc, delay)
            await asyncio.sleep(delay)
            continue
        if result is not None:
            return result
        attempt = 0
