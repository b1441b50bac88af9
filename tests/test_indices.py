"""Compact index coding: round trips, sizes, and every rejection reason."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_fl.protocol.indices import (
    REASONS,
    IndexCodingError,
    decode_indices,
    encode_bitpack,
    encode_delta_varint,
    encode_indices,
    index_width,
)


@st.composite
def index_sets(draw, max_size=100):
    d = draw(st.one_of(st.integers(1, 300), st.integers(1, 2**32)))
    idx = draw(st.sets(st.integers(0, d - 1), max_size=min(d, max_size)))
    return d, np.array(sorted(idx), dtype=np.uint64)


@settings(max_examples=300, deadline=None)
@given(index_sets())
def test_round_trip_both_codings(case):
    d, idx = case
    for tag, blob in (("bp", encode_bitpack(idx, d)), ("dv", encode_delta_varint(idx, d))):
        out = decode_indices(tag, blob, d, idx.size, 100)
        assert out.dtype == np.uint32
        np.testing.assert_array_equal(out, idx)
    tag, blob = encode_indices(idx, d)
    assert len(blob) == min(len(encode_bitpack(idx, d)), len(encode_delta_varint(idx, d)))
    np.testing.assert_array_equal(decode_indices(tag, blob, d, idx.size, 100), idx)


@settings(max_examples=200, deadline=None)
@given(index_sets(), st.binary(min_size=1, max_size=3))
def test_extra_bytes_are_always_rejected(case, junk):
    d, idx = case
    for tag, blob in (("bp", encode_bitpack(idx, d)), ("dv", encode_delta_varint(idx, d))):
        with pytest.raises(IndexCodingError):
            decode_indices(tag, blob + junk, d, idx.size, 100)
        if blob:
            with pytest.raises(IndexCodingError):
                decode_indices(tag, blob[:-1], d, idx.size, 100)


def test_widths():
    assert [index_width(d) for d in (1, 2, 3, 4, 5, 66404, 2**17, 2**17 + 1, 2**32)] == [
        1,
        1,
        2,
        2,
        3,
        17,
        17,
        18,
        32,
    ]
    with pytest.raises(ValueError, match="d = 0"):
        index_width(0)


def test_known_encodings():
    # 17-bit fields, MSB first, zero padded: 00000000 00000000 1|1000000 11011000 11|000000
    assert encode_bitpack([1, 66403], 66404) == bytes([0x00, 0x00, 0xC0, 0xD8, 0xC0])
    assert encode_delta_varint([1, 66403], 66404) == bytes([0x01, 0xE2, 0x86, 0x04])
    assert encode_delta_varint([0, 127, 128, 16511], 2**20) == bytes([0, 0x7F, 0x01, 0xFF, 0x7F])


def test_sizes_for_the_lenet_anchor():
    # d = 66404, h = 43: bit-packing is exactly 92 bytes; the chosen coding is never larger.
    rng = np.random.default_rng(30)
    d, h = 66404, 43
    chosen = []
    for _ in range(500):
        idx = np.sort(rng.choice(d, h, replace=False))
        assert len(encode_bitpack(idx, d)) == 92
        tag, blob = encode_indices(idx, d)
        chosen.append(len(blob))
        np.testing.assert_array_equal(decode_indices(tag, blob, d, h, 100), idx)
    assert max(chosen) <= 92
    assert np.mean(chosen) < 85  # delta-varint wins on uniform draws (about 82.6 bytes)


def _reject(reason, tag, data, d=1000, count=3, max_count=100):
    with pytest.raises(IndexCodingError) as exc:
        decode_indices(tag, data, d, count, max_count)
    assert exc.value.reason == reason, str(exc.value)
    assert isinstance(exc.value, ValueError)
    return str(exc.value)


def test_rejections_common():
    good_bp = encode_bitpack([1, 5, 9], 1000)
    assert "unknown index coding 'zz'" in _reject("bad_tag", "zz", good_bp)
    _reject("bad_type", "bp", "not bytes")
    _reject("bad_type", "bp", good_bp, count=-1)
    assert "101 indices exceed the limit of 100" in _reject("too_many", "bp", good_bp, count=101)
    assert "cannot fit in d = 2" in _reject("too_many", "bp", good_bp, d=2, count=3)


def test_rejections_bitpack():
    d = 1000  # 10 bits per index; 3 indices = 30 bits = 4 bytes, 2 padding bits
    good = encode_bitpack([1, 5, 9], d)
    assert len(good) == 4
    np.testing.assert_array_equal(decode_indices("bp", good, d, 3, 100), [1, 5, 9])
    _reject("truncated", "bp", good[:3])
    _reject("trailing", "bp", good + b"\x00")
    assert "padding" in _reject("trailing", "bp", good[:3] + bytes([good[3] | 0x01]))
    out_of_range = encode_bitpack([1, 5, 1000], 1024)  # 10 bits too, but 1000 >= d
    assert "index 1000 at position 2 is out of range [0, 1000)" in _reject(
        "out_of_range", "bp", out_of_range
    )
    dup = _pack_raw([1, 5, 5], 10)
    assert "duplicate index 5 at position 2" in _reject("duplicate", "bp", dup)
    unsorted = _pack_raw([1, 9, 5], 10)
    assert "5 at position 2 follows 9" in _reject("unsorted", "bp", unsorted)


def _pack_raw(values, width):
    bits = "".join(format(v, f"0{width}b") for v in values)
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))


def test_rejections_delta_varint():
    d = 1000
    good = encode_delta_varint([1, 5, 300], d)  # 01 04 a7 02
    assert good == bytes([0x01, 0x04, 0xA7, 0x02])
    np.testing.assert_array_equal(decode_indices("dv", good, d, 3, 100), [1, 5, 300])
    _reject("truncated", "dv", good[:3])  # last varint unterminated
    _reject("truncated", "dv", good[:2])  # a whole value missing
    _reject("truncated", "dv", b"")
    _reject("trailing", "dv", good + b"\x07")  # a 4th value
    _reject("trailing", "dv", good + b"\x87")  # an unterminated extra byte
    _reject("trailing", "dv", b"\x01", count=0)
    assert "6 bytes" in _reject(
        "overlong", "dv", bytes([0x81, 0x80, 0x80, 0x80, 0x80, 0x00]), count=1
    )
    assert "not minimally" in _reject("overlong", "dv", bytes([0x01, 0x84, 0x00, 0x01]))
    assert "duplicate index 5" in _reject("duplicate", "dv", bytes([0x01, 0x04, 0x00]))
    assert "index 1001 at position 2" in _reject(
        "out_of_range", "dv", bytes([0x01, 0x04, 0xE4, 0x07])
    )
    big = encode_delta_varint([0, 2**32 - 1], 2**32)
    assert len(big) == 6
    _reject("out_of_range", "dv", big, d=2**32 - 1, count=2)


def test_every_reason_is_exercised():
    # keep REASONS and the tests above in sync
    assert set(REASONS) == {
        "bad_tag",
        "bad_type",
        "too_many",
        "truncated",
        "trailing",
        "overlong",
        "out_of_range",
        "duplicate",
        "unsorted",
    }


def test_empty_list():
    assert encode_indices([], 10) == ("bp", b"")
    assert decode_indices("bp", b"", 10, 0, 100).size == 0
    assert decode_indices("dv", b"", 10, 0, 100).size == 0


@pytest.mark.parametrize(
    ("indices", "reason"),
    [
        ([3, 3], "duplicate"),
        ([4, 2], "unsorted"),
        ([1, 10], "out_of_range"),
        ([-1, 2], "out_of_range"),
    ],
)
def test_encoder_rejects_bad_lists(indices, reason):
    for enc in (encode_bitpack, encode_delta_varint, encode_indices):
        with pytest.raises(IndexCodingError) as exc:
            enc(np.array(indices), 10)
        assert exc.value.reason == reason
    with pytest.raises(IndexCodingError):
        encode_indices(np.array([0.5, 1.5]), 10)
