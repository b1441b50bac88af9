"""f32 and f16: deterministic float32 rounding; stochastic float16 rounding, unbiased."""

from __future__ import annotations

import numpy as np
from codec_testing import decodes, hoeffding_unbiased

from edge_fl.protocol.codecs import build_codec


def test_f32_is_float32_rounding() -> None:
    x = np.random.default_rng(0).standard_normal(500) * 10
    out = build_codec("f32").decode(build_codec("f32").encode(x, None)[0], 500)
    assert np.all(np.abs(out - x) <= 2.0**-24 * np.abs(x))
    assert np.array_equal(out, x.astype(np.float32))


def _ulp_f16(x: np.ndarray) -> np.ndarray:
    lo = np.abs(x).astype(np.float16)
    return (np.nextafter(lo, np.float16(np.inf)) - lo).astype(np.float64) * 2


def test_f16_error_is_below_one_float16_ulp() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(500), rng.standard_normal(50) * 1e-6, [0.0, 1.0]])
    codec = build_codec("f16")
    for _ in range(20):
        out = codec.decode(codec.encode(x, rng)[0], x.size).astype(np.float64)
        err = np.abs(out - x)
        # stated bound: < 2^-10 |x| in the normal range, < 2^-24 for subnormals
        assert np.all(err <= np.maximum(2.0**-10 * np.abs(x), 2.0**-24))
        assert np.all(err <= _ulp_f16(x))


def test_f16_is_unbiased_and_the_test_detects_round_to_nearest() -> None:
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 1, 64)
    lo = x.astype(np.float16).astype(np.float64)
    width = _ulp_f16(x)
    ok, ratio = hoeffding_unbiased(decodes(build_codec("f16"), x, 4000), x, width)
    assert ok, ratio
    nearest = np.tile(lo, (4000, 1))  # the biased rounding a plain astype(float16) does
    assert not hoeffding_unbiased(nearest, x, width)[0]


def test_f16_beyond_its_range_rounds_to_nearest() -> None:
    out = build_codec("f16").encode(np.array([1e6, -1e6, 1.0]), np.random.default_rng(0))[0]
    vals = np.frombuffer(out["x"], "<f2")
    assert np.isinf(vals[:2]).all() and vals[2] == 1.0
