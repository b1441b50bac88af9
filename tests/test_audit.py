"""Empirical DP audit: Clopper-Pearson bound, the runners, and the audit CLI."""

from __future__ import annotations

import json
import math
import shlex

import pytest
from click.testing import CliRunner
from scipy import special, stats

from edge_fl.cli.privacy_cmds import audit_group
from edge_fl.privacy.audit import (
    audit_gaussian,
    audit_laplace,
    audit_rr,
    beta_ppf,
    betainc,
    clopper_pearson_upper,
    eps_lower_bound,
)
from edge_fl.privacy.rng import seeded_generator

N_AUDIT = 100_000  # spec 5.2: bound ~0.98 for a correct eps = 1 mechanism, catches >= 10% excess


@pytest.mark.parametrize(
    ("a", "b"),
    [(1, 10), (5, 6), (184, 817), (183941, 816060), (1, 1_000_000), (999_999, 2), (0.5, 2.5)],
)
def test_beta_functions_match_scipy(a, b):
    for x in (1e-7, 0.01, 0.18, 0.5, 0.9, 0.999):
        assert betainc(a, b, x) == pytest.approx(special.betainc(a, b, x), rel=1e-9, abs=1e-300)
    for p in (0.0005, 0.025, 0.5, 0.975, 0.9995):
        assert beta_ppf(p, a, b) == pytest.approx(stats.beta.ppf(p, a, b), rel=1e-9)


def test_clopper_pearson_edges():
    assert clopper_pearson_upper(10, 10, 0.025) == 1.0
    # k = 0: the upper bound solves (1 - p)^n = level
    assert clopper_pearson_upper(0, 100, 0.025) == pytest.approx(1 - 0.025 ** (1 / 100), rel=1e-9)


def _scipy_eps_lb(k0, k1, n, delta=0.0, alpha=0.05):
    fpr = 1.0 if k0 == n else stats.beta.ppf(1 - alpha / 2, k0 + 1, n - k0)
    fnr = 1.0 if k1 == 0 else stats.beta.ppf(1 - alpha / 2, n - k1 + 1, k1)
    cands = [0.0]
    for num, den in ((1 - delta - fnr, fpr), (1 - delta - fpr, fnr)):
        if num > 0:
            cands.append(math.log(num / den))
    return max(cands)


@pytest.mark.parametrize(
    ("k0", "k1", "n", "delta", "alpha"),
    [
        (184, 500, 1000, 0.0, 0.05),
        (183940, 500000, 1_000_000, 0.0, 0.05),
        (5535, 11480, 1_000_000, 1e-3, 0.05),
        (731, 269, 1000, 0.0, 0.001),  # the reversed direction
        (0, 1000, 1000, 0.0, 0.05),
        (500, 500, 1000, 0.0, 0.05),
    ],
)
def test_eps_lower_bound_matches_scipy_reference(k0, k1, n, delta, alpha):
    assert eps_lower_bound(k0, k1, n, delta, alpha) == pytest.approx(
        _scipy_eps_lb(k0, k1, n, delta, alpha), rel=1e-8, abs=1e-12
    )


@pytest.mark.parametrize(("n", "expected"), [(1000, 0.805), (10_000, 0.939), (1_000_000, 0.994)])
def test_eps_lower_bound_spec_table_laplace(n, expected):
    k0, k1 = round(n * math.exp(-1) / 2), n // 2  # expected counts for Laplace eps = 1
    assert eps_lower_bound(k0, k1, n) == pytest.approx(expected, abs=1.5e-3)


def test_eps_lower_bound_domain_errors():
    with pytest.raises(ValueError, match=r"k0 and k1 must be in \[0, n=10\]"):
        eps_lower_bound(11, 3, 10)
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\), got 0"):
        eps_lower_bound(1, 3, 10, alpha=0)
    with pytest.raises(ValueError, match=r"n must be an integer >= 1, got 0"):
        eps_lower_bound(0, 0, 0)


def _keys_ok(out: dict) -> None:
    for key in ("mechanism", "claimed_epsilon", "epsilon_lower_bound", "n", "k0", "k1", "alpha"):
        assert key in out
    assert "delta" in out


