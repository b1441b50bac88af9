"""Choosing and checking (neighbours k, threshold t, bit width b, clip) for n devices
(docs/specs/secagg.md section 5). Every bound is an exact hypergeometric tail and a union bound:

- secrecy: no honest device has t colluding neighbours (with ``against_lying``: 2t - k, the
  count that lets an aggregator who lies about who dropped rebuild both of a device's secrets):
  n * P[Hyp(n-1, floor(collude n), k) >= t] <= 2^-sigma;
- the sum is the only thing revealed: the honest survivors stay connected in H(n, k), i.e. no two
  runs of k/2 positions are all dropped or colluding: C(n, 2) * (m)_k / (n)_k <= 2^-sigma with
  m = floor((dropout + collude) n) ((x)_k the falling factorial);
- correctness: every device keeps t answering neighbours with a dropout fraction of the
  selection gone: n * P[Hyp(n-1, floor(dropout n), k) > k - t] <= 2^-eta (else the round fails,
  clearly: it never yields a wrong sum);
- bits: the sum of n values in [-Q, Q], Q = ceil(clip / step), fits Z_2^b as a signed number:
  b >= bit_length(n Q) + 1, b <= 64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

MAX_BITS = 64


class CalibrationError(ValueError):
    """An unsound secure-aggregation setting; the message is one line saying which and why."""


def _log2(p: Fraction) -> float:
    if p <= 0:
        return -math.inf
    return math.log2(p.numerator) - math.log2(p.denominator)


def hypergeom_tail(population: int, marked: int, draws: int, at_least: int) -> Fraction:
    """P[X >= at_least], X the marked items among ``draws`` drawn without replacement."""
    draws = min(draws, population)
    marked = min(marked, population)
    total = math.comb(population, draws)
    hits = sum(
        math.comb(marked, i) * math.comb(population - marked, draws - i)
        for i in range(max(at_least, 0), min(marked, draws) + 1)
    )
    return Fraction(hits, total)


def _falling_ratio(m: int, n: int, r: int) -> Fraction:
    out = Fraction(1)
    for i in range(r):
        if m - i <= 0:
            return Fraction(0)
        out *= Fraction(m - i, n - i)
    return out


@dataclass(frozen=True)
class Calibration:
    """A checked setting, with the log2 of each failure probability it was checked against."""

    n: int
    neighbours: int
    threshold: int
    bits: int
    clip: float
    step: float
    dropout: float
    collude: float
    sigma: int
    eta: int
    against_lying: bool
    log2_secrecy: float  # P[some device's secrets within the colluders' reach]
    log2_disconnect: float  # P[the honest survivors split: a partial sum leaks]
    log2_failure: float  # P[a round with `dropout` gone fails]

    @property
    def max_int(self) -> int:
        return max_int(self.clip, self.step)

    @property
    def complete(self) -> bool:
        return self.neighbours >= self.n - 1


def roster_graph(neighbours: int, threshold: int, n: int) -> tuple[int, int]:
    """(k, t) of a round of ``n`` devices for a job calibrated to ``neighbours`` and
    ``threshold``: the graph capped at the complete one when fewer devices were available."""
    k = min(neighbours, n - 1)
    return k, min(threshold, k)


def max_int(clip: float, step: float) -> int:
    return math.ceil(clip / step)


def min_bits(n: int, clip: float, step: float) -> int:
    return (n * max_int(clip, step)).bit_length() + 1


def _bounds(
    n: int, k: int, t: int, dropout: float, collude: float, against_lying: bool
) -> tuple[float, float, float]:
    colluders, dropped = math.floor(collude * n), math.floor(dropout * n)
    reach = 2 * t - k if against_lying else t
    secrecy = n * hypergeom_tail(n - 1, colluders, k, reach) if colluders else Fraction(0)
    if k >= n - 1:
        split = Fraction(0)
    else:
        gone = math.floor((dropout + collude) * n)
        split = math.comb(n, 2) * _falling_ratio(gone, n, 2 * (k // 2))
    failure = n * hypergeom_tail(n - 1, dropped, k, k - t + 1)
    return _log2(secrecy), _log2(split), _log2(failure)


def _shown(log2p: float) -> str:
    """A probability from its log2 (a union bound may pass 1: then it says so)."""
    return f"2^{log2p:.1f}" if log2p < 0 else f"1 (union bound 2^{log2p:.1f})"


def _check_inputs(n: int, clip: float, step: float, dropout: float, collude: float) -> None:
    if type(n) is not int or n < 2:
        raise CalibrationError(f"secure aggregation needs at least 2 devices per round, got {n!r}")
    if not (math.isfinite(clip) and clip > 0 and math.isfinite(step) and step > 0):
        raise CalibrationError(
            f"clip {clip!r} and quantisation step {step!r} must be finite and > 0"
        )
    if not (0 <= dropout < 1 and 0 <= collude < 1 and dropout + collude < 1):
        raise CalibrationError(
            f"dropout {dropout!r} and collude {collude!r} are fractions in [0, 1) summing below 1"
        )


def check(
    n: int,
    neighbours: int,
    threshold: int,
    bits: int,
    clip: float,
    step: float,
    *,
    dropout: float = 0.3,
    collude: float = 0.0,
    sigma: int = 40,
    eta: int = 20,
    against_lying: bool = False,
) -> Calibration:
    """The setting if it is sound, else :class:`CalibrationError` naming the first violation."""
    _check_inputs(n, clip, step, dropout, collude)
    k, t = neighbours, threshold
    if type(k) is not int or not 1 <= k <= n - 1:
        raise CalibrationError(f"neighbours {k!r} must be an int in [1, {n - 1}] for {n} devices")
    if k < n - 1 and k % 2:
        raise CalibrationError(f"neighbours {k} must be even (a Harary graph) or {n - 1} (all)")
    if type(t) is not int or not 2 <= t <= k:
        raise CalibrationError(f"threshold {t!r} must be an int in [2, neighbours = {k}]")
    if against_lying and 2 * t <= k:
        raise CalibrationError(
            f"threshold {t} of {k} neighbours: against an aggregator that lies about dropouts t must exceed k/2"
        )
    need = min_bits(n, clip, step)
    if type(bits) is not int or not need <= bits <= MAX_BITS:
        raise CalibrationError(
            f"bits {bits!r}: the sum of {n} values in [-{max_int(clip, step)}, {max_int(clip, step)}] "
            f"(clip {clip:g} / step {step:g}) needs {need} to {MAX_BITS} bits"
        )
    secrecy, split, failure = _bounds(n, k, t, dropout, collude, against_lying)
    if secrecy > -sigma:
        raise CalibrationError(
            f"threshold {t} of {k} neighbours: {collude:.0%} colluding devices reach a device's "
            f"secrets with probability {_shown(secrecy)} (> 2^-{sigma}); raise t or neighbours"
        )
    if split > -sigma:
        raise CalibrationError(
            f"neighbours {k}: with {dropout:.0%} dropouts and {collude:.0%} colluders the survivors "
            f"split (a partial sum leaks) with probability {_shown(split)} (> 2^-{sigma}); raise neighbours"
        )
    if failure > -eta:
        raise CalibrationError(
            f"threshold {t} of {k} neighbours: {dropout:.0%} dropouts fail a round with probability "
            f"{_shown(failure)} (> 2^-{eta}); lower t or raise neighbours"
        )
    return Calibration(n, k, t, bits, clip, step, dropout, collude, sigma, eta, against_lying,
                       secrecy, split, failure)  # fmt: skip


def calibrate(
    n: int,
    clip: float,
    step: float,
    *,
    dropout: float = 0.3,
    collude: float = 0.0,
    sigma: int = 40,
    eta: int = 20,
    against_lying: bool = False,
) -> Calibration:
    """The smallest degree k (then the largest threshold t it allows, then the fewest bits) that
    :func:`check` accepts; :class:`CalibrationError` when even the complete graph fails."""
    _check_inputs(n, clip, step, dropout, collude)
    bits = min_bits(n, clip, step)
    if bits > MAX_BITS:
        raise CalibrationError(f"{n} devices x clip {clip:g} / step {step:g} need {bits} > 64 bits")
    for k in [*range(2, n - 1, 2), n - 1]:
        if _bounds(n, k, 2, dropout, collude, False)[1] > -sigma:
            continue  # the survivors may split whatever t is
        # failure grows with t and secrecy shrinks: the largest t that keeps rounds alive is best
        t = k
        while t >= 2 and _bounds(n, k, t, dropout, 0.0, False)[2] > -eta:
            t -= 1
        if t < 2:
            continue
        try:
            return check(n, k, t, bits, clip, step, dropout=dropout, collude=collude,
                         sigma=sigma, eta=eta, against_lying=against_lying)  # fmt: skip
        except CalibrationError:
            continue
    raise CalibrationError(
        f"no (neighbours, threshold) secures {n} devices with {dropout:.0%} dropouts and "
        f"{collude:.0%} colluders at 2^-{sigma} / 2^-{eta}"
    )
