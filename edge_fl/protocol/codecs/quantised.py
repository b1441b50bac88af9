"""Per-block stochastic uniform quantisation, shared by ``q8`` and ``q4``.

Scheme (normative: docs/protocol.md, "Compressed dense updates"): the delta is cut into blocks of
``BLOCK`` = 256 consecutive values (the last one shorter). Each block b sends ``lo_b`` (float32, at
most its minimum) and ``s_b`` (float32 step, ``lo_b + (L-1) s_b`` at least its maximum; 0 for a
constant block), and each value one level ``q`` in [0, L-1] (L = 2^bits):
``p = (x - lo_b) / s_b``, ``q = floor(p) + Bernoulli(p - floor(p))``; decoded ``lo_b + q s_b``.

Bounds: E[q] = p exactly, so E[x_hat] = x (unbiased, up to the final float32 rounding, 2^-24
relative); every value |x_hat - x| < s_b (deterministic); Var[x_hat_i] <= s_b^2 / 4, so
E||x_hat - x||^2 <= sum_b n_b s_b^2 / 4, with s_b ~ (max_b - min_b) / (L - 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_fl.protocol.codecs.base import Codec, CodecState, bin_size, check_vector
from edge_fl.protocol.messages import PayloadRejected, Reject

BLOCK = 256
F4 = np.dtype("<f4")


def n_blocks(dim: int) -> int:
    return -(-dim // BLOCK)


def block_params(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(lo, step) per block as float32, with lo <= min and lo + (levels-1) step >= max exactly."""
    nb = n_blocks(x.size)
    padded = np.concatenate([x, np.full(nb * BLOCK - x.size, x[-1] if x.size else 0.0)])
    blocks = padded.reshape(nb, BLOCK)
    mn, mx = blocks.min(axis=1), blocks.max(axis=1)
    lo = mn.astype(np.float32)
    lo = np.where(lo.astype(np.float64) > mn, np.nextafter(lo, np.float32(-np.inf)), lo)
    step = ((mx - lo.astype(np.float64)) / (levels - 1)).astype(np.float32)
    for _ in range(4):  # float32 rounding of the step: make the grid cover [lo, max]
        short = lo.astype(np.float64) + (levels - 1) * step.astype(np.float64) < mx
        if not short.any():
            break
        step = np.where(short, np.nextafter(step, np.float32(np.inf)), step)
    return lo, step


def _positions(x: np.ndarray, bits: int) -> tuple[np.ndarray, bytes]:
    """(p, block parameters): each value's position p = (x - lo_b) / step_b in [0, L-1]."""
    levels = 1 << bits
    lo, step = block_params(x, levels)
    rep_lo = np.repeat(lo.astype(np.float64), BLOCK)[: x.size]
    rep_step = np.repeat(step.astype(np.float64), BLOCK)[: x.size]
    safe = np.where(rep_step > 0, rep_step, 1.0)
    p = np.clip(np.where(rep_step > 0, (x - rep_lo) / safe, 0.0), 0, levels - 1)
    params = np.empty((lo.size, 2), dtype=F4)
    params[:, 0], params[:, 1] = lo, step
    return p, params.tobytes()


def quantise(x: np.ndarray, bits: int, rng: np.random.Generator) -> tuple[np.ndarray, bytes]:
    """(levels as uint8, block parameters as bytes: (lo, step) float32 pairs, little-endian)."""
    p, params = _positions(x, bits)
    base = np.floor(p)
    q = base + (rng.random(x.size) < (p - base))
    return np.minimum(q, (1 << bits) - 1).astype(np.uint8), params


def quantise_nearest(x: np.ndarray, bits: int) -> tuple[np.ndarray, bytes]:
    """As :func:`quantise`, but each value to its nearest level (deterministic: the downlink's
    quantised global model, whose bytes must not change when the same model is re-encoded).
    Every error is at most step_b / 2."""
    p, params = _positions(x, bits)
    return np.minimum(np.rint(p), (1 << bits) - 1).astype(np.uint8), params


def dequantise(q: np.ndarray, params: bytes, dim: int) -> np.ndarray:
    pairs = np.frombuffer(params, F4).reshape(-1, 2).astype(np.float64)
    lo, step = pairs[:, 0], pairs[:, 1]
    bad = np.flatnonzero(~np.isfinite(lo) | ~np.isfinite(step) | (step < 0))
    if bad.size:
        b = int(bad[0])
        raise PayloadRejected(
            Reject.OUT_OF_RANGE,
            f"field 'qp' (block parameters): block {b} has lo = {lo[b]!r}, step = {step[b]!r}; "
            "expected finite float32 values with step >= 0",
            field="qp",
        )
    rep = np.repeat(np.arange(lo.size), BLOCK)[:dim]
    with np.errstate(over="ignore", invalid="ignore"):
        return (lo[rep] + q.astype(np.float64) * step[rep]).astype(np.float32)


class Quantised(Codec):
    """``bits``-bit levels, per-block (lo, step); see the module docstring."""

    bits: int
    keys = frozenset({"x", "qp"})
    unbiased = True

    def encode(
        self, x: np.ndarray, rng: np.random.Generator, state: CodecState | None = None
    ) -> tuple[dict[str, Any], CodecState | None]:
        vec = check_vector(x)
        q, params = quantise(vec, self.bits, rng)
        return {"x": self.pack(q), "qp": params}, None

    def decode(self, fields: dict[str, Any], dim: int) -> np.ndarray:
        params = self.blob(
            fields,
            "qp",
            "block parameters",
            8 * n_blocks(dim),
            f"{n_blocks(dim)} blocks of {BLOCK} x (lo, step) float32",
        )
        blob = self.blob(
            fields,
            "x",
            "quantised levels",
            self.level_bytes(dim),
            f"{dim} levels of {self.bits} bits",
        )
        q = self.unpack(blob, dim)
        return self.finite(dequantise(q, params, dim), "x", "decoded delta")

    def level_bytes(self, dim: int) -> int:
        return -(-dim * self.bits // 8)

    def payload_bytes(self, dim: int) -> int:
        return 6 + 2 + bin_size(self.level_bytes(dim)) + 3 + bin_size(8 * n_blocks(dim))

    def pack(self, q: np.ndarray) -> bytes:
        raise NotImplementedError

    def unpack(self, blob: bytes, dim: int) -> np.ndarray:
        raise NotImplementedError

    def error_bound(self, fields: dict[str, Any], dim: int) -> np.ndarray:
        """Per-value deterministic bound |x_hat - x| <= step of its block."""
        pairs = np.frombuffer(fields["qp"], F4).reshape(-1, 2).astype(np.float64)
        return np.repeat(pairs[:, 1], BLOCK)[:dim]
