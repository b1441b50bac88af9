"""How rounds are run: the one part of the engine that differs between sync rounds and FedBuff /
FedAsync windows.

The engine (:class:`~edge_fl.server.aggregator.AggregatorCore`) owns what every mode shares: the
fleet view, decoding and admission order, the privacy ledger, the strategy and the round records.
A :class:`RoundPolicy` owns the rest: which devices are asked (selection, or everyone, or C at a
time), which round or version an update may name and with which nonce, when a round ends, what is
held for later and which devices may still be training after the last round. Each policy keeps its
own state and saves it with ``snapshot()`` / ``restore()``, so checkpoints and journals never need
to know which one runs.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from edge_fl.protocol import GlobalModel, Reject, Update

from .rounds import Decision, SyncRound

if TYPE_CHECKING:
    from .aggregator import AggregatorCore


class Round(Protocol):
    """The open round (sync) or window (async) as the engine uses it."""

    number: int
    selected: frozenset[str]
    target: int
    min_updates: int
    extended: bool
    opened_at: float

    @property
    def deadline(self) -> float: ...

    @property
    def count(self) -> int: ...

    def admit(self, device: str, update_round: int, base_version: int) -> Reject | None: ...

    def weight(self, base_version: int) -> float: ...

    def accept(self, device: str, base_version: int = 0) -> None: ...

    def decide(self, now: float) -> Decision: ...

    def staleness_stats(self) -> dict: ...


class RoundPolicy(Protocol):
    """What the engine asks of the way rounds are run (see the module docstring)."""

    kind: str  # "sync" | "async": the round type in checkpoints and journals

    # opening
    def open(self, now: float) -> GlobalModel | None: ...
    def reopen(self, rnd: Any, spec: dict[str, Any]) -> None: ...
    def open_message(self) -> GlobalModel: ...
    def open_spec(self) -> dict[str, Any]: ...
    def build_round(self, fields: dict[str, Any], now: float) -> Any: ...

    # admission
    def known(self, device: str) -> bool: ...
    def nonce_of(self, round_number: int) -> bytes | None: ...
    def current_nonce(self) -> bytes | None: ...
    def chargeable(self, device: str, update: Update) -> bool: ...
    def holds(self) -> bool: ...
    def hold(self, device: str, payload: bytes) -> Reject | None: ...
    def answered(self, device: str, releases: list[tuple[str, int, int]]) -> None: ...
    def on_status(self, device: str) -> None: ...

    # deciding and dispatching
    def decide(self, now: float) -> Decision: ...
    def arrivals_to_decide(self) -> int | None: ...
    def deadline(self) -> float | None: ...
    def dispatch(self, now: float) -> GlobalModel | None: ...
    def restore_dispatch(self, version: int, sent: list[str] | tuple[str, ...]) -> None: ...

    # closing and the end of the job
    def closing(self, rnd: Any) -> None: ...
    def remember(self, rnd: Any) -> None: ...
    def closed(self, record: dict[str, Any]) -> None: ...
    def charge_held(self) -> int: ...
    def outstanding(self) -> frozenset[str]: ...
    def summary(self) -> dict[str, Any]: ...

    # state
    def snapshot(self) -> dict[str, Any]: ...
    def restore(self, state: dict[str, Any]) -> None: ...
    def forget(self) -> None: ...


#: round fields rebuilt rather than stored: the clock (a resumed round gets a fresh deadline),
#: what replayed updates re-create, and the staleness function (from the settings)
REBUILT_FIELDS = frozenset(
    {"opened_at", "extended", "accepted", "earlier", "staleness_seen", "staleness"}
)


def round_fields(kind: str, rnd: Any) -> dict[str, Any]:
    """A round as plain data: every init field (number, selection, target, base version, any
    nonce, ...) but those rebuilt on restore; ``kind`` is the policy's."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(rnd):
        if f.name in REBUILT_FIELDS or not f.init:
            continue
        value = getattr(rnd, f.name)
        if isinstance(value, set | frozenset):
            value = {"frozenset": sorted(value)}
        elif isinstance(value, bytes):
            value = {"bytes": base64.b64encode(value).decode()}
        fields[f.name] = value
    return {"type": kind, "fields": fields}


def field_values(data: dict[str, Any]) -> dict[str, Any]:
    """The fields ``round_fields`` wrote, decoded."""

    def value(v: Any) -> Any:
        if isinstance(v, dict) and "frozenset" in v:
            return frozenset(v["frozenset"])
        if isinstance(v, dict) and "bytes" in v:
            return base64.b64decode(v["bytes"])
        return v

    return {k: value(v) for k, v in data["fields"].items()}


