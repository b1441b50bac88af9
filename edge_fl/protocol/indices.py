"""Compact coding of a strictly ascending index list for a known dimension d (SignDS uploads).

Two codings; the encoder sends whichever is shorter (ties go to bit-packing). On the wire the
coding travels as the **integer** ``c`` of a SignDS update (:data:`CODINGS`):

- ``c = 0`` (:data:`CODE_BITPACK`, internal name ``"bp"``) bit-packing: every index in
  ``w = max(1, ceil(log2 d))`` bits, most significant bit first, concatenated and zero-padded to a
  whole byte. Fixed size ``ceil(h w / 8)``.
- ``c = 1`` (:data:`CODE_DELTA_VARINT`, internal name ``"dv"``) delta + unsigned LEB128: the first
  index, then the gaps to the previous index, each as a varint (7 bits per byte, low group first,
  high bit = "more bytes follow"). Small when indices cluster or d is large relative to h.

The short strings ``"bp"``/``"dv"`` are this module's names for logs and benchmarks only; they
never travel. :func:`encode_indices_coded` returns the wire code, :func:`encode_indices` the name,
and :func:`decode_indices` takes either.

The decoder trusts nothing: it rejects (never repairs or skips) an unknown coding, more indices
than allowed, truncated input, trailing bytes or non-zero padding, over-long or non-minimal
varints, out-of-range, duplicate or unsorted indices. Each rejection is an ``IndexCodingError``
whose ``reason`` is one of ``REASONS`` (the codec reports all of them as ``bad_indices``, with the
sub-reason in the detail), so the aggregator can count rejections by cause.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "CODES",
    "CODE_BITPACK",
    "CODE_DELTA_VARINT",
    "CODINGS",
    "REASONS",
    "TAG_BITPACK",
    "TAG_DELTA_VARINT",
    "IndexCodingError",
    "decode_indices",
    "encode_bitpack",
    "encode_delta_varint",
    "encode_indices",
    "encode_indices_coded",
    "index_width",
]

TAG_BITPACK = "bp"
TAG_DELTA_VARINT = "dv"
CODE_BITPACK = 0  # the wire value of ``c`` for bit-packing
CODE_DELTA_VARINT = 1  # the wire value of ``c`` for delta + LEB128 varints
CODINGS: dict[int, str] = {CODE_BITPACK: TAG_BITPACK, CODE_DELTA_VARINT: TAG_DELTA_VARINT}
CODES: dict[str, int] = {tag: code for code, tag in CODINGS.items()}
MAX_DIM = 2**32  # indices are uint32
_MAX_VARINT_BYTES = 5  # ceil(32 / 7)

REASONS = (
    "bad_tag",
    "bad_type",
    "too_many",
    "truncated",
    "trailing",
    "overlong",
    "out_of_range",
    "duplicate",
    "unsorted",
)


class IndexCodingError(ValueError):
    """An index list that must not be accepted; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _check_dim(d: Any) -> int:
    if isinstance(d, bool) or not isinstance(d, int | np.integer) or not 1 <= d <= MAX_DIM:
        raise ValueError(f"dimension d = {d!r} is out of domain integer [1, 2**32]")
    return int(d)


def index_width(d: int) -> int:
    """Bits per index for bit-packing: ceil(log2 d), at least 1."""
    return max(1, (_check_dim(d) - 1).bit_length())


def _check_order(vals: np.ndarray, d: int) -> None:
    """Range first, then order; the message names the first offending position."""
    bad = np.flatnonzero(vals >= d)
    if bad.size:
        i = int(bad[0])
        raise IndexCodingError(
            "out_of_range", f"index {int(vals[i])} at position {i} is out of range [0, {d})"
        )
    if vals.size > 1:
        steps = vals[1:].astype(np.int64) - vals[:-1].astype(np.int64)
        bad = np.flatnonzero(steps <= 0)
        if bad.size:
            i = int(bad[0]) + 1
            if steps[i - 1] == 0:
                raise IndexCodingError(
                    "duplicate", f"duplicate index {int(vals[i])} at position {i}"
                )
            raise IndexCodingError(
                "unsorted",
                f"indices not ascending: {int(vals[i])} at position {i} follows {int(vals[i - 1])}",
            )


def _as_index_array(indices: Any, d: int) -> np.ndarray:
    arr = np.asarray(indices)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise IndexCodingError("bad_type", "indices must be a 1-D integer array")
    if arr.size and int(arr.min()) < 0:
        i = int(np.flatnonzero(arr < 0)[0])
        raise IndexCodingError(
            "out_of_range", f"index {int(arr[i])} at position {i} is out of range [0, {d})"
        )
    vals = arr.astype(np.uint64)
    _check_order(vals, d)
    return vals


# ---------------------------------------------------------------------------------------------
# Encoding


