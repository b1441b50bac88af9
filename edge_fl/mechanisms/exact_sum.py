"""An exact, order-independent vector sum: fixed-point limbs in int64.

Why: a float64 running sum depends on the order of its terms, so two ingest workers that each fold
half of a round's updates would produce a merged model that differs in its last bits from one
aggregator folding the same updates (and from itself on another arrival order). Sharded
aggregation promises bit-for-bit the single aggregator's model (docs/scale.md), so every
aggregation sum goes through this accumulator: each float64 term is cut into four signed 30-bit
limbs on a fixed grid (2^32, 2^2, 2^-28, 2^-58); integer addition of limbs is exact and
associative, and the float value is a fixed function of the exact integer total.

Range and resolution: |term| < 2^62 (about 4.6e18; a term is weight x samples x a delta bounded
by the decoder's plausibility check), truncated toward zero below 2^-58 (about 3.5e-18, far
under float32's resolution of any parameter). Up to 2^32 terms per accumulator (limb sums stay in
int64). Truncation toward zero is odd-symmetric, so ``add(-x)`` cancels ``add(x)`` exactly.
"""

from __future__ import annotations

import numpy as np

from edge_fl.protocol import PayloadRejected, Reject

#: the weight of each limb: 2^32, 2^2, 2^-28, 2^-58 (30 bits apart)
_SHIFTS = (32, 2, -28, -58)
_LIMB_BITS = 30
#: terms at or beyond this magnitude do not fit the top limb
MAX_TERM = 2.0**62


class ExactSum:
    """A sum of float64 vectors that is exact (to 2^-58) and independent of the order of terms
    and of how they are grouped: ``a.merge(b)`` equals one accumulator fed both term streams."""

    __slots__ = ("limbs",)

    def __init__(self, n: int) -> None:
        self.limbs = np.zeros((len(_SHIFTS), n), dtype=np.int64)

    def __len__(self) -> int:
        return self.limbs.shape[1]

    def add(self, x: np.ndarray) -> None:
        """Add one term; PayloadRejected ``implausible`` (nothing added) if it is not finite or
        out of range: only an update far past any real delta gets there."""
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (len(self),):
            raise ValueError(f"term has shape {x.shape}, expected ({len(self)},)")
        big = np.abs(x)
        if not np.all(big < MAX_TERM):  # also catches NaN
            raise PayloadRejected(
                Reject.IMPLAUSIBLE,
                "weight x samples x delta is not finite or beyond the aggregator's exact sum "
                f"(|x| < 2^62; max |x| = {float(np.nanmax(big)) if big.size else 0:.4g})",
            )
        self.limbs += split(x)

    def add_at(self, indices: np.ndarray, value: float) -> None:
        """Add ``value`` at ``indices`` (distinct, in range: the caller checked): a sparse term,
        O(len(indices)) (a SignDS vote)."""
        if not abs(value) < MAX_TERM:
            raise PayloadRejected(
                Reject.IMPLAUSIBLE, f"vote weight {value!r} is beyond the exact sum's |x| < 2^62"
            )
        self.limbs[:, indices] += split(np.full(len(indices), value, dtype=np.float64))

    def merge(self, other: ExactSum) -> None:
        if len(other) != len(self):
            raise ValueError(f"cannot merge sums of length {len(other)} and {len(self)}")
        self.limbs += other.limbs

    def value(self) -> np.ndarray:
        """The sum as float64: a fixed function of the exact integer total (carries normalised
        first, so every grouping of the same terms gives the same bits)."""
        limbs = normalised(self.limbs)
        out = np.zeros(len(self), dtype=np.float64)
        for row, shift in zip(limbs, _SHIFTS, strict=True):
            out += np.ldexp(row.astype(np.float64), shift)
        return out

    def to_bytes(self) -> bytes:
        """Canonical little-endian limbs (normalised), for a partial aggregate on the wire."""
        return normalised(self.limbs).astype("<i8").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, n: int) -> ExactSum:
        expected = len(_SHIFTS) * n * 8
        if len(data) != expected:
            raise ValueError(f"exact sum of {n} values needs {expected} bytes, got {len(data)}")
        out = cls(n)
        out.limbs = np.frombuffer(data, dtype="<i8").reshape(len(_SHIFTS), n).astype(np.int64)
        return out


def split(x: np.ndarray) -> np.ndarray:
    """The limbs of ``x`` (each |limb| < 2^30), by truncation toward zero; every step is exact
    in float64 (scaling by powers of two, truncation, subtracting a value's own high part)."""
    out = np.empty((len(_SHIFTS), x.size), dtype=np.int64)
    rest = x
    for i, shift in enumerate(_SHIFTS):
        part = np.trunc(np.ldexp(rest, -shift))
        out[i] = part.astype(np.int64)
        rest = rest - np.ldexp(part, shift)
    return out


def normalised(limbs: np.ndarray) -> np.ndarray:
    """Carry each lower limb's excess into the one above, so the lower limbs lie in
    [0, 2^30): a canonical form of the total (the top limb holds the sign)."""
    out = limbs.copy()
    for i in range(len(_SHIFTS) - 1, 0, -1):
        carry = out[i] >> _LIMB_BITS  # floor division by 2^30, negative values included
        out[i] -= carry << _LIMB_BITS
        out[i - 1] += carry
    return out
