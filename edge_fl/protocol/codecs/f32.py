"""``f32``: the dense baseline, every value as a little-endian float32 (wire ``dt = "f4"``).

Error: only float32 rounding of the float64 delta, |x_hat - x| <= 2^-24 |x| (round to nearest;
exact for a float32 input). Deterministic, not stochastic.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_fl.protocol.codecs.base import Codec, CodecState, bin_size, check_vector

F4 = np.dtype("<f4")


class F32(Codec):
    name = "f32"
    dt = "f4"
    keys = frozenset({"x"})
    unbiased = True  # exact for the float32 deltas devices send
    preserves_norm = True
    downlink = True

    def encode(
        self, x: np.ndarray, rng: np.random.Generator, state: CodecState | None = None
    ) -> tuple[dict[str, Any], CodecState | None]:
        return {"x": check_vector(x).astype(F4).tobytes()}, None

    def decode(self, fields: dict[str, Any], dim: int) -> np.ndarray:
        blob = self.blob(fields, "x", "delta vector", 4 * dim, f"{dim} f4 values")
        return self.finite(np.frombuffer(blob, F4).astype(np.float32), "x", "delta vector")

    def payload_bytes(self, dim: int) -> int:
        return 6 + 2 + bin_size(4 * dim)
