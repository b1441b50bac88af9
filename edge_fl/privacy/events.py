"""Privacy events: a dp-accounting ``DpEvent`` with the relation and unit its numbers hold under.

Conventions (they matter, see ``docs/specs/privacy.md`` pitfalls 4, 6 and 8):

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
  target (:func:`implies`): device-level replace-one events (local DP: any two inputs of the
  device) imply any example-level relation; otherwise mixing raises :class:`IncompatibleEventsError`.
* ``relation`` is dp-accounting's ``NeighboringRelation`` or its lower-case name, as a mechanism's
  ``Guarantee`` spells it (:data:`RELATION_NAMES`: ``"add_or_remove_one"``, ``"replace_one"``,
  ``"replace_special"``); :func:`as_relation` maps one to the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation

__all__ = [
    "RELATION_NAMES",
    "IncompatibleEventsError",
    "NeighboringRelation",
    "PrivacyEvent",
    "Unit",
    "as_relation",
    "check_delta",
    "check_positive_epsilon",
    "implies",
    "pure_dp_event",
    "pure_epsilon_of",
    "pure_privacy_event",
    "relation_name",
]

Unit = Literal["example", "device"]
_UNITS = ("example", "device")


class IncompatibleEventsError(ValueError):
    """Events whose neighbouring relations / units do not imply one common guarantee."""


#: the names a relation may be given by (dp-accounting's ``NeighboringRelation`` members, lower case)
RELATION_NAMES = tuple(r.name.lower() for r in NeighboringRelation)


def relation_name(relation: NeighboringRelation) -> str:
    return relation.name.lower()


def as_relation(relation: NeighboringRelation | str) -> NeighboringRelation:
    """``relation`` as dp-accounting's enum: the enum itself, or its name as a ``Guarantee``
    spells it (``"replace_one"``); ValueError naming the accepted values otherwise."""
    if isinstance(relation, NeighboringRelation):
        return relation
    if isinstance(relation, str) and relation in RELATION_NAMES:
        return NeighboringRelation[relation.upper()]
    raise ValueError(
        f"relation must be a dp_accounting NeighboringRelation or one of "
        f"{', '.join(repr(n) for n in RELATION_NAMES)}, got {relation!r}"
    )


def implies(
    relation: NeighboringRelation, unit: str, target: tuple[NeighboringRelation, str]
) -> bool:
    """Whether an epsilon that holds under ``relation`` for ``unit`` holds, as it is, under the
    ``target`` (relation, unit).

    Only two cases do: the same relation and unit; and device-level replace-one (local DP: any
    two inputs of the device are neighbours) for any example-level target, whose neighbouring
    datasets are two inputs of one device. Nothing else is implied without a factor or an
    assumption about the mechanism: add/remove-one eps gives replace-one only as 2 eps (group
    privacy: a swap is a removal and an addition); replace-one eps gives no add/remove bound at
    all (a release of |D| alone is replace-one 0-DP and add/remove not DP); replace-special
    (replace by a null element) holds under replace-one only if the null element is a real
    input, and example-level events say nothing of a whole device's data.
    """
    if (relation, unit) == target:
        return True
    return (
        relation == NeighboringRelation.REPLACE_ONE and unit == "device" and target[1] == "example"
    )


def check_delta(delta: float) -> float:
    d = float(delta)
    if not math.isfinite(d) or not 0.0 <= d < 1.0:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}")
    return d


def check_positive_epsilon(name: str, eps: float) -> float:
    e = float(eps)
    if not math.isfinite(e) or e <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {eps!r}")
    return e


def pure_dp_event(epsilon: float) -> dp_event.RandomizedResponseDpEvent:
    """The tight generic DpEvent of any pure ``epsilon``-DP release (see module docstring).

    Record it with relation ``REPLACE_ONE``: that is the relation dp-accounting's RR formulas use
    for the symmetric pair [e^eps, 1]/(1+e^eps) vs its swap.
    """
    e = check_positive_epsilon("epsilon", epsilon)
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
        known = [p for p in parts if p is not None]
        return math.fsum(known) if len(known) == len(parts) else None
    return None


def _has_poisson(event: dp_event.DpEvent) -> bool:
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        return True
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return _has_poisson(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return any(_has_poisson(e) for e in event.events)
    return False


@dataclass(frozen=True, init=False)
class PrivacyEvent:
    """A DpEvent with the relation and unit its numbers refer to; what one release realises.

    ``relation``: dp-accounting's ``NeighboringRelation``, or its name as ``Guarantee`` spells
    it (``"replace_one"``, ``"add_or_remove_one"``, ``"replace_special"``); it is held as the
    enum either way.
    """

    event: dp_event.DpEvent
    relation: NeighboringRelation
    unit: Unit
    mechanism: str = "unspecified"
    #: derived from the event (never declared), so basic composition cannot be fed a wrong claim
    pure_epsilon: float | None = field(default=None, init=False, compare=False)

    def __init__(
        self,
        event: dp_event.DpEvent,
        relation: NeighboringRelation | str,
        unit: Unit,
        mechanism: str = "unspecified",
    ) -> None:
        if not isinstance(event, dp_event.DpEvent):
            raise TypeError(f"event must be a dp_accounting DpEvent, got {type(event).__name__}")
        rel = as_relation(relation)
        if unit not in _UNITS:
            raise ValueError(f"unit must be one of {_UNITS}, got {unit!r}")
        object.__setattr__(self, "event", event)
        object.__setattr__(self, "relation", rel)
        object.__setattr__(self, "unit", unit)
        object.__setattr__(self, "mechanism", mechanism)
        object.__setattr__(self, "pure_epsilon", pure_epsilon_of(event, rel))

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
