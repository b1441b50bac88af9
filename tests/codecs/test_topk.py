"""topk with error feedback: sends the largest |y|, loses nothing over rounds (EF telescopes)."""

from __future__ import annotations

import numpy as np
import pytest
from codec_testing import rejects

from edge_fl.protocol.codecs import CodecState, build_codec
from edge_fl.protocol.codecs.topk import CODE_BITMAP, CODE_BITPACK, index_coding


def test_sends_the_largest_coordinates_exactly() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1000)
    codec = build_codec("topk", fraction=0.05, error_feedback=False)
    fields, state = codec.encode(x, rng)
    assert state is None and fields["h"] == 50
    out = codec.decode(fields, 1000).astype(np.float64)
    sent = out != 0
    assert sent.sum() == 50
    np.testing.assert_array_equal(out[sent], x[sent].astype(np.float32))
    assert np.abs(x[~sent]).max() <= np.abs(x[sent]).min()
    # stated bound: ||y_hat - y||^2 <= (1 - h/d) ||y||^2
    assert np.sum((out - x) ** 2) <= (1 - 50 / 1000) * np.sum(x**2)


def test_error_feedback_telescopes() -> None:
    rng = np.random.default_rng(6)
    codec = build_codec("topk", fraction=0.02)
    state: CodecState | None = None
    total_in, total_out = np.zeros(500), np.zeros(500)
    for _ in range(30):
        x = rng.standard_normal(500)
        fields, state = codec.encode(x, rng, state)
        total_in += x
        total_out += codec.decode(fields, 500)
    assert state is not None and state.residual is not None
    np.testing.assert_allclose(total_out + state.residual, total_in, atol=1e-9)
    # and the residual is what was not sent: far smaller than what was summed
    assert np.linalg.norm(state.residual) < np.linalg.norm(total_in) * 3


def test_error_feedback_state_is_not_mutated() -> None:
    codec = build_codec("topk", fraction=0.1)
    rng = np.random.default_rng(0)
    _, state = codec.encode(np.arange(10.0), rng)
    before = state.residual.copy()
    codec.encode(np.arange(10.0), rng, state)
    np.testing.assert_array_equal(state.residual, before)
    with pytest.raises(ValueError, match="residual"):
        codec.encode(np.arange(11.0), rng, state)


def test_index_coding_is_the_shorter_and_both_decode() -> None:
    assert index_coding(100_000, 1000)[0] == CODE_BITPACK  # 17 bits x 1000 < 100000 bits
    assert index_coding(1000, 200)[0] == CODE_BITMAP  # 10 bits x 200 > 1000 bits
    rng = np.random.default_rng(7)
    for dim, frac in ((100_000, 0.01), (1000, 0.2)):
        x = rng.standard_normal(dim)
        codec = build_codec("topk", fraction=frac, error_feedback=False)
        out = codec.decode(codec.encode(x, rng)[0], dim)
        assert np.count_nonzero(out) == codec.encode(x, rng)[0]["h"]


def test_hostile_indices_are_rejected() -> None:
    codec = build_codec("topk", fraction=0.2, error_feedback=False)
    x = np.random.default_rng(8).standard_normal(1000)
    fields, _ = codec.encode(x, None)
    assert fields["c"] == CODE_BITMAP
    extra = bytearray(fields["ix"])
    byte = next(i for i, b in enumerate(extra) if b != 0xFF)
    extra[byte] |= 1 << next(j for j in range(8) if not extra[byte] >> j & 1)
    exc = rejects(lambda: codec.decode({**fields, "ix": bytes(extra)}, 1000))
    assert exc.reason == "bad_indices" and "sets" in exc.detail
    exc = rejects(lambda: codec.decode({**fields, "c": 1}, 1000))
    assert exc.reason == "out_of_range" and exc.field == "c"
    exc = rejects(lambda: codec.decode({**fields, "h": 1001}, 1000))
    assert exc.reason == "out_of_range" and exc.field == "h"
    small = build_codec("topk", fraction=0.01, error_feedback=False)
    f2, _ = small.encode(np.random.default_rng(9).standard_normal(100_000), None)
    assert f2["c"] == CODE_BITPACK
    dup = f2["ix"][:3] * (len(f2["ix"]) // 3) + f2["ix"][: len(f2["ix"]) % 3]
    exc = rejects(lambda: small.decode({**f2, "ix": dup}, 100_000))
    assert exc.reason == "bad_indices"


@pytest.mark.parametrize("fraction", [0, -0.1, 0.6, True, "0.1"])
def test_fraction_domain(fraction: object) -> None:
    with pytest.raises(ValueError, match="fraction"):
        build_codec("topk", fraction=fraction)
