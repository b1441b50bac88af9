"""An exact, order-independent vector sum: fixed-point limbs, added in float64, carried to int64.

Why: a float64 running sum depends on the order of its terms, so two ingest workers that each fold
half of a round's updates would produce a merged model that differs in its last bits from one
aggregator folding the same updates (and from itself on another arrival order). Sharded
aggregation promises bit-for-bit the single aggregator's model (docs/scale.md), so every
aggregation sum goes through this accumulator.

How: each term is truncated (toward zero, so ``add(-x)`` cancels ``add(x)``) to the grid
2^-50 and split into a high part (units of 2^-5) and a low part (units of 2^-50), each an integer
below 2^45 in magnitude. Both are added in float64, where integers below 2^53 add exactly, and
every :data:`CARRY_EVERY` additions the low limb's carry moves up and the high limb moves into an
int64 total, before 2^53 could be reached. Integer addition is associative, so the total is the
same for any order and grouping of the terms, and the float value is a fixed function of it.
Cost: about 8 in-place numpy passes per term, a few times a plain float64 ``+=``
(BENCHMARKS.md section 2).

Domain: |term| < 2^40 (about 1.1e12; a term is weight x samples x a delta the decoder bounds by
1e4), resolution 2^-50 (about 8.9e-16, far under float32's resolution of any parameter).
"""

from __future__ import annotations

import numpy as np

from edge_fl.protocol import PayloadRejected, Reject

#: bits per limb, the grid of the high limb and of the low one
_BITS = 45
_HI, _LO = 2.0**-5, 2.0**-50
#: terms at or beyond this magnitude do not fit
MAX_TERM = 2.0**40
#: additions between carries: each moves a limb by < 2^45, so 2^53 is never reached
CARRY_EVERY = 128


class ExactSum:
    """A sum of float64 vectors, exact on the 2^-50 grid and independent of the order of terms
    and of how they are grouped: ``a.merge(b)`` equals one accumulator fed both term streams."""

    __slots__ = ("_adds", "_hi", "_lo", "_tmp", "_top")

    def __init__(self, n: int) -> None:
        self._top = np.zeros(n, dtype=np.int64)  # units of 2^-5, carried out of _hi
        self._hi = np.zeros(n, dtype=np.float64)  # units of 2^-5, exact integers < 2^53
        self._lo = np.zeros(n, dtype=np.float64)  # units of 2^-50, exact integers < 2^53
        self._tmp = np.empty((2, n), dtype=np.float64)
        self._adds = 0

    def __len__(self) -> int:
        return self._top.shape[0]

    def add(self, x: np.ndarray, scale: float = 1.0) -> None:
        """Add ``scale * x`` (computed in float64); PayloadRejected ``implausible`` (nothing
        added) if it is not finite or out of range: only an update far past any real delta
        gets there."""
        x = np.asarray(x)
        if x.shape != (len(self),):
            raise ValueError(f"term has shape {x.shape}, expected ({len(self)},)")
        term, t = self._tmp
        np.multiply(x, scale, out=term, dtype=np.float64)
        np.abs(term, out=t)
        biggest = t.max(initial=0.0)
        if not biggest < MAX_TERM:  # also NaN
            raise PayloadRejected(
                Reject.IMPLAUSIBLE,
                "weight x samples x delta is not finite or beyond the aggregator's exact sum "
                f"(|x| < 2^40; max |x| = {float(biggest):.4g})",
            )
        np.multiply(term, 1 / _HI, out=t)
        np.trunc(t, out=t)  # the high part, in units of 2^-5
        self._hi += t
        np.multiply(t, _HI, out=t)
        np.subtract(term, t, out=t)  # what is left, |r| < 2^-5 (exact)
        np.multiply(t, 1 / _LO, out=t)
        np.trunc(t, out=t)  # in units of 2^-50; below that is dropped
        self._lo += t
        self._counted()

    def add_at(self, indices: np.ndarray, value: float) -> None:
        """Add ``value`` at ``indices`` (distinct, in range: the caller checked): a sparse term,
        O(len(indices)) (a SignDS vote)."""
        if not abs(value) < MAX_TERM:
            raise PayloadRejected(
                Reject.IMPLAUSIBLE, f"vote weight {value!r} is beyond the exact sum's |x| < 2^40"
            )
        hi = float(np.trunc(value / _HI))
        lo = float(np.trunc((value - hi * _HI) / _LO))
        self._hi[indices] += hi
        self._lo[indices] += lo
        self._counted()

    def _counted(self) -> None:
        self._adds += 1
        if self._adds >= CARRY_EVERY:
            self._carry()

    def _carry(self) -> None:
        """Low limb into [0, 2^45) (floor: canonical), its carry and the high limb into _top."""
        carry = np.floor(self._lo / 2.0**_BITS)
        self._lo -= carry * 2.0**_BITS
        self._top += (self._hi + carry).astype(np.int64)
        self._hi[:] = 0.0
        self._adds = 0

    def merge(self, other: ExactSum) -> None:
        if len(other) != len(self):
            raise ValueError(f"cannot merge sums of length {len(other)} and {len(self)}")
        self._carry()
        other._carry()
        self._top += other._top
        self._lo += other._lo  # both in [0, 2^45): exact
        self._carry()

    def value(self) -> np.ndarray:
        """The sum as float64: a fixed function of the exact total (carried to the canonical
        form first, so every grouping of the same terms gives the same bits)."""
        self._carry()
        return self._top.astype(np.float64) * _HI + self._lo * _LO

    def to_bytes(self) -> bytes:
        """Canonical little-endian (top, low) limbs, for a partial aggregate on the wire."""
        self._carry()
        return self._top.astype("<i8").tobytes() + self._lo.astype("<i8").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, n: int) -> ExactSum:
        if len(data) != 16 * n:
            raise ValueError(f"exact sum of {n} values needs {16 * n} bytes, got {len(data)}")
        limbs = np.frombuffer(data, dtype="<i8").reshape(2, n)
        if n and not (limbs[1].min() >= 0 and limbs[1].max() < 2**_BITS):
            raise ValueError("exact sum: the low limb is not canonical (each in [0, 2^45))")
        out = cls(n)
        out._top[:] = limbs[0]
        out._lo[:] = limbs[1].astype(np.float64)
        return out
