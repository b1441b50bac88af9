"""The aggregator service: the core's I/O edge over aiomqtt.

It subscribes to updates and statuses, feeds payload bytes to :class:`AggregatorCore`, drives
round deadlines with the event loop's clock, publishes the retained global model and one metrics
record per round. If the broker vanishes it reconnects with a persistent session (QoS 1 updates queued by the
broker meanwhile are delivered then) and republishes the open round; the core's state, and so every
accepted update, survives the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiomqtt

from edge_fl.protocol import Topics, encode_global
from edge_fl.transport.url import BrokerSpec

from .aggregator import AggregatorCore
from .rounds import Decision

log = logging.getLogger("edge_fl.aggregator")

RecordCallback = Callable[[dict[str, Any]], None]


class BrokerUnavailable(RuntimeError):
    """The broker could not be reached within the retry budget."""


class AggregatorService:
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
    ) -> None:
        self.core = core
        self.spec = spec
        self.topics = topics
        self.wait_for_devices_s = wait_for_devices_s
        self.expected_devices = expected_devices
        self.on_record = on_record or (lambda _r: None)
        self.reconnect_attempts = reconnect_attempts
        self.checkpoint_dir = checkpoint_dir
        self.client_id = client_id or f"edgefl-{topics.job}-aggregator"
        self._wake = asyncio.Event()
        self._global_payload: bytes | None = None
        self._client: aiomqtt.Client | None = None
        self._round_started = 0.0
        self.connected = asyncio.Event()

    # ---------------------------------------------------------------- plumbing

    def _dispatch(self, message: aiomqtt.Message) -> None:
        topic = str(message.topic)
        payload = message.payload if isinstance(message.payload, bytes | bytearray) else b""
        if (device := self.topics.device_of(topic, "up")) is not None:
            reason = self.core.on_update(device, bytes(payload))
            if reason is not None:
                log.debug("update from %s rejected: %s", device, reason)
            else:
                # any accepted update may end the round: the target, or the last one that can
                # still come (decide() knows which devices stopped or went offline)
                self._wake.set()
        elif (device := self.topics.device_of(topic, "status")) is not None:
            self.core.on_status(device, bytes(payload))
            self._wake.set()

    async def _reader(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            self._dispatch(message)

    async def _publish_global(self, client: aiomqtt.Client) -> None:
        if self._global_payload is not None:
            await client.publish(self.topics.global_model, self._global_payload, qos=1, retain=True)

    async def _sleep_until(self, deadline: float | None) -> None:
        """Wait for a wake-up (update, status) or until ``deadline`` on the loop clock."""
        self._wake.clear()
        timeout = None if deadline is None else max(0.0, deadline - self._now())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # ---------------------------------------------------------------- rounds

    async def _wait_for_devices(self) -> None:
        """Start when every expected device has reported a status (online or not) and enough are
        available, or after the wait with whoever is there."""
        want = self.expected_devices or self.core.settings.n_select
        need = min(want, self.core.settings.n_select)
        until = self._now() + self.wait_for_devices_s
        while self._now() < until and (
            len(self.core.devices) < want or len(self.core.available()) < need
        ):
            if len(self.core.devices) >= want and len(self.core.available()) >= max(
                1, self.core.settings.min_updates
            ):
                break  # everyone reported; fewer are available than we would like: go
            await self._sleep_until(until)
        if len(self.core.available()) < self.core.settings.min_updates:
            raise RuntimeError(
                f"only {len(self.core.available())} devices online after "
                f"{self.wait_for_devices_s:.0f}s; a round needs at least "
                f"{self.core.settings.min_updates}"
            )

    async def _run_rounds(self, client: aiomqtt.Client) -> None:
        core = self.core
        while not core.finished:
            if core.current is None:
                now = self._now()
                msg = core.open_round(now)
                if msg is None:
                    reason = core.hopeless()
                    if reason is not None:
                        log.warning("ending the job after round %d: %s", core.round_number, reason)
                        core.ended_early = reason
                        break
                    await self._wait_for_devices()
                    continue
                self._global_payload = encode_global(msg)
                self._round_started = time.perf_counter()
                await self._publish_global(client)
                # every online device receives the retained broadcast
                core.tally.bytes_down += len(self._global_payload) * core.online_count
            decision = core.decide(self._now())
            if decision in (Decision.WAIT, Decision.EXTEND):
                if decision is Decision.EXTEND:
                    log.info("round %d short of updates; deadline extended", core.round_number)
                await self._sleep_until(core.deadline)
                continue
            wall = time.perf_counter() - self._round_started
            record = core.close_round(self._now(), wall, skipped=decision is Decision.SKIP)
            if self.checkpoint_dir is not None:
                from .checkpoint import save_checkpoint

                save_checkpoint(core, self.checkpoint_dir)
            self.on_record(record)
            public = core.public_record(record)
            await client.publish(self.topics.metrics, json.dumps(public, default=str), qos=0)

    async def _session(self) -> None:
        async with aiomqtt.Client(
            **self.spec.aiomqtt_kwargs(),
            identifier=self.client_id,
            clean_session=False,
            max_inflight_messages=100,
        ) as client:
            self._client = client
            if self.core.round_number == 0 and self.core.current is None:
                # forget the retained model of an earlier run of this job id
                await client.publish(self.topics.global_model, b"", qos=1, retain=True)
            await client.subscribe(self.topics.all_status, qos=1)
            await client.subscribe(self.topics.all_updates, qos=1)
            self.connected.set()
            self._attempt = 0
            reader = asyncio.create_task(self._reader(client))
            runner: asyncio.Task | None = None
            try:
                if self.core.current is not None:  # reconnected mid-round
                    await self._publish_global(client)
                else:
                    await self._wait_for_devices()
                runner = asyncio.create_task(self._run_rounds(client))
                done, _ = await asyncio.wait({reader, runner}, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # re-raise a reader MqttError or a round error
                final = self.core.global_message(done=True, now=time.time())
                await client.publish(self.topics.global_model, encode_global(final), 1, retain=True)
            finally:
                reader.cancel()
                if runner is not None:
                    runner.cancel()

    async def run(self) -> list[dict[str, Any]]:
        """Run all rounds; reconnect on broker loss with exponential backoff."""
        self._attempt = 0
        while True:
            try:
                await self._session()
                return self.core.records
            except aiomqtt.MqttError as exc:
                self.connected.clear()
                self._attempt += 1
                attempt = self._attempt
                if attempt > self.reconnect_attempts:
                    raise BrokerUnavailable(
                        f"lost the broker at {self.spec.redacted()} and could not reconnect after "
                        f"{self.reconnect_attempts} attempts: {exc}"
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
                await asyncio.sleep(delay)
