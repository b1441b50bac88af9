"""The distributed discrete Gaussian over SecAgg+ (edge_fl/secagg/ddg.py, docs/specs/secagg.md
section 12): the exact sampler's distribution, rotation and conditional rounding, the accounting
against dp-accounting and a direct computation, calibration for the minimum surviving count, and
a whole secure round whose decoded sum carries the calibrated noise."""

from __future__ import annotations

import hashlib
import math
import os
from fractions import Fraction

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp
from scipy import stats

from edge_fl.secagg import RoundParams, Summed, ddg
from edge_fl.secagg.driver import run_round


def drbg(label: str):
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    enc = Cipher(
        algorithms.ChaCha20(hashlib.sha256(label.encode()).digest(), bytes(16)), None
    ).encryptor()
    return lambda n: enc.update(bytes(n))


def test_bernoulli_exp_has_the_right_mean() -> None:
    ex = ddg.Exact(drbg("bexp"))
    for gamma in (Fraction(1, 3), Fraction(5, 2)):
        hits = sum(ex.bernoulli_exp(gamma) for _ in range(20_000))
        p = math.exp(-float(gamma))
        assert abs(hits / 20_000 - p) < 5 * math.sqrt(p * (1 - p) / 20_000)


def test_the_vectorised_bernoulli_exp_has_the_right_mean() -> None:
    vec = ddg._VectorExact(np.random.default_rng(11))
    for a, b in ((1, 3), (5, 2), (7, 1), (0, 9)):
        hits = vec.bernoulli_exp(np.full(40_000, a, np.int64), np.full(40_000, b, np.int64))
        p = math.exp(-a / b)
        assert abs(hits.mean() - p) < 5 * math.sqrt(p * (1 - p) / 40_000) + 1e-12


def test_the_scalar_and_vectorised_samplers_agree() -> None:
    """Two-sample chi-square: the rational-arithmetic draws and the int64 array draws of the
    same discrete Gaussian (sigma^2 = 4) have one distribution."""
    scalar = ddg.Exact(drbg("scalar"))
    a = np.array([scalar.discrete_gaussian(Fraction(4)) for _ in range(8000)])
    b = ddg.Exact(drbg("vector")).discrete_gaussians(Fraction(4), 8000)
    support = np.arange(-6, 7)
    table = np.array([[np.sum(np.clip(s, -6, 6) == v) for v in support] for s in (a, b)])
    assert stats.chi2_contingency(table).pvalue > 1e-4


@pytest.mark.parametrize(
    "sigma2", [Fraction(1, 2), Fraction(1), Fraction(4), Fraction(45, 2), Fraction(23)]
)
def test_the_exact_sampler_matches_the_discrete_gaussian(sigma2: Fraction) -> None:
    """Chi-square of 12,000 draws against P[x] = exp(-x^2 / 2 sigma^2) / Z (tails pooled);
    integer variances take the vectorised path, the others the scalar one."""
    xs = ddg.Exact(drbg(f"dg{sigma2}")).discrete_gaussians(sigma2, 12_000)
    s2 = float(sigma2)
    support = np.arange(-60, 61)
    pmf = np.exp(-(support**2) / (2 * s2))
    pmf /= pmf.sum()
    keep = pmf * xs.size >= 5
    lo, hi = support[keep][0], support[keep][-1]
    observed = (
        [np.sum(xs <= lo)] + [np.sum(xs == v) for v in range(lo + 1, hi)] + [np.sum(xs >= hi)]
    )
    expected = [pmf[support <= lo].sum()] + [pmf[support == v][0] for v in range(lo + 1, hi)]
    expected = np.array([*expected, pmf[support >= hi].sum()]) * xs.size
    assert stats.chisquare(observed, expected).pvalue > 1e-4


def test_rotation_is_orthogonal_and_inverted() -> None:
    x = np.random.default_rng(0).normal(size=1000)
    y = ddg.rotate(x, b"\x07" * 32)
    assert y.size == 1024
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x))
    assert np.allclose(ddg.unrotate(y, b"\x07" * 32, 1000), x)
    assert np.abs(y).max() < 0.3 * np.abs(x).max() + 5 * np.linalg.norm(x) / math.sqrt(1024)


def test_conditional_rounding_keeps_the_bound_and_is_unbiased() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=256) * 3
    bound = ddg.rounded_bound(float(np.linalg.norm(x)), 256, math.exp(-0.5))
    rounds = np.array([ddg.conditional_round(x, bound, rng) for _ in range(2000)])
    assert (np.linalg.norm(rounds, axis=1) <= bound).all()
    assert np.abs(rounds.mean(axis=0) - x).max() < 0.1