def test_audit_laplace_correct_passes_and_is_calibrated():
    out = audit_laplace(1.0, N_AUDIT, seeded_generator(20240601))
    _keys_ok(out)
    assert out["mechanism"] == "laplace" and out["n"] == N_AUDIT
    assert 0.95 < out["epsilon_lower_bound"] <= out["claimed_epsilon"] == 1.0
    assert abs(out["epsilon_estimate"] - 1.0) <= 6 * out["epsilon_estimate_se"]


def test_audit_laplace_catches_halved_noise():
    out = audit_laplace(1.0, N_AUDIT, seeded_generator(20240602), scale_factor=0.5)
    assert out["epsilon_lower_bound"] > out["claimed_epsilon"]
    assert out["epsilon_lower_bound"] > 1.8  # true eps is 2


def test_audit_rr_correct_and_halved():
    ok = audit_rr(1.0, N_AUDIT, seeded_generator(20240603))
    _keys_ok(ok)
    assert 0.95 < ok["epsilon_lower_bound"] <= 1.0
    assert abs(ok["epsilon_estimate"] - 1.0) <= 6 * ok["epsilon_estimate_se"]
    bad = audit_rr(1.0, N_AUDIT, seeded_generator(20240604), scale_factor=0.5)
    assert bad["epsilon_lower_bound"] > bad["claimed_epsilon"]
    with pytest.raises(ValueError, match="flip probability"):
        audit_rr(1.0, 10, seeded_generator(1), scale_factor=3.0)


def test_audit_gaussian_correct_and_halved():
    ok = audit_gaussian(1.0, 1e-5, N_AUDIT, seeded_generator(20240605))
    _keys_ok(ok)
    assert ok["delta"] == 1e-3
    assert ok["claimed_epsilon"] == pytest.approx(0.643181, abs=1e-5)  # exact eps at delta' 1e-3
    assert 0.3 < ok["epsilon_lower_bound"] <= ok["claimed_epsilon"]
    bad = audit_gaussian(1.0, 1e-5, N_AUDIT, seeded_generator(20240606), scale_factor=0.5)
    assert bad["epsilon_lower_bound"] > bad["claimed_epsilon"]


def test_audit_gaussian_explicit_noise_multiplier_classic():
    c = math.sqrt(2 * math.log(1.25 / 1e-5))  # 4.845: classic sigma for eps = 1 (spec 5.2 row)
    out = audit_gaussian(1.0, 1e-5, N_AUDIT, seeded_generator(7), noise_multiplier=2 * c)
    assert out["claimed_epsilon"] == pytest.approx(0.4713, abs=1e-3)
    assert 0.25 < out["epsilon_lower_bound"] <= out["claimed_epsilon"]


def test_audit_runner_validation():
    with pytest.raises(ValueError, match=r"scale_factor must be a finite number > 0, got 0"):
        audit_laplace(1.0, 10, seeded_generator(1), scale_factor=0)
    with pytest.raises(ValueError, match=r"eps must be a finite number > 0, got -1"):
        audit_laplace(-1, 10, seeded_generator(1))


def test_audit_cli_seeded_and_secure():
    runner = CliRunner()
    args = shlex.split("laplace --eps 1 --n 20000 --json --seed 5")
    a = json.loads(runner.invoke(audit_group, args).output)
    b = json.loads(runner.invoke(audit_group, args).output)
    assert a == b and a["rng"] == "pcg64-seeded (seed 5)" and a["passed"] is True
    sec = runner.invoke(audit_group, shlex.split("rr --eps 1 --n 20000 --json"))
    assert sec.exit_code == 0
    assert json.loads(sec.output)["rng"] == "chacha20-urandom"
    g = runner.invoke(audit_group, shlex.split("gaussian --eps 1 --delta 1e-5 --n 20000 --seed 1"))
    assert g.exit_code == 0 and "pcg64-seeded (seed 1)" in g.output
    bad = runner.invoke(audit_group, shlex.split("gaussian --eps 1 --n 10"))
    assert bad.exit_code == 2 and "--delta" in bad.output
    neg = runner.invoke(audit_group, shlex.split("rr --eps 1 --n -5"))
    assert neg.exit_code == 2 and "'-5' is not an integer >= 1" in neg.output
