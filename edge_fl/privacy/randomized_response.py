"""Binary randomized response (Warner 1965), the MagRR bit's mechanism, and its debiasing.

A respondent reports its true bit with probability P = e^eps / (1 + e^eps) and the flipped bit
otherwise: P / (1 - P) = e^eps, so one report is pure eps local DP. With N reports of which N_C are
ones, ``N_T_hat = (N_C - N + N P) / (2P - 1)`` is unbiased with variance
``N P (1 - P) / (2P - 1)^2``. The estimate can leave [0, N]; clip only after any averaging and
report that it was clipped (:func:`clip_count`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from edge_fl.privacy import _checks, _dp

if TYPE_CHECKING:
    from dp_accounting import dp_event

    from edge_fl.privacy.events import PrivacyEvent

__all__ = [
    "RrEstimate",
    "clip_count",
    "debias_count",
    "randomized_response",
    "rr_dp_event",
    "rr_privacy_event",
    "truth_probability",
]


def truth_probability(eps: float) -> float:
    """P = e^eps / (1 + e^eps), computed without overflow."""
    e = _checks.positive("eps", eps)
    return 1.0 / (1.0 + math.exp(-e))


def randomized_response(bit: int | np.ndarray, eps: float, rng: np.random.Generator) -> np.ndarray:
    """Report each bit truthfully with probability P, flipped otherwise (vectorised over arrays)."""
    p = truth_probability(eps)
    b = np.asarray(bit)
    if b.dtype == bool:
        b = b.astype(np.int8)
    if not np.all((b == 0) | (b == 1)):
        raise ValueError(f"bit must be 0 or 1 (or an array of them), got {bit!r}")
    flip = rng.random(b.shape) >= p  # P(flip) = 1 - P
    return np.where(flip, 1 - b, b).astype(np.int8)


class RrEstimate(NamedTuple):
    estimate: float
    std: float


def debias_count(n_ones: float, n: int, eps: float) -> RrEstimate:
    """Unbiased estimate of the number of true ones among ``n`` reports, with its std."""
    p = truth_probability(eps)
    total = _checks.integer("n", n)
    ones = _checks.non_negative("n_ones", n_ones)
    if ones > total:
        raise ValueError(f"n_ones must be in [0, n={total}], got {n_ones!r}")
    est = (ones - total + total * p) / (2 * p - 1)
    std = math.sqrt(total * p * (1 - p)) / (2 * p - 1)
    return RrEstimate(est, std)


def clip_count(estimate: float, n: int) -> tuple[float, bool]:
    """Clip a (final, averaged) estimate to [0, n]; the flag says whether clipping happened."""
    total = _checks.integer("n", n, minimum=0)
    v = _checks.real("estimate", estimate, "a finite number")
    clipped = min(max(v, 0.0), float(total))
    return clipped, clipped != v


def rr_dp_event(eps: float) -> dp_event.RandomizedResponseDpEvent:
    """One report: ``RandomizedResponseDpEvent(2 / (1 + e^eps), 2)`` (replace-one)."""
    e = _checks.positive("eps", eps)
    return _dp.events().RandomizedResponseDpEvent(
        noise_parameter=2.0 * math.exp(-e) / (1.0 + math.exp(-e)), num_buckets=2
    )


def rr_privacy_event(eps: float, mechanism: str = "randomized-response") -> PrivacyEvent:
    """A local-DP report: relation replace-one, unit device."""
    from edge_fl.privacy.events import PrivacyEvent

    return PrivacyEvent(rr_dp_event(eps), _dp.relation("REPLACE_ONE"), "device", mechanism)
