"""Asynchronous aggregation: FedBuff (apply every K updates) and FedAsync (apply each update).

There are no rounds to wait for: devices train on the newest model they were given and upload; the
aggregator weights each update by its staleness ``s = version - base_version``, drops it beyond
``max_staleness``, and applies a batch when K updates are buffered (or at the window's deadline with
at least one). Every application increases the model version; the metrics record of an application
is its "round", with the staleness distribution of what it applied.

Concurrency limit C (FedBuff's concurrency, Papaya): at most C devices train at once. Without it
every available device trains on every version, and most of that work arrives too stale to help
(BENCHMARKS.md: 1.9-5.7x sync's device work). With it the core keeps an in-flight set: it selects C
devices, and whenever one of them answers (its update arrives, whatever the verdict), times out
(``dispatch_timeout_s`` after its selection was published), goes offline or stops, it selects a
replacement among the available devices that are not in flight, so C stay busy. The selection of a
window travels in its global message (``selected``, as in sync mode); replacements chosen while a
window is open go out with :meth:`AsyncAggregatorCore.dispatch` (a service that publishes it keeps C
busy between applications) or else with the next window's message. Only a device selected for the
version it trained on is admitted and charged (admission before accounting).

Device work: ``device_updates`` in every record is the number of updates devices computed for the
job that reached the aggregator (one per (device, version), counted once, admitted or not: late,
stale or discarded work included); ``dispatched`` is the number of selections published. A device
that trains and then never uploads (a dropout) is invisible here: the fleet counts it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_fl.protocol import (
    GlobalModel,
    PayloadRejected,
    Reject,
    Update,
    decode_update,
    new_nonce,
)

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
    # with a concurrency limit: the devices its global message selected (plus replacements
    # published while it was open); without one, empty: every device may contribute
    selected: frozenset[str] = frozenset()
    min_updates: int = 1
    extended: bool = False
    accepted: set[tuple[str, int]] = field(default_factory=set)  # (device, base version)
    earlier: set[tuple[str, int]] = field(default_factory=set)  # applied in earlier windows
    staleness_seen: list[int] = field(default_factory=list)
    # concurrency limit: version -> devices selected to train on it (the core's); None: no limit,
    # any known device may contribute
    selected_on: Callable[[int], frozenset[str]] | None = field(
        default=None, init=False, repr=False
    )

    @property
    def deadline(self) -> float:
        return self.opened_at + self.deadline_s

    @property
    def count(self) -> int:
        return len(self.accepted)

    def admit(self, device: str, update_round: int, base_version: int) -> Reject | None:
        if base_version != update_round:  # in async modes r = the version trained on = bv; the
            return Reject.WRONG_NONCE  # nonce binds r only: another bv would dodge staleness
        s = self.version - base_version
        if s < 0:
            return Reject.FUTURE
        if s > self.max_staleness:
            return Reject.STALE
        key = (device, base_version)
        if key in self.accepted or key in self.earlier:
            return Reject.DUPLICATE
        if self.selected_on is not None and device not in self.selected_on(update_round):
            return Reject.NOT_SELECTED  # trained although nobody asked it to
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
    """FedBuff / FedAsync on the same fleet view, ledger, strategies and records as sync mode.

    ``concurrency``: C, the most devices training at once (None or 0: no limit, every available
    device trains on every version). ``dispatch_timeout_s``: how long a selected device may take
    before its slot goes to another device (default: the settings' ``deadline_s``; same clock)."""

    _applied: set[tuple[str, int]]

    def __init__(
        self,
        *args: Any,
        concurrency: int | None = None,
        dispatch_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if concurrency is not None and concurrency < 0:
            raise ValueError(f"concurrency = {concurrency} must be >= 0 (0: no limit)")
        self.concurrency = concurrency or None
        self.dispatch_timeout_s = (
            self.settings.deadline_s if dispatch_timeout_s is None else dispatch_timeout_s
        )
        self._applied = set()
        self.nonces: dict[int, bytes] = {}  # version -> nonce, for versions within max_staleness
        self._held: list[tuple[str, bytes]] = []  # arrived while no window had room
        # concurrency limit. The selections are kept in ``history`` (version -> (nonce, devices
        # selected to train on it)), which checkpoints carry; the in-flight set is derived from it
        # and the ledger's releases, so a resumed core rebuilds it (None: rebuild on next use)
        self._flight: dict[str, int] | None = None  # device -> version it was selected for
        self._since: dict[str, float] = {}  # device -> when its selection was published
        self._unsent: list[str] = []  # selected (in flight) but not yet published
        self.dispatched = 0  # selections published so far
        self.timeouts = 0  # in-flight devices given up on (dispatch_timeout_s)
        self.departed = 0  # in-flight devices that went offline or stopped

    # ----------------------------------------------------------- the in-flight set

    @property
    def in_flight(self) -> dict[str, int]:
        """Device -> the version it was selected to train on, for every device in flight
        (published or about to be). Empty without a concurrency limit."""
        if self.concurrency is None:
            return {}
        if self._flight is None:
            self._flight = self._rebuild_flight()
        return self._flight

    @property
    def training(self) -> frozenset[str]:
        """The in-flight devices whose selection was published (the others wait to be sent)."""
        return frozenset(d for d in self.in_flight if d not in self._unsent)

    def _rebuild_flight(self) -> dict[str, int]:
        """From the selections (history, and the open window's) and the releases: a device is in
        flight on its last selection until an update of its computed on that version or a newer
        one has arrived. Clocks restart (a resumed core gives everyone a fresh timeout)."""
        last: dict[str, int] = {}
        selections = sorted((v, sel) for v, (_, sel) in self.history.items())
        window = self.current
        if isinstance(window, AsyncWindow):
            selections.append((window.version, window.selected))
        for version, sel in selections:
            for device in sel:
                last[device] = max(version, last.get(device, -1))
        answered: dict[str, int] = {}
        for device, rnd, _ in self.releases:
            answered[device] = max(int(rnd), answered.get(device, -1))

        def gone(device: str) -> bool:  # its offline or stopped status came before the rebuild
            rec = self.devices.get(device)
            return rec is not None and (not rec.online or rec.stopped is not None)

        flight = {d: v for d, v in last.items() if answered.get(d, -1) < v and not gone(d)}
        # devices freed by a timeout come back beside their replacements: the C most recent
        # selections stay (an older one's late answer is still admitted and charged: history)
        keep = sorted(flight, key=lambda d: (-flight[d], d))[: self.concurrency or len(flight)]
        return {d: flight[d] for d in keep}

    def _selected_on(self, version: int) -> frozenset[str]:
        """Devices selected to train on ``version``: kept in ``history`` when published, and in
        the open window (a window rebuilt from the journal has only the latter)."""
        facts = self.history.get(version)
        sel = facts[1] if facts is not None else frozenset()
        window = self.current
        if isinstance(window, AsyncWindow) and window.version == version:
            sel = sel | window.selected
        return sel

    def _free(self, device: str) -> None:
        self.in_flight.pop(device, None)
        self._since.pop(device, None)
        if device in self._unsent:
            self._unsent.remove(device)

    def _replace(self) -> list[str]:
        """Select devices until C are in flight: available, not in flight, and not already
        selected for the version they would get now (a device answers a version once)."""
        flight = self.in_flight
        room = self.concurrency - len(flight) if self.concurrency is not None else 0
        if room <= 0:
            return []
        done_here = self._selected_on(self.version)
        pool = [d for d in self.available() if d not in flight and d not in done_here]
        if not pool:
            return []
        chosen = self.rng.choice(len(pool), size=min(room, len(pool)), replace=False)
        picked = sorted(pool[i] for i in chosen)
        for device in picked:
            flight[device] = self.version
            self._unsent.append(device)
        return picked

    def _publish_unsent(self, now: float) -> tuple[str, ...]:
        """The devices the next global message selects: the unsent selections still available,
        now dispatched on the current version."""
        live = set(self.available())
        for device in [d for d in self._unsent if d not in live]:
            self._free(device)
        self._replace()
        sent = tuple(sorted(d for d in self._unsent if d in live))
        self._unsent = []
        flight = self.in_flight
        for device in sent:
            flight[device] = self.version
            self._since[device] = now
        if sent:
            nonce = self.nonces.setdefault(self.version, new_nonce())
            self.history[self.version] = (nonce, self._selected_on(self.version) | set(sent))
            self.ever_selected.update(sent)
            self.dispatched += len(sent)
        window = self.current
        if isinstance(window, AsyncWindow) and window.version == self.version:
            window.selected = window.selected | frozenset(sent)
        return sent

    def restore_dispatch(self, version: int, sent: list[str] | tuple[str, ...]) -> None:
        """Replay of a journaled ``dispatch`` record: ``sent`` were selected to train on
        ``version`` by a message published mid-window (the in-flight set is rebuilt from it)."""
        devices = frozenset(str(d) for d in sent)
        nonce = self.nonces.setdefault(version, new_nonce())
        self.history[version] = (nonce, self._selected_on(version) | devices)
        self.ever_selected.update(devices)
        window = self.current
        if isinstance(window, AsyncWindow) and window.version == version:
            window.selected = window.selected | devices
        self._flight = None  # derived again from the selections and releases

    def expire(self, now: float) -> list[str]:
        """Give up on devices selected longer than ``dispatch_timeout_s`` ago (dropped out, or
        slower than the job can wait) and select replacements; returns the devices given up."""
        if self.concurrency is None:
            return []
        for device in self.in_flight:  # rebuilt after a resume: the clock starts now
            if device not in self._since and device not in self._unsent:
                self._since[device] = now
        gone = [d for d, t in self._since.items() if now - t >= self.dispatch_timeout_s]
        for device in gone:
            self._free(device)
        self.timeouts += len(gone)
        if gone:
            self._replace()
        return gone

    def dispatch(self, now: float) -> GlobalModel | None:
        """The global message that sends the replacements selected since the last one (on the
        current model version), or None if there are none. A service that publishes it after
        updates and status changes keeps C devices busy while a window fills."""
        if self.concurrency is None or self.current is None:
            return None
        self._replace()  # top up (e.g. a resumed core has only the devices still in flight)
        if not self._unsent:
            return None
        sent = self._publish_unsent(now)
        if not sent:
            return None
        return self.global_message(selected=sent, round_number=self.version)

    @property
    def next_timeout(self) -> float | None:
        if not self._since:
            return None
        return min(self._since.values()) + self.dispatch_timeout_s

    # ----------------------------------------------------------- events

    def on_status(self, device: str, payload: bytes) -> None:
        super().on_status(device, payload)
        # not built yet (a fresh or resuming core): nothing to free, and no build from a history
        # a resume has not restored yet
        if self._flight is None or device not in self._flight:
            return
        rec = self.devices.get(device)
        if rec is None or not rec.online or rec.stopped is not None:
            self._free(device)  # it will not answer: its slot goes to another device
            self.departed += 1
            self._replace()

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
        if self.concurrency is not None:
            window.selected_on = self._selected_on
        before = len(self.releases)
        reason = super().on_update(device, payload, counted=counted)
        if self.concurrency is not None:
            # the device answered (whatever the verdict): a new release on the version it was
            # selected for, or a newer one, frees its slot for a replacement
            selected_for = self.in_flight.get(device)
            answered = [r for d, r, _ in self.releases[before:] if d == device]
            if selected_for is not None and answered and max(answered) >= selected_for:
                self._free(device)
                self._replace()
        return reason

    def decide(self, now: float) -> Decision:
        window = self.current
        if window is None:
            return Decision.WAIT
        self.expire(now)
        decision = window.decide(now)
        if (
            decision is Decision.WAIT
            and self.concurrency is not None
            and not self._unsent
            and not self.any_can_answer(self._since)
        ):
            # nobody who was sent a model is still training and no replacement waits to be
            # sent: close (or skip) now instead of idling to the deadline
            return Decision.CLOSE if window.count >= 1 else Decision.SKIP
        return decision

    @property
    def deadline(self) -> float | None:
        """The window's deadline, or the next in-flight timeout if that comes first (the
        service sleeps until it and then calls ``decide``)."""
        if self.current is None:
            return None
        t = self.next_timeout
        return self.current.deadline if t is None else min(self.current.deadline, t)

    # ----------------------------------------------------------- admission

    def current_nonce(self) -> bytes | None:
        return self.nonces.get(self.version)

    def nonce_of(self, round_number: int) -> bytes | None:
        """Updates echo the nonce of the version they trained on."""
        return self.nonces.get(round_number)

    def _chargeable(self, device: str, update: Update) -> bool:
        """Without a limit any known device may train on any version that was published
        (``update.round`` is the version it trained on; its nonce was checked): a stale one was
        still released. With one, only a device selected for that version."""
        if update.round not in self.nonces:
            return False
        if self.concurrency is not None:
            return device in self._selected_on(update.round)
        return self._known(device)  # what may contribute was released (a resume included)

    def remember(self, rnd) -> None:
        """The versions' nonces are kept in ``nonces``; with a limit, the closing window's
        selection joins ``history`` (version -> (nonce, selected)), which checkpoints carry."""
        if self.concurrency is not None and rnd.selected:
            self.history[rnd.version] = (
                self.nonces.get(rnd.version),
                self._selected_on(rnd.version) | rnd.selected,
            )

    def _known(self, device: str) -> bool:
        if self.concurrency is not None and (
            device in self.ever_selected or device in self._selected_on(self.version)
        ):
            return True
        return device in self.devices or (self.round_number > 0 and not self.devices)

    # ----------------------------------------------------------- windows

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
        if self.concurrency is None:
            return self.global_message(selected=None, round_number=self.version)
        self.expire(now)
        sent = self._publish_unsent(now)  # replacements chosen since, topped up to C
        return self.global_message(selected=sent, round_number=self.version)

    def close_round(self, now: float, wall_time_s: float, skipped: bool = False) -> dict:
        window = self.current
        assert isinstance(window, AsyncWindow)
        self._applied |= window.accepted
        record = super().close_round(now, wall_time_s, skipped)
        if self.finished:  # no window will take what is held: charge it as released
            record["device_updates"] += self.charge_held()
        if self.concurrency is not None:
            record["concurrency"] = self.concurrency
            record["in_flight"] = len(self.in_flight)
            record["dispatched"] = self.dispatched
            record["timeouts"] = self.timeouts
        return record

    def charge_held(self) -> int:
        """Charge the held updates no window will take (the job ended), as a sync round charges
        late answers: each one that decodes, echoes its version's nonce and was asked for is a
        release. Returns how many were charged."""
        before = len(self.releases)
        for device, payload in self._held:
            try:
                update = decode_update(payload, self.limits, topic_device=device)
            except PayloadRejected:
                continue
            key = (device, update.round)
            if update.nonce != self.nonce_of(update.round) or key in self._released:
                continue
            if self._chargeable(device, update):
                self.record_release(
                    device, update.round, self.samples_cap(device, update.n_samples)
                )
        return len(self.releases) - before

    def after_last_round(self) -> dict[str, Any]:
        out = super().after_last_round()
        if self.concurrency is not None:
            out["dispatched"] = self.dispatched
        return out
