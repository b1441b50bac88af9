"""Noise samplers, clipping and mechanisms A-D + randomized response."""

from __future__ import annotations

import math
import warnings

import dp_accounting as dpa
import numpy as np
import pytest
from scipy import stats

from edge_fl.privacy.accountants import compose_epsilon
from edge_fl.privacy.clipping import clip_l2, clip_rows_l1, clip_rows_l2
from edge_fl.privacy.dpsgd import DpSgdConfig, calibrate_dpsgd_noise_multiplier
from edge_fl.privacy.events import NeighboringRelation
from edge_fl.privacy.gaussian import (
    CentralGaussianConfig,
    LocalGaussianConfig,
    calibrate_central_noise_multiplier,
    calibrate_local_noise_multiplier,
    central_dp_event,
)
from edge_fl.privacy.laplace import LaplaceConfig
from edge_fl.privacy.nbafl import NbAflCalibrationWarning, NbAflConfig, nbafl_constant
from edge_fl.privacy.noise import gaussian_noise, laplace_noise, poisson_mask
from edge_fl.privacy.randomized_response import (
    clip_count,
    debias_count,
    randomized_response,
    rr_dp_event,
    truth_probability,
)
from edge_fl.privacy.rng import secure_generator, seeded_generator

N_KS = 200_000

# ----------------------------------------------------------------------------------------------
# noise.py


@pytest.mark.parametrize("scale", [0.3, 1.0, 7.5])
def test_laplace_sampler_matches_laplace_distribution(scale):
    x = laplace_noise(seeded_generator(11), scale, N_KS)
    assert x.dtype == np.float64 and x.shape == (N_KS,)
    assert stats.kstest(x, stats.laplace(scale=scale).cdf).pvalue > 1e-3
    # The same test has power against a 5% scale error at this n (so the pass above means something).
    assert stats.kstest(x, stats.laplace(scale=scale * 1.05).cdf).pvalue < 1e-6


@pytest.mark.parametrize("std", [0.5, 2.0])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_gaussian_sampler_matches_normal(std, n):
    x = gaussian_noise(seeded_generator(12, n), std, N_KS, n=n)
    assert stats.kstest(x, stats.norm(scale=std).cdf).pvalue > 1e-3
    assert stats.kstest(x, stats.norm(scale=std * 1.05).cdf).pvalue < 1e-6


def test_gaussian_sampler_is_sum_of_2n_draws_over_sqrt_2n():
    got = gaussian_noise(seeded_generator(5), 3.0, (4, 3), n=2)
    rng = seeded_generator(5)
    draws = [rng.standard_normal((4, 3)) for _ in range(4)]
    np.testing.assert_allclose(got, 3.0 * sum(draws) / 2.0, rtol=1e-14)


def test_secure_generator_path_runs():
    rng = secure_generator()
    n = 1_000_000
    lap = laplace_noise(rng, 2.0, n)
    gau = gaussian_noise(rng, 2.0, (1000, 1000))
    assert lap.shape == (n,) and gau.shape == (1000, 1000)
    assert np.all(np.isfinite(lap)) and np.all(np.isfinite(gau))
    # E|Lap(b)| = b with sd b/sqrt(n); std of N(0, s^2) has sd ~ s/sqrt(2n): 6 SE tolerances.
    assert abs(np.abs(lap).mean() - 2.0) < 6 * 2.0 / math.sqrt(n)
    assert abs(gau.std() - 2.0) < 6 * 2.0 / math.sqrt(2 * n)
    assert stats.kstest(lap[:N_KS], stats.laplace(scale=2.0).cdf).pvalue > 1e-6


def test_noise_zero_scale_and_shapes():
    rng = seeded_generator(1)
    assert np.array_equal(laplace_noise(rng, 0.0, 3), np.zeros(3))
    assert np.array_equal(gaussian_noise(rng, 0, (2, 2)), np.zeros((2, 2)))
    assert laplace_noise(rng, 1.0, (0,)).shape == (0,)


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, "x", None])
def test_noise_rejects_bad_scale(bad):
    rng = seeded_generator(1)
    with pytest.raises(ValueError, match="scale") as e:
        laplace_noise(rng, bad, 3)
    assert repr(bad) in str(e.value)
    with pytest.raises(ValueError, match="std"):
        gaussian_noise(rng, bad, 3)


