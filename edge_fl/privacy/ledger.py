"""The privacy ledger: every release, per device and for the job, composed by the accountants.

``device=None`` marks a job-level release (e.g. the aggregator's central noise) that touches every
device's data. A device's epsilon composes its own releases and the job-level ones; the job's is the
worst device's (parallel composition over disjoint data).

A composition depends only on which events it holds, how many of each, and the order in which each
kind first occurs (the accountants sum and compose in that order). The ledger keeps that
*signature* per device as releases are recorded, so grouping 10,000 devices costs one dict lookup
each, not a scan of every entry per device, and a signature once composed is never composed again.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat

from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation, UnsupportedEventError

from edge_fl.privacy.accountants import (
    DP_ACCOUNTING_VERSION,
    RDP_ORDERS,
    Accountant,
    Bound,
    Composer,
    EpsilonResult,
    best_with,
    compose_with,
)
from edge_fl.privacy.events import IncompatibleEventsError, PrivacyEvent, Unit

__all__ = ["LedgerEntry", "PrivacyLedger"]

#: a composition's input: (event key, count) in the order each key first occurs
Signature = tuple[tuple[tuple, int], ...]


@dataclass(frozen=True)
class LedgerEntry:
    event: PrivacyEvent
    device: Hashable | None
    round: int | None


class PrivacyLedger:
    """Records every release per device and for the job, and composes them all."""

    def __init__(
        self, *, orders: Sequence[float] = RDP_ORDERS, pld_discretization: float = 1e-4
    ) -> None:
        if not pld_discretization > 0:
            raise ValueError(f"pld_discretization must be > 0, got {pld_discretization!r}")
        self._composer = Composer(orders, pld_discretization)
        self._entries: list[LedgerEntry] = []
        self._devices: dict[Hashable, None] = {}
        self._event_of: dict[tuple, PrivacyEvent] = {}  # event key -> its first event
        self._job: dict[tuple, int] = {}  # job-level key -> count, in first-occurrence order
        self._own: dict[Hashable, dict[tuple, int]] = {}  # device -> its composition's counts
        self._sig: dict[Hashable, Signature] = {}  # device -> signature (dropped on change)
        # compositions by signature: pure functions of it, so they stay valid as the ledger grows
        self._eps_cache: dict[tuple, EpsilonResult] = {}
        self._best_cache: dict[tuple, Bound] = {}

    # --- recording -------------------------------------------------------------------------
    def add(
        self,
        event: PrivacyEvent | dp_event.DpEvent,
        device: Hashable | None = None,
        round: int | None = None,
        *,
        relation: NeighboringRelation | None = None,
        unit: Unit | None = None,
        mechanism: str = "unspecified",
    ) -> LedgerEntry:
        """Record one release. A bare DpEvent needs ``relation`` and ``unit``."""
        if isinstance(event, dp_event.DpEvent):
            if relation is None or unit is None:
                raise ValueError(
                    "a bare DpEvent needs relation= and unit= (the guarantee is meaningless "
                    "without them); or pass a PrivacyEvent from a mechanism"
                )
            event = PrivacyEvent(event, relation, unit, mechanism)
        elif not isinstance(event, PrivacyEvent):
            raise TypeError(f"event must be a PrivacyEvent or DpEvent, got {type(event).__name__}")
        if round is not None and (isinstance(round, bool) or int(round) != round or round < 0):
            raise ValueError(f"round must be an integer >= 0 or None, got {round!r}")
        entry = LedgerEntry(event, device, None if round is None else int(round))
        self._entries.append(entry)
        key = event.key
        self._event_of.setdefault(key, event)
        if device is None:  # every device's composition gains it: O(devices), once a round
            self._job[key] = self._job.get(key, 0) + 1
            for held in self._own.values():
                held[key] = held.get(key, 0) + 1
            self._sig.clear()
        else:
            self._devices.setdefault(device, None)
            counts = self._own.get(device)
            if counts is None:  # the job-level events so far come first, in their order
                counts = self._own[device] = dict(self._job)
            counts[key] = counts.get(key, 0) + 1
            self._sig.pop(device, None)
        return entry

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    @property
    def devices(self) -> list[Hashable]:
        return list(self._devices)

    def _events_for(self, device: Hashable | None) -> list[PrivacyEvent]:
        return [e.event for e in self._entries if e.device is None or e.device == device]

    def _signature(self, device: Hashable | None) -> Signature:
        """What ``device``'s composition depends on (a device without releases, or None: the
        job-level events alone)."""
        sig = self._sig.get(device)
        if sig is None:
            counts = self._own.get(device) if device is not None else None
            sig = tuple((counts if counts is not None else self._job).items())
            if device is not None and counts is not None:
                self._sig[device] = sig
        return sig

    def _expand(self, sig: Signature) -> list[PrivacyEvent]:
        """Events whose composition is the signature's (same kinds, counts and first order)."""
        return [ev for key, n in sig for ev in repeat(self._event_of[key], n)]

    # --- epsilon ---------------------------------------------------------------------------
    def _result(self, delta: float, accountant: str, device: Hashable | None) -> EpsilonResult:
        sig = self._signature(device)
        key = (float(delta), accountant, sig)
        res = self._eps_cache.get(key)
        if res is None:
            res = compose_with(self._composer, self._expand(sig), delta, accountant)
            self._eps_cache[key] = res
        return res

    def _job_result(self, delta: float, accountant: str) -> tuple[EpsilonResult, Hashable | None]:
        if not self._devices:
            return self._result(delta, accountant, None), None
        worst: tuple[EpsilonResult, Hashable | None] | None = None
        for dev in self._signatures():
            res = self._result(delta, accountant, dev)
            if worst is None or res.epsilon > worst[0].epsilon:
                worst = (res, dev)
        assert worst is not None
        return worst

    def epsilon(
        self, delta: float, accountant: Accountant = "rdp", device: Hashable | None = None
    ) -> float:
        """Total epsilon at ``delta`` over all recorded rounds and mechanisms.

        With ``device`` it is that device's (its events plus the job-level ones); without, the
        job's: the worst device (parallel composition across devices' disjoint data).
        """
        if device is not None:
            return self._result(delta, accountant, device).epsilon
        return self._job_result(delta, accountant)[0].epsilon

    def epsilon_by_device(self, delta: float, accountant: Accountant = "rdp") -> dict:
        return {d: self._result(delta, accountant, d).epsilon for d in self._devices}

    def _groups(self, extra: Iterable[Hashable] = ()) -> dict[frozenset, list]:
        """Devices by multiset of events (equal multisets have equal epsilon): the multiset ->
        [its first device, how many devices]; ``extra``: devices without releases counted in
        too (first in ledger order, then theirs)."""
        groups: dict[frozenset, list] = {}
        for dev in self._devices:
            group = groups.setdefault(frozenset(self._signature(dev)), [dev, 0])
            group[1] += 1
        bare = sum(1 for dev in dict.fromkeys(extra) if dev not in self._devices)
        if bare:
            groups.setdefault(frozenset(self._job.items()), [None, 0])[1] += bare
        return groups

    def _signatures(self) -> list[Hashable]:
        """One device per distinct multiset of events: equal multisets have equal epsilon."""
        return [dev for dev, _ in self._groups().values()]

    def best(self, delta: float, device: Hashable | None = None) -> tuple[Bound, Hashable | None]:
        """The tightest valid bound (see :func:`best_epsilon`) for ``device``, or for the job: the
        worst device's, returned with that device.

        For the job, devices are visited by decreasing RDP epsilon (cheap: cached curves); since a
        device's best bound is at most its RDP value, the search stops at the first device whose
        RDP value cannot beat the worst best bound found so far. Exact, and it spares the PLD of
        most devices on every round.
        """
        if device is not None or not self._devices:
            return self._best_of(delta, device), device
        scopes = self._signatures()
        try:
            rdp = {d: self._result(delta, "rdp", d).epsilon for d in scopes}
            scopes.sort(key=lambda d: -rdp[d])
        except (UnsupportedEventError, IncompatibleEventsError):
            rdp = {}
        worst: tuple[Bound, Hashable | None] | None = None
        for dev in scopes:
            if worst is not None and dev in rdp and rdp[dev] <= worst[0].epsilon:
                break
            bound = self._best_of(delta, dev)
            if worst is None or bound.epsilon > worst[0].epsilon:
                worst = (bound, dev)
        assert worst is not None
        return worst

    def _best_of(self, delta: float, device: Hashable | None) -> Bound:
        sig = self._signature(device)
        key = (float(delta), sig)
        bound = self._best_cache.get(key)
        if bound is None:
            bound = self._best_cache[key] = best_with(self._composer, self._expand(sig), delta)
        return bound

    def device_distribution(
        self, delta: float, devices: Iterable[Hashable] = ()
    ) -> list[tuple[float, int]]:
        """Every device's tightest epsilon (``best``), as (epsilon, how many devices) sorted by
        epsilon: the ledger's devices, and those of ``devices`` it holds no release of (the
        job-level events alone). Each distinct multiset is composed once, through the same
        device as :meth:`best` composes it, so the largest value is exactly the job's."""
        values: dict[float, int] = {}
        for dev, count in self._groups(devices).values():
            eps = self._best_of(delta, dev).epsilon
            values[eps] = values.get(eps, 0) + count
        if not values:
            values[self._best_of(delta, None).epsilon] = 0
        return sorted(values.items())

    # --- reporting -------------------------------------------------------------------------
    def report(self, delta: float, device: Hashable | None = None) -> dict:
        """The total guarantee with everything needed to interpret it (docs/specs/privacy.md pitfall 6): the tightest
        valid epsilon, every accountant's value (None plus a reason when skipped), the scope."""
        bound, worst = self.best(delta, device)
        events = self._events_for(worst)
        poisson = any(e.poisson_sampled for e in events)
        return {
            **bound.as_dict(),
            "accountant_impl": f"dp-accounting {DP_ACCOUNTING_VERSION}",
            "sampling": (
                "poisson: each unit included independently with prob q, selection secret and "
                "from a CSPRNG (amplification void otherwise)"
                if poisson
                else "none (no amplification by sampling claimed)"
            ),
            "scope": f"device {device}"
            if device is not None
            else ("job (max over devices)" if self._devices else "job"),
            "worst_device": worst if device is None else None,
            "events": len(events),
            "rounds": len({e.round for e in self._entries if e.round is not None}),
            "mechanisms": sorted({e.mechanism for e in events}),
            "composition": "all recorded releases (all rounds, all mechanisms)",
        }
