"""The privacy ledger: every release, per device and for the job, composed by the accountants.

``device=None`` marks a job-level release (e.g. the aggregator's central noise) that touches every
device's data. A device's epsilon composes its own releases and the job-level ones; the job's is the
worst device's (parallel composition over disjoint data).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation, UnsupportedEventError

from edge_fl.privacy.accountants import (
    DP_ACCOUNTING_VERSION,
    RDP_ORDERS,
    Accountant,
    Bound,
    EpsilonResult,
    _best,
    _compose,
    _Composer,
)
from edge_fl.privacy.events import IncompatibleEventsError, PrivacyEvent, Unit

__all__ = ["LedgerEntry", "PrivacyLedger"]


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
        self._composer = _Composer(orders, pld_discretization)
        self._entries: list[LedgerEntry] = []
        self._devices: dict[Hashable, None] = {}
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
        if device is not None:
            self._devices.setdefault(device, None)
        self._eps_cache.clear()
        self._best_cache.clear()
        return entry

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    @property
    def devices(self) -> list[Hashable]:
        return list(self._devices)

    def _events_for(self, device: Hashable | None) -> list[PrivacyEvent]:
        return [e.event for e in self._entries if e.device is None or e.device == device]

    # --- epsilon ---------------------------------------------------------------------------
    def _result(self, delta: float, accountant: str, device: Hashable | None) -> EpsilonResult:
        key = (float(delta), accountant, device)
        res = self._eps_cache.get(key)
        if res is None:
            res = _compose(self._composer, self._events_for(device), delta, accountant)
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

    def _signatures(self) -> list[Hashable]:
        """One device per distinct multiset of events: equal multisets have equal epsilon."""
        by_signature: dict[tuple, Hashable] = {}
        for dev in self._devices:
            sig = tuple(sorted(Counter(e.key for e in self._events_for(dev)).items(), key=str))
            by_signature.setdefault(sig, dev)
        return list(by_signature.values())

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
        key = (float(delta), device)
        bound = self._best_cache.get(key)
        if bound is None:
            bound = self._best_cache[key] = _best(self._composer, self._events_for(device), delta)
        return bound

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