def test_noise_rejects_bad_n_and_rng():
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        gaussian_noise(seeded_generator(1), 1.0, 3, n=0)
    with pytest.raises(TypeError, match="Generator"):
        laplace_noise(np.random.RandomState(0), 1.0, 3)  # type: ignore[arg-type]


def test_poisson_mask_rate_and_domain():
    n, q = 400_000, 0.01
    m = poisson_mask(seeded_generator(2), n, q)
    assert m.dtype == bool and m.shape == (n,)
    assert abs(m.mean() - q) < 6 * math.sqrt(q * (1 - q) / n)
    assert not poisson_mask(seeded_generator(2), 10, 0.0).any()
    assert poisson_mask(seeded_generator(2), 10, 1.0).all()
    with pytest.raises(ValueError, match=r"q must be a probability in \[0, 1\], got 1.5"):
        poisson_mask(seeded_generator(2), 10, 1.5)


# ----------------------------------------------------------------------------------------------
# clipping.py


def test_row_clipping_norms_and_fraction():
    g = np.array([[3.0, 4.0], [0.3, 0.4], [-6.0, 8.0], [0.0, 0.0]])
    l2 = clip_rows_l2(g, 1.0)
    np.testing.assert_allclose(np.linalg.norm(l2.values, axis=1), [1.0, 0.5, 1.0, 0.0])
    np.testing.assert_array_equal(l2.values[1], g[1])  # inside the ball: unchanged
    assert l2.fraction_clipped == 0.5
    l1 = clip_rows_l1(g, 1.0)
    np.testing.assert_allclose(np.abs(l1.values).sum(axis=1), [1.0, 0.7, 1.0, 0.0])
    np.testing.assert_allclose(l1.values[0], [3 / 7, 4 / 7])
    assert l1.fraction_clipped == 0.5


def test_vector_clipping_and_empty_batch():
    v, frac = clip_l2(np.array([30.0, 40.0], dtype=np.float32), 5.0)
    np.testing.assert_allclose(v, [3.0, 4.0])
    assert v.dtype == np.float64 and frac == 1.0
    assert clip_l2(np.array([1.0, 1.0]), 5.0).fraction_clipped == 0.0
    empty = clip_rows_l2(np.zeros((0, 3)), 1.0)
    assert empty.values.shape == (0, 3) and empty.fraction_clipped == 0.0


def test_clipping_rejects_bad_input():
    with pytest.raises(ValueError, match=r"clip must be a finite number > 0, got 0"):
        clip_rows_l2(np.ones((2, 2)), 0)
    with pytest.raises(ValueError, match="NaN"):
        clip_rows_l1(np.array([[1.0, np.nan]]), 1.0)
    with pytest.raises(ValueError, match="2-d"):
        clip_rows_l2(np.ones(3), 1.0)


# ----------------------------------------------------------------------------------------------
# A: Laplace output perturbation


def test_laplace_sensitivity_holds_for_replace_one_neighbours():
    cfg = LaplaceConfig(clip_l1=0.5, learning_rate=0.3, epsilon=1.0, rounds=1)
    rng = seeded_generator(3)
    n, d = 20, 6
    w = rng.normal(size=d)
    worst = 0.0
    for _ in range(300):
        g = rng.normal(scale=rng.uniform(0.01, 3.0), size=(n, d))
        g2 = g.copy()
        g2[rng.integers(n)] = rng.normal(scale=5.0, size=d)
        a, _ = cfg.local_step(w, g)
        b, _ = cfg.local_step(w, g2)
        worst = max(worst, float(np.abs(a - b).sum()))
    assert worst <= cfg.sensitivity(n) * (1 + 1e-12)
    assert cfg.sensitivity(n) == pytest.approx(2 * 0.3 * 0.5 / 20)


def test_laplace_budget_schedules_sum_to_epsilon():
    uni = LaplaceConfig(1.0, 0.1, epsilon=2.0, rounds=7)
    assert math.fsum(uni.epsilon_schedule()) == pytest.approx(2.0, abs=1e-12)
    assert uni.epsilon_round(3) == pytest.approx(2.0 / 7)
    geo = LaplaceConfig(1.0, 0.1, epsilon=2.0, rounds=10, schedule="geometric", decay=0.8)
    sched = geo.epsilon_schedule()
    assert math.fsum(sched) == pytest.approx(2.0, abs=1e-12)
    assert np.all(np.diff(sched) < 0)
    assert [geo.epsilon_round(k) for k in range(10)] == pytest.approx(list(sched))
    with pytest.raises(ValueError, match=r"round_index must be in \[0, 10\)"):
        geo.epsilon_round(10)


