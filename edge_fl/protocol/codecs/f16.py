"""``f16``: every value as a little-endian float16 (wire ``dt = "f2"``), stochastically rounded.

Each value goes to one of the two float16 values that bracket it, the upper one with probability
(x - lo) / (hi - lo), so E[x_hat] = x (unbiased) and |x_hat - x| < hi - lo = one float16 ulp:
at most 2^-10 |x| for |x| >= 2^-14 (normal range) and 2^-24 below (subnormals). Values beyond the
float16 range (|x| > 65504) round to nearest (infinity: the aggregator refuses such an update as
non_finite; a real delta is far below its 1e4 plausibility bound). The wire format is the one
every peer already reads; only the rounding differs from a plain ``astype(float16)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_fl.protocol.codecs.base import Codec, CodecState, bin_size, check_vector

F2 = np.dtype("<f2")
F16_MAX = float(np.finfo(np.float16).max)


def stochastic_f16(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unbiased stochastic rounding of float64 ``x`` to float16."""
    with np.errstate(over="ignore"):  # beyond float16: infinity, refused by the aggregator
        near = x.astype(np.float16)
        near64 = near.astype(np.float64)
        lo = np.where(near64 > x, np.nextafter(near, np.float16(-np.inf)), near)
        hi = np.nextafter(lo, np.float16(np.inf))
    lo64, hi64 = lo.astype(np.float64), hi.astype(np.float64)
    inside = np.isfinite(lo64) & np.isfinite(hi64) & (np.abs(x) <= F16_MAX)
    gap = np.where(inside, hi64 - lo64, 1.0)
    p = np.where(inside, (x - lo64) / gap, 0.0)
    up = rng.random(x.shape) < p
    return np.where(inside, np.where(up, hi, lo), near).astype(F2)


class F16(Codec):
    name = "f16"
    dt = "f2"
    keys = frozenset({"x"})
    unbiased = True
    preserves_norm = True  # within the server's float16 rounding slack
    downlink = True

    def encode(
        self, x: np.ndarray, rng: np.random.Generator, state: CodecState | None = None
    ) -> tuple[dict[str, Any], CodecState | None]:
        return {"x": stochastic_f16(check_vector(x), rng).tobytes()}, None

    def decode(self, fields: dict[str, Any], dim: int) -> np.ndarray:
        blob = self.blob(fields, "x", "delta vector", 2 * dim, f"{dim} f2 values")
        return self.finite(np.frombuffer(blob, F2).astype(np.float32), "x", "delta vector")

    def payload_bytes(self, dim: int) -> int:
        return 6 + 2 + bin_size(2 * dim)
