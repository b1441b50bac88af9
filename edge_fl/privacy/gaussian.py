"""Mechanism B: Gaussian DP-FedAvg, local and central variants (McMahan et al., ICLR 2018).

Both clip the client's whole update ``Delta = w_local - w_global`` in L2 to S (docs/specs/privacy.md pitfall 5: the
update, not the per-step gradient) and add N(0, (z S)^2) per coordinate.

* Local: the client adds the noise before upload (local DP on the update). Two updates in the S-ball
  differ by up to 2S, so under the honest local-DP relation (``replace_one``: any two inputs of the
  device) one release is ``GaussianDpEvent(z / 2)`` (docs/specs/privacy.md pitfall 4). ``replace_special`` (the device's
  update replaced by zero) gives ``GaussianDpEvent(z)``; it is the weaker, commonly quoted claim.
* Central: clients only clip; the aggregator adds N(0, (z S)^2) to the SUM of clipped updates and
  divides by a FIXED denominator, the expected number of participants (dividing by the realised
  count would leak it). User-level DP, add/remove one device; per round
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` with q = expected participants / population,
  composed over ALL rounds (whether a device took part is itself secret).

Pitfall 8: the amplification by q holds only if every device is selected independently with
probability q from CSPRNG randomness and participation stays secret from the adversary. Devices
that pick themselves (availability), an aggregator that is itself the adversary, or logs / timing
that reveal participation void it; set ``poisson_selection=False`` to account without
amplification (``GaussianDpEvent(z)`` per round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np

from edge_fl.privacy import _checks, _dp
from edge_fl.privacy.clipping import Clipped, clip_l2
from edge_fl.privacy.noise import gaussian_noise

if TYPE_CHECKING:
    from dp_accounting import dp_event

    from edge_fl.privacy.events import PrivacyEvent

__all__ = [
    "CentralGaussianConfig",
    "GaussianRelease",
    "LocalGaussianConfig",
    "calibrate_central_noise_multiplier",
    "calibrate_local_noise_multiplier",
    "central_dp_event",
    "central_privacy_event",
]

LocalRelation = Literal["replace_one", "replace_special"]


class GaussianRelease(NamedTuple):
    update: np.ndarray
    std: float
    fraction_clipped: float


def _local_event(z: float, relation: LocalRelation) -> dp_event.GaussianDpEvent:
    if relation == "replace_one":
        return _dp.events().GaussianDpEvent(z / 2.0)
    if relation == "replace_special":
        return _dp.events().GaussianDpEvent(z)
    raise ValueError(f"relation must be 'replace_one' or 'replace_special', got {relation!r}")


@dataclass(frozen=True)
class LocalGaussianConfig:
    """Local DP-FedAvg: clip the update to ``clip_norm`` S, add N(0, (z S)^2) on the device."""

    clip_norm: float
    noise_multiplier: float
    secure_draws: int = 2  # Gaussian = sum of 2n draws / sqrt(2n) (docs/specs/privacy.md pitfall 2)

    unit = "device"

    def __post_init__(self) -> None:
        _checks.positive("clip_norm", self.clip_norm)
        _checks.positive("noise_multiplier", self.noise_multiplier)
        _checks.integer("secure_draws", self.secure_draws)

    @property
    def std(self) -> float:
        return self.noise_multiplier * self.clip_norm

    def clip(self, update: np.ndarray) -> Clipped:
        return clip_l2(update, self.clip_norm)

    def perturb(self, clipped: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        c = np.asarray(clipped, dtype=np.float64)
        return c + gaussian_noise(rng, self.std, c.shape, n=self.secure_draws)

    def privatize_update(self, update: np.ndarray, rng: np.random.Generator) -> GaussianRelease:
        clipped = self.clip(update)
        return GaussianRelease(
            self.perturb(clipped.values, rng), self.std, clipped.fraction_clipped
        )

    def dp_event(self, relation: LocalRelation = "replace_one") -> dp_event.GaussianDpEvent:
        """One upload. ``replace_one`` (default, local DP): sensitivity 2S, multiplier z/2."""
        return _local_event(self.noise_multiplier, relation)

    def privacy_event(self, relation: LocalRelation = "replace_one") -> PrivacyEvent:
        from edge_fl.privacy.events import PrivacyEvent

        rel = _dp.relation("REPLACE_ONE" if relation == "replace_one" else "REPLACE_SPECIAL")
        return PrivacyEvent(self.dp_event(relation), rel, "device", "gaussian-local")


@dataclass(frozen=True)
class CentralGaussianConfig:
    """Central DP-FedAvg: clients clip, the aggregator noises the sum, fixed denominator."""

    clip_norm: float
    noise_multiplier: float
    expected_participants: float
    population: int
    poisson_selection: bool = True
    secure_draws: int = 2

    unit = "device"

    @property
    def neighboring_relation(self):  # dp-accounting's enum, imported only to account
        return _dp.relation("ADD_OR_REMOVE_ONE")

    def __post_init__(self) -> None:
        _checks.positive("clip_norm", self.clip_norm)
        _checks.positive("noise_multiplier", self.noise_multiplier)
        _checks.positive("expected_participants", self.expected_participants)
        _checks.integer("population", self.population)
        _checks.integer("secure_draws", self.secure_draws)
        if self.expected_participants > self.population:
            raise ValueError(
                f"expected_participants must be in (0, population={self.population}], "
                f"got {self.expected_participants!r}"
            )

    @property
    def sampling_rate(self) -> float:
        return float(self.expected_participants) / self.population

    @property
    def std(self) -> float:
        return self.noise_multiplier * self.clip_norm

    def clip_update(self, update: np.ndarray) -> Clipped:
        """Client side: the only privacy step a central-variant client runs."""
        return clip_l2(update, self.clip_norm)

    def noisy_mean(self, clipped_sum: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Aggregator side: (sum of clipped updates + N(0, (zS)^2)) / expected participants.

        Call it every round, also when nobody arrived (pass zeros): skipping the noise on an
        empty round would reveal that nobody took part.
        """
        s = np.asarray(clipped_sum, dtype=np.float64)
        if s.ndim != 1 or not np.all(np.isfinite(s)):
            raise ValueError(f"clipped_sum must be a finite 1-d vector, got shape {s.shape}")
        noisy = s + gaussian_noise(rng, self.std, s.shape, n=self.secure_draws)
        return noisy / float(self.expected_participants)

    def dp_event(self, rounds: int = 1) -> dp_event.DpEvent:
        """``rounds`` aggregation rounds (every round counts, not only a device's own)."""
        q = self.sampling_rate if self.poisson_selection else 1.0
        return central_dp_event(self.noise_multiplier, q, rounds)

    def privacy_event(self, rounds: int = 1) -> PrivacyEvent:
        from edge_fl.privacy.events import PrivacyEvent

        return PrivacyEvent(
            self.dp_event(rounds), self.neighboring_relation, "device", "gaussian-central"
        )