class SyncPolicy:
    """Synchronous rounds: select ``n_select`` devices (or let every available device flip its
    Poisson coin), wait for the target or the deadline (extended once when short), close."""

    kind = "sync"

    def __init__(self, engine: AggregatorCore) -> None:
        self.engine = engine

    # ----------------------------------------------------------- opening

    def open(self, now: float) -> GlobalModel | None:
        """Select devices and open the next round; None if too few devices are available."""
        e = self.engine
        pool = e.available()
        s = e.settings
        if s.sample_rate is not None:
            # Poisson: devices flip their own secret coins; the round runs to its deadline
            if not pool:
                return None
            selected, target, minimum = frozenset(pool), len(pool), 0
        else:
            if len(pool) < s.min_updates:
                return None
            n_select = min(s.n_select, len(pool))
            chosen = e.rng.choice(len(pool), size=n_select, replace=False)
            selected = frozenset(pool[i] for i in chosen)
            target = min(s.target, n_select)
            minimum = min(s.min_updates, target)
        e.round_number += 1
        e.current = SyncRound(
            number=e.round_number,
            base_version=e.version,
            selected=selected,
            target=target,
            min_updates=minimum,
            opened_at=now,
            deadline_s=s.deadline_s,
            extend_when_short=s.extend_when_short,
            nonce=e.new_nonce("round", e.round_number),
        )
        e.strategy = e.new_strategy()
        return self.open_message()

    def reopen(self, rnd: SyncRound, spec: dict[str, Any]) -> None:
        e = self.engine
        e.current = rnd
        e.strategy = e.new_strategy()

    def open_message(self) -> GlobalModel:
        e = self.engine
        rnd = e.current
        assert rnd is not None
        if e.settings.sample_rate is not None:
            return e.global_message(selected=None)
        return e.global_message(selected=tuple(sorted(rnd.selected)))

    def open_spec(self) -> dict[str, Any]:
        return {}

    def build_round(self, fields: dict[str, Any], now: float) -> SyncRound:
        return SyncRound(**fields, opened_at=now)

    # ----------------------------------------------------------- admission

    def round_facts(self, round_number: int) -> tuple[bytes | None, frozenset[str]] | None:
        """The nonce and selection of a round, open or closed (None: no such round)."""
        e = self.engine
        rnd = e.current
        if rnd is not None and rnd.number == round_number:
            return rnd.nonce, rnd.selected
        return e.history.get(round_number)

    def known(self, device: str) -> bool:
        """Announced a status, or was ever selected (a resumed aggregator learns statuses only
        after the broker has delivered the updates it queued)."""
        e = self.engine
        rnd = e.current
        return (
            device in e.devices
            or device in e.ever_selected
            or (rnd is not None and device in rnd.selected)
        )

    def nonce_of(self, round_number: int) -> bytes | None:
        facts = self.round_facts(round_number)
        return None if facts is None else facts[0]

    def current_nonce(self) -> bytes | None:
        rnd = self.engine.current
        return None if rnd is None else rnd.nonce

    def chargeable(self, device: str, update: Update) -> bool:
        """Selected for the round the update names: open, or closed (a straggler's late answer
        was still released). O(1)."""
        facts = self.round_facts(update.round)
        return facts is not None and device in facts[1]

    def holds(self) -> bool:
        return False  # a late answer is judged (and charged) at once

    def hold(self, device: str, payload: bytes) -> Reject | None:
        raise AssertionError("a synchronous round holds nothing")

    def answered(self, device: str, releases: list[tuple[str, int, int]]) -> None:
        return None

    def on_status(self, device: str) -> None:
        return None

    # ----------------------------------------------------------- deciding

    def decide(self, now: float) -> Decision:
        e = self.engine
        rnd = e.current
        if rnd is None:
            return Decision.WAIT
        decision = rnd.decide(now)
        pending = rnd.selected - rnd.accepted - e.refused
        if decision is Decision.WAIT and rnd.selected and not e.any_can_answer(pending):
            # every selected device that has not answered is offline or stopped: waiting for the
            # deadline cannot add an update
            return Decision.CLOSE if len(rnd.accepted) >= rnd.min_updates else Decision.SKIP
        return decision

    def arrivals_to_decide(self) -> int | None:
        """Until the deadline, :meth:`decide` changes when the target is reached or when every
        selected device still to answer is offline: after the smaller of (target - accepted)
        and (those still to answer that are online) more updates, or on a status. Without a
        selection (Poisson), any arrival may."""
        e = self.engine
        rnd = e.current
        if rnd is None or not rnd.selected:
            return None
        pending = rnd.selected - rnd.accepted - e.refused
        return max(1, min(rnd.target - len(rnd.accepted), e.can_answer(pending)))

    def deadline(self) -> float | None:
        rnd = self.engine.current
        return None if rnd is None else rnd.deadline

    def dispatch(self, now: float) -> GlobalModel | None:
        return None  # a round's selection goes out once, with its global message

    def restore_dispatch(self, version: int, sent: list[str] | tuple[str, ...]) -> None:
        raise ValueError("a dispatch record belongs to an asynchronous job, not a sync one")

    # ----------------------------------------------------------- closing

    def closing(self, rnd: SyncRound) -> None:
        return None

    def remember(self, rnd: SyncRound) -> None:
        """Keep a round's nonce and selection for late answers (and the O(1) stranger check)."""
        e = self.engine
        e.history[rnd.number] = (rnd.nonce, frozenset(rnd.selected))
        e.ever_selected |= rnd.selected

    def closed(self, record: dict[str, Any]) -> None:
        return None

    def charge_held(self) -> int:
        return 0  # late answers are charged as they arrive

    def outstanding(self) -> frozenset[str]:
        """Devices the last round asked, not yet heard from, that can still answer. Poisson
        rounds: none (the coins are secret; such a round already ran to its deadline)."""
        e = self.engine
        rnd = e.previous
        if rnd is None or e.settings.sample_rate is not None:
            return frozenset()
        pending = {d for d in rnd.selected if not e.is_released(d, rnd.number)}
        return frozenset(d for d in pending if e.any_can_answer((d,)))

    def summary(self) -> dict[str, Any]:
        return {}

    # ----------------------------------------------------------- state

    def snapshot(self) -> dict[str, Any]:
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        return None

    def forget(self) -> None:
        return None