def test_laplace_release_noise_scale_and_event():
    cfg = LaplaceConfig(clip_l1=1.0, learning_rate=0.5, epsilon=3.0, rounds=3)
    d, n = 200_000, 50
    rng = seeded_generator(4)
    w = np.zeros(d)
    g = rng.normal(size=(n, d)).astype(np.float32) * 1e-3
    rel = cfg.release(w, g, 0, seeded_generator(5))
    stepped, _ = cfg.local_step(w, g)
    noise = rel.params - stepped
    assert rel.epsilon_round == pytest.approx(1.0)
    assert rel.scale == pytest.approx(rel.sensitivity / 1.0) == pytest.approx(2 * 0.5 / 50)
    assert abs(np.abs(noise).mean() - rel.scale) < 6 * rel.scale / math.sqrt(d)
    assert cfg.dp_event(0) == dpa.LaplaceDpEvent(1.0)
    pe = cfg.privacy_event(1)
    assert pe.relation == NeighboringRelation.REPLACE_ONE and pe.unit == "example"
    assert pe.pure_epsilon == pytest.approx(1.0)


def test_laplace_config_validation_names_parameter():
    with pytest.raises(ValueError, match=r"clip_l1 must be a finite number > 0, got -1"):
        LaplaceConfig(clip_l1=-1, learning_rate=0.1, epsilon=1.0, rounds=1)
    with pytest.raises(ValueError, match=r"rounds must be an integer >= 1, got 0"):
        LaplaceConfig(1.0, 0.1, 1.0, 0)
    with pytest.raises(ValueError, match="schedule"):
        LaplaceConfig(1.0, 0.1, 1.0, 2, schedule="cosine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"decay must be in \(0, 1\), got 1.0"):
        LaplaceConfig(1.0, 0.1, 1.0, 2, schedule="geometric", decay=1.0)


# ----------------------------------------------------------------------------------------------
# B: Gaussian DP-FedAvg


def test_local_gaussian_clips_update_and_adds_noise():
    cfg = LocalGaussianConfig(clip_norm=2.0, noise_multiplier=0.5)
    d = 100_000
    upd = np.full(d, 1.0)  # norm sqrt(d) >> 2
    rel = cfg.privatize_update(upd, seeded_generator(6))
    clipped = cfg.clip(upd).values
    assert np.linalg.norm(clipped) == pytest.approx(2.0)
    assert rel.fraction_clipped == 1.0 and rel.std == 1.0
    assert abs((rel.update - clipped).std() - 1.0) < 6 / math.sqrt(2 * d)


def test_local_gaussian_events_and_calibration():
    cfg = LocalGaussianConfig(clip_norm=1.0, noise_multiplier=3.0)
    assert cfg.dp_event() == dpa.GaussianDpEvent(1.5)  # replace-one: sensitivity 2S
    assert cfg.dp_event("replace_special") == dpa.GaussianDpEvent(3.0)
    z = calibrate_local_noise_multiplier(1.0, 1e-5)
    assert dpa.get_epsilon_gaussian(z / 2, 1e-5) == pytest.approx(1.0, abs=1e-6)
    assert dpa.get_epsilon_gaussian(z / 2, 1e-5) <= 1.0
    z10 = calibrate_local_noise_multiplier(2.0, 1e-5, rounds=10)
    ev = LocalGaussianConfig(1.0, z10).privacy_event()
    assert compose_epsilon([ev] * 10, 1e-5, "pld").epsilon == pytest.approx(2.0, abs=1e-4)


def test_central_gaussian_fixed_denominator_and_event():
    cfg = CentralGaussianConfig(
        clip_norm=1.0, noise_multiplier=1.2, expected_participants=10, population=1000
    )
    assert cfg.sampling_rate == 0.01
    d = 200_000
    s = np.full(d, 3.0)  # e.g. 3 clipped updates arrived; still divided by 10, not 3
    out = cfg.noisy_mean(s, seeded_generator(7))
    assert abs(out.mean() - 0.3) < 6 * (1.2 / 10) / math.sqrt(d)
    assert abs(out.std() - 0.12) < 6 * 0.12 / math.sqrt(2 * d)
    assert cfg.dp_event() == dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.2))
    assert cfg.dp_event(5) == dpa.SelfComposedDpEvent(cfg.dp_event(), 5)
    no_amp = CentralGaussianConfig(1.0, 1.2, 10, 1000, poisson_selection=False)
    assert no_amp.dp_event() == dpa.GaussianDpEvent(1.2)
    pe = cfg.privacy_event()
    assert pe.relation == NeighboringRelation.ADD_OR_REMOVE_ONE and pe.unit == "device"
    assert pe.poisson_sampled
    with pytest.raises(ValueError, match=r"expected_participants must be in \(0, population=5\]"):
        CentralGaussianConfig(1.0, 1.0, 6, 5)


