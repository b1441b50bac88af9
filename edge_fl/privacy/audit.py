"""Empirical DP audit: a statistical lower bound on eps from a distinguishing test.

Method (``docs/specs/privacy.md`` section 5; Jagielski et al. 2020, Nasr et al. 2021, Kairouz-Oh-
Viswanath 2015): run the PRODUCTION mechanism n times on each of two worst-case neighbouring inputs,
count k0 / k1 outputs in a test event S fixed in advance, bound the false-positive and
false-negative rates from above with one-sided Clopper-Pearson bounds at alpha/2 each, and turn them
into eps_lb = max(0, ln((1 - delta - FNR)/FPR), ln((1 - delta - FPR)/FNR)). eps_lb is a lower
confidence bound at level 1 - alpha: for a correct mechanism the check ``eps_lb <= claimed eps``
fails (a false alarm) with probability at most alpha for any n, the run's stated false-alarm
rate; a mechanism with too little noise is caught once n is large enough (table in spec 5.2).
The bound is conservative: for the Laplace test below at eps = 1 and alpha = 0.05 the exact
false-alarm probability is about 0.4% (tests/test_audit_false_alarms.py computes it).

The runners draw all n runs in one vectorised call: the mechanisms add i.i.d. noise per coordinate,
so perturbing a vector of n copies of the worst-case output is n independent runs. The
``scale_factor`` knobs build the same production mechanism with a wrong noise scale while the claim
stays the configured one, which is how tests check that the audit catches a bug.

The Beta quantile is computed here (regularised incomplete beta by Lentz's continued fraction,
inverted by bisection) because scipy is only a development dependency.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting import get_epsilon_gaussian

from edge_fl.privacy import _checks
from edge_fl.privacy.gaussian import LocalGaussianConfig, calibrate_local_noise_multiplier
from edge_fl.privacy.laplace import LaplaceConfig
from edge_fl.privacy.randomized_response import randomized_response, truth_probability

__all__ = [
    "audit_gaussian",
    "audit_laplace",
    "audit_rr",
    "beta_ppf",
    "betainc",
    "clopper_pearson_upper",
    "eps_lower_bound",
]

_TINY = 1e-300


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta (modified Lentz)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 200_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            return h
    raise ArithmeticError(
        f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})"
    )


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) for a, b > 0, x in [0, 1]."""
    if a <= 0 or b <= 0:
        raise ValueError(f"a and b must be > 0, got a={a!r}, b={b!r}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x!r}")
    if x == 0.0 or x == 1.0:
        return x
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def beta_ppf(p: float, a: float, b: float) -> float:
    """Quantile of Beta(a, b): the x with I_x(a, b) = p (bisection to double precision)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p!r}")
    if p in (0.0, 1.0):
        return p
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if betainc(a, b, mid) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def clopper_pearson_upper(k: int, n: int, level: float) -> float:
    """One-sided upper confidence bound (error ``level``) for a binomial rate with k of n."""
    if k >= n:
        return 1.0
    return beta_ppf(1.0 - level, k + 1, n - k)


def eps_lower_bound(k0: int, k1: int, n: int, delta: float = 0.0, alpha: float = 0.05) -> float:
    """Lower confidence bound (level 1 - alpha) on eps from k0 / n false positives on D0 and
    k1 / n hits on D1 of the test event S."""
    total = _checks.integer("n", n)
    c0 = _checks.integer("k0", k0, minimum=0)
    c1 = _checks.integer("k1", k1, minimum=0)
    if c0 > total or c1 > total:
        raise ValueError(f"k0 and k1 must be in [0, n={total}], got k0={k0!r}, k1={k1!r}")
    d = _checks.delta("delta", delta)
    a = _checks.real("alpha", alpha, "in (0, 1)")
    if not 0 < a < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    fpr = clopper_pearson_upper(c0, total, a / 2)
    fnr = clopper_pearson_upper(total - c1, total, a / 2)
    best = 0.0
    for num, den in ((1.0 - d - fnr, fpr), (1.0 - d - fpr, fnr)):
        if num > 0 and den > 0:
            best = max(best, math.log(num / den))
    return best


def _result(
    mechanism: str, claimed: float, k0: int, k1: int, n: int, alpha: float, delta: float, **extra
) -> dict:
    out = {
        "mechanism": mechanism,
        "claimed_epsilon": claimed,
        "epsilon_lower_bound": eps_lower_bound(k0, k1, n, delta, alpha),
        "n": n,
        "k0": k0,
        "k1": k1,
        "alpha": alpha,
        "delta": delta,
        "confidence": 1.0 - alpha,
        "false_alarm_rate_at_most": alpha,
        "test": (
            f"passes when epsilon_lower_bound, a lower confidence bound at level {1.0 - alpha:g} "
            f"(one-sided Clopper-Pearson bounds at {alpha / 2:g} on each error rate), is at most "
            f"claimed_epsilon; a correct mechanism fails it in at most {alpha:g} of runs"
        ),
    }
    if k0 > 0 and k1 > 0:  # exact tests: E[k1/k0] = e^eps; a calibration check (spec 5.1 step 6)
        p0, p1 = k0 / n, k1 / n
        out["epsilon_estimate"] = math.log(k1 / k0)
        out["epsilon_estimate_se"] = math.sqrt((1 - p1) / (n * p1) + (1 - p0) / (n * p0))
    out.update(extra)
    return out


def _scale_factor(value: float) -> float:
    return _checks.positive("scale_factor", value)


def audit_laplace(
    eps: float,
    n: int,
    rng: np.random.Generator,
    scale_factor: float = 1.0,
    alpha: float = 0.05,
    delta: float = 0.0,
) -> dict:
    """Audit mechanism A (one local step + Laplace) at per-release ``eps``.

    Neighbours: two local datasets of size 2 differing in one sample whose clipped gradients are
    -C and +C (replace-one, output gap = sensitivity 2 eta C / |D|). Event: y > f(D1).
    ``scale_factor`` multiplies the noise scale of the implementation (0.5 = noise halved);
    ``delta`` is the claimed delta (0 for the pure-DP claim).
    """
    claimed = _checks.positive("eps", eps)
    runs = _checks.integer("n", n)
    f = _scale_factor(scale_factor)
    impl = LaplaceConfig(clip_l1=1.0, learning_rate=1.0, epsilon=claimed / f, rounds=1)
    w = np.zeros(1)
    out0, _ = impl.local_step(w, np.array([[0.25], [3.0]]))  # clipped row +1: output lower
    out1, _ = impl.local_step(w, np.array([[0.25], [-3.0]]))  # clipped row -1: output higher
    threshold = float(out1[0])
    y0 = impl.perturb(np.full(runs, out0[0]), 2, 0, rng)
    k0 = int(np.count_nonzero(y0 > threshold))
    del y0
    y1 = impl.perturb(np.full(runs, out1[0]), 2, 0, rng)
    k1 = int(np.count_nonzero(y1 > threshold))
    return _result("laplace", claimed, k0, k1, runs, alpha, delta, scale_factor=f)


def audit_gaussian(
    eps: float,
    delta: float,
    n: int,
    rng: np.random.Generator,
    audit_delta: float = 1e-3,
    noise_multiplier: float | None = None,
    scale_factor: float = 1.0,
    alpha: float = 0.05,
    calibration_runs: int | None = None,
) -> dict:
    """Audit the local Gaussian mechanism (B) calibrated for (eps, delta), one release.

    The claim checked is the exact eps of the claimed noise at ``audit_delta`` (analytic Gaussian):
    tails at delta = 1e-5 need far more than 1/delta samples. Neighbours: updates -S e1 and +S e1
    (local DP, gap 2S); event: y1 above a threshold picked on ``calibration_runs`` separate runs
    (default n/10), among the claim's likelihood-ratio threshold and a grid around it.
    ``noise_multiplier`` replaces the calibrated claim; ``scale_factor`` scales the implemented std.
    """
    target = _checks.positive("eps", eps)
    target_delta = _checks.open_delta("delta", delta)
    runs = _checks.integer("n", n)
    a_delta = _checks.open_delta("audit_delta", audit_delta)
    f = _scale_factor(scale_factor)
    if noise_multiplier is None:
        z = calibrate_local_noise_multiplier(target, target_delta)
    else:
        z = _checks.positive("noise_multiplier", noise_multiplier)
    claim = LocalGaussianConfig(clip_norm=1.0, noise_multiplier=z)
    impl = LocalGaussianConfig(clip_norm=1.0, noise_multiplier=z * f)
    sens = 2.0 * claim.clip_norm
    claimed = float(get_epsilon_gaussian(claim.std / sens, a_delta))
    c0 = float(impl.clip(np.array([-5.0])).values[0])
    c1 = float(impl.clip(np.array([5.0])).values[0])

    def draw(m: int) -> tuple[np.ndarray, np.ndarray]:
        return impl.perturb(np.full(m, c0), rng), impl.perturb(np.full(m, c1), rng)

    # The threshold is chosen on a separate calibration run (so the final counts are independent
    # of the choice): candidates from the claim's likelihood-ratio threshold outwards, since an
    # implementation with less noise than claimed is best detected nearer the middle.
    n_cal = (
        max(1000, runs // 10)
        if calibration_runs is None
        else _checks.integer("calibration_runs", calibration_runs)
    )
    lr_threshold = c0 + claim.std**2 * claimed / sens + sens / 2.0
    candidates = np.append(c0 + sens / 2.0 + claim.std * np.linspace(0.0, 6.0, 61), lr_threshold)
    y0, y1 = draw(n_cal)
    k0s = n_cal - np.searchsorted(np.sort(y0), candidates, side="right")
    k1s = n_cal - np.searchsorted(np.sort(y1), candidates, side="right")
    scores = [
        eps_lower_bound(int(a), int(b), n_cal, a_delta, alpha)
        for a, b in zip(k0s, k1s, strict=True)
    ]
    best = int(np.argmax(scores))
    threshold = float(candidates[best]) if scores[best] > 0 else lr_threshold
    del y0, y1
    y0 = impl.perturb(np.full(runs, c0), rng)
    k0 = int(np.count_nonzero(y0 > threshold))
    del y0
    y1 = impl.perturb(np.full(runs, c1), rng)
    k1 = int(np.count_nonzero(y1 > threshold))
    out = _result(
        "gaussian",
        claimed,
        k0,
        k1,
        runs,
        alpha,
        a_delta,
        target_epsilon=target,
        target_delta=target_delta,
        noise_multiplier=z,
        scale_factor=f,
        threshold=threshold,
        calibration_runs=n_cal,
    )
    out.pop("epsilon_estimate", None)  # the Gaussian test's ratio is not e^eps
    out.pop("epsilon_estimate_se", None)
    return out


def audit_rr(
    eps: float,
    n: int,
    rng: np.random.Generator,
    scale_factor: float = 1.0,
    alpha: float = 0.05,
    delta: float = 0.0,
) -> dict:
    """Audit randomized response: bits 0 vs 1, event "reported 1".

    ``scale_factor`` scales the implemented flip probability 1 - P (0.5 = noise halved).
    """
    claimed = _checks.positive("eps", eps)
    runs = _checks.integer("n", n)
    f = _scale_factor(scale_factor)
    flip = (1.0 - truth_probability(claimed)) * f
    if not 0 < flip < 0.5:
        raise ValueError(
            f"scale_factor must keep the flip probability in (0, 1/2), got {scale_factor!r} "
            f"(flip probability {flip})"
        )
    eps_impl = math.log((1.0 - flip) / flip)
    k0 = int(randomized_response(np.zeros(runs, dtype=np.int8), eps_impl, rng).sum(dtype=np.int64))
    k1 = int(randomized_response(np.ones(runs, dtype=np.int8), eps_impl, rng).sum(dtype=np.int64))
    return _result("randomized_response", claimed, k0, k1, runs, alpha, delta, scale_factor=f)
