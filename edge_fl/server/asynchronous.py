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
window is open go out with :meth:`AsyncPolicy.dispatch` (a service that publishes it keeps C
busy between applications) or else with the next window's message. The model of a version goes
out once; a mid-window selection goes out as a dispatch message (``edge_fl.protocol.dispatch``:
the version, its nonce and the devices, without the model; ``Dispatch.of`` of what
:meth:`AsyncPolicy.dispatch` returns), so devices download each version once, not once per
selection. Only a device selected for the version it trained on is admitted and charged
(admission before accounting).

Device work: ``device_updates`` in every record is the number of updates devices computed for the
job that reached the aggregator (one per (device, version), counted once, admitted or not: late,
stale or discarded work included); ``dispatched`` is the number of selections published. A device
that trains and then never uploads (a dropout) is invisible here: the fleet counts it.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_fl.protocol import (
    GlobalModel,
    PayloadRejected,
    Reject,
    Update,
    decode_update,
)

from .rounds import Decision
from .staleness import Staleness
from .state import decode_nonces, encode_nonces

if TYPE_CHECKING:
    from .aggregator import AggregatorCore


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


class AsyncPolicy:
    """FedBuff / FedAsync windows on the engine's fleet view, ledger, strategies and records.

    ``concurrency``: C, the most devices training at once (None or 0: no limit, every available
    device trains on every version). ``dispatch_timeout_s``: how long a selected device may take
    before its slot goes to another device (default: the settings' ``deadline_s``; same clock)."""

    kind = "async"

    def __init__(
        self,
        engine: AggregatorCore,
        concurrency: int | None = None,
        dispatch_timeout_s: float | None = None,
    ) -> None:
        if concurrency is not None and concurrency < 0:
            raise ValueError(f"concurrency = {concurrency} must be >= 0 (0: no limit)")
        self.engine = engine
        self.concurrency = concurrency or None
        self.dispatch_timeout_s = (
            engine.settings.deadline_s if dispatch_timeout_s is None else dispatch_timeout_s
        )
        self.applied: set[tuple[str, int]] = set()  # (device, base version) applied, recently
        self.held: list[tuple[str, bytes]] = []  # arrived while no window had room
        self._held_keys: set[tuple[str, int]] = set()  # their (device, version): one each
        # concurrency limit. The selections are kept in the engine's ``history`` (version ->
        # (nonce, devices selected to train on it)), which checkpoints carry; the in-flight set is
        # derived from it and the ledger's releases, so a resumed core rebuilds it (None: rebuild
        # on next use)
        self._flight: dict[str, int] | None = None  # device -> version it was selected for
        self._since: dict[str, float] = {}  # device -> when its selection was published
        self.unsent: list[str] = []  # selected (in flight) but not yet published
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
        return frozenset(d for d in self.in_flight if d not in self.unsent)

    def _rebuild_flight(self) -> dict[str, int]:
        """From the selections (history, and the open window's) and the releases: a device is in
        flight on its last selection until an update of its computed on that version or a newer
        one has arrived. Clocks restart (a resumed core gives everyone a fresh timeout)."""
        e = self.engine
        last: dict[str, int] = {}
        selections = sorted((v, sel) for v, (_, sel) in e.history.items())
        window = e.current
        if window is not None:
            selections.append((window.version, window.selected))
        for version, sel in selections:
            for device in sel:
                last[device] = max(version, last.get(device, -1))
        answered = self._answered()

        def gone(device: str) -> bool:  # its offline or stopped status came before the rebuild
            rec = e.devices.get(device)
            return rec is not None and (not rec.online or rec.stopped is not None)

        flight = {d: v for d, v in last.items() if answered.get(d, -1) < v and not gone(d)}
        # devices freed by a timeout come back beside their replacements: the C most recent
        # selections stay (an older one's late answer is still admitted and charged: history)
        keep = sorted(flight, key=lambda d: (-flight[d], d))[: self.concurrency or len(flight)]
        return {d: flight[d] for d in keep}

    def _answered(self) -> dict[str, int]:
        """Device -> the newest version it released an update on (held ones once charged)."""
        answered: dict[str, int] = {}
        for device, rnd, _ in self.engine.releases:
            answered[device] = max(int(rnd), answered.get(device, -1))
        return answered

    def selected_on(self, version: int) -> frozenset[str]:
        """Devices selected to train on ``version``: kept in ``history`` when published, and in
        the open window (a window rebuilt from the journal has only the latter)."""
        e = self.engine
        facts = e.history.get(version)
        sel = facts[1] if facts is not None else frozenset()
        window = e.current
        if window is not None and window.version == version:
            sel = sel | window.selected
        return sel

    def _free(self, device: str) -> None:
        self.in_flight.pop(device, None)
        self._since.pop(device, None)
        if device in self.unsent:
            self.unsent.remove(device)

    def _replace(self) -> list[str]:
        """Select devices until C are in flight: available, not in flight, and not already
        selected for the version they would get now (a device answers a version once)."""
        e = self.engine
        flight = self.in_flight
        room = self.concurrency - len(flight) if self.concurrency is not None else 0
        if room <= 0:
            return []
        done_here = self.selected_on(e.version)
        pool = [d for d in e.available() if d not in flight and d not in done_here]
        if not pool:
            return []
        chosen = e.rng.choice(len(pool), size=min(room, len(pool)), replace=False)
        picked = sorted(pool[i] for i in chosen)
        for device in picked:
            flight[device] = e.version
            self.unsent.append(device)
        return picked

    def _publish_unsent(self, now: float) -> tuple[str, ...]:
        """The devices the next global message selects: the unsent selections still available,
        now dispatched on the current version."""
        e = self.engine
        live = set(e.available())
        for device in [d for d in self.unsent if d not in live]:
            self._free(device)
        self._replace()
        sent = tuple(sorted(d for d in self.unsent if d in live))
        self.unsent = []
        flight = self.in_flight
        for device in sent:
            flight[device] = e.version
            self._since[device] = now
        if sent:
            nonce = self.nonce(e.version)
            e.history[e.version] = (nonce, self.selected_on(e.version) | set(sent))
            e.ever_selected.update(sent)
            self.dispatched += len(sent)
        window = e.current
        if window is not None and window.version == e.version:
            window.selected = window.selected | frozenset(sent)
        return sent

    def restore_dispatch(self, version: int, sent: list[str] | tuple[str, ...]) -> None:
        """Replay of a journaled ``dispatch`` record: ``sent`` were selected to train on
        ``version`` by a message published mid-window (the in-flight set is rebuilt from it)."""
        e = self.engine
        devices = frozenset(str(d) for d in sent)
        nonce = self.nonce(version)
        e.history[version] = (nonce, self.selected_on(version) | devices)
        e.ever_selected.update(devices)
        window = e.current
        if window is not None and window.version == version:
            window.selected = window.selected | devices
        self._flight = None  # derived again from the selections and releases

    def expire(self, now: float) -> list[str]:
        """Give up on devices selected longer than ``dispatch_timeout_s`` ago (dropped out, or
        slower than the job can wait) and select replacements; returns the devices given up."""
        if self.concurrency is None:
            return []
        for device in self.in_flight:  # rebuilt after a resume: the clock starts now
            if device not in self._since and device not in self.unsent:
                self._since[device] = now
        gone = [d for d, t in self._since.items() if now - t >= self.dispatch_timeout_s]
        for device in gone:
            self._free(device)
        self.timeouts += len(gone)
        if gone:
            self._replace()
        return gone

    def dispatch(self, now: float) -> GlobalModel | None:
        """The replacements selected since the last publication (on the current model version),
        as that version's global message selecting them, or None if there are none. A service
        publishes its selection as a dispatch message (``Dispatch.of``: the model went out with
        the window; every device already has it) after updates and status changes, which keeps
        C devices busy while a window fills."""
        e = self.engine
        if self.concurrency is None or e.current is None:
            return None
        self._replace()  # top up (e.g. a resumed core has only the devices still in flight)
        if not self.unsent:
            return None
        sent = self._publish_unsent(now)
        if not sent:
            return None
        return e.global_message(selected=sent, round_number=e.version)

    @property
    def next_timeout(self) -> float | None:
        if not self._since:
            return None
        return min(self._since.values()) + self.dispatch_timeout_s

    # ----------------------------------------------------------- admission

    def on_status(self, device: str) -> None:
        # not built yet (a fresh or resuming core): nothing to free, and no build from a history
        # a resume has not restored yet
        if self._flight is None or device not in self._flight:
            return
        rec = self.engine.devices.get(device)
        if rec is None or not rec.online or rec.stopped is not None:
            self._free(device)  # it will not answer: its slot goes to another device
            self.departed += 1
            self._replace()

    def holds(self) -> bool:
        """An update that finds no open window, or a full one, waits for the next window: in
        async modes nothing is late, and a window applies exactly K (FedAsync: 1) updates. After
        the last window nothing is held: it is judged (and charged) at once."""
        e = self.engine
        if e.finished:
            return False
        window = e.current
        return window is None or window.count >= window.target

    def hold(self, device: str, payload: bytes) -> Reject | None:
        """Keep an update for the next window, if it can ever be admitted: it decodes within
        the job's limits (so at most ``limits.max_bytes``), echoes the nonce of a published
        version within ``max_staleness``, and is the first held for its (device, version).
        Memory is then bounded by devices x versions x max_bytes, whatever one device sends
        (issue 24: 1,000 x 1 MiB from one device grew RSS by 1 GB). A refused one is judged
        now; one that is a release (a stale answer, or refused for its values) is charged now."""
        e = self.engine
        try:
            update = decode_update(payload, e.limits, topic_device=device)
        except PayloadRejected as exc:
            if exc.reason is Reject.IMPLAUSIBLE:
                e.charge_refused(device, payload)
            e.last_rejection = exc
            return exc.reason
        published = self.nonce_of(update.round)
        if published is None:  # never published: it cannot be admitted
            return Reject.FUTURE if update.round > e.version else Reject.WRONG_NONCE
        if update.nonce != published:
            return Reject.WRONG_NONCE
        if update.base_version != update.round:
            return Reject.WRONG_NONCE  # as AsyncWindow.admit: the nonce binds r only
        key = (device, update.round)
        if key in self.applied or key in self._held_keys:
            return Reject.DUPLICATE
        if e.version - update.round > e.settings.max_staleness:
            if self.chargeable(device, update) and not e.is_released(*key):
                e.record_release(device, update.round, e.samples_cap(device, update.n_samples))
            return Reject.STALE
        self._held_keys.add(key)
        self.held.append((device, payload))
        return None

    def answered(self, device: str, releases: list[tuple[str, int, int]]) -> None:
        """The device answered (whatever the verdict): a new release on the version it was
        selected for, or a newer one, frees its slot for a replacement."""
        if self.concurrency is None:
            return
        selected_for = self.in_flight.get(device)
        answered = [r for d, r, _ in releases if d == device]
        if selected_for is not None and answered and max(answered) >= selected_for:
            self._free(device)
            if not self.engine.finished:
                self._replace()

    def current_nonce(self) -> bytes | None:
        return self.nonce_of(self.engine.version)

    def nonce_of(self, round_number: int) -> bytes | None:
        """Updates echo the nonce of the version they trained on (None: never published)."""
        facts = self.engine.history.get(round_number)
        return None if facts is None else facts[0]

    def nonce(self, version: int) -> bytes:
        """The nonce of ``version``, made when it is first published. Every version's nonce
        lives in the engine's ``history`` beside its selection (empty without a limit), whose
        entries a checkpoint appends to its ledger file: a commit writes only the new version's,
        and a straggler's answer on any published version is still checked and charged."""
        e = self.engine
        facts = e.history.get(version)
        if facts is not None and facts[0] is not None:
            return facts[0]
        return self._keep_nonce(version, e.new_nonce("version", version))

    def _learn_nonces(self, encoded: dict[str, str]) -> None:
        """Nonces a journal's ``open`` record (or a checkpoint written before they moved to
        the history) carries, kept where the history has none."""
        for version, nonce in decode_nonces(encoded).items():
            if self.nonce_of(version) is None:
                self._keep_nonce(version, nonce)

    def _keep_nonce(self, version: int, nonce: bytes) -> bytes:
        """``version``'s nonce into the history, beside its selection so far."""
        facts = self.engine.history.get(version)
        self.engine.history[version] = (nonce, frozenset() if facts is None else facts[1])
        return nonce

    def chargeable(self, device: str, update: Update) -> bool:
        """Without a limit any known device may train on any version that was published
        (``update.round`` is the version it trained on; its nonce was checked): a stale one was
        still released. With one, only a device selected for that version."""
        if self.nonce_of(update.round) is None:
            return False
        if self.concurrency is not None:
            return device in self.selected_on(update.round)
        return self.known(device)  # what may contribute was released (a resume included)

    def known(self, device: str) -> bool:
        e = self.engine
        if self.concurrency is not None and (
            device in e.ever_selected or device in self.selected_on(e.version)
        ):
            return True
        return device in e.devices or (e.round_number > 0 and not e.devices)

    # ----------------------------------------------------------- windows

    def _window(self, number: int, now: float) -> AsyncWindow:
        e = self.engine
        s = e.settings
        return AsyncWindow(
            number=number,
            version=e.version,
            target=1 if s.mode == "fedasync" else s.buffer_size,
            opened_at=now,
            deadline_s=s.deadline_s,
            staleness=s.staleness or Staleness(),
            max_staleness=s.max_staleness,
        )

    def open(self, now: float) -> GlobalModel | None:
        e = self.engine
        if not e.available():
            return None
        e.round_number += 1
        self.nonce(e.version)
        self._start(self._window(e.round_number, now))
        # in async modes the "round" a device answers is the model version it trains on
        if self.concurrency is None:
            return e.global_message(selected=None, round_number=e.version)
        self.expire(now)
        sent = self._publish_unsent(now)  # replacements chosen since, topped up to C
        return e.global_message(selected=sent, round_number=e.version)

    def reopen(self, rnd: AsyncWindow, spec: dict[str, Any]) -> None:
        self._learn_nonces(spec.get("nonces", {}))
        self._start(rnd)

    def _start(self, window: AsyncWindow) -> None:
        """Make ``window`` the open one and replay what was held, in arrival order (the
        overflow waits again)."""
        e = self.engine
        # an update accepted in window n was computed on a version <= the window's version; QoS 1
        # may redeliver it after its window closed: remember what was applied while it can still
        # be admitted (within max_staleness), and span windows with the (device, bv) key
        oldest = window.version - e.settings.max_staleness
        self.applied = {k for k in self.applied if k[1] >= oldest}
        window.earlier = self.applied
        if self.concurrency is not None:
            window.selected_on = self.selected_on
        e.current = window
        e.strategy = e.new_strategy()
        held, self.held, self._held_keys = self.held, [], set()
        for device, payload in held:
            e.on_update(device, payload, counted=True)

    def open_message(self) -> GlobalModel:
        """Everyone, unless a concurrency limit selects."""
        e = self.engine
        window = e.current
        assert window is not None
        selected = tuple(sorted(window.selected)) if self.concurrency else None
        return e.global_message(selected=selected, round_number=window.version)

    def open_spec(self) -> dict[str, Any]:
        # the new version's nonce: the earlier ones are in the checkpoint's history, or in the
        # journal's earlier ``open`` records (a journal replayed without a checkpoint)
        version = self.engine.version
        return {"nonces": encode_nonces({version: self.nonce(version)})}

    def build_round(self, fields: dict[str, Any], now: float) -> AsyncWindow:
        staleness = self.engine.settings.staleness or Staleness()
        return AsyncWindow(**fields, opened_at=now, staleness=staleness)

    def decide(self, now: float) -> Decision:
        e = self.engine
        window = e.current
        if window is None:
            return Decision.WAIT
        self.expire(now)
        decision = window.decide(now)
        if (
            decision is Decision.WAIT
            and self.concurrency is not None
            and not self.unsent
            and not e.any_can_answer(self._since)
        ):
            # nobody who was sent a model is still training and no replacement waits to be
            # sent: close (or skip) now instead of idling to the deadline
            return Decision.CLOSE if window.count >= 1 else Decision.SKIP
        return decision

    def arrivals_to_decide(self) -> int | None:
        """Every arrival may decide (a replacement is dispatched as each update comes)."""
        return None

    def deadline(self) -> float | None:
        """The window's deadline, or the next in-flight timeout if that comes first (the
        service sleeps until it and then calls ``decide``)."""
        window = self.engine.current
        if window is None:
            return None
        t = self.next_timeout
        return window.deadline if t is None else min(window.deadline, t)

    def closing(self, rnd: AsyncWindow) -> None:
        self.applied |= rnd.accepted

    def remember(self, rnd: AsyncWindow) -> None:
        """Every version's nonce is in ``history`` already; with a limit, the closing window's
        selection joins ``history`` (version -> (nonce, selected)), which checkpoints carry."""
        if self.concurrency is not None and rnd.selected:
            self.engine.history[rnd.version] = (
                self.nonce_of(rnd.version),
                self.selected_on(rnd.version) | rnd.selected,
            )

    def closed(self, record: dict[str, Any]) -> None:
        if self.engine.finished:  # no window will take what is held: charged now (its devices
            record["device_updates"] += self.charge_held()  # are not waited for); the engine's
            # ``settle`` then brings the record's epsilon up to date
        if self.concurrency is not None:
            record["concurrency"] = self.concurrency
            record["in_flight"] = len(self.in_flight)
            record["dispatched"] = self.dispatched
            record["timeouts"] = self.timeouts

    def charge_held(self) -> int:
        """Charge the held updates no window will take (the job ended), as a sync round charges
        late answers: each one that decodes (or is refused only for its values), echoes its
        version's nonce and was asked for is a release. Returns how many were charged."""
        e = self.engine
        before = len(e.releases)
        for device, payload in self.held:
            try:
                update = decode_update(payload, e.limits, topic_device=device)
            except PayloadRejected as exc:
                if exc.reason is Reject.IMPLAUSIBLE:
                    e.charge_refused(device, payload)
                continue
            if update.nonce != self.nonce_of(update.round) or e.is_released(device, update.round):
                continue
            if self.chargeable(device, update):
                e.record_release(device, update.round, e.samples_cap(device, update.n_samples))
        return len(e.releases) - before

    def outstanding(self) -> frozenset[str]:
        """Devices still training on a version that was published. With a concurrency limit:
        those in flight whose selection went out; without one, every device that can answer and
        has not yet answered the last published version (each trains on the newest it got)."""
        e = self.engine
        if self.concurrency is not None:
            flight, answered = self.in_flight, self._answered()
            return frozenset(
                d
                for d in self.training
                if answered.get(d, -1) < flight[d] and e.any_can_answer((d,))
            )
        window = e.previous
        if window is None:
            return frozenset()
        return frozenset(d for d in e.available() if not e.is_released(d, window.version))

    def summary(self) -> dict[str, Any]:
        return {"dispatched": self.dispatched} if self.concurrency is not None else {}

    # ----------------------------------------------------------- state

    def snapshot(self) -> dict[str, Any]:
        """Updates held for the next window and what was applied within ``max_staleness``
        (duplicates): checkpoint keys ``held`` and ``applied``, both bounded. The versions' nonces
        are in the engine's history."""
        return {
            "held": [[dev, base64.b64encode(p).decode()] for dev, p in self.held],
            "applied": sorted([dev, int(v)] for dev, v in self.applied),
        }

    def restore(self, state: dict[str, Any]) -> None:
        if "held" in state:
            self.held = [(dev, base64.b64decode(p)) for dev, p in state["held"]]
            self._held_keys = set()  # a held payload decoded once; a re-delivery is no harm
        if "applied" in state:
            self.applied = {(dev, int(v)) for dev, v in state["applied"]}
        self._learn_nonces(state.get("nonces", {}))  # a checkpoint that still lists them
        self._flight = None

    def forget(self) -> None:
        self.applied, self.held, self._held_keys = set(), [], set()
        self._flight, self._since, self.unsent = None, {}, []
