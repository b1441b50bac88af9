"""Where the dashboard's data comes from: a live job on the broker, or a run directory.

:class:`BrokerSource` subscribes, read-only, to what an operator may read of one job: the
retained job document, global message, device statuses and ingest workers' liveness, the metrics
records and the negative acks (the live rejection details). It never subscribes to ``up/+``:
updates are the aggregator's load, and the page needs none of their bytes.

:class:`RunDirSource` follows ``metrics.jsonl`` (a finished run, or one still being written or
resumed), with ``run.json`` for the config and ``checkpoint.json`` for the fleet view at the last
checkpoint, and the releases of the ledger file it covers (read incrementally, read only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_fl.dashboard.state import DashboardState
from edge_fl.protocol.codec import decode_ack, decode_global, decode_status
from edge_fl.protocol.jobdoc import decode_job_document
from edge_fl.protocol.topics import Topics

__all__ = ["BrokerSource", "RunDirSource"]

log = logging.getLogger("edge_fl.dashboard")

RECONNECT_S = (0.5, 1.0, 2.0, 5.0)  # backoff between broker sessions


#: a ``ts`` before this (September 2001) is no Unix time: another clock's (uptime, monotonic)
UNIX_TIME_FLOOR = 1e9
#: nor one further than this ahead of the dashboard's clock
PLAUSIBLE_SKEW_S = 300.0


def wall_clock(ts: float, now: float | None = None) -> float:
    """When a global message was issued: its ``ts`` (the aggregator's wall clock, Unix seconds),
    so a page opened mid-round counts the deadline from the round's start; the message's arrival
    instead when ``ts`` is no plausible Unix time (0 or another clock, as older aggregators
    wrote, or a clock set far off)."""
    now = time.time() if now is None else now
    return ts if UNIX_TIME_FLOOR <= ts <= now + PLAUSIBLE_SKEW_S else now


class BrokerSource:
    """Feeds ``state`` from the broker until cancelled; reconnects when the broker goes away."""

    def __init__(
        self, state: DashboardState, broker_url: str, job: str, prefix: str = "edgefl"
    ) -> None:
        from edge_fl.transport.url import parse_broker_url

        self.state = state
        self.spec = parse_broker_url(broker_url)
        self.topics = Topics(job, prefix)
        self.on_change: Callable[[], None] = lambda: None
        self.connected = asyncio.Event()
        self.bad_messages = 0
        state.job = job
        state.source = "live"

    def subscriptions(self) -> list[str]:
        t = self.topics
        return [
            t.job_document,
            t.global_model,
            t.metrics,
            t.all_status,
            f"{t.base}/ack/+",
            t.all_ingest("worker"),
        ]

    async def run(self) -> None:
        import aiomqtt

        attempt = 0
        while True:
            client = aiomqtt.Client(
                **self.spec.aiomqtt_kwargs(),
                identifier=f"dashboard-{secrets.token_hex(4)}",
                clean_session=True,
            )
            try:
                async with client:
                    for topic in self.subscriptions():
                        await client.subscribe(topic, qos=0)
                    self.connected.set()
                    self.state.connected = True
                    self.state.touch()
                    self.on_change()
                    attempt = 0
                    async for message in client.messages:
                        self.handle(str(message.topic), bytes(message.payload or b""))
            except aiomqtt.MqttError as exc:
                self.connected.clear()
                self.state.connected = False
                self.state.touch()
                self.on_change()
                delay = RECONNECT_S[min(attempt, len(RECONNECT_S) - 1)]
                attempt += 1
                log.warning("broker %s: %s; reconnecting in %.1fs", self.spec, exc, delay)
                await asyncio.sleep(delay)

    def handle(self, topic: str, payload: bytes) -> None:
        """Fold one message into the state (a message that does not decode is counted, not
        fatal: the page shows what it can)."""
        try:
            self._handle(topic, payload)
        except Exception as exc:  # any decoder's refusal: counted, not fatal
            self.bad_messages += 1
            log.debug("ignored a message on %s: %s", topic, exc)
            return
        self.on_change()

    def _handle(self, topic: str, payload: bytes) -> None:
        t, state = self.topics, self.state
        if (device := t.device_of(topic, "status")) is not None:
            if not payload:
                state.forget_device(device)
                return
            status = decode_status(payload, device)
            stopped = status.info.get("stopped")
            state.set_status(device, status.online, stopped or None, status.n_samples)
        elif topic == t.metrics:
            if payload:
                record = json.loads(payload)
                if isinstance(record, dict):
                    state.add_record(record)
        elif topic == t.global_model:
            if not payload:
                return
            msg = decode_global(payload)
            mechanism = (msg.mechanism_params or {}).get("m")
            if isinstance(mechanism, str) and not state.config.get("privacy"):
                state.config["privacy"] = {"mechanism": mechanism}  # no job document (simulate)
            state.set_global(
                round_=msg.round,
                version=msg.version,
                mode=msg.mode,
                deadline_s=msg.deadline_s,
                issued_at=wall_clock(msg.issued_at),
                selected=msg.selected,
                sample_rate=msg.sample_rate,
                done=msg.done,
            )
        elif (device := t.device_of(topic, "ack")) is not None:
            ack = decode_ack(payload, device)
            if not ack.ok:
                state.add_ack(device, ack.round, ack.reason or "?", ack.detail)
        elif topic == t.job_document:
            if payload:
                state.set_config(decode_job_document(payload).config)
        elif topic.startswith(f"{t.base}/ingest/worker/"):
            worker = topic.rsplit("/", 1)[1]
            state.set_worker(worker, payload.decode("utf-8", "replace") or None)


class RunDirSource:
    """Feeds ``state`` from a run directory, following ``metrics.jsonl`` as it grows."""

    POLL_S = 0.5

    def __init__(self, state: DashboardState, run_dir: str | Path) -> None:
        self.state = state
        self.dir = Path(run_dir)
        self.on_change: Callable[[], None] = lambda: None
        self._offset = 0
        self._stamps: dict[str, float] = {}
        self._checkpoint: dict[str, Any] | None = None
        self._ledger: Any = None  # edge_fl.server.ledger_file.LedgerReader, built on first use
        self._inode = -1  # metrics.jsonl's: a new file is read from its start
        self._epsilon: Any = None  # edge_fl.dashboard.epsilon.DeviceEpsilon, built on first use
        self._epsilon_due = False
        state.source = "run"
        state.job = self.dir.name

    def check(self) -> None:
        """Fail now, in one line, when this is no run directory."""
        if not (self.dir / "metrics.jsonl").is_file():
            raise FileNotFoundError(
                f"{self.dir}: no metrics.jsonl here (a run directory written by "
                "`edge-fl simulate --out DIR` or `edge-fl aggregator --out DIR`)"
            )

    async def run(self) -> None:
        while True:
            if self.poll():
                self.on_change()
            if self._epsilon_due and self._checkpoint is not None and self._replay_needed():
                self._epsilon_due = False
                records = [dict(r) for r in self.state.records]
                by_round = await asyncio.to_thread(self._device_epsilon, records, self._checkpoint)
                if by_round:
                    self.state.set_device_epsilon(by_round)
                    self.on_change()
            await asyncio.sleep(self.POLL_S)

    def _replay_needed(self) -> bool:
        """Whether some record lacks the aggregator's own ``epsilon_device_*`` (a run written
        before the aggregator recorded them): only those are replayed from the checkpoint."""
        return any("epsilon_device_max" not in r for r in self.state.records)

    def _device_epsilon(
        self, records: list[dict[str, Any]], checkpoint: dict[str, Any]
    ) -> dict[int, dict[str, float]]:
        """Per-device epsilon quantiles per round (in a thread: building the job and composing
        can take a while); a run whose job cannot be rebuilt here gets a note instead."""
        from edge_fl.dashboard.epsilon import DeviceEpsilon

        try:
            if self._epsilon is None:
                self._epsilon = DeviceEpsilon(self.state.config)
            if not self._epsilon.accounts:
                return {}
            return self._epsilon.per_round(records, checkpoint)
        except Exception as exc:  # a run's job that cannot be rebuilt here: say so, go on
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.state.notes["epsilon_device"] = f"per-device epsilon unavailable: {first}"
            self._checkpoint = None
            return {}

    def _changed(self, name: str) -> dict[str, Any] | None:
        """The JSON object in ``name`` when the file is new or changed since the last poll."""
        path = self.dir / name
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            return None
        if self._stamps.get(name) == stamp:
            return None
        self._stamps[name] = stamp
        with contextlib.suppress(OSError, ValueError):
            obj = json.loads(path.read_text(encoding="utf-8"))
            return obj if isinstance(obj, dict) else None
        return None

    def poll(self) -> bool:
        """Read what is new; True when anything was."""
        state, changed = self.state, False
        if (run := self._changed("run.json")) is not None and isinstance(run.get("config"), dict):
            state.set_config(run["config"])
            changed = True
        if self._tail():
            changed = self._epsilon_due = True
        if (ckpt := self._changed("checkpoint.json")) is not None and (
            ckpt := self._with_ledger(ckpt)
        ) is not None:
            self._checkpoint = ckpt
            self._epsilon_due = True
            devices = ckpt.get("devices") or {}
            state.devices.clear()
            for dev, (online, n, stopped) in devices.items():
                state.set_status(str(dev), bool(online), stopped or None, int(n or 0))
            state.devices_as_of = f"checkpoint of round {ckpt.get('round_number')}"
            state.touch()
            changed = True
        if (summary := self._changed("summary.json")) is not None:
            state.summary = summary
            state.current["done"] = True
            state.touch()
            changed = True
        return changed

    def _with_ledger(self, ckpt: dict[str, Any]) -> dict[str, Any] | None:
        """The checkpoint with the releases of its ledger file inline (only what was appended
        since the last one is read); None, to be read again at the next poll, when the file is
        no longer what the checkpoint covers (a later commit replaced it) or is damaged. Never
        ahead: the aggregator syncs the ledger's lines before the checkpoint that covers them."""
        if not isinstance(ckpt.get("ledger"), dict):
            return ckpt  # a checkpoint that lists them itself (format 2)
        from edge_fl.server.ledger_file import LedgerReader, with_ledger

        if self._ledger is None:
            self._ledger = LedgerReader()
        try:
            return with_ledger(self.dir, ckpt, self._ledger)
        except ValueError:
            self._stamps.pop("checkpoint.json", None)
            return None

    def _tail(self) -> bool:
        path = self.dir / "metrics.jsonl"
        reset = False
        try:
            stat = path.stat()
            size = stat.st_size
            if size < self._offset or stat.st_ino != self._inode:  # rewritten (a resume
                # reconciled it, atomically replacing the file): read it again from the start
                self._inode = stat.st_ino
                self._offset = 0
                self.state.rows_epoch += 1
                self.state.records.clear()
                self.state.rejections.clear()
                self.state.samples.clear()
                reset = self.state.seq > 0
            if size == self._offset:
                return reset
            with path.open("rb") as f:
                f.seek(self._offset)
                data = f.read(size - self._offset)
        except OSError:
            return False
        changed = reset
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # a record still being written: read it whole next time
            self._offset += len(line)
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                self.state.add_record(record)
                changed = True
        if changed and self.state.records:
            last = self.state.records[-1]
            self.state.current.update(
                round=last.get("round"),
                version=last.get("version"),
                mode=self.state.current.get("mode"),
            )
        return changed
