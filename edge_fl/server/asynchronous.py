"""Asynchronous aggregation: FedBuff (apply every K updates) and FedAsync (apply each update).

There are no rounds to wait for: every available device trains on the newest model it has and
uploads; the aggregator weights each update by its staleness ``s = version - base_version``, drops
it beyond ``max_staleness``, and applies a batch when K updates are buffered (or at the window's
deadline with at least one). Every application increases the model version; the metrics record
of an application is its "round", with the staleness distribution of what it applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge_fl.protocol import GlobalModel, Reject, Update, new_nonce

from .aggregator import AggregatorCore
from .rounds import Decision
from .staleness import Staleness


@dataclass
class AsyncWindow:
    """The collection window of one application; same interface as SyncRound."""

    number: int
    version: int  # the global version devices are training on (newest)
    target: int  # K
    opened_at: float
    deadline_s: float
    staleness: Staleness
    max_staleness: int
    selected: frozenset[str] = frozenset()  # nobody is selected: everyone may contribute
    min_updates: int = 1
    extended: bool = False
    accepted: set[tuple[str, int]] = field(default_factory=set)  # (device, base version)
    earlier: set[tuple[str, int]] = field(default_factory=set)  # applied in earlier windows
    staleness_seen: list[int] = field(default_factory=list)

    @property
    def deadline(self) -> float:
        return self.opened_at + self.deadline_s

    @property
    def count(self) -> int:
        return len(self.accepted)

    def admit(self, device: str, update_round: int, base_version: int) -> Reject | None:
        s = self.version - base_version
        if s < 0:
            return Reject.FUTURE
        if s > self.max_staleness:
            return Reject.STALE
        key = (device, base_version)
        if key in self.accepted or key in self.earlier:
            return Reject.DUPLICATE
        return None

    def weight(self, base_version: int) -> float:
        return self.staleness.weight(self.version - base_version)

    def accept(self, device: str, base_version: int = 0) -> None:
        self.accepted.add((device, base_version))
        self.staleness_seen.append(self.version - base_version)

    def decide(self, now: float) -> Decision:
        if self.count >= self.target:
            return Decision.CLOSE
        if now < self.deadline:
            return Decision.WAIT
        return Decision.CLOSE if self.count >= 1 else Decision.SKIP

    def staleness_stats(self) -> dict:
        s = np.asarray(self.staleness_seen, dtype=np.int64)
        if s.size == 0:
            return {"staleness_mean": None, "staleness_max": None, "staleness_hist": {}}
        values, counts = np.unique(s, return_counts=True)
        return {
            "staleness_mean": float(s.mean()),
            "staleness_max": int(s.max()),
            "staleness_hist": {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)},
        }


class AsyncAggregatorCore(AggregatorCore):
    """FedBuff / FedAsync on the same fleet view, ledger, strategies and records as sync mode."""

    _applied: set[tuple[str, int]]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._applied = set()
        self.nonces: dict[int, bytes] = {}  # version -> nonce, for versions within max_staleness
        self._held: list[tuple[str, bytes]] = []  # arrived while no window had room

    def on_update(self, device: str, payload: bytes, *, counted: bool = False) -> Reject | None:
        """An update that finds no open window, or a full one, waits for the next window: in
        async modes nothing is late, and a window applies exactly K (FedAsync: 1) updates."""
        window = self.current
        if not self._known(device):  # strangers are refused now, not held
            return super().on_update(device, payload, counted=counted)
        if window is None or window.count >= window.target:
            if not counted:
                self.tally.bytes_up += len(payload)
                self.tally.messages_up += 1
            self._held.append((device, payload))
            return None
        return super().on_update(device, payload, counted=counted)

    def current_nonce(self) -> bytes | None:
        return self.nonces.get(self.version)

    def nonce_of(self, round_number: int) -> bytes | None:
        """Updates echo the nonce of the version they trained on."""
        return self.nonces.get(round_number)

    def _chargeable(self, device: str, update: Update) -> bool:
        """Any known device may train on any version that was published (``update.round`` is the
        version it trained on; its nonce was checked): a stale one was still released."""
        return device in self.devices and update.round in self.nonces

    def remember(self, rnd) -> None:
        """Async windows select nobody; the versions' nonces are the history."""

    def _known(self, device: str) -> bool:
        return device in self.devices or (self.round_number > 0 and not self.devices)

    def open_round(self, now: float) -> GlobalModel | None:
        s = self.settings
        if not self.available():
            return None
        self.round_number += 1
        # an update accepted in window n was computed on a version <= the window's version; the
        # duplicate check spans windows through the (device, base_version) key below
        window = AsyncWindow(
            number=self.round_number,
            version=self.version,
            target=1 if s.mode == "fedasync" else s.buffer_size,
            opened_at=now,
            deadline_s=s.deadline_s,
            staleness=s.staleness or Staleness(),
            max_staleness=s.max_staleness,
        )
        # QoS 1 may redeliver an update after its window closed: remember what was applied while
        # it can still be admitted (within max_staleness)
        oldest = self.version - s.max_staleness
        self._applied = {k for k in self._applied if k[1] >= oldest}
        self.nonces.setdefault(self.version, new_nonce())  # all kept: 16 bytes per version
        window.earlier = self._applied
        self.current = window  # type: ignore[assignment]
        self.strategy = self.new_strategy()
        held, self._held = self._held, []
        for device, payload in held:  # in arrival order; the overflow waits again
            self.on_update(device, payload, counted=True)
        # in async modes the "round" a device answers is the model version it trains on
        return self.global_message(selected=None, round_number=self.version)

    def close_round(self, now: float, wall_time_s: float, skipped: bool = False) -> dict:
        window = self.current
        assert isinstance(window, AsyncWindow)
        self._applied |= window.accepted
        return super().close_round(now, wall_time_s, skipped)
