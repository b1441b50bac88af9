"""``topk``: top-k sparsification with error feedback kept on the device (wire ``dt = "tk"``).

The device adds its residual ``r`` (what earlier rounds did not send) to the delta, sends the
``h = min(d, max(1, ceil(fraction d)))`` coordinates of ``y = x + r`` largest in magnitude, their
values as float32, and keeps ``r' = y - y_hat`` for the next round (Stich et al. 2018, Karimireddy
et al. 2019). Indices travel bit-packed (``c = 0``, the SignDS coding: ``ceil(log2 d)`` bits each)
or as a bitmap of d bits (``c = 2``, bit i of byte i // 8, least significant first; padding 0),
whichever is shorter for (d, h): both sizes depend on d and h only, so the payload size is exact.

Bounds (deterministic, biased by design): y_hat equals y on the sent support and 0 elsewhere, so
||y_hat - y||^2 <= (1 - h/d) ||y||^2 and every dropped |y_i| <= the smallest sent |y_j|; with error
feedback nothing is lost, only delayed: sum_t y_hat_t = sum_t x_t - r_T (r_0 = 0), exactly up to
float64 arithmetic (the residual is computed from the float32 values actually sent).

Privacy: the residual is a function of earlier (privatised) deltas, so sending it is
post-processing of releases already accounted; mechanisms that need the delta to arrive as sent
(central Gaussian: its norm bound) refuse this codec (``Mechanism.accepts_codec``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

import edge_fl.protocol.fields as F
from edge_fl.protocol.codecs.base import Codec, CodecState, bin_size, check_vector, int_size
from edge_fl.protocol.indices import IndexCodingError, decode_indices, encode_bitpack, index_width
from edge_fl.protocol.messages import PayloadRejected, Reject

F4 = np.dtype("<f4")
CODE_BITPACK = 0
CODE_BITMAP = 2
MAX_FRACTION = 0.5


def sent_count(dim: int, fraction: float) -> int:
    return min(dim, max(1, math.ceil(fraction * dim)))


def index_coding(dim: int, h: int) -> tuple[int, int]:
    """(code, bytes) of the shorter index coding for h of d indices (bit-packing on a tie)."""
    packed = -(-h * index_width(dim) // 8)
    bitmap = -(-dim // 8)
    return (CODE_BITPACK, packed) if packed <= bitmap else (CODE_BITMAP, bitmap)


class TopK(Codec):
    name = "topk"
    dt = "tk"
    keys = frozenset({"h", "c", "ix", "x"})
    stateful = True
    options: ClassVar[dict[str, Any]] = {"fraction": 0.01, "error_feedback": True}

    def __init__(self, fraction: float = 0.01, error_feedback: bool = True) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ValueError(f"topk fraction = {fraction!r} is not a number")
        if not (0 < fraction <= MAX_FRACTION):
            raise ValueError(f"topk fraction = {fraction!r} is out of domain (0, {MAX_FRACTION}]")
        self.fraction = float(fraction)
        self.error_feedback = bool(error_feedback)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "fraction": self.fraction, "ef": self.error_feedback}

    def encode(
        self, x: np.ndarray, rng: np.random.Generator, state: CodecState | None = None
    ) -> tuple[dict[str, Any], CodecState | None]:
        y = check_vector(x)
        dim = y.size
        if self.error_feedback and state is not None and state.residual is not None:
            if state.residual.shape != y.shape:
                raise ValueError(
                    f"error-feedback residual has {state.residual.size} values, the delta {dim}"
                )
            y = y + state.residual
        h = sent_count(dim, self.fraction)
        idx = np.sort(np.argpartition(np.abs(y), dim - h)[dim - h :]).astype(np.uint32)
        values = y[idx].astype(F4)
        code, _ = index_coding(dim, h)
        if code == CODE_BITPACK:
            blob = encode_bitpack(idx, dim)
        else:
            bits = np.zeros(-(-dim // 8) * 8, np.uint8)
            bits[idx] = 1
            blob = np.packbits(bits, bitorder="little").tobytes()
        fields = {"h": h, "c": code, "ix": blob, "x": values.tobytes()}
        if not self.error_feedback:
            return fields, None
        residual = y.copy()
        residual[idx] -= values.astype(np.float64)
        return fields, CodecState(residual=residual)

    def decode(self, fields: dict[str, Any], dim: int) -> np.ndarray:
        h = F.int_field(fields, "h", "sent coordinates", 0, dim)
        code = F.int_field(fields, "c", "index coding", 0, CODE_BITMAP)
        if code not in (CODE_BITPACK, CODE_BITMAP):
            raise F.out_of_range("c", "index coding", code, "0 (bit-packing) or 2 (bitmap)")
        ix = F.get(fields, "ix", bytes, "indices", "bin")
        values = self.blob(fields, "x", "sent values", 4 * h, f"{h} f4 values")
        if code == CODE_BITPACK:
            try:
                idx = decode_indices(CODE_BITPACK, ix, dim, h, dim)
            except IndexCodingError as exc:
                raise PayloadRejected(
                    Reject.BAD_INDICES,
                    f"field 'ix' (indices, c = 0) does not decode to {h} strictly ascending "
                    f"indices in [0, {dim}): {exc.reason}: {exc}",
                    field="ix",
                ) from None
        else:
            size = -(-dim // 8)
            if len(ix) != size:
                raise PayloadRejected(
                    Reject.WRONG_SHAPE,
                    f"field 'ix' (index bitmap, c = 2) has {len(ix)} bytes; expected {size} "
                    f"(d = {dim} bits)",
                    field="ix",
                )
            bits = np.unpackbits(np.frombuffer(ix, np.uint8), bitorder="little")
            if bits[dim:].any():
                raise PayloadRejected(
                    Reject.BAD_INDICES,
                    "field 'ix' (index bitmap): non-zero padding bits",
                    field="ix",
                )
            idx = np.flatnonzero(bits[:dim])
            if idx.size != h:
                raise PayloadRejected(
                    Reject.BAD_INDICES,
                    f"field 'ix' (index bitmap) sets {idx.size} bits; 'h' says {h}",
                    field="ix",
                )
        vals = self.finite(np.frombuffer(values, F4).astype(np.float32), "x", "sent values")
        out = np.zeros(dim, np.float32)
        out[idx] = vals
        return out

    def payload_bytes(self, dim: int) -> int:
        h = sent_count(dim, self.fraction)
        _, ix = index_coding(dim, h)
        return 6 + 2 + int_size(h) + 3 + 3 + bin_size(ix) + 2 + bin_size(4 * h)
