"""The cryptographic pieces of SecAgg+ (docs/specs/secagg.md section 4), all from ``cryptography``.

- X25519 key agreement; HKDF-SHA256 turns every shared secret into a key bound to one purpose,
  one job, one round, one round nonce and the device ids involved (:func:`context`).
- ChaCha20-Poly1305 encrypts the shares one device sends another through the aggregator
  (ChaCha20 rather than AES-GCM: a Raspberry Pi 4 has no AES instructions).
- ChaCha20's keystream is the PRG that expands a 32-byte seed into a mask in Z_2^b.
- Shamir t-of-n sharing over GF(p), p = 2^255 - 19. Why not a library: pycryptodome's ``Shamir``
  (the one well-kept Python implementation) shares only 16-byte secrets over GF(2^128), numbers
  shares 1..n itself, and its pure-Python field multiplication takes 49 ms per reconstruction at
  t = 26 (measured; 1.29 ms here): 49 s for the self-mask seeds of 1,000 survivors. Python's
  integers make GF(p) a dozen lines whose only operations are ``*``, ``+`` and ``pow(x, -1, p)``.
  p is the Curve25519 prime, so an X25519 private scalar (clamped, below 2^255) is one field
  element, and every share is 32 bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from edge_fl.protocol.secure import context

#: the Shamir field's prime (the Curve25519 prime)
PRIME = 2**255 - 19
KEY_BYTES = 32
SHARE_BYTES = 32
TAG_BYTES = 16
#: a share ciphertext: the key share and the self-mask-seed share, then the Poly1305 tag
SEALED_BYTES = 2 * SHARE_BYTES + TAG_BYTES

RandBytes = Callable[[int], bytes]


class ShareError(ValueError):
    """Shares that do not determine a secret (too few, repeated or out of the field)."""


def hkdf(ikm: bytes, salt: bytes, info: bytes, length: int = KEY_BYTES) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


# ------------------------------------------------------------------ keys


def clamp(raw: bytes) -> int:
    """The X25519 scalar of 32 private-key bytes (RFC 7748 clamping), an int below 2^255."""
    b = bytearray(raw)
    b[0] &= 248
    b[31] &= 127
    b[31] |= 64
    return int.from_bytes(b, "little")


def new_key(randbytes: RandBytes) -> int:
    """A fresh X25519 private scalar that is also a field element (below PRIME; the two clamped
    values at or above it, 2^255 - 16 and 2^255 - 8, are drawn again)."""
    while True:
        scalar = clamp(randbytes(KEY_BYTES))
        if scalar < PRIME:
            return scalar


def private_key(scalar: int) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(scalar.to_bytes(KEY_BYTES, "little"))


def public_bytes(scalar: int) -> bytes:
    return (
        private_key(scalar)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )


def agree(scalar: int, peer_public: bytes) -> bytes:
    """X25519(scalar, peer): the 32-byte shared secret (ValueError for a low-order peer key)."""
    return private_key(scalar).exchange(X25519PublicKey.from_public_bytes(peer_public))


_PROBE = clamp(bytes(range(32)))


def valid_public(key: bytes) -> bool:
    """A peer key X25519 accepts: 32 bytes whose agreement is not all zero (a low-order point
    would give every peer the same, public, shared secret)."""
    try:
        agree(_PROBE, key)
    except ValueError:
        return False
    return True


def new_seed(randbytes: RandBytes) -> int:
    """A self-mask seed: uniform in [0, PRIME) (rejection from 255 random bits)."""
    while True:
        value = int.from_bytes(randbytes(KEY_BYTES), "little") & (2**255 - 1)
        if value < PRIME:
            return value


def seed_commitment(job: str, rnd: int, nonce: bytes, device: str, seed: int) -> bytes:
    """SHA-256 of the self-mask seed in its context: lets the aggregator check a reconstruction
    (a wrong share would otherwise give a wrong sum silently)."""
    data = context("seed-commitment", job, rnd, device) + nonce + seed.to_bytes(32, "little")
    return hashlib.sha256(data).digest()


# ------------------------------------------------------------------ derived keys


def pair_seed(shared: bytes, job: str, rnd: int, nonce: bytes, a: str, b: str) -> bytes:
    """The pairwise mask seed of devices a and b (symmetric: the ids are taken in order)."""
    lo, hi = sorted((a, b))
    return hkdf(shared, nonce, context("pair-mask", job, rnd, lo, hi))


def self_seed(seed: int, job: str, rnd: int, nonce: bytes, device: str) -> bytes:
    return hkdf(seed.to_bytes(32, "little"), nonce, context("self-mask", job, rnd, device))


def share_key(shared: bytes, job: str, rnd: int, nonce: bytes, sender: str, receiver: str) -> bytes:
    """The AEAD key of sender -> receiver (directional: each key seals exactly one message)."""
    return hkdf(shared, nonce, context("share-key", job, rnd, sender, receiver))


def share_aad(job: str, rnd: int, nonce: bytes, sender: str, receiver: str, keys: bytes) -> bytes:
    """The associated data of a sealed share: the context, the nonce and the four public keys
    (sender's ck, sk, receiver's ck, sk) as the sealing device saw them, so that a key altered
    on its way to either party makes the share fail to open instead of making masks that do not
    cancel."""
    return context("share", job, rnd, sender, receiver) + nonce + keys


_ZERO_NONCE = bytes(12)


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    return ChaCha20Poly1305(key).encrypt(_ZERO_NONCE, plaintext, aad)


def open_sealed(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    """The plaintext, or ``cryptography.exceptions.InvalidTag``."""
    return ChaCha20Poly1305(key).decrypt(_ZERO_NONCE, sealed, aad)


# ------------------------------------------------------------------ masks in Z_2^b


def ring_mask(bits: int) -> np.uint64:
    return np.uint64((1 << bits) - 1)


def expand(seed: bytes, dim: int, bits: int) -> np.ndarray:
    """``dim`` uniform elements of Z_2^bits (uint64): the ChaCha20 keystream of ``seed`` (nonce
    and counter 0) read as little-endian 32-bit words (bits <= 32) or 64-bit words, low bits."""
    width = 4 if bits <= 32 else 8
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    words = np.frombuffer(stream.update(bytes(dim * width)), dtype="<u4" if width == 4 else "<u8")
    out = words.astype(np.uint64)
    out &= ring_mask(bits)
    return out


def to_ring(values: np.ndarray, bits: int) -> np.ndarray:
    """Signed integers as elements of Z_2^bits (two's complement)."""
    out = np.asarray(values, dtype=np.int64).astype(np.uint64)
    out &= ring_mask(bits)
    return out


def from_ring(values: np.ndarray, bits: int) -> np.ndarray:
    """Elements of Z_2^bits lifted to [-2^(bits-1), 2^(bits-1)) as int64."""
    v = np.asarray(values, dtype=np.uint64) & ring_mask(bits)
    if bits == 64:
        return v.view(np.int64).copy()
    half = np.uint64(1 << (bits - 1))
    return (v ^ half).astype(np.int64) - np.int64(1 << (bits - 1))  # sign-extend bit bits-1


def pack(values: np.ndarray, bits: int) -> bytes:
    """Ring elements, each in ceil(bits / 8) little-endian bytes."""
    width = (bits + 7) // 8
    raw = np.ascontiguousarray(values, dtype="<u8").view(np.uint8).reshape(-1, 8)
    return raw[:, :width].tobytes()


def unpack(blob: bytes, dim: int, bits: int) -> np.ndarray | None:
    """The inverse of :func:`pack`, or None when the length is wrong or a value has bits set
    at or above ``bits``."""
    width = (bits + 7) // 8
    if len(blob) != dim * width:
        return None
    wide = np.zeros((dim, 8), dtype=np.uint8)
    wide[:, :width] = np.frombuffer(blob, dtype=np.uint8).reshape(dim, width)
    out = wide.view("<u8").reshape(dim).astype(np.uint64)
    if bits < 64 and bool((out >> np.uint64(bits)).any()):
        return None
    return out


# ------------------------------------------------------------------ Shamir over GF(PRIME)


def _field_element(randbytes: RandBytes) -> int:
    return new_seed(randbytes)


def split(secret: int, threshold: int, xs: Sequence[int], randbytes: RandBytes) -> list[int]:
    """Shares of ``secret`` (in [0, PRIME)) at the distinct nonzero points ``xs``: any
    ``threshold`` of them determine it, fewer say nothing (a random polynomial of degree t-1)."""
    if not 0 <= secret < PRIME:
        raise ShareError("a secret is a field element, in [0, 2^255 - 19)")
    if (
        not 1 <= threshold <= len(xs)
        or len(set(xs)) != len(xs)
        or not all(0 < x < PRIME for x in xs)
    ):
        raise ShareError(
            f"threshold {threshold} needs that many distinct nonzero points, got {len(xs)}"
        )
    coeffs = [secret] + [_field_element(randbytes) for _ in range(threshold - 1)]
    shares = []
    for x in xs:
        acc = 0
        for c in reversed(coeffs):
            acc = (acc * x + c) % PRIME
        shares.append(acc)
    return shares


def combine(points: Sequence[tuple[int, int]]) -> int:
    """The polynomial's value at 0 from ``(x, share)`` points (Lagrange). Exactly the threshold's
    number of points is enough; with fewer the result is a uniformly random field element."""
    return interpolate(points, 0)


def interpolate(points: Sequence[tuple[int, int]], at: int) -> int:
    """The value at ``at`` of the polynomial of degree len(points) - 1 through ``points``
    (Lagrange): at 0 the secret; at another holder's point, the share it should hold."""
    xs = [x for x, _ in points]
    if not points or len(set(xs)) != len(xs) or not all(0 < x < PRIME for x in xs):
        raise ShareError("shares need distinct nonzero points")
    value = 0
    for i, (xi, yi) in enumerate(points):
        if not 0 <= yi < PRIME:
            raise ShareError("a share is a field element")
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * (at - xj) % PRIME
                den = den * (xi - xj) % PRIME
        value = (value + yi * num * pow(den, -1, PRIME)) % PRIME
    return value


def share_bytes(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "little")


def share_value(blob: bytes) -> int | None:
    """A share from its 32 little-endian bytes, None if it is not a field element."""
    value = int.from_bytes(blob, "little")
    return value if len(blob) == SHARE_BYTES and value < PRIME else None
