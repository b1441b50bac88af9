"""rot1: randomised Hadamard rotation + stochastic 1 bit + scale; unbiased, bounded error."""

from __future__ import annotations

import math

import numpy as np
from codec_testing import decodes, rejects

from edge_fl.protocol.codecs import build_codec
from edge_fl.protocol.codecs.rot1 import fwht, padded_dim, rotation_signs


def test_rotation_is_orthonormal_and_reproducible_from_the_seed() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal(64)
    np.testing.assert_allclose(fwht(fwht(a)), a, atol=1e-12)
    assert math.isclose(np.linalg.norm(fwht(a)), np.linalg.norm(a))
    s = rotation_signs(b"\0" * 16, 64)
    np.testing.assert_array_equal(s, rotation_signs(b"\0" * 16, 64))
    assert set(np.unique(s)) == {-1.0, 1.0}
    # SHAKE-128 bit order is normative (docs/protocol.md): pin the first byte
    import hashlib

    first = hashlib.shake_128(b"edge-fl/rot1\x00" + b"\0" * 16).digest(1)[0]
    assert [int(v > 0) for v in s[:8]] == [(first >> i) & 1 for i in range(8)]


def test_deterministic_bound() -> None:
    rng = np.random.default_rng(1)
    codec = build_codec("rot1")
    for dim in (1, 5, 300, 1024):
        x = rng.standard_normal(dim)
        for _ in range(5):
            fields, _ = codec.encode(x, rng)
            out = codec.decode(fields, dim).astype(np.float64)
            m = fields["s"]
            assert m <= np.linalg.norm(x) * (1 + 1e-9)
            assert np.linalg.norm(out - x) <= 2 * m * math.sqrt(padded_dim(dim)) * (1 + 1e-6)


def test_unbiased_within_a_clt_bound_and_mean_squared_error_bound() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal(100)
    codec = build_codec("rot1")
    n = 3000
    dec = decodes(codec, x, n, seed=3).astype(np.float64)
    # Var[x_hat_i] <= M^2 <= ||x||^2 (independent bits, Hadamard entries +-1/sqrt(D)); 6 sigma
    # per coordinate with a Bonferroni factor is far beyond chance for 100 coordinates
    sigma = np.linalg.norm(x) / math.sqrt(n)
    assert np.abs(dec.mean(axis=0) - x).max() <= 6 * sigma
    mse = np.mean(np.sum((dec - x) ** 2, axis=1))
    m = float(np.abs(fwht(np.concatenate([x, np.zeros(28)]))).max())  # M without signs: looser
    assert mse <= 128 * np.linalg.norm(x) ** 2  # D M^2 - ||x||^2 <= D ||x||^2
    assert m > 0


def test_hostile_fields() -> None:
    codec = build_codec("rot1")
    fields, _ = codec.encode(np.ones(5), np.random.default_rng(0))
    exc = rejects(lambda: codec.decode({**fields, "s": -1.0}, 5))
    assert exc.reason == "out_of_range" and exc.field == "s"
    exc = rejects(lambda: codec.decode({**fields, "s": 1}, 5))
    assert exc.reason == "bad_type"
    fields3, _ = codec.encode(np.ones(3), np.random.default_rng(0))  # D = 4: 4 padding bits
    exc = rejects(lambda: codec.decode({**fields3, "x": b"\xf0"}, 3))
    assert exc.reason == "out_of_range" and "padding" in exc.detail