def encode_bitpack(indices: Any, d: int) -> bytes:
    """Fixed-width big-endian bit-packing (validates the list first)."""
    d = _check_dim(d)
    vals = _as_index_array(indices, d)
    w = index_width(d)
    shifts = np.arange(w - 1, -1, -1, dtype=np.uint64)
    bits = ((vals[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.reshape(-1)).tobytes()


def encode_delta_varint(indices: Any, d: int) -> bytes:
    """First index, then gaps, each as an unsigned LEB128 varint (validates the list first)."""
    d = _check_dim(d)
    vals = _as_index_array(indices, d)
    if vals.size == 0:
        return b""
    gaps = np.diff(vals, prepend=np.uint64(0))
    n_bytes = np.ones(gaps.size, dtype=np.int64)
    for k in range(1, _MAX_VARINT_BYTES):
        n_bytes += gaps >= np.uint64(1 << (7 * k))
    col = np.arange(_MAX_VARINT_BYTES)
    groups = (gaps[:, None] >> (7 * col).astype(np.uint64)) & np.uint64(0x7F)
    more = col[None, :] < (n_bytes - 1)[:, None]
    table = (groups | (more.astype(np.uint64) << np.uint64(7))).astype(np.uint8)
    return table[col[None, :] < n_bytes[:, None]].tobytes()


def encode_indices(indices: Any, d: int) -> tuple[str, bytes]:
    """(name, bytes) of the shorter coding; bit-packing on a tie (fixed size, cheaper to check).

    The name is ``"bp"`` or ``"dv"``; the wire carries ``CODES[name]`` (see
    :func:`encode_indices_coded`)."""
    packed = encode_bitpack(indices, d)
    varint = encode_delta_varint(indices, d)
    if len(varint) < len(packed):
        return TAG_DELTA_VARINT, varint
    return TAG_BITPACK, packed


def encode_indices_coded(indices: Any, d: int) -> tuple[int, bytes]:
    """(wire code ``c``, bytes) of the shorter coding: what a SignDS update carries."""
    tag, blob = encode_indices(indices, d)
    return CODES[tag], blob


# ---------------------------------------------------------------------------------------------
# Decoding


def _decode_bitpack(buf: np.ndarray, d: int, count: int) -> np.ndarray:
    w = index_width(d)
    n_bits = count * w
    need = (n_bits + 7) // 8
    if buf.size < need:
        raise IndexCodingError(
            "truncated",
            f"bit-packed indices need {need} bytes for {count} x {w} bits, got {buf.size}",
        )
    if buf.size > need:
        raise IndexCodingError(
            "trailing", f"{buf.size - need} trailing bytes after {count} bit-packed indices"
        )
    bits = np.unpackbits(buf)
    if bits[n_bits:].any():
        raise IndexCodingError("trailing", "non-zero padding bits after the last bit-packed index")
    shifts = np.arange(w - 1, -1, -1, dtype=np.uint64)
    rows = bits[:n_bits].reshape(count, w).astype(np.uint64)
    return (rows << shifts).sum(axis=1, dtype=np.uint64)


def _decode_delta_varint(buf: np.ndarray, count: int) -> np.ndarray:
    if buf.size == 0:
        if count:
            raise IndexCodingError("truncated", f"no bytes for {count} delta-varint indices")
        return np.empty(0, dtype=np.uint64)
    last = buf < 0x80
    ends = np.flatnonzero(last)
    if ends.size < count:
        raise IndexCodingError(
            "truncated", f"only {ends.size} complete varints where {count} indices were announced"
        )
    if ends.size > count or ends.size == 0 or ends[-1] != buf.size - 1:
        extra = buf.size - 1 - int(ends[count - 1]) if count else buf.size
        raise IndexCodingError("trailing", f"{extra} trailing bytes after {count} varint indices")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    long_ = np.flatnonzero(lengths > _MAX_VARINT_BYTES)
    if long_.size:
        i = int(long_[0])
        raise IndexCodingError(
            "overlong", f"varint {i} is {int(lengths[i])} bytes (at most {_MAX_VARINT_BYTES})"
        )
    padded = np.flatnonzero((lengths > 1) & (buf[ends] == 0))
    if padded.size:
        raise IndexCodingError("overlong", f"varint {int(padded[0])} is not minimally encoded")
    pos = np.arange(buf.size) - np.repeat(starts, lengths)
    contrib = (buf & 0x7F).astype(np.uint64) << (7 * pos).astype(np.uint64)
    gaps = np.add.reduceat(contrib, starts)
    zero = np.flatnonzero(gaps[1:] == 0)
    if zero.size:
        i = int(zero[0]) + 1
        raise IndexCodingError(
            "duplicate", f"zero gap at position {i}: duplicate index {int(gaps[:i].sum())}"
        )
    return np.cumsum(gaps, dtype=np.uint64)


def decode_indices(tag: str | int, data: Any, d: int, count: int, max_count: int) -> np.ndarray:
    """``count`` strictly ascending indices in [0, d) as uint32, or raise IndexCodingError.

    ``tag``: the wire code ``c`` (0 or 1) or the internal name (``"bp"`` or ``"dv"``)."""
    d = _check_dim(d)
    if type(tag) is int:
        tag = CODINGS.get(tag, f"code {tag}")
    for name, value in (("count", count), ("max_count", max_count)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise IndexCodingError("bad_type", f"{name} = {value!r} is not an integer >= 0")
    if count > max_count:
        raise IndexCodingError("too_many", f"{count} indices exceed the limit of {max_count}")
    if count > d:
        raise IndexCodingError("too_many", f"{count} distinct indices cannot fit in d = {d}")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise IndexCodingError("bad_type", f"index data must be bytes, got {type(data).__name__}")
    buf = np.frombuffer(bytes(data), dtype=np.uint8)
    if tag == TAG_BITPACK:
        vals = _decode_bitpack(buf, d, int(count))
    elif tag == TAG_DELTA_VARINT:
        vals = _decode_delta_varint(buf, int(count))
    else:
        raise IndexCodingError(
            "bad_tag",
            f"unknown index coding {tag!r} (expected c = {CODE_BITPACK} bit-packing or "
            f"c = {CODE_DELTA_VARINT} delta-varint)",
        )
    _check_order(vals, d)
    return vals.astype(np.uint32)
