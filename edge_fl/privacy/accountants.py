"""Accountants: the epsilon of a multiset of privacy events, and the tightest valid one.

Four accountants bound the same composition: RDP and PLD (dp-accounting, for any supported event;
PLD is the exact analytic Gaussian when the ledger holds only un-sampled Gaussians)
and, for pure eps-DP events only, basic and advanced composition. Each result is an upper bound,
so the smallest is valid too; :func:`best_epsilon` computes every applicable one, says why any was
skipped, and names the winner. The device's budget check and the aggregator's ledger both use it,
so a device and the report can never disagree about what a release cost.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import version as _pkg_version
from typing import Literal

import numpy as np
from dp_accounting import dp_event, get_epsilon_gaussian, mechanism_calibration
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.privacy_accountant import NeighboringRelation, UnsupportedEventError
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from edge_fl.privacy.events import (
    IncompatibleEventsError,
    PrivacyEvent,
    check_delta,
    check_positive_epsilon,
    implies,
    relation_name,
)

__all__ = [
    "ACCOUNTANTS",
    "DP_ACCOUNTING_VERSION",
    "PLD_MAX_PURE_EPSILON",
    "RDP_ORDERS",
    "Bound",
    "Composer",
    "EpsilonResult",
    "best_epsilon",
    "best_with",
    "calibrate_noise_multiplier",
    "compose_epsilon",
    "compose_with",
]

#: Opacus / TF-Privacy orders (docs/specs/privacy.md 1.3); identical results to dp-accounting's default
#: for the project's reference cases.
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10 for x in range(1, 100)] + list(range(12, 64)))
DP_ACCOUNTING_VERSION: str = _pkg_version("dp-accounting")
ACCOUNTANTS = ("rdp", "pld", "basic", "advanced")
Accountant = Literal["rdp", "pld", "basic", "advanced"]
#: A pure release above this eps has a privacy-loss range too wide for a 1e-4 PLD grid (SignDS at
#: eps 100 would need millions of points per composition): PLD is skipped, with this reason.
PLD_MAX_PURE_EPSILON = 10.0
#: Likewise for Gaussian noise this small relative to the sensitivity (eps in the hundreds).
PLD_MIN_GAUSSIAN_SIGMA = 0.05

# ----------------------------------------------------------------------------------------------
# Composition of a multiset of PrivacyEvents


def _covers(kind: tuple[NeighboringRelation, str], target: tuple[NeighboringRelation, str]) -> bool:
    # Local DP (any two inputs of one device) implies every example-level relation inside it.
    return implies(kind[0], kind[1], target)


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


class Composer:
    """Composes multisets of PrivacyEvents, caching per-event RDP curves and PLDs."""

    def __init__(self, orders: Sequence[float], pld_discretization: float) -> None:
        self.orders = np.asarray(orders, dtype=np.float64)
        self.dx = float(pld_discretization)
        self._rdp: dict[tuple, np.ndarray] = {}
        self._pld: dict[tuple, pld_lib.PrivacyLossDistribution] = {}
        self._leaves: dict[tuple, pld_lib.PrivacyLossDistribution] = {}

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
    def _leaf(
        self,
        event: dp_event.DpEvent,
        rel: NeighboringRelation,
        make: Callable[[], pld_lib.PrivacyLossDistribution],
    ) -> pld_lib.PrivacyLossDistribution:
        """One run's PLD, built once per event: a ledger that grows each round re-composes
        cached bases (FFT self-composition) instead of rebuilding them."""
        key = (repr(event), rel)
        base = self._leaves.get(key)
        if base is None:
            base = self._leaves[key] = make()
        return base

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
            base = self._leaf(
                event,
                rel,
                lambda: pld_lib.from_laplace_mechanism(
                    parameter=event.noise_multiplier, value_discretization_interval=self.dx
                ),
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
            base = self._leaf(
                event,
                rel,
                lambda: pld_lib.from_randomized_response(
                    noise_parameter=event.noise_parameter,
                    num_buckets=event.num_buckets,
                    value_discretization_interval=self.dx,
                    neighboring_relation=rel,
                ),
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
                    if inner.noise_multiplier < PLD_MIN_GAUSSIAN_SIGMA:
                        raise UnsupportedEventError(
                            f"noise multiplier {inner.noise_multiplier:g} < "
                            f"{PLD_MIN_GAUSSIAN_SIGMA:g} is too narrow for a discretised PLD"
                        )
                    base = self._leaf(
                        event,
                        rel,
                        lambda: pld_lib.from_gaussian_mechanism(
                            standard_deviation=inner.noise_multiplier,
                            value_discretization_interval=self.dx,
                            sampling_prob=q,
                            neighboring_relation=rel,
                        ),
                    )
                else:
                    base = self._leaf(
                        event,
                        rel,
                        lambda: pld_lib.from_laplace_mechanism(
                            parameter=inner.noise_multiplier,
                            value_discretization_interval=self.dx,
                            sampling_prob=q,
                        ),
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
            sigma = 1.0 / math.sqrt(gauss_precision)
            if not plds:  # only un-sampled Gaussians: one Gaussian, whose PLD is known exactly
                return float(get_epsilon_gaussian(sigma, delta))
            if sigma < PLD_MIN_GAUSSIAN_SIGMA:
                raise UnsupportedEventError(
                    f"composed Gaussian noise multiplier {sigma:.3g} < "
                    f"{PLD_MIN_GAUSSIAN_SIGMA:g} is too narrow for a discretised PLD"
                )
            plds.append(
                pld_lib.from_gaussian_mechanism(
                    standard_deviation=sigma, value_discretization_interval=self.dx
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


def compose_with(
    composer: Composer,
    events: Iterable[PrivacyEvent],
    delta: float,
    accountant: str,
) -> EpsilonResult:
    delta = check_delta(delta)
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
    return compose_with(Composer(orders, pld_discretization), events, delta, accountant)


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
    eps = check_positive_epsilon("target_epsilon", target_epsilon)
    d = float(delta)
    if not (math.isfinite(d) and 0 < d < 1):
        raise ValueError(f"delta must be in (0, 1) to calibrate Gaussian noise, got {delta!r}")
    if accountant == "rdp":

        def fresh() -> rdp_lib.RdpAccountant:
            return rdp_lib.RdpAccountant(list(orders))
    elif accountant == "pld":

        def fresh() -> pld_privacy_accountant.PLDAccountant:
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
# The tightest valid bound


@dataclass(frozen=True)
class Bound:
    """The smallest epsilon any applicable accountant proves, and every accountant's value.

    ``values[name]`` is None for an accountant that was not run; ``skipped[name]`` says why.
    """

    epsilon: float
    delta: float
    accountant: str
    relation: str | None
    unit: str | None
    values: dict[str, float | None] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    rdp_order: float | None = None
    rdp_order_at_grid_edge: bool = False  # if so, a wider order grid might give a smaller RDP eps

    def as_dict(self) -> dict:
        return {
            "rdp_optimal_order": self.rdp_order,
            "rdp_order_at_grid_edge": self.rdp_order_at_grid_edge,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "neighbouring_relation": self.relation,
            "unit": self.unit,
            "epsilon_by_accountant": dict(self.values),
            "skipped_accountants": dict(self.skipped),
        }


def _group(events: Iterable[PrivacyEvent]) -> tuple[Counter, dict[tuple, PrivacyEvent]]:
    counted: Counter = Counter()
    by_key: dict[tuple, PrivacyEvent] = {}
    for ev in events:
        counted[ev.key] += 1
        by_key.setdefault(ev.key, ev)
    return counted, by_key


def best_with(composer: Composer, events: Iterable[PrivacyEvent], delta: float) -> Bound:
    """:func:`best_epsilon` on the caller's ``composer`` (a ledger keeps one, with its caches)."""
    delta = check_delta(delta)
    counted, by_key = _group(events)
    if not counted:
        return Bound(0.0, delta, "none", None, None, dict.fromkeys(ACCOUNTANTS, 0.0))
    relation, unit = _target({(e.relation, e.unit) for e in by_key.values()})
    values: dict[str, float | None] = dict.fromkeys(ACCOUNTANTS)
    skipped: dict[str, str] = {}
    pure = [ev.pure_epsilon for ev in by_key.values()]
    all_pure = all(p is not None for p in pure)
    order: float | None = None
    try:
        values["rdp"], order = composer.rdp(counted, by_key, delta)
    except UnsupportedEventError as err:
        skipped["rdp"] = str(err)
    edge = order is not None and order in (composer.orders[0], composer.orders[-1])
    widest = max((p for p in pure if p is not None), default=0.0)
    if widest > PLD_MAX_PURE_EPSILON:
        skipped["pld"] = (
            f"a release of pure eps {widest:g} > {PLD_MAX_PURE_EPSILON:g} is too wide for a "
            "discretised PLD; the other accountants are valid bounds"
        )
    else:
        try:
            values["pld"] = composer.pld(counted, by_key, delta)
        except (UnsupportedEventError, MemoryError, OverflowError) as err:
            skipped["pld"] = str(err) or type(err).__name__
    if all_pure:
        plist = _pure_list(counted, by_key, "basic")
        values["basic"] = _basic(plist)
        values["advanced"] = _advanced(plist, delta)
    else:
        reason = "composes pure eps-DP events only; this ledger holds approximate-DP events"
        skipped["basic"] = skipped["advanced"] = reason
    ran = {k: v for k, v in values.items() if v is not None}
    if not ran:
        raise UnsupportedEventError(f"no accountant supports these events: {skipped}")
    name = min(ran, key=lambda k: (ran[k], ACCOUNTANTS.index(k)))
    return Bound(
        ran[name], delta, name, relation_name(relation), unit, values, skipped, order, edge
    )


def best_epsilon(
    events: Iterable[PrivacyEvent],
    delta: float,
    *,
    orders: Sequence[float] = RDP_ORDERS,
    pld_discretization: float = 1e-4,
) -> Bound:
    """The tightest valid epsilon of the adaptive composition of ``events`` at ``delta``.

    Uses one composer per (orders, discretisation) for the process, so the cached RDP curves and
    PLDs of an event are built once however many devices check their budgets with it."""
    return best_with(_shared_composer(tuple(orders), float(pld_discretization)), events, delta)


@cache
def _shared_composer(orders: tuple[float, ...], pld_discretization: float) -> Composer:
    return Composer(orders, pld_discretization)
