"""``q4``: 4-bit per-block stochastic quantisation (wire ``dt = "q4"``), unbiased.

Two values per byte (value 2i in the low nibble, 2i+1 in the high one; an odd d leaves the last
high nibble 0, which the decoder requires) plus 8 bytes per block of 256 values: about 7.5x
smaller than float32. Scheme and bounds: :mod:`edge_fl.protocol.codecs.quantised` (|x_hat - x| < s_b =
(max_b - min_b) / 15 per block, E[x_hat] = x, Var <= s_b^2 / 4).
"""

from __future__ import annotations

import numpy as np

from edge_fl.protocol.codecs.quantised import Quantised
from edge_fl.protocol.messages import PayloadRejected, Reject


class Q4(Quantised):
    name = "q4"
    dt = "q4"
    bits = 4

    def pack(self, q: np.ndarray) -> bytes:
        q = q.astype(np.uint8)
        if q.size % 2:
            q = np.concatenate([q, np.zeros(1, np.uint8)])
        return (q[0::2] | (q[1::2] << 4)).astype(np.uint8).tobytes()

    def unpack(self, blob: bytes, dim: int) -> np.ndarray:
        raw = np.frombuffer(blob, np.uint8)
        if dim % 2 and raw[-1] >> 4:
            raise PayloadRejected(
                Reject.OUT_OF_RANGE,
                f"field 'x' (quantised levels): d = {dim} is odd, so the last byte's high nibble "
                f"is padding and must be 0, got {int(raw[-1] >> 4)}",
                field="x",
            )
        out = np.empty(raw.size * 2, np.uint8)
        out[0::2], out[1::2] = raw & 0x0F, raw >> 4
        return out[:dim]
