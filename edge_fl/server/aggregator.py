"""The aggregator core: fleet view, device selection, round control, aggregation and round records.

Sans-I/O: the service feeds it payload bytes, status changes and the time, and publishes what it
returns. Everything here is deterministic given its inputs and the injected generator.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_fl.protocol import (
    GlobalModel,
    PayloadRejected,
    Reject,
    UpdateLimits,
    decode_status,
    decode_update,
)

from .rounds import Decision, SyncRound
from .strategy import FedAvg, Strategy

Evaluator = Callable[[np.ndarray], tuple[float, float]]  # params -> (accuracy, loss)
StrategyFactory = Callable[[int], Strategy]  # round number -> fresh strategy


@dataclass(frozen=True)
class SyncSettings:
    job: str
    rounds: int
    target: int
    min_updates: int
    deadline_s: float
    extend_when_short: bool = True
    over_selection: float = 1.0
    server_lr: float = 1.0
    wire_dtype: str = "f4"
    config_digest: str = ""
    mechanism: str = "none"

    @property
    def n_select(self) -> int:
        return math.ceil(self.target * self.over_selection)


@dataclass
class DeviceRecord:
    online: bool = False
    n_samples: int = 0
    stopped: str | None = None


@dataclass
class RoundTally:
    """What happened on the wire during one round, for its metrics record."""

    bytes_up: int = 0
    messages_up: int = 0
    bytes_down: int = 0
    late: int = 0
    rejected: Counter = field(default_factory=Counter)


class AggregatorCore:
    def __init__(
        self,
        settings: SyncSettings,
        params: np.ndarray,
        limits: UpdateLimits,
        rng: np.random.Generator,
        evaluate: Evaluator | None = None,
        strategy_factory: StrategyFactory | None = None,
    ) -> None:
        self.settings = settings
        self.params = params.astype(np.float32, copy=True)
        self.limits = limits
        self.rng = rng
        self.evaluate = evaluate
        self.make_strategy = strategy_factory or (
            lambda _r: FedAvg(len(self.params), settings.server_lr)
        )
        self.version = 0
        self.round_number = 0  # rounds opened so far; the open round's number when one is open
        self.devices: dict[str, DeviceRecord] = {}
        self.current: SyncRound | None = None
        self.strategy: Strategy | None = None
        self.tally = RoundTally()
        self.records: list[dict[str, Any]] = []
        self.extra_metrics: Callable[[], dict[str, Any]] = dict

    # ----------------------------------------------------------- fleet view

    def on_status(self, device: str, payload: bytes) -> None:
        """Track availability from retained status messages (and last wills)."""
        if not payload:  # a cleared retained message
            self.devices.pop(device, None)
            return
        try:
            status = decode_status(payload, topic_device=device)
        except PayloadRejected:
            return  # a broken status cannot make a device selectable
        rec = self.devices.setdefault(device, DeviceRecord())
        rec.online = status.online
        rec.n_samples = status.n_samples
        rec.stopped = status.info.get("stopped") if status.info else None

    def available(self) -> list[str]:
        return sorted(d for d, r in self.devices.items() if r.online and r.stopped is None)

    @property
    def online_count(self) -> int:
        return sum(1 for r in self.devices.values() if r.online)

    @property
    def finished(self) -> bool:
        return self.round_number >= self.settings.rounds and self.current is None

    # ----------------------------------------------------------- rounds

    def open_round(self, now: float) -> GlobalModel | None:
        """Select devices and open the next round; None if too few devices are available."""
        pool = self.available()
        s = self.settings
        if len(pool) < s.min_updates:
            return None
        n_select = min(s.n_select, len(pool))
        chosen = self.rng.choice(len(pool), size=n_select, replace=False)
        selected = frozenset(pool[i] for i in chosen)
        target = min(s.target, n_select)
        self.round_number += 1
        self.current = SyncRound(
            number=self.round_number,
            base_version=self.version,
            selected=selected,
            target=target,
            min_updates=min(s.min_updates, target),
            opened_at=now,
            deadline_s=s.deadline_s,
            extend_when_short=s.extend_when_short,
        )
        self.strategy = self.make_strategy(self.round_number)
        return self.global_message(selected=tuple(sorted(selected)))

    def global_message(
        self, selected: tuple[str, ...] | None = None, done: bool = False, now: float = 0.0
    ) -> GlobalModel:
        return GlobalModel(
            job=self.settings.job,
            version=self.version,
            round=self.round_number,
            params=self.params,
            mode="sync",
            selected=selected,
            deadline_s=self.settings.deadline_s,
            config_digest=self.settings.config_digest,
            wire_dtype=self.settings.wire_dtype,
            done=done,
            issued_at=now,
        )

    def on_update(self, device: str, payload: bytes) -> Reject | None:
        """Decode, validate, admit and fold in one update. Returns the rejection reason, if any."""
        self.tally.bytes_up += len(payload)
        self.tally.messages_up += 1
        try:
            update = decode_update(payload, self.limits, topic_device=device)
        except PayloadRejected as exc:
            self.tally.rejected[exc.reason] += 1
            return exc.reason
        if self.current is None:
            self.tally.late += 1
            return Reject.LATE
        reason = self.current.admit(device, update.round, update.base_version)
        if reason is None and self.devices.get(device, DeviceRecord()).stopped:
            reason = Reject.BUDGET_EXHAUSTED
        if reason is not None:
            if reason is Reject.LATE:
                self.tally.late += 1
            else:
                self.tally.rejected[reason] += 1
            return reason
        assert self.strategy is not None
        try:
            self.strategy.add(update, 1.0)
        except (TypeError, ValueError) as exc:
            self.tally.rejected[Reject.WRONG_MECHANISM] += 1
            del exc
            return Reject.WRONG_MECHANISM
        self.current.accept(device)
        return None

    def decide(self, now: float) -> Decision:
        if self.current is None:
            return Decision.WAIT
        return self.current.decide(now)

    @property
    def deadline(self) -> float | None:
        return None if self.current is None else self.current.deadline

    def close_round(self, now: float, wall_time_s: float, skipped: bool = False) -> dict[str, Any]:
        """Apply the round's aggregate (unless skipped), evaluate, and return its record."""
        assert self.current is not None and self.strategy is not None
        rnd, strategy = self.current, self.strategy
        info: dict[str, Any] = {}
        if not skipped and strategy.count > 0:
            self.params, info = strategy.finish(self.params)
            self.version += 1
        accuracy = loss = None
        if self.evaluate is not None:
            accuracy, loss = self.evaluate(self.params)
        t = self.tally
        record: dict[str, Any] = {
            "round": rnd.number,
            "version": self.version,
            "status": "skipped" if skipped else "closed",
            "accuracy": accuracy,
            "loss": loss,
            "selected": len(rnd.selected),
            "target": rnd.target,
            "received": len(rnd.accepted),
            "late": t.late,
            "rejected": sum(t.rejected.values()),
            "rejected_by_reason": {str(k): v for k, v in sorted(t.rejected.items())},
            "extended": rnd.extended,
            "bytes_up": t.bytes_up,
            "messages_up": t.messages_up,
            "bytes_down": t.bytes_down,
            "online": self.online_count,
            "mechanism": self.settings.mechanism,
            "epsilon": None,
            "wall_time_s": wall_time_s,
            **info,
            **self.extra_metrics(),
        }
        self.records.append(record)
        self.current = None
        self.strategy = None
        self.tally = RoundTally()
        return record
