"""q8 / q4: per-block stochastic quantisation, |error| < block step, unbiased."""

from __future__ import annotations

import numpy as np
import pytest
from codec_testing import decodes, hoeffding_unbiased, rejects

from edge_fl.protocol.codecs import build_codec
from edge_fl.protocol.codecs.quantised import BLOCK, block_params


@pytest.mark.parametrize("name,levels", [("q8", 256), ("q4", 16)])
def test_error_is_below_the_block_step(name: str, levels: int) -> None:
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(700), rng.standard_normal(301) * 1e-3])
    codec = build_codec(name)
    for _ in range(10):
        fields, _ = codec.encode(x, rng)
        out = codec.decode(fields, x.size).astype(np.float64)
        step = codec.error_bound(fields, x.size)
        assert np.all(np.abs(out - x) <= step * (1 + 1e-6) + 2.0**-24 * np.abs(x))
        # the step is the block's range / (levels - 1), up to float32 rounding
        for b in range(-(-x.size // BLOCK)):
            blk = x[b * BLOCK : (b + 1) * BLOCK]
            assert step[b * BLOCK] <= (blk.max() - blk.min()) / (levels - 1) * (1 + 1e-6)


def test_block_grid_covers_the_block_exactly() -> None:
    x = np.array([0.1, 0.2, 0.30000001, -7.3e-5] * 100)
    for levels in (16, 256):
        lo, step = block_params(x, levels)
        for b in range(lo.size):
            blk = x[b * BLOCK : (b + 1) * BLOCK]
            assert float(lo[b]) <= blk.min()
            assert float(lo[b]) + (levels - 1) * float(step[b]) >= blk.max()


@pytest.mark.parametrize("name", ["q8", "q4"])
def test_unbiased_and_the_test_detects_nearest_rounding(name: str) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal(300)
    codec = build_codec(name)
    fields, _ = codec.encode(x, rng)
    width = codec.error_bound(fields, x.size)  # each decode lies in [floor, floor + step]
    ok, ratio = hoeffding_unbiased(decodes(codec, x, 3000), x, width)
    assert ok, ratio
    # nearest rounding to the same grid: biased, and the same test must notice it
    levels = 255 if name == "q8" else 15
    lo, step = block_params(x, levels + 1)
    rep_lo = np.repeat(lo.astype(float), BLOCK)[:300]
    rep_step = np.repeat(step.astype(float), BLOCK)[:300]
    nearest = rep_lo + np.round((x - rep_lo) / rep_step) * rep_step
    assert not hoeffding_unbiased(np.tile(nearest, (3000, 1)), x, width)[0]


def test_q4_packs_two_levels_per_byte_and_checks_the_padding_nibble() -> None:
    codec = build_codec("q4")
    fields, _ = codec.encode(np.array([0.0, 1, 2, 3, 15]), np.random.default_rng(0))
    assert fields["x"] == bytes([0x10, 0x32, 0x0F])  # levels 0, 1, 2, 3, 15, last high nibble 0
    bad = {**fields, "x": bytes([0x10, 0x32, 0x1F])}
    exc = rejects(lambda: codec.decode(bad, 5))
    assert exc.reason == "out_of_range" and "padding" in exc.detail


def test_hostile_block_parameters_are_rejected() -> None:
    codec = build_codec("q8")
    fields, _ = codec.encode(np.ones(10), np.random.default_rng(0))
    for lo, step in ((np.nan, 1.0), (0.0, -1.0), (0.0, np.inf)):
        qp = np.array([lo, step], "<f4").tobytes()
        exc = rejects(lambda qp=qp: codec.decode({**fields, "qp": qp}, 10))
        assert exc.reason == "out_of_range" and exc.field == "qp"
    qp = np.array([3e38, 3e38], "<f4").tobytes()  # lo + 255 step overflows float32
    exc = rejects(lambda: codec.decode({**fields, "x": b"\xff" * 10, "qp": qp}, 10))
    assert exc.reason == "non_finite"


def test_sizes_against_f32() -> None:
    d = 100_000
    f32 = build_codec("f32").payload_bytes(d)
    assert 3.8 < f32 / build_codec("q8").payload_bytes(d) < 4.0
    assert 7.4 < f32 / build_codec("q4").payload_bytes(d) < 8.0
