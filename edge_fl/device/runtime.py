"""A single device agent's I/O edge (e.g. on a Raspberry Pi), over aiomqtt.

Reconnects with backoff when the network or broker goes away: a Pi on Wi-Fi loses its connection
routinely. The agent core remembers which round it answered, so a redelivered or re-read retained
global model never produces a second update.
"""

from __future__ import annotations

import asyncio
import logging

import aiomqtt

from edge_fl.device.agent import DeviceAgent
from edge_fl.protocol import PayloadRejected, Topics, decode_global
from edge_fl.transport.url import BrokerSpec

log = logging.getLogger("edge_fl.device")


async def _session(agent: DeviceAgent, spec: BrokerSpec, topics: Topics, digest: str) -> bool:
    """One connection; returns True when the job is done."""
    will = aiomqtt.Will(topics.status(agent.device_id), agent.status(False), qos=1, retain=True)
    async with aiomqtt.Client(
        **spec.aiomqtt_kwargs(), identifier=f"edgefl-{topics.job}-{agent.device_id}", will=will
    ) as client:
        await client.publish(topics.status(agent.device_id), agent.status(True), qos=1, retain=True)
        await client.subscribe(topics.global_model, qos=1)
        log.info("device %s connected to %s", agent.device_id, spec.redacted())
        async for message in client.messages:
            payload = message.payload
            if not isinstance(payload, bytes | bytearray) or not payload:
                continue
            try:
                msg = decode_global(bytes(payload))
            except PayloadRejected as exc:
                log.warning("ignoring a bad global model: %s", exc)
                continue
            if msg.job != topics.job:
                continue
            if msg.done:
                if message.retain:
                    continue  # an earlier run's end marker
                await client.publish(
                    topics.status(agent.device_id), agent.status(False), qos=1, retain=True
                )
                return True
            if digest and msg.config_digest and msg.config_digest != digest:
                log.error(
                    "round %d: the aggregator's config digest %s differs from this device's %s "
                    "(model, data, training or privacy settings disagree); not training",
                    msg.round,
                    msg.config_digest,
                    digest,
                )
                continue
            resend = agent.pending_for(msg)
            if resend is not None:  # released before the connection dropped: deliver it now
                await client.publish(topics.update(agent.device_id), resend, qos=1)
                log.info("round %d: re-sent %d bytes (round re-broadcast)", msg.round, len(resend))
                continue
            stopped_before = agent.state.stopped_reason
            update = await asyncio.to_thread(agent.on_global, msg)
            if agent.state.stopped_reason != stopped_before:
                log.warning("device %s stops: %s", agent.device_id, agent.state.stopped_reason)
                await client.publish(
                    topics.status(agent.device_id), agent.status(True), qos=1, retain=True
                )
            if update is not None:
                await client.publish(topics.update(agent.device_id), update, qos=1)
                log.info("round %d: sent %d bytes", msg.round, len(update))
    return False


async def run_device(
    agent: DeviceAgent,
    spec: BrokerSpec,
    topics: Topics,
    digest: str = "",
    max_backoff_s: float = 60.0,
) -> int:
    """Serve rounds until the job is done; returns the number of updates sent."""
    attempt = 0
    while True:
        try:
            if await _session(agent, spec, topics, digest):
                return agent.state.updates_sent
            attempt = 0
        except aiomqtt.MqttError as exc:
            attempt += 1
            delay = min(0.5 * 2**attempt, max_backoff_s)
            log.warning("broker %s: %s; retrying in %.1fs", spec.redacted(), exc, delay)
            await asyncio.sleep(delay)
