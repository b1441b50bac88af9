"""MagRR: client bit, randomized response, and the aggregator's state machine (spec section 4)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from edge_fl.privacy.magrr import (
    MagRRConfig,
    MagRRState,
    accept_r_est,
    magrr_bit,
    magrr_bit_from_r,
    magrr_step,
    randomized_response,
    rr_estimate,
    rr_keep_probability,
)
from edge_fl.privacy.rng import seeded_generator

N = 100  # configured uploads per round
LR = 0.1
YES = [1, 1, 1, 0, 0]  # majority B = 1
NO = [0, 0, 0, 1, 1]  # majority B = 0
TIE = [1, 1, 0, 0, 1, 0]  # c1 == c0 -> B = 0


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("r_est0", 0.0, "magrr.r_est0 = 0.0 is out of domain (0, 1)"),
        ("r_est0", 1.0, "magrr.r_est0 = 1.0 is out of domain (0, 1)"),
        ("growth", 1.0, "magrr.growth = 1.0 is out of domain (1, inf)"),
        ("shrink", 0.5, "magrr.shrink = 0.5 is out of domain (1, inf)"),
        ("reached_threshold", -1, "magrr.reached_threshold = -1 is out of domain integer [0, inf)"),
        ("reached_threshold", 2.5, "magrr.reached_threshold = 2.5 is out of domain integer"),
        ("rr_eps", 0, "magrr.rr_eps = 0 is out of domain (0, inf)"),
        ("rr_eps", math.inf, "magrr.rr_eps = inf is out of domain (0, inf)"),
        ("step_ratio", -3.0, "magrr.step_ratio = -3.0 is out of domain (0, inf)"),
        ("fallback_ratio", 1.5, "magrr.fallback_ratio = 1.5 is out of domain [0, 1]"),
    ],
)
def test_config_validation(field, value, message):
    with pytest.raises(ValueError) as exc:
        MagRRConfig(**{field: value})
    assert str(exc.value).startswith(message)


def test_config_defaults_are_the_reference_constants():
    c = MagRRConfig()
    assert (c.r_est0, c.growth, c.shrink, c.reached_threshold) == (1e-5, 5.0, 1.5, 10)
    assert (c.rr_eps, c.step_ratio, c.fallback_ratio) == (5.0, 3.0, 0.05)
    assert MagRRState.initial(c) == MagRRState(1e-5, False, 0)


# ---------------------------------------------------------------------------------------------
# Server state machine


def _run(state, rounds, cfg=None):
    infos = []
    for bits in rounds:
        state, info = magrr_step(state, bits, N, LR, cfg)
        infos.append(info)
    return state, infos


def test_fast_phase_grows_x5_on_b0():
    s, info = magrr_step(MagRRState(1e-5), NO, N, LR)
    assert s.r_est == pytest.approx(5e-5, rel=1e-15)
    assert (s.is_reached, s.reached_count) == (False, 0)
    assert info.action == "grow" and info.majority == 0
    assert info.step == pytest.approx(3 * N * 5e-5)


def test_tie_counts_as_b0():
    s, info = magrr_step(MagRRState(1e-5), TIE, N, LR)
    assert info.majority == 0 and info.action == "grow" and s.r_est == pytest.approx(5e-5)
    s2, info2 = magrr_step(MagRRState(2e-3, True, 11), TIE, N, LR)
    assert info2.action == "hold" and s2 == MagRRState(2e-3, True, 11)


def test_switch_on_eleventh_cumulative_b1_round():
    # B=1 rounds interleaved with B=0 rounds: the counter never resets.
    rounds = []
    for i in range(10):
        rounds += [YES, NO] if i % 3 == 0 else [YES]
    state, infos = _run(MagRRState(1e-5), rounds)
    assert not state.is_reached and state.reached_count == 10
    grow_rounds = sum(1 for i in infos if i.action == "grow")
    assert grow_rounds == 4
    assert state.r_est == pytest.approx(1e-5 * 5**4)
    r_before = state.r_est
    state, info = magrr_step(state, YES, N, LR)  # the 11th B=1 round
    assert info.action == "switch"
    assert state.is_reached and state.reached_count == 11
    assert state.r_est == r_before  # the switch round does not move r_est


def test_shrink_phase():
    s = MagRRState(3e-3, True, 11)
    s1, info = magrr_step(s, YES, N, LR)
    assert info.action == "shrink" and s1.r_est == pytest.approx(2e-3)
    assert (s1.is_reached, s1.reached_count) == (True, 11)
    s2, info2 = magrr_step(s1, NO, N, LR)
    assert info2.action == "hold" and s2 == s1
    assert info2.step == pytest.approx(3 * N * 2e-3)


def test_custom_threshold_zero_switches_on_first_b1():
    s, info = magrr_step(MagRRState(1e-5), YES, N, LR, MagRRConfig(reached_threshold=0))
    assert info.action == "switch" and s.is_reached and s.reached_count == 1


def test_fallback_when_too_few_bits():
    for state in (MagRRState(1e-5, False, 3), MagRRState(7e-4, True, 12)):
        s, info = magrr_step(state, [1, 1, 1, 1], N, LR)  # 4 < 0.05 * 100
        assert info.action == "fallback" and info.majority is None
        assert s.r_est == pytest.approx(LR / 3 / N)
        assert (s.is_reached, s.reached_count) == (state.is_reached, state.reached_count)
        assert s.step(N) == pytest.approx(LR)
        assert info.step == pytest.approx(LR)
    s, info = magrr_step(MagRRState(1e-5), [1] * 5, N, LR)  # exactly 5 bits: not a fallback
    assert info.action == "count" and s.reached_count == 1
    _, info = magrr_step(MagRRState(1e-5), [], N, LR)
    assert info.action == "fallback" and info.n_bits == 0


def test_debiased_counts_in_round_info():
    bits = [1] * 30 + [0] * 70
    _, info = magrr_step(MagRRState(1e-5), bits, N, LR)
    p = math.exp(5) / (1 + math.exp(5))
    assert (info.ones, info.zeros, info.n_bits) == (30, 70, 100)
    assert info.ones_debiased == pytest.approx((30 + 100 * (p - 1)) / (2 * p - 1), rel=1e-12)
    assert info.majority == 0


def test_bits_must_be_zero_or_one():
    with pytest.raises(ValueError, match="0/1"):
        magrr_step(MagRRState(), [0, 2, 1, 1, 1], N, LR)
    with pytest.raises(ValueError, match="0/1"):
        magrr_step(MagRRState(), [0.5] * 6, N, LR)
    with pytest.raises(ValueError, match="expected_n = 0"):
        magrr_step(MagRRState(), YES, 0, LR)
    with pytest.raises(ValueError, match="sign_global_lr = 0"):
        magrr_step(MagRRState(), YES, N, 0)


def test_state_dict_round_trip_and_validation():
    s = MagRRState(1.2345e-4, True, 17)
    d = s.to_dict()
    assert d == {"r_est": 1.2345e-4, "reached": True, "reached_count": 17}
    assert MagRRState.from_dict(d) == s
    assert MagRRState.from_dict({"r_est": 1e-5, "reached": 0, "reached_count": 0}) == MagRRState()
    for bad, msg in [
        ({"r_est": 1e-5, "reached": 0}, "do not match"),
        ({"r_est": 1e-5, "reached": 0, "reached_count": 0, "x": 1}, "do not match"),
        ({"r_est": -1.0, "reached": 0, "reached_count": 0}, "magrr.r_est = -1.0"),
        ({"r_est": 1e-5, "reached": 2, "reached_count": 0}, "magrr.reached = 2"),
        ({"r_est": 1e-5, "reached": 0, "reached_count": -1}, "magrr.reached_count = -1"),
        ([1e-5, 0, 0], "must be a dict"),
    ]:
        with pytest.raises(ValueError, match=msg):
            MagRRState.from_dict(bad)


# ---------------------------------------------------------------------------------------------
# Client


def test_client_bit_thresholds_follow_the_code():
    # fast phase: 1 iff r < 2 r_est; shrink phase: 1 iff r < r_est / 2 (the doc says r_est)
    assert magrr_bit_from_r(1.99e-3, 1e-3, False) == 1
    assert magrr_bit_from_r(2e-3, 1e-3, False) == 0
    assert magrr_bit_from_r(0.49e-3, 1e-3, True) == 1
    assert magrr_bit_from_r(0.5e-3, 1e-3, True) == 0
    assert magrr_bit_from_r(0.8e-3, 1e-3, True) == 0
    assert magrr_bit_from_r(math.nan, 1e-3, False) == 0


def test_client_bit_uses_signed_topk_mean():
    u = np.array([0.5, -4.0, 0.1, 3.0, -0.2, 1.0, -3.0, 0.0])
    # sign +1, K=3: {3.0, 1.0, 0.5} mean 1.5; sign -1, K=3: {-4, -3, -0.2} mean -2.4 -> r = 2.4
    assert magrr_bit(u, 1, 3, 0.76, False) == 1  # 1.5 < 1.52
    assert magrr_bit(u, 1, 3, 0.75, False) == 0  # 1.5 == 1.5
    assert magrr_bit(u, -1, 3, 1.21, False) == 1  # 2.4 < 2.42
    assert magrr_bit(u, -1, 3, 1.2, False) == 0
    assert magrr_bit(u, -1, np.array([1, 6, 4]), 1.21, False) == 1  # indices instead of K
    assert magrr_bit(u, -1, 3, 4.79, True) == 0  # shrink phase: 2.4 < 2.395 is false
    assert magrr_bit(u, -1, 3, 4.82, True) == 1


def test_accept_r_est(caplog):
    assert accept_r_est(0.0) == 0.0
    assert accept_r_est(0.25) == 0.25
    with caplog.at_level(logging.WARNING, logger="edge_fl.privacy.magrr"):
        for bad in (1.0, -1e-9, math.nan, "0.1", None):
            assert accept_r_est(bad) == 1.0
    assert len(caplog.records) == 5


def test_randomized_response_keep_rate():
    rng = seeded_generator(21)
    n = 50_000
    p = rr_keep_probability(1.0)
    kept = sum(randomized_response(1, 1.0, rng) for _ in range(n))
    assert abs(kept - n * p) <= 5 * math.sqrt(n * p * (1 - p))
    flipped = sum(randomized_response(0, 1.0, rng) for _ in range(n))
    assert abs(flipped - n * (1 - p)) <= 5 * math.sqrt(n * p * (1 - p))
    assert rr_keep_probability(5.0) == pytest.approx(0.993307, abs=5e-7)
    with pytest.raises(ValueError, match="bit = 2"):
        randomized_response(2, 1.0, rng)


@pytest.mark.parametrize(
    ("eps", "p", "n", "n_c", "est", "std"),
    [
        (math.log(3), 0.75, 1000, 400, 300.0, 27.3861),
        (1.0, 0.7310585786, 10000, 4000, 2836.046586, 95.9517),
        (0.5, 0.6224593312, 500, 260, 290.829882, 44.2589),
        (2.0, 0.8807970780, 200, 40, 21.217883, 6.0169),
    ],
)
def test_rr_debias_matches_privacy_spec_table(eps, p, n, n_c, est, std):
    assert rr_keep_probability(eps) == pytest.approx(p, abs=1e-10)
    got_est, got_std = rr_estimate(n_c, n, eps)
    assert got_est == pytest.approx(est, abs=1e-5)
    assert got_std == pytest.approx(std, abs=1e-4)