def calibrate_local_noise_multiplier(
    target_epsilon: float,
    delta: float,
    rounds: int = 1,
    relation: LocalRelation = "replace_one",
) -> float:
    """Smallest z whose ``rounds`` local releases compose to at most (target_epsilon, delta).

    Exact, no accountant slack: k Gaussian releases compose to one Gaussian with multiplier
    m / sqrt(k), and one Gaussian is calibrated by the analytic Gaussian mechanism
    (``dp_accounting.get_sigma_gaussian``, Balle & Wang 2018). A 1e-9 relative margin covers the
    root finder's tolerance so the result never overshoots the target.
    """
    eps = _checks.positive("target_epsilon", target_epsilon)
    d = _checks.open_delta("delta", delta)
    k = _checks.integer("rounds", rounds)
    factor = 2.0 if relation == "replace_one" else 1.0
    _local_event(1.0, relation)  # validates relation
    _dp.events()
    from dp_accounting import get_sigma_gaussian

    return factor * math.sqrt(k) * get_sigma_gaussian(eps, d) * (1 + 1e-9)


def calibrate_central_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    rounds: int,
    accountant: Literal["rdp", "pld"] = "rdp",
) -> float:
    """Smallest z for central DP-FedAvg with Poisson rate q over ``rounds`` rounds."""
    q = _checks.probability("sampling_rate", sampling_rate)
    _checks.integer("rounds", rounds)
    from edge_fl.privacy.accountants import calibrate_noise_multiplier

    return calibrate_noise_multiplier(
        lambda z: central_dp_event(z, q, rounds), target_epsilon, delta, accountant
    )


def central_dp_event(
    noise_multiplier: float, sampling_rate: float, rounds: int = 1
) -> dp_event.DpEvent:
    """``rounds`` central rounds: PoissonSampled(q, Gaussian(z)) each (plain Gaussian if q = 1).

    Relation add/remove one device. Pass q = 1 when selection is not secret Poisson sampling.
    """
    z = _checks.non_negative("noise_multiplier", noise_multiplier)
    q = _checks.probability("sampling_rate", sampling_rate)
    k = _checks.integer("rounds", rounds)
    e = _dp.events()
    g = e.GaussianDpEvent(z)
    one: dp_event.DpEvent = e.PoissonSampledDpEvent(q, g) if q < 1 else g
    return one if k == 1 else e.SelfComposedDpEvent(one, k)


def central_privacy_event(
    noise_multiplier: float, sampling_rate: float, rounds: int = 1
) -> PrivacyEvent:
    from edge_fl.privacy.events import PrivacyEvent

    return PrivacyEvent(
        central_dp_event(noise_multiplier, sampling_rate, rounds),
        _dp.relation("ADD_OR_REMOVE_ONE"),
        "device",
        "gaussian-central",
    )