def test_central_calibration_is_tight_and_safe():
    z = calibrate_central_noise_multiplier(2.0, 1e-5, 0.01, 500)
    eps = compose_epsilon([CentralGaussianConfig(1.0, z, 10, 1000).privacy_event(500)], 1e-5)
    assert eps.epsilon <= 2.0 and eps.epsilon == pytest.approx(2.0, abs=1e-4)
    assert (
        compose_epsilon(
            [CentralGaussianConfig(1.0, z * 0.99, 10, 1000).privacy_event(500)], 1e-5
        ).epsilon
        > 2.0
    )
    assert central_dp_event(z, 1.0, 1) == dpa.GaussianDpEvent(z)


# ----------------------------------------------------------------------------------------------
# C: DP-SGD


def test_dpsgd_noisy_gradient_divides_by_expected_batch_size():
    cfg = DpSgdConfig(clip_norm=1.0, noise_multiplier=1.0, sampling_rate=0.1, learning_rate=1.0)
    g = np.array([[3.0, 4.0], [0.1, 0.0]])
    got, frac = cfg.noisy_gradient(g, dataset_size=50, rng=seeded_generator(8))
    expected = (np.array([0.6, 0.8]) + np.array([0.1, 0.0])) + gaussian_noise(
        seeded_generator(8), 1.0, 2
    )
    np.testing.assert_allclose(got, expected / 5.0)  # q |D| = 5, not the realised 2
    assert frac == 0.5


def test_dpsgd_step_samples_poisson_and_noises_empty_batches():
    cfg = DpSgdConfig(clip_norm=1.0, noise_multiplier=2.0, sampling_rate=0.05, learning_rate=0.5)
    seen: list[np.ndarray] = []

    def grads(idx: np.ndarray) -> np.ndarray:
        seen.append(idx)
        return np.ones((idx.size, 3))

    sizes = [
        cfg.step(np.zeros(3), grads, 1000, seeded_generator(9, i)).batch_size for i in range(200)
    ]
    assert abs(np.mean(sizes) - 50) < 6 * math.sqrt(1000 * 0.05 * 0.95 / 200)
    assert all(np.all(np.diff(i) > 0) for i in seen)
    tiny = DpSgdConfig(clip_norm=1.0, noise_multiplier=2.0, sampling_rate=1e-9)
    st = tiny.step(np.zeros(3), grads, 10, seeded_generator(10))
    assert st.batch_size == 0 and np.all(st.params != 0)  # noise is added anyway


def test_dpsgd_event_and_calibration():
    cfg = DpSgdConfig(1.0, 1.0, 256 / 60000)
    ev = cfg.dp_event(234)
    assert ev == dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(256 / 60000, dpa.GaussianDpEvent(1.0)), 234
    )
    sigma = calibrate_dpsgd_noise_multiplier(3.078673, 1e-5, 256 / 60000, 14062)
    assert sigma == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError, match=r"sampling_rate must be a probability in \(0, 1\], got 0"):
        DpSgdConfig(1.0, 1.0, 0)


# ----------------------------------------------------------------------------------------------
# D: NbAFL


