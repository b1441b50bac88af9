"""Empirical audit of distributed-gaussian through its real encode, secure sum and decode
(tools/bench_ddg_audit.py; method: docs/specs/privacy.md section 5; results: docs/bench/ddg-audit.md).

One secure round of a job calibrated for (3, 1e-5) in one round, 8 parameters, 2 noise shares
(2 selected, floor 2): every device runs ``ddg.device_encode`` (the production encode and exact
discrete Gaussian sampler), the integers are summed mod 2^b (a few rounds through a whole SecAgg+
round, checked bit-identical), the mechanism's ``secure_decode`` gives the mean. Neighbours: the
canary's update ``clip`` along a rotated axis vs zero (zero-out; its noise share stays).

The event {statistic > t} is fixed in advance, from the public parameters only: t maximises the
typical bound computed from the exact rates of the summed discrete Gaussians
(``bench_ddg_audit.exact_rates``); no audit sample sees it. Both checks use Clopper-Pearson at
alpha = 1e-3 with delta' = 1e-3 against the ledger's one-round epsilon at delta' (2.184):

- as configured: the check ``eps_lb <= claim`` fails with probability at most alpha = 1e-3 for
  any mechanism that keeps its claim (the stated false-alarm rate); for this mechanism, at the
  exact rates of its summed noise, ``pass_probability`` puts it below 1e-12;
- a third of the noise (the real mechanism with privacy.noise_multiplier a third of the
  configured calibration's, 1/9 of the variance, claiming the configured epsilon): caught with
  probability 0.9999 at 1,500 runs per input (``pass_probability`` at its exact rates, t = 71;
  computed, and re-checked below). Half the noise needs ~10^4 runs per input: the slow test.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_ddg_audit as B

from edge_fl.mechanisms.secure import SecureJob
from edge_fl.privacy.audit import eps_lower_bound
from edge_fl.privacy.rng import seeded_generator

logging.getLogger("absl").setLevel(logging.ERROR)

JOB = SecureJob(B.DIM, 2, 2)
ALPHA = 1e-3
N = 1500  # runs per input (fast tests)


def params(row: B.Row):
    mech, _ = B.mechanism(row.job, row.noise_multiplier)
    return mech.calibration(row.job).params


def fixed_threshold(row: B.Row, n: int) -> int:
    """The event's t from the row's public parameters: the largest typical bound at n runs."""
    p = params(row)
    best, best_t = -1.0, 0
    for t in range(0, int(6 * math.sqrt(row.honest * float(p.sigma2))) + 60):
        r0, r1 = B.exact_rates(p, row.honest, t)
        bound = eps_lower_bound(round(r0 * n), round(r1 * n), n, B.AUDIT_DELTA, ALPHA)
        if bound > best:
            best, best_t = bound, t
    return best_t


def audit(row: B.Row, n: int, t: int, seed: int, secagg: int = 0) -> dict:
    s0, _ = B.draw((row, False, n, (seed, 0), secagg))
    s1, _ = B.draw((row, True, n, (seed, 1), secagg))
    return B.lower_bound(s0, s1, t, ALPHA)


def within(k: int, n: int, rate: float, sds: float = 5.0) -> bool:
    return abs(k - n * rate) <= sds * math.sqrt(n * rate * (1 - rate)) + 1


def as_configured() -> B.Row:
    return B.Row("as configured", JOB, 2)


def scaled(factor: float) -> B.Row:
    mech, _ = B.mechanism(JOB)
    z = mech.calibration(JOB).noise_multiplier
    return B.Row(f"noise x {factor:g}", JOB, 2, noise_multiplier=z * factor)


def test_the_claim_is_the_ledgers_one_round_epsilon():
    claim = B.claimed_epsilon(JOB)
    mech, _ = B.mechanism(JOB)
    assert mech.describe()["epsilon_per_round"] == pytest.approx(
        B.claimed_epsilon(JOB, B.DELTA), rel=1e-9
    )
    assert B.claimed_epsilon(JOB, B.DELTA) <= B.EPSILON
    assert claim == pytest.approx(2.184, abs=1e-3)


def test_as_configured_stays_within_the_claim_and_matches_the_exact_rates():
    row = as_configured()
    claim = B.claimed_epsilon(JOB)
    t = fixed_threshold(row, N)
    r0, r1 = B.exact_rates(params(row), row.honest, t)
    false_alarm = 1 - B.pass_probability(N, r0, r1, claim, ALPHA)
    assert false_alarm <= ALPHA  # here ~0: the stated rate, alpha, is the guarantee
    res = audit(row, N, t, seed=101, secagg=10)
    assert res["epsilon_lower_bound"] <= claim, res
    # the pipeline delivers the noise the accounting analyses: each count within 5 standard
    # errors of its exact rate (a wrong decode, a lost share or too much noise fails here;
    # false alarm ~1e-6)
    assert within(res["k0"], N, r0) and within(res["k1"], N, r1), (res, r0, r1)


def test_noise_beyond_the_floor_removed_keeps_the_floors_rates_and_the_claim():
    """Six deliver to a job whose floor is 4: the two survivors first by SHA-256(nonce || id)
    reveal their noise and it leaves the sum (10 rounds through the whole SecAgg+ session, checked
    bit for bit against the direct sum). The counts match the exact rates of 4 noise shares, not
    6 (the removal happens), and the bound stays within the claim (it removes no more)."""
    job = SecureJob(B.DIM, 6, 4)
    row = B.Row("noise beyond the floor removed", job, 6, noise_floor=4)
    assert row.honest == 4
    claim = B.claimed_epsilon(job)
    t = fixed_threshold(row, N)
    p = params(row)
    r0, r1 = B.exact_rates(p, 4, t)
    res = audit(row, N, t, seed=107, secagg=10)
    assert res["epsilon_lower_bound"] <= claim, res
    assert within(res["k0"], N, r0) and within(res["k1"], N, r1), (res, r0, r1)

    # had nothing been removed (6 shares): the counts favour 4 shares over 6 by likelihood
    # (expected log-likelihood ratio ~26, standard deviation ~7: a false alarm ~1e-4)
    def loglik(rates: tuple[float, float]) -> float:
        return sum(k * math.log(r) + (N - k) * math.log(1 - r)
                   for k, r in zip((res["k0"], res["k1"]), rates, strict=True))  # fmt: skip

    assert loglik((r0, r1)) > loglik(B.exact_rates(p, 6, t)), res


def test_a_third_of_the_noise_is_caught():
    row, claim = scaled(1 / 3), B.claimed_epsilon(JOB)
    t = fixed_threshold(row, N)
    r0, r1 = B.exact_rates(params(row), row.honest, t)
    power = 1 - B.pass_probability(N, r0, r1, claim, ALPHA)
    assert power > 0.999  # computed: 0.9999
    res = audit(row, N, t, seed=102)
    assert res["epsilon_lower_bound"] > claim, res


@pytest.mark.slow
def test_half_the_noise_is_caught_with_ten_thousand_runs():
    """Half the noise standard deviation (a quarter of the variance), as BENCHMARKS section
    10's "half" rows: at 10^4 runs per input its power is computed below (> 0.99)."""
    row, claim, n = scaled(0.5), B.claimed_epsilon(JOB), 10_000
    t = fixed_threshold(row, n)
    r0, r1 = B.exact_rates(params(row), row.honest, t)
    power = 1 - B.pass_probability(n, r0, r1, claim, ALPHA)
    assert power > 0.99, power
    res = audit(row, n, t, seed=103, secagg=20)
    assert res["epsilon_lower_bound"] > claim, res


def test_the_canary_is_the_worst_case_and_secagg_sums_bit_for_bit():
    """The canary has norm clip (the clip does not shrink it) and rotates to clip/gamma on axis 0;
    a whole SecAgg+ round gives the modular sum bit for bit (``statistic`` raises otherwise)."""
    p = params(as_configured())
    rng = seeded_generator(104)
    for _ in range(3):
        seed = rng.bytes(32)
        x = B.canary(p, seed)
        assert np.linalg.norm(x) == pytest.approx(p.clip, rel=1e-12)
        want = np.zeros(p.padded)
        want[0] = p.clip / p.gamma
        np.testing.assert_allclose(B.ddg.rotate(x, seed) / p.gamma, want, atol=1e-9)
    got = [B.statistic(as_configured(), True, rng, secagg=True) for _ in range(3)]
    assert all(isinstance(v, int) for v in got)
