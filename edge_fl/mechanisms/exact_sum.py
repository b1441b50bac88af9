"""An exact, order-independent vector sum: each term rounded to a fixed grid, added exactly.

Why: a float64 running sum depends on the order of its terms, so two ingest workers that each fold
half of a round's updates would produce a merged model that differs in its last bits from one
aggregator folding the same updates (and from itself on another arrival order). Sharded
aggregation promises bit-for-bit the single aggregator's model (docs/scale.md), so every
aggregation sum goes through this accumulator.

How: every term is rounded (to nearest, ties to even: odd-symmetric, so ``add(-x)`` cancels
``add(x)``) to the grid G = 2^-40, a fixed function of the term alone. Numbers on that grid add
exactly in float64 while they stay below 2^12 (52 bits), so the accumulator ``_lo`` takes small
terms with one rounding (``x + M - M``, M = 1.5 * 2^12) and one addition: four array passes per
term with the scaling, about as many as a plain ``acc += scale * x``. It tracks a bound on its
magnitude (from each term's peak |value|, which the decoder has measured already) and carries into
an int64 total in units of 2^-5 before the bound could reach 2^12; large terms are split exactly
into a 2^-5-grid part (``_hi``, exact below 2^47) and a small rest. Integer addition is
associative, so the total is the same for any order and grouping of the terms, and the float value
is a fixed function of it (BENCHMARKS.md section 2 has the cost).

Domain: |term| < 2^47 (1.4e14; a term is weight x samples x a delta the decoder bounds by 1e4),
resolution 2^-40 (9.1e-13) per term.
"""

from __future__ import annotations

import numpy as np

from edge_fl.protocol import PayloadRejected, Reject

GRID = 2.0**-40
#: adding and subtracting this rounds |x| < 2^11 to the grid (its ulp is 2^-40)
_MAGIC = 1.5 * 2.0**12
#: terms below this take the fast path (rounded straight onto the grid)
_SMALL = 2.0**11
#: |_lo| stays below this (exact on the grid), |_hi| below 2^47 (exact on 2^-5)
_LO_LIMIT, _HI_LIMIT = 2.0**12, 2.0**47
_UNIT = 32.0  # _top counts units of 2^-5
#: terms at or beyond this magnitude do not fit
MAX_TERM = 2.0**47


class ExactSum:
    """A sum of float64 vectors, exact on the 2^-40 grid and independent of the order of terms
    and of how they are grouped: ``a.merge(b)`` equals one accumulator fed both term streams."""

    __slots__ = ("_hi", "_hi_bound", "_lo", "_lo_bound", "_tmp", "_top")

    def __init__(self, n: int) -> None:
        self._top = np.zeros(n, dtype=np.int64)  # units of 2^-5
        self._hi = np.zeros(n, dtype=np.float64)  # multiples of 2^-5, |.| < 2^47
        self._lo = np.zeros(n, dtype=np.float64)  # multiples of 2^-40, |.| < 2^12
        self._tmp = np.empty((2, n), dtype=np.float64)
        self._hi_bound = 0.0  # bounds on |_hi| and |_lo| since the last carry
        self._lo_bound = 0.0

    def __len__(self) -> int:
        return self._top.shape[0]

    def add(self, x: np.ndarray, scale: float = 1.0, peak: float | None = None) -> None:
        """Add ``scale * x`` (computed in float64). ``peak``: max |x| if known (the decoder
        measured it). PayloadRejected ``implausible`` (nothing added) if the term is not finite
        or out of range: only an update far past any real delta gets there."""
        x = np.asarray(x)
        if x.shape != (len(self),):
            raise ValueError(f"term has shape {x.shape}, expected ({len(self)},)")
        if peak is None:
            peak = float(np.abs(x).max(initial=0.0))
        bound = abs(scale) * peak
        if not bound < MAX_TERM:  # also NaN
            raise PayloadRejected(
                Reject.IMPLAUSIBLE,
                "weight x samples x delta is not finite or beyond the aggregator's exact sum "
                f"(|x| < 2^47; here up to {bound:.4g})",
            )
        term = self._tmp[0]
        np.multiply(x, scale, out=term, dtype=np.float64)
        if bound >= _SMALL:  # split off an exact 2^-5-grid part first
            high = self._tmp[1]
            np.multiply(term, _UNIT, out=high)
            np.trunc(high, out=high)
            high /= _UNIT
            term -= high  # exact; |rest| < 2^-5
            if self._hi_bound + bound >= _HI_LIMIT:
                self._carry()
            self._hi += high
            self._hi_bound += bound
            bound = 1 / _UNIT
        if self._lo_bound + bound + GRID >= _LO_LIMIT:
            self._carry()
        term += _MAGIC
        term -= _MAGIC  # rounded to the grid
        self._lo += term
        self._lo_bound += bound + GRID

    def add_at(self, indices: np.ndarray, value: float) -> None:
        """Add ``value`` at ``indices`` (distinct, in range: the caller checked): a sparse term,
        O(len(indices)) (a SignDS vote)."""
        bound = abs(value)
        if not bound < MAX_TERM:
            raise PayloadRejected(
                Reject.IMPLAUSIBLE, f"vote weight {value!r} is beyond the exact sum's |x| < 2^47"
            )
        high = 0.0
        if bound >= _SMALL:
            high = float(np.trunc(value * _UNIT)) / _UNIT
            if self._hi_bound + bound >= _HI_LIMIT:
                self._carry()
            self._hi[indices] += high
            self._hi_bound += bound
            bound = 1 / _UNIT
        if self._lo_bound + bound + GRID >= _LO_LIMIT:
            self._carry()
        self._lo[indices] += ((value - high) + _MAGIC) - _MAGIC
        self._lo_bound += bound + GRID

    def _carry(self) -> None:
        """_lo into [0, 2^-5) (floor: the canonical form), its carry and _hi into _top."""
        carry = np.floor(self._lo * _UNIT)  # exact: a power-of-two scaling, then an integer
        self._lo -= carry / _UNIT
        self._top += (self._hi * _UNIT + carry).astype(np.int64)  # integers below 2^53: exact
        self._hi[:] = 0.0
        self._hi_bound, self._lo_bound = 0.0, 1 / _UNIT

    def merge(self, other: ExactSum) -> None:
        if len(other) != len(self):
            raise ValueError(f"cannot merge sums of length {len(other)} and {len(self)}")
        self._carry()
        other._carry()
        self._top += other._top
        self._lo += other._lo  # both in [0, 2^-5): exact
        self._lo_bound = 2 / _UNIT
        self._carry()

    def value(self) -> np.ndarray:
        """The sum as float64: a fixed function of the exact total (carried to the canonical
        form first, so every grouping of the same terms gives the same bits)."""
        self._carry()
        return self._top.astype(np.float64) / _UNIT + self._lo

    def to_bytes(self) -> bytes:
        """Canonical little-endian (top, low) limbs, for a partial aggregate on the wire."""
        self._carry()
        low = (self._lo / GRID).astype("<i8")  # integers in [0, 2^35)
        return self._top.astype("<i8").tobytes() + low.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, n: int) -> ExactSum:
        if len(data) != 16 * n:
            raise ValueError(f"exact sum of {n} values needs {16 * n} bytes, got {len(data)}")
        limbs = np.frombuffer(data, dtype="<i8").reshape(2, n)
        if n and not (limbs[1].min() >= 0 and limbs[1].max() < 2**35):
            raise ValueError("exact sum: the low limb is not canonical (each in [0, 2^35))")
        out = cls(n)
        out._top[:] = limbs[0]
        out._lo[:] = limbs[1].astype(np.float64) * GRID
        return out