def test_nbafl_worked_example():
    cfg = NbAflConfig(
        clip_norm=1.0,
        epsilon=0.5,
        delta=1e-5,
        rounds=100,
        exposures=100,
        num_clients=50,
        min_dataset_size=600,
    )
    assert cfg.c == pytest.approx(4.844805, abs=1e-6)
    assert cfg.sigma_uplink == pytest.approx(3.229870, abs=1e-6)
    assert cfg.sigma_downlink == 0.0  # T <= L sqrt(N)
    assert cfg.dp_event() == dpa.GaussianDpEvent(cfg.c * 100 / 0.5)
    up, frac = cfg.privatize_upload(np.full(4, 10.0), seeded_generator(11))
    assert frac == 1.0 and up.shape == (4,)
    np.testing.assert_array_equal(
        cfg.perturb_broadcast(np.ones(3), seeded_generator(1)), np.ones(3)
    )


def test_nbafl_downlink_and_warning():
    cfg = NbAflConfig(
        1.0, 0.5, 1e-5, rounds=100, exposures=10, num_clients=50, min_dataset_size=600
    )
    c = nbafl_constant(1e-5)
    assert cfg.sigma_uplink == pytest.approx(2 * c * 10 / (600 * 0.5))
    assert cfg.sigma_downlink == pytest.approx(
        2 * c * math.sqrt(100**2 - 10**2 * 50) / (600 * 50 * 0.5)
    )
    with pytest.warns(NbAflCalibrationWarning, match="eps < 1"):
        NbAflConfig(1.0, 1.0, 1e-5, 10, 10, 5, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NbAflConfig(1.0, 0.99, 1e-5, 10, 10, 5, 100)
    with pytest.raises(ValueError, match=r"exposures must be in \[1, rounds=10\], got 11"):
        NbAflConfig(1.0, 0.5, 1e-5, 10, 11, 5, 100)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\), got 0"):
        NbAflConfig(1.0, 0.5, 0, 10, 10, 5, 100)


# ----------------------------------------------------------------------------------------------
# randomized response


@pytest.mark.parametrize(
    ("eps", "n", "n_ones", "est", "std"),
    [
        (math.log(3), 1000, 400, 300.0, 27.3861),
        (1.0, 10000, 4000, 2836.046586, 95.9517),
        (0.5, 500, 260, 290.829882, 44.2589),
        (2.0, 200, 40, 21.217883, 6.0169),
    ],
)
def test_rr_debiasing_reference_values(eps, n, n_ones, est, std):
    got = debias_count(n_ones, n, eps)
    assert got.estimate == pytest.approx(est, abs=1e-6)
    assert got.std == pytest.approx(std, abs=1e-4)


def test_rr_flip_rate_unbiased_estimate_and_event():
    eps, n = 1.0, 400_000
    p = truth_probability(eps)
    assert p == pytest.approx(math.e / (1 + math.e))
    rng = seeded_generator(12)
    bits = (rng.random(n) < 0.3).astype(np.int8)
    rep = randomized_response(bits, eps, rng)
    assert abs((rep == bits).mean() - p) < 6 * math.sqrt(p * (1 - p) / n)
    got = debias_count(int(rep.sum()), n, eps)
    assert abs(got.estimate - bits.sum()) < 6 * got.std
    assert rr_dp_event(eps) == dpa.RandomizedResponseDpEvent(2 / (1 + math.e), 2)
    assert randomized_response(1, 50.0, rng) in (0, 1)
    with pytest.raises(ValueError, match="bit must be 0 or 1"):
        randomized_response(np.array([0, 2]), eps, rng)
    with pytest.raises(ValueError, match=r"eps must be a finite number > 0, got 0"):
        randomized_response(0, 0, rng)


def test_rr_clip_count_reports_clipping():
    assert clip_count(-3.5, 10) == (0.0, True)
    assert clip_count(12.0, 10) == (10.0, True)
    assert clip_count(4.0, 10) == (4.0, False)


def test_every_guarantee_names_what_it_assumes_public():
    """Every update and status carries n = |D| in the clear, so a guarantee that does not cover
    the sample count must say so (issue 23 F5: gaussian and signds said nothing was public)."""
    from edge_fl.mechanisms import mechanism_class, mechanism_names

    for name in mechanism_names():
        guarantee = mechanism_class(name).guarantee
        if name == "none":
            continue
        assert guarantee.public, name
        if guarantee.unit == "device" and guarantee.relation == "replace_one":
            assert any("|D|" in item for item in guarantee.public), name
