"""The synchronous round as a small state machine: who may answer, and when the round ends.

Pure: the caller passes ``now`` (seconds on any monotonic clock). Idempotent per (device, round), so
QoS 1 redelivery cannot double-count an update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from edge_fl.protocol import Reject


class Decision(StrEnum):
    WAIT = "wait"  # keep collecting
    CLOSE = "close"  # enough updates: aggregate
    EXTEND = "extend"  # deadline passed short of min_updates: the deadline moved once
    SKIP = "skip"  # still short after the extension (or extensions disabled): no update applied


@dataclass
class SyncRound:
    number: int
    base_version: int
    selected: frozenset[str]
    target: int
    min_updates: int
    opened_at: float
    deadline_s: float
    extend_when_short: bool = True
    extended: bool = False
    accepted: set[str] = field(default_factory=set)
    nonce: bytes | None = None  # in the round's signed global message; updates must echo it

    def __post_init__(self) -> None:
        # 0 is for rounds that act without updates (central noise under Poisson selection)
        if not 0 <= self.min_updates <= self.target:
            raise ValueError(
                f"min_updates = {self.min_updates} must be in [0, target = {self.target}]"
            )
        if self.target > len(self.selected):
            raise ValueError(f"target {self.target} exceeds {len(self.selected)} selected devices")

    @property
    def deadline(self) -> float:
        return self.opened_at + self.deadline_s * (2 if self.extended else 1)

    def admit(self, device: str, update_round: int, base_version: int) -> Reject | None:
        """None if this update may be accepted now, else why not. Does not change state."""
        if update_round < self.number:
            return Reject.LATE
        if update_round > self.number:
            return Reject.FUTURE
        if device not in self.selected:
            return Reject.NOT_SELECTED
        if device in self.accepted:
            return Reject.DUPLICATE
        if base_version != self.base_version:
            return Reject.STALE
        if len(self.accepted) >= self.target:
            return Reject.LATE  # over-selection: the round is already full
        return None

    def weight(self, base_version: int) -> float:
        """Every on-time update of a synchronous round counts fully."""
        return 1.0

    def accept(self, device: str, base_version: int = 0) -> None:
        self.accepted.add(device)

    @property
    def count(self) -> int:
        return len(self.accepted)

    def staleness_stats(self) -> dict:
        return {}

    def decide(self, now: float) -> Decision:
        if len(self.accepted) >= self.target:
            return Decision.CLOSE
        if now < self.deadline:
            return Decision.WAIT
        if len(self.accepted) >= self.min_updates:
            return Decision.CLOSE
        if self.extend_when_short and not self.extended:
            self.extended = True
            return Decision.EXTEND
        return Decision.SKIP