def test_without_tau_the_accounting_is_the_gaussian_mechanisms() -> None:
    """Large noise: tau vanishes and every curve is the Gaussian mechanism's RDP with noise
    multiplier sqrt(n) sigma / l2; dp-accounting's GaussianDpEvent must give the same epsilon."""
    p = ddg.DdgParams(1.0, 1e-3, Fraction(10**6), math.exp(-0.5), 4810, 80)
    assert ddg.tau(float(p.sigma2), p.n_min) == 0.0
    eps = ddg.epsilon(p, 200, 1e-5)
    acc = rdp.RdpAccountant()
    z = math.sqrt(p.n_min * float(p.sigma2)) / p.l2
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z), 200))
    assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_the_epsilon_equals_a_direct_computation() -> None:
    """Small noise (tau > 0): the three curves by hand, composed, converted to (eps, delta) with
    the RDP conversion eps = min_a rdp(a) + log(1 - 1/a) - log(delta a) / (a - 1)."""
    p = ddg.DdgParams(1.0, 0.05, Fraction(1, 4), math.exp(-0.5), 64, 20)
    t = 10 * sum(math.exp(-2 * math.pi**2 * 0.25 * k / (k + 1)) for k in range(1, 20))
    assert t > 1e-3
    sigma = math.sqrt(20 * 0.25)
    l2 = min(20 + 8, math.sqrt(400 + 16 + math.sqrt(2 * 0.5) * (20 + 4))) / sigma
    l1 = l2 * min(8, l2 * sigma)
    rounds, delta = 3, 1e-5
    orders = np.linspace(1.5, 200, 4000)
    curves = [
        (t * 64, l2**2 / 2),
        (0, (l2**2 + 2 * l1 * t + t**2 * 64) / 2),
        (0, (l2 + 8 * t) ** 2 / 2),
    ]
    direct = min(
        float(
            np.min(
                rounds * (xi + rho * orders)
                + np.log1p(-1 / orders)
                - np.log(delta * orders) / (orders - 1)
            )
        )
        for xi, rho in curves
    )
    assert ddg.epsilon(p, rounds, delta, orders=list(orders)) == pytest.approx(direct, rel=1e-6)


def test_calibration_for_the_minimum_survivors_is_honest() -> None:
    p = ddg.calibrate(4.0, 1e-5, 50, 1.0, 1e-3, 4810, n_min=70)
    assert ddg.epsilon(p, 50, 1e-5) <= 4.0
    assert ddg.epsilon(p, 50, 1e-5) > 3.98  # tight
    fewer = ddg.DdgParams(p.clip, p.gamma, p.sigma2, p.beta, p.dim, 60)
    assert ddg.epsilon(fewer, 50, 1e-5) > 4.0  # more dropouts than planned: the claim breaks
    with pytest.raises(ValueError):
        ddg.calibrate(0, 1e-5, 50, 1.0, 1e-3, 4810, 70)


def test_a_secure_round_sums_the_clipped_updates_plus_the_calibrated_noise() -> None:
    n, d = 8, 300
    p = ddg.DdgParams(1.0, 2e-3, Fraction(400), math.exp(-0.5), d, n)
    seed = b"\x09" * 32
    rng = np.random.default_rng(4)
    deltas = {f"d{i}": rng.normal(size=d) * 0.2 for i in range(n)}  # norms ~3.5: clipped to 1
    ints = {dev: ddg.device_encode(x, p, seed, os.urandom) for dev, x in deltas.items()}
    bits = ddg.ring_bits(p, n)
    reach = max(int(np.abs(v).max()) for v in ints.values()) * n
    assert reach < 2 ** (bits - 1) and bits <= 24  # no wrap, and a 3-byte masked value
    rp = RoundParams("job1", 1, os.urandom(16), tuple(sorted(ints)), n - 1, 3, bits, p.padded, 1000)
    trace = run_round(rp, ints, {}, modular=True)
    assert isinstance(trace.outcome, Summed)
    assert np.array_equal(trace.outcome.total, sum(ints.values()))
    clipped = sum(x / np.linalg.norm(x) for x in deltas.values())
    err = ddg.server_decode(trace.outcome.total, p, seed) - clipped
    # noise n * sigma2 * gamma^2 per coordinate, plus the rounding's variance (<= 1/4 gamma^2 each)
    noise_sd = math.sqrt(n * float(p.sigma2)) * p.gamma
    assert abs(err.std() / noise_sd - 1) < 0.15
    assert abs(err.mean()) < 4 * noise_sd / math.sqrt(d)


def test_a_large_variance_keeps_its_variance() -> None:
    xs = ddg.Exact(drbg("large")).discrete_gaussians(Fraction(10**6), 60_000)
    assert abs(xs.var() / 10**6 - 1) < 5 * math.sqrt(2 / 60_000)
    assert abs(xs.mean()) < 5 * 1000 / math.sqrt(60_000)
