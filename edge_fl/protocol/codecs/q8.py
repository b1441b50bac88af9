"""``q8``: 8-bit per-block stochastic quantisation (wire ``dt = "q8"``), unbiased.

One byte per value (its level, 0-255) plus 8 bytes per block of 256 values: about 3.9x smaller
than float32. Scheme and bounds: :mod:`edge_fl.protocol.codecs.quantised` (|x_hat - x| < s_b =
(max_b - min_b) / 255 per block, E[x_hat] = x, Var <= s_b^2 / 4).
"""

from __future__ import annotations

import numpy as np

from edge_fl.protocol.codecs.quantised import Quantised


class Q8(Quantised):
    name = "q8"
    dt = "q8"
    bits = 8
    downlink = True  # the global model, rounded to nearest: protocol.codec, "q8" downlink

    def pack(self, q: np.ndarray) -> bytes:
        return q.astype(np.uint8).tobytes()

    def unpack(self, blob: bytes, dim: int) -> np.ndarray:
        return np.frombuffer(blob, np.uint8)
