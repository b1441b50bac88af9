"""``rot1``: random rotation + 1 bit per coordinate + one scale (wire ``dt = "r1"``), unbiased.

Scheme (Suresh et al., ICML 2017, "stochastic rotated binary quantisation"; the rotation as in
DRIVE/EDEN): pad the delta with zeros to D = the next power of two >= d, rotate
``z = H diag(s) x / sqrt(D)`` (H the Sylvester-ordered Walsh-Hadamard matrix, s random signs), send
``M = max |z_i|`` (``s``, a float at least that maximum), and for every coordinate one bit, 1 with
probability (z_i + M) / (2M) (``x``: D bits, bit i of byte i // 8, least significant first). The
decoder maps a bit to +M / -M and rotates back, ``x_hat = diag(s) H z_hat / sqrt(D)``, keeping the
first d values. The signs are the first D bits of SHAKE-128(``b"edge-fl/rot1\\x00" + rs``)
(same bit order, 1 -> +1), ``rs`` 16 random bytes from the device's CSPRNG: the receiver
reproduces the rotation from the payload, and the rotation is independent of x.

Bounds: E[z_hat_i] = z_i and the rotation is linear, so E[x_hat] = x exactly (unbiased);
deterministically ||x_hat - x||_2 <= ||z_hat - z||_2 <= 2 M sqrt(D); in expectation
E||x_hat - x||^2 <= D M^2 - ||x||^2, and M <= ||x||_2 (after the random rotation M is about
||x|| sqrt(2 ln(2D) / D) with high probability, so the error is about 2 ln(2D) ||x||^2: 1 bit per
coordinate is noisy, it pays off averaged over many devices). DRIVE's deterministic sign with
scale ||x||^2 / ||z||_1 has a smaller error but is unbiased only for uniformly random rotations,
not for this Hadamard one; this codec keeps exact unbiasedness.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

import edge_fl.protocol.fields as F
from edge_fl.protocol.codecs.base import Codec, CodecState, bin_size, check_vector

SEED_BYTES = 16
CONTEXT = b"edge-fl/rot1\x00"


def padded_dim(dim: int) -> int:
    return 1 << max(0, (dim - 1).bit_length())


def rotation_signs(seed: bytes, size: int) -> np.ndarray:
    raw = hashlib.shake_128(CONTEXT + seed).digest(-(-size // 8))
    bits = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")[:size]
    return bits.astype(np.float64) * 2.0 - 1.0


def fwht(a: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh-Hadamard transform (Sylvester order) of a power-of-two length vector."""
    n = a.size
    out = a.astype(np.float64).copy()
    h = 1
    while h < n:
        v = out.reshape(-1, 2, h)
        out = np.stack([v[:, 0] + v[:, 1], v[:, 0] - v[:, 1]], axis=1).reshape(-1)
        h *= 2
    return out / math.sqrt(n)


class Rot1(Codec):
    name = "rot1"
    dt = "r1"
    keys = frozenset({"x", "s", "rs"})
    unbiased = True

    def encode(
        self, x: np.ndarray, rng: np.random.Generator, state: CodecState | None = None
    ) -> tuple[dict[str, Any], CodecState | None]:
        vec = check_vector(x)
        big = padded_dim(vec.size)
        seed = rng.bytes(SEED_BYTES)
        signs = rotation_signs(seed, big)
        z = fwht(np.concatenate([vec, np.zeros(big - vec.size)]) * signs)
        m = float(np.abs(z).max())
        if m > 0:
            p = (z + m) / (2 * m)
            bits = (rng.random(big) < p).astype(np.uint8)
        else:
            bits = (np.arange(big) % 2).astype(np.uint8)  # any bits: M = 0 decodes to zeros
        pad = np.zeros(-(-big // 8) * 8 - big, np.uint8)
        blob = np.packbits(np.concatenate([bits, pad]), bitorder="little").tobytes()
        return {"x": blob, "s": m, "rs": seed}, None

    def decode(self, fields: dict[str, Any], dim: int) -> np.ndarray:
        big = padded_dim(dim)
        m = F.number(
            F.get(fields, "s", float, "rotated max", "float"), "s", "rotated max", 0.0, 1e30
        )
        seed = self.blob(fields, "rs", "rotation seed", SEED_BYTES, f"{SEED_BYTES} random bytes")
        blob = self.blob(
            fields, "x", "rotated sign bits", -(-big // 8), f"D = {big} bits, d padded to 2^k"
        )
        bits = np.unpackbits(np.frombuffer(blob, np.uint8), bitorder="little")
        if bits[big:].any():
            raise F.out_of_range("x", "rotated sign bits", blob, "zero padding bits after D bits")
        z_hat = (bits[:big].astype(np.float64) * 2.0 - 1.0) * m
        out = (fwht(z_hat) * rotation_signs(seed, big))[:dim]
        with np.errstate(over="ignore"):
            return self.finite(out.astype(np.float32), "x", "decoded delta")

    def payload_bytes(self, dim: int) -> int:
        return 6 + 2 + bin_size(-(-padded_dim(dim) // 8)) + 2 + 9 + 3 + bin_size(SEED_BYTES)
