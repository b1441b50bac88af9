"""The privacy ledger: every release is recorded as a dp-accounting event and composed.

Conventions (they matter, see ``specs/privacy.md`` pitfalls 4, 6 and 8):

* A :class:`PrivacyEvent` is a ``DpEvent`` plus the neighbouring relation and the unit (``example``
  or ``device``) under which its numbers hold. Noise multipliers are always relative to the
  sensitivity *under the declared relation* (replace-one sensitivity for ``REPLACE_ONE``).
  dp-accounting 0.6.0 is not consistent about this: its RDP accountant ignores the relation for
  ``GaussianDpEvent``, while ``PLDAccountant(REPLACE_ONE)`` reads the same multiplier as relative to
  the add/remove sensitivity and doubles the shift (``GaussianDpEvent(1.1)`` at delta 1e-5: RDP
  4.24, PLD 8.90). The ledger therefore builds PLDs itself from ``privacy_loss_distribution``
  (un-sampled Gaussians always as the symmetric shift) so both accountants read events the same way.
* Pure eps-DP releases with no dedicated event (the SignDS exponential mechanism, any generic
  eps-DP step) are recorded by :func:`pure_dp_event` as binary randomized response with truth
  probability e^eps/(1+e^eps). That is provably valid and the tightest generic choice: for any
  eps-DP mechanism and neighbours, the output pair is a post-processing of the RR_eps pair
  (Kairouz, Oh, Viswanath 2015, privacy region of eps-DP), so every Renyi divergence and every
  hockey-stick divergence is at most RR's, and dominating pairs compose adaptively (Zhu, Dong,
  Wang, AISTATS 2022). It is NOT
  ``LaplaceDpEvent(1/eps)``: the Laplace RDP curve is strictly below RR's (eps = 1, order 1.1: 0.400
  vs 0.500), so using it for a generic mechanism would understate eps. Bun-Steinke's
  ``ZCDpEvent(eps^2/2)`` is valid but looser than RR at every order.
* dp-accounting 0.6.0's PLD accountant ignores ``count`` for randomized response (composes it once).
  The ledger composes RR PLDs with ``self_compose(count)``, which is correct.
* Composition: all events of one device plus all job-level events (``device=None``, e.g. central
  DP-FedAvg noise) compose into that device's epsilon; the job's epsilon is the maximum over
  devices. This is parallel composition and assumes every example / device belongs to exactly one
  device's data.
* Events of different relations or units compose only when each one's guarantee implies the common
  target: device-level replace-one events (local DP: any two inputs of the device) imply any
  example-level relation; otherwise mixing raises :class:`IncompatibleEventsError`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version as _pkg_version
from typing import Literal

import numpy as np
from dp_accounting import dp_event, mechanism_calibration
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.privacy_accountant import NeighboringRelation, UnsupportedEventError
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

__all__ = [
    "ACCOUNTANTS",
    "DP_ACCOUNTING_VERSION",
    "RDP_ORDERS",
    "EpsilonResult",
    "IncompatibleEventsError",
    "LedgerEntry",
    "NeighboringRelation",
    "PrivacyEvent",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "compose_epsilon",
    "pure_dp_event",
    "pure_epsilon_of",
    "pure_privacy_event",
    "relation_name",
]

#: Opacus / TF-Privacy orders (specs/privacy.md 1.3); identical results to dp-accounting's default
#: for the project's reference cases.
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10 for x in range(1, 100)] + list(range(12, 64)))
DP_ACCOUNTING_VERSION: str = _pkg_version("dp-accounting")
ACCOUNTANTS = ("rdp", "pld", "basic", "advanced")
Accountant = Literal["rdp", "pld", "basic", "advanced"]
Unit = Literal["example", "device"]
_UNITS = ("example", "device")
_SLACK = 1e-9  # relative float slack when comparing spent epsilon to a budget


class IncompatibleEventsError(ValueError):
    """Events whose neighbouring relations / units do not imply one common guarantee."""


def relation_name(relation: NeighboringRelation) -> str:
    return relation.name.lower()


def _check_delta(delta: float) -> float:
    d = float(delta)
    if not math.isfinite(d) or not 0.0 <= d < 1.0:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")
    return d


def _check_pos_eps(name: str, eps: float) -> float:
    e = float(eps)
    if not math.isfinite(e) or e <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {eps!r}")
    return e


def pure_dp_event(epsilon: float) -> dp_event.RandomizedResponseDpEvent:
    """The tight generic DpEvent of any pure ``epsilon``-DP release (see module docstring).

    Record it with relation ``REPLACE_ONE``: that is the relation dp-accounting's RR formulas use
    for the symmetric pair [e^eps, 1]/(1+e^eps) vs its swap.
    """
    e = _check_pos_eps("epsilon", epsilon)
    return dp_event.RandomizedResponseDpEvent(
        noise_parameter=2.0 * math.exp(-e) / (1.0 + math.exp(-e)), num_buckets=2
    )


def pure_epsilon_of(event: dp_event.DpEvent, relation: NeighboringRelation) -> float | None:
    """Pure eps of an event if it is pure DP (Laplace, RR, compositions of them), else None."""
    if isinstance(event, dp_event.NoOpDpEvent):
        return 0.0
    if isinstance(event, dp_event.LaplaceDpEvent):
        return math.inf if event.noise_multiplier == 0 else 1.0 / event.noise_multiplier
    if isinstance(event, dp_event.RandomizedResponseDpEvent):
        p, k = float(event.noise_parameter), int(event.num_buckets)
        if k == 1 or p == 1:
            return 0.0
        if p == 0:
            return math.inf
        if relation == NeighboringRelation.REPLACE_ONE:
            return math.log(k / p - k + 1)
        if relation == NeighboringRelation.REPLACE_SPECIAL:
            return max(math.log(k * (1 - p) + p), -math.log(p))
        return None
    if isinstance(event, dp_event.SelfComposedDpEvent):
        inner = pure_epsilon_of(event.event, relation)
        return None if inner is None else inner * event.count
    if isinstance(event, dp_event.ComposedDpEvent):
        parts = [pure_epsilon_of(e, relation) for e in event.events]
        return None if any(p is None for p in parts) else math.fsum(parts)  # type: ignore[arg-type]
    return None


def _has_poisson(event: dp_event.DpEvent) -> bool:
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        return True
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return _has_poisson(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return any(_has_poisson(e) for e in event.events)
    return False


@dataclass(frozen=True)
class PrivacyEvent:
    """A DpEvent with the relation and unit its numbers refer to; what one release realises."""

    event: dp_event.DpEvent
    relation: NeighboringRelation
    unit: Unit
    mechanism: str = "unspecified"
    #: derived from the event (never declared), so basic composition cannot be fed a wrong claim
    pure_epsilon: float | None = field(default=None, init=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.event, dp_event.DpEvent):
            raise TypeError(
                f"event must be a dp_accounting DpEvent, got {type(self.event).__name__}"
            )
        if not isinstance(self.relation, NeighboringRelation):
            raise ValueError(f"relation must be a NeighboringRelation, got {self.relation!r}")
        if self.unit not in _UNITS:
            raise ValueError(f"unit must be one of {_UNITS}, got {self.unit!r}")
        object.__setattr__(self, "pure_epsilon", pure_epsilon_of(self.event, self.relation))

    @property
    def poisson_sampled(self) -> bool:
        return _has_poisson(self.event)

    @property
    def key(self) -> tuple[str, NeighboringRelation, str]:
        # attrs reprs are deterministic and round-trip floats, so they identify equal events even
        # when the event holds a list (ComposedDpEvent) and is unhashable.
        return (repr(self.event), self.relation, self.unit)


def pure_privacy_event(epsilon: float, mechanism: str, unit: Unit = "device") -> PrivacyEvent:
    """A pure eps-DP release (e.g. SignDS exponential mechanism) as a ledger event."""
    return PrivacyEvent(pure_dp_event(epsilon), NeighboringRelation.REPLACE_ONE, unit, mechanism)


# ----------------------------------------------------------------------------------------------
# Composition of a multiset of PrivacyEvents


def _covers(kind: tuple[NeighboringRelation, str], target: tuple[NeighboringRelation, str]) -> bool:
    if kind == target:
        return True
    # Local DP (any two inputs of one device) implies every example-level relation inside it.
    return kind == (NeighboringRelation.REPLACE_ONE, "device") and target[1] == "example"


def _target(kinds: set[tuple[NeighboringRelation, str]]) -> tuple[NeighboringRelation, str]:
    for cand in sorted(kinds, key=lambda k: (k[1], k[0].value)):
        if all(_covers(k, cand) for k in kinds):
            return cand
    shown = ", ".join(f"{relation_name(r)}/{u}" for r, u in sorted(kinds, key=str))
    raise IncompatibleEventsError(
        f"events with neighbouring relations/units {{{shown}}} do not imply one common guarantee; "
        "account them in separate ledgers"
    )


@dataclass(frozen=True)
class EpsilonResult:
    """An epsilon with what it means (relation, unit, accountant)."""

    epsilon: float
    delta: float
    accountant: str
    relation: NeighboringRelation | None
    unit: str | None
    optimal_order: float | None = None
    order_at_grid_edge: bool = False


class _Composer:
    """Composes multisets of PrivacyEvents, caching per-event RDP curves and PLDs."""

    def __init__(self, orders: Sequence[float], pld_discretization: float) -> None:
        self.orders = np.asarray(orders, dtype=np.float64)
        self.dx = float(pld_discretization)
        self._rdp: dict[tuple, np.ndarray] = {}
        self._pld: dict[tuple, pld_lib.PrivacyLossDistribution] = {}

    # --- RDP -------------------------------------------------------------------------------
    def _rdp_curve(self, ev: PrivacyEvent) -> np.ndarray:
        curve = self._rdp.get(ev.key)
        if curve is None:
            acc = rdp_lib.RdpAccountant(list(self.orders), ev.relation)
            try:
                acc.compose(ev.event)
            except UnsupportedEventError as err:
                raise UnsupportedEventError(
                    f"RDP accountant cannot compose {ev.mechanism} event {ev.event} under "
                    f"{relation_name(ev.relation)}: {err}"
                ) from err
            curve = acc.rdp
            self._rdp[ev.key] = curve
        return curve

    def rdp(self, counted: Counter, events: dict, delta: float) -> tuple[float, float]:
        total = np.zeros_like(self.orders)
        for key, count in counted.items():
            total = total + count * self._rdp_curve(events[key])
        eps, order = rdp_lib.compute_epsilon(self.orders, total, delta)
        return float(eps), float(order)

    # --- PLD -------------------------------------------------------------------------------
    def _pld_of(
        self, event: dp_event.DpEvent, rel: NeighboringRelation, count: int
    ) -> list[pld_lib.PrivacyLossDistribution] | None:
        """PLDs whose composition is ``count`` runs of ``event``; None means not private."""
        ar = NeighboringRelation.ADD_OR_REMOVE_ONE
        sampled_ok = (ar, NeighboringRelation.REPLACE_SPECIAL)
        if isinstance(event, dp_event.NoOpDpEvent) or count == 0:
            return []
        if isinstance(event, dp_event.NonPrivateDpEvent):
            return None
        if isinstance(event, dp_event.SelfComposedDpEvent):
            return self._pld_of(event.event, rel, count * event.count)
        if isinstance(event, dp_event.ComposedDpEvent):
            out: list[pld_lib.PrivacyLossDistribution] = []
            for e in event.events:
                part = self._pld_of(e, rel, count)
                if part is None:
                    return None
                out.extend(part)
            return out
        if isinstance(event, dp_event.GaussianDpEvent):
            if event.noise_multiplier == 0:
                return None
            # Multiplier relative to the declared relation's sensitivity: symmetric shift.
            return [
                pld_lib.from_gaussian_mechanism(
                    standard_deviation=event.noise_multiplier / math.sqrt(count),
                    value_discretization_interval=self.dx,
                    neighboring_relation=ar,
                )
            ]
        if isinstance(event, dp_event.LaplaceDpEvent):
            if event.noise_multiplier == 0:
                return None
            base = pld_lib.from_laplace_mechanism(
                parameter=event.noise_multiplier, value_discretization_interval=self.dx
            )
            return [base.self_compose(count) if count > 1 else base]
        if isinstance(event, dp_event.RandomizedResponseDpEvent):
            if rel not in (NeighboringRelation.REPLACE_ONE, NeighboringRelation.REPLACE_SPECIAL):
                raise UnsupportedEventError(
                    f"randomized response needs relation replace_one or replace_special, got "
                    f"{relation_name(rel)}"
                )
            if event.num_buckets == 1:
                return []
            if event.noise_parameter == 0:
                return None
            base = pld_lib.from_randomized_response(
                noise_parameter=event.noise_parameter,
                num_buckets=event.num_buckets,
                value_discretization_interval=self.dx,
                neighboring_relation=rel,
            )
            # Work-around for dp-accounting 0.6.0, whose PLDAccountant drops `count` for RR.
            return [base.self_compose(count) if count > 1 else base]
        if isinstance(event, dp_event.PoissonSampledDpEvent):
            inner, q = event.event, float(event.sampling_probability)
            if rel not in sampled_ok:
                raise UnsupportedEventError(
                    f"PoissonSampled events need relation add_or_remove_one or replace_special, "
                    f"got {relation_name(rel)}"
                )
            if q == 0:
                return []
            if isinstance(inner, dp_event.GaussianDpEvent | dp_event.LaplaceDpEvent):
                if inner.noise_multiplier == 0:
                    return None
                if isinstance(inner, dp_event.GaussianDpEvent):
                    base = pld_lib.from_gaussian_mechanism(
                        standard_deviation=inner.noise_multiplier,
                        value_discretization_interval=self.dx,
                        sampling_prob=q,
                        neighboring_relation=rel,
                    )
                else:
                    base = pld_lib.from_laplace_mechanism(
                        parameter=inner.noise_multiplier,
                        value_discretization_interval=self.dx,
                        sampling_prob=q,
                    )
                return [base.self_compose(count) if count > 1 else base]
        raise UnsupportedEventError(f"PLD accountant does not support {event}")

    def pld(self, counted: Counter, events: dict, delta: float) -> float:
        plds: list[pld_lib.PrivacyLossDistribution] = []
        # Un-sampled Gaussians (all read as symmetric shifts) merge exactly: sum of count/sigma^2.
        gauss_precision = 0.0
        for key, count in counted.items():
            ev: PrivacyEvent = events[key]
            base = ev.event
            n = count
            while isinstance(base, dp_event.SelfComposedDpEvent):
                n *= base.count
                base = base.event
            if isinstance(base, dp_event.GaussianDpEvent) and base.noise_multiplier > 0:
                gauss_precision += n / base.noise_multiplier**2
                continue
            cache_key = (*ev.key, count)
            cached = self._pld.get(cache_key)
            if cached is None:
                try:
                    parts = self._pld_of(ev.event, ev.relation, count)
                except UnsupportedEventError as err:
                    raise UnsupportedEventError(
                        f"PLD accountant cannot compose {ev.mechanism} event {ev.event}: {err}"
                    ) from err
                if parts is None:
                    return math.inf
                cached = _compose_all(parts, self.dx)
                self._pld[cache_key] = cached
            plds.append(cached)
        if gauss_precision > 0:
            plds.append(
                pld_lib.from_gaussian_mechanism(
                    standard_deviation=1.0 / math.sqrt(gauss_precision),
                    value_discretization_interval=self.dx,
                )
            )
        return float(_compose_all(plds, self.dx).get_epsilon_for_delta(delta))


def _compose_all(
    plds: list[pld_lib.PrivacyLossDistribution], dx: float
) -> pld_lib.PrivacyLossDistribution:
    if not plds:
        return pld_lib.identity(value_discretization_interval=dx)
    out = plds[0]
    for p in plds[1:]:
        out = out.compose(p)
    return out


def _pure_list(counted: Counter, events: dict, accountant: str) -> list[tuple[float, int]]:
    out = []
    for key, count in counted.items():
        ev: PrivacyEvent = events[key]
        if ev.pure_epsilon is None:
            raise ValueError(
                f"accountant {accountant!r} composes pure eps-DP events only; {ev.mechanism} "
                f"event {ev.event} is not pure DP (use 'rdp' or 'pld')"
            )
        out.append((ev.pure_epsilon, count))
    return out


def _basic(pure: list[tuple[float, int]]) -> float:
    return math.fsum(e * c for e, c in pure)


def _advanced(pure: list[tuple[float, int]], delta: float) -> float:
    """Heterogeneous advanced composition (Kairouz-Oh-Viswanath 2015, Thm 3.5), min with basic."""
    basic = _basic(pure)
    if delta <= 0 or math.isinf(basic):
        return basic
    sq = math.fsum(e * e * c for e, c in pure)
    mean = math.fsum(c * e * math.tanh(e / 2) for e, c in pure)  # (e^e - 1)/(e^e + 1) = tanh(e/2)
    return min(basic, mean + math.sqrt(2 * sq * math.log(1 / delta)))


def _compose(
    composer: _Composer,
    events: Iterable[PrivacyEvent],
    delta: float,
    accountant: str,
) -> EpsilonResult:
    delta = _check_delta(delta)
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    counted: Counter = Counter()
    by_key: dict[tuple, PrivacyEvent] = {}
    for ev in events:
        counted[ev.key] += 1
        by_key.setdefault(ev.key, ev)
    if not counted:
        return EpsilonResult(0.0, delta, accountant, None, None)
    relation, unit = _target({(e.relation, e.unit) for e in by_key.values()})
    order: float | None = None
    edge = False
    if accountant == "rdp":
        eps, order = composer.rdp(counted, by_key, delta)
        edge = math.isfinite(eps) and order in (composer.orders[0], composer.orders[-1])
    elif accountant == "pld":
        eps = composer.pld(counted, by_key, delta)
    elif accountant == "basic":
        eps = _basic(_pure_list(counted, by_key, accountant))
    else:
        eps = _advanced(_pure_list(counted, by_key, accountant), delta)
    return EpsilonResult(eps, delta, accountant, relation, unit, order, edge)


def compose_epsilon(
    events: Iterable[PrivacyEvent],
    delta: float,
    accountant: Accountant = "rdp",
    *,
    orders: Sequence[float] = RDP_ORDERS,
    pld_discretization: float = 1e-4,
) -> EpsilonResult:
    """Epsilon of the adaptive composition of ``events`` (one unit's view, no parallel split)."""
    return _compose(_Composer(orders, pld_discretization), events, delta, accountant)


def calibrate_noise_multiplier(
    make_event: Callable[[float], dp_event.DpEvent],
    target_epsilon: float,
    delta: float,
    accountant: Literal["rdp", "pld"] = "rdp",
    *,
    orders: Sequence[float] = RDP_ORDERS,
) -> float:
    """Smallest noise multiplier x with eps(make_event(x)) <= target_epsilon at ``delta``.

    Uses ``dp_accounting.calibrate_dp_mechanism`` (Brent search; the returned x never gives more
    than the target). Accountants run under add/remove, which reads Gaussian / Laplace multipliers
    relative to the declared sensitivity (this module's convention) and is what PoissonSampled
    events need.
    """
    eps = _check_pos_eps("target_epsilon", target_epsilon)
    d = float(delta)
    if not (math.isfinite(d) and 0 < d < 1):
        raise ValueError(f"delta must be in (0, 1) to calibrate Gaussian noise, got {delta!r}")
    if accountant == "rdp":

        def fresh() -> rdp_lib.RdpAccountant:
            return rdp_lib.RdpAccountant(list(orders))
    elif accountant == "pld":

        def fresh() -> pld_privacy_accountant.PLDAccountant:  # type: ignore[misc]
            return pld_privacy_accountant.PLDAccountant()
    else:
        raise ValueError(f"accountant must be 'rdp' or 'pld' for calibration, got {accountant!r}")
    x = mechanism_calibration.calibrate_dp_mechanism(
        fresh,
        make_event,
        eps,
        d,
        bracket_interval=mechanism_calibration.LowerEndpointAndGuess(0.0, 1.0),
    )
    return float(x)


# ----------------------------------------------------------------------------------------------
# The ledger


@dataclass(frozen=True)
class LedgerEntry:
    event: PrivacyEvent
    device: Hashable | None
    round: int | None


class PrivacyLedger:
    """Records every release per device and for the job, and composes them all.

    ``device=None`` marks a job-level release (e.g. the aggregator's central noise) that touches
    every device's data. The optional budget (``budget_epsilon`` at ``budget_delta`` under
    ``budget_accountant``) is what :meth:`remaining` and :meth:`exhausted` check against.
    """

    def __init__(
        self,
        *,
        orders: Sequence[float] = RDP_ORDERS,
        pld_discretization: float = 1e-4,
        budget_epsilon: float | None = None,
        budget_delta: float | None = None,
        budget_accountant: Accountant = "rdp",
    ) -> None:
        if budget_epsilon is not None:
            _check_pos_eps("budget_epsilon", budget_epsilon)
            if budget_delta is None:
                raise ValueError(
                    "budget_delta is required with budget_epsilon (use 0.0 for pure DP)"
                )
        if budget_delta is not None:
            _check_delta(budget_delta)
        if budget_accountant not in ACCOUNTANTS:
            raise ValueError(
                f"budget_accountant must be one of {ACCOUNTANTS}, got {budget_accountant!r}"
            )
        if not (math.isfinite(pld_discretization) and pld_discretization > 0):
            raise ValueError(f"pld_discretization must be > 0, got {pld_discretization!r}")
        self._composer = _Composer(orders, pld_discretization)
        self._entries: list[LedgerEntry] = []
        self._devices: dict[Hashable, None] = {}
        self.budget_epsilon = budget_epsilon
        self.budget_delta = budget_delta
        self.budget_accountant = budget_accountant
        self._eps_cache: dict[tuple, EpsilonResult] = {}

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
        # Devices with the same multiset of events have the same epsilon: compute each once.
        by_signature: dict[tuple, Hashable] = {}
        for dev in self._devices:
            sig = tuple(sorted(Counter(e.key for e in self._events_for(dev)).items(), key=str))
            by_signature.setdefault(sig, dev)
        worst: tuple[EpsilonResult, Hashable | None] | None = None
        for dev in by_signature.values():
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

    # --- budget ----------------------------------------------------------------------------
    def _budget(
        self, budget_eps: float | None, delta: float | None, accountant: str | None
    ) -> tuple[float, float, str]:
        b = self.budget_epsilon if budget_eps is None else budget_eps
        d = self.budget_delta if delta is None else delta
        if b is None or d is None:
            raise ValueError(
                "no budget: pass budget_eps and delta, or construct the ledger with one"
            )
        return (
            _check_pos_eps("budget_eps", b),
            _check_delta(d),
            accountant or self.budget_accountant,
        )

    def remaining(
        self,
        device: Hashable | None = None,
        budget_eps: float | None = None,
        delta: float | None = None,
        accountant: Accountant | None = None,
    ) -> float:
        """Budget left for ``device`` (negative when overspent)."""
        b, d, acc = self._budget(budget_eps, delta, accountant)
        return b - self.epsilon(d, acc, device)  # type: ignore[arg-type]

    def exhausted(
        self,
        device: Hashable | None = None,
        budget_eps: float | None = None,
        delta: float | None = None,
        *,
        accountant: Accountant | None = None,
        next_event: PrivacyEvent | None = None,
    ) -> bool:
        """True if ``device`` has spent its budget, or could not afford ``next_event``.

        Checking ``next_event`` before a release is what lets a device stop *before* it overspends.
        """
        b, d, acc = self._budget(budget_eps, delta, accountant)
        if next_event is None:
            return self.epsilon(d, acc, device) >= b * (1 - _SLACK)  # type: ignore[arg-type]
        scopes = [device] if device is not None or not self._devices else list(self._devices)
        return any(
            _compose(self._composer, [*self._events_for(s), next_event], d, acc).epsilon
            > b * (1 + _SLACK)
            for s in scopes
        )

    # --- reporting -------------------------------------------------------------------------
    def report(
        self, delta: float, accountant: Accountant = "rdp", device: Hashable | None = None
    ) -> dict:
        """The total guarantee with everything needed to interpret it (pitfall 6)."""
        if device is None:
            res, worst = self._job_result(delta, accountant)
            scope = "job (max over devices)" if self._devices else "job"
        else:
            res, worst = self._result(delta, accountant, device), device
            scope = f"device {device}"
        events = self._events_for(worst)
        poisson = any(e.poisson_sampled for e in events)
        pure = [e.pure_epsilon for e in events]
        out: dict = {
            "epsilon": res.epsilon,
            "delta": res.delta,
            "accountant": accountant,
            "accountant_impl": f"dp-accounting {DP_ACCOUNTING_VERSION}",
            "neighbouring_relation": None if res.relation is None else relation_name(res.relation),
            "unit": res.unit,
            "sampling": (
                "poisson: each unit included independently with prob q, selection secret and "
                "from a CSPRNG (amplification void otherwise)"
                if poisson
                else "none (no amplification by sampling claimed)"
            ),
            "scope": scope,
            "worst_device": worst if device is None else None,
            "events": len(events),
            "rounds": len({e.round for e in self._entries if e.round is not None}),
            "mechanisms": sorted({e.mechanism for e in events}),
            "composition": "all recorded releases (all rounds, all mechanisms)",
        }
        if res.optimal_order is not None:
            out["rdp_optimal_order"] = res.optimal_order
            out["rdp_order_at_grid_edge"] = res.order_at_grid_edge
        if events and all(p is not None for p in pure):
            # Pure-DP-only ledgers: basic (and advanced) composition are valid bounds too, and for
            # few rounds of large per-round eps can beat the RDP conversion.
            pure_counts = list(Counter(pure).items())
            out["basic_epsilon"] = _basic(pure_counts)  # type: ignore[arg-type]
            out["advanced_epsilon"] = _advanced(pure_counts, res.delta)  # type: ignore[arg-type]
        return out
