"""SignDS: parameters, exact combinatorics (spec rows), selection, reconstruction, audit."""

from __future__ import annotations

import itertools
import math
from decimal import Decimal, getcontext
from math import comb

import numpy as np
import pytest
from scipy import stats

from edge_fl.privacy import signds as sd
from edge_fl.privacy.rng import seeded_generator
from edge_fl.privacy.signds import (
    PureDpRelease,
    SignDSParams,
    audit_signds,
    check_dimension,
    nu_pmf,
    optimal_output_dim,
    optimal_threshold,
    plan,
    plan_from_counts,
    select,
    select_batch,
    signds_dp_events,
    signds_global_update,
    signds_vote,
    topk_size,
)

# ---------------------------------------------------------------------------------------------
# Parameters


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("k", 0.3, "signds.sign_k = 0.3 is out of domain (0, 0.25]"),
        ("k", 0.0, "signds.sign_k = 0.0 is out of domain (0, 0.25]"),
        ("k", float("nan"), "signds.sign_k = nan is out of domain (0, 0.25]"),
        ("eps", 0, "signds.sign_eps = 0 is out of domain (0, 100]"),
        ("eps", 100.5, "signds.sign_eps = 100.5 is out of domain (0, 100]"),
        ("thr_ratio", 0.49, "signds.sign_thr_ratio = 0.49 is out of domain [0.5, 1]"),
        ("thr_ratio", 1.01, "signds.sign_thr_ratio = 1.01 is out of domain [0.5, 1]"),
        ("global_lr", 0.0, "signds.sign_global_lr = 0.0 is out of domain (0, inf)"),
        ("global_lr", math.inf, "signds.sign_global_lr = inf is out of domain (0, inf)"),
        ("dim_out", 51, "signds.sign_dim_out = 51 is out of domain integer [0, 50]"),
        ("dim_out", -1, "signds.sign_dim_out = -1 is out of domain integer [0, 50]"),
        ("dim_out", 2.0, "signds.sign_dim_out = 2.0 is out of domain integer [0, 50]"),
        ("dim_out", True, "signds.sign_dim_out = True is out of domain integer [0, 50]"),
        ("max_dim_out", 0, "signds.max_dim_out = 0 is out of domain integer [1, inf)"),
        ("k", "0.1", "signds.sign_k = '0.1' is out of domain (0, 0.25]"),
    ],
)
def test_params_reject_out_of_domain(field, value, message):
    with pytest.raises(ValueError) as exc:
        SignDSParams(**{field: value})
    assert str(exc.value) == message


def test_params_accept_domain_edges_and_defaults():
    p = SignDSParams(k=0.25, eps=100, thr_ratio=0.5, global_lr=1e-9, dim_out=50)
    assert (p.k, p.eps, p.thr_ratio, p.dim_out) == (0.25, 100.0, 0.5, 50)
    assert isinstance(p.eps, float)
    assert SignDSParams(thr_ratio=1).thr_ratio == 1.0
    d = SignDSParams()
    assert (d.k, d.eps, d.thr_ratio, d.global_lr, d.dim_out, d.max_dim_out) == (
        0.01,
        100.0,
        0.6,
        0.1,
        0,
        100,
    )


def test_dim_out_above_cap_is_rejected():
    with pytest.raises(ValueError, match=r"sign_dim_out = 30 exceeds signds\.max_dim_out = 20"):
        SignDSParams(dim_out=30, max_dim_out=20)


def test_check_dimension_warns_when_topk_is_small():
    warns = check_dimension(SignDSParams(k=0.01), 5000)
    assert len(warns) == 1 and "<= 50" in warns[0] and "5000" in warns[0]
    assert check_dimension(SignDSParams(k=0.01), 5001) == []
    assert check_dimension(SignDSParams(k=0.01), 66404) == []


def test_topk_size_exact_and_java_float32():
    assert topk_size(0.05, 1000) == 50
    assert topk_size(0.01, 66404) == 664
    assert topk_size(0.2, 66404) == 13280
    assert topk_size(0.01, 100) == 1
    # float32 evaluation (Java) loses one here; the exact decimal product is 117.0
    assert topk_size(0.13, 900) == 117
    assert topk_size(0.13, 900, java_float32=True) == 116
    assert topk_size(0.05, 1000, java_float32=True) == 50
    with pytest.raises(ValueError, match="model dimension d = 0"):
        topk_size(0.1, 0)


# ---------------------------------------------------------------------------------------------
# Exact combinatorics: spec reference values


@pytest.mark.parametrize(
    ("d", "k", "eps", "K", "h", "nu_th", "p", "tol"),
    [
        (1000, 0.05, 1.0, 50, 1, 1, 0.12516, 5e-6),
        (66404, 0.01, 100.0, 664, 43, 26, 0.99831, 5e-6),
        (66404, 0.2, 10.0, 13280, 14, 9, 0.8936, 5e-5),
    ],
)
def test_spec_reference_rows(d, k, eps, K, h, nu_th, p, tol):
    pl = plan(SignDSParams(k=k, eps=eps, thr_ratio=0.6), d)
    assert (pl.topk, pl.h, pl.nu_th) == (K, h, nu_th)
    assert pl.p_topk_threshold == pytest.approx(p, abs=tol)
    assert not pl.capped and pl.h_uncapped == h
    pmf = np.exp(pl.log_pmf)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-12)
    assert pmf[nu_th:].sum() == pytest.approx(pl.p_topk_threshold, rel=1e-12)


def test_reference_row_ratio_target_missed_keeps_h_1():
    pl = plan(SignDSParams(k=0.05, eps=1.0), 1000)
    assert pl.h == 1 and pl.expected_topk_fraction == pytest.approx(0.12516, abs=5e-6)
    assert pl.expected_topk_fraction < 0.6


def _decimal_ratio(K: int, d: int, h: int, eps: int) -> tuple[int, Decimal]:
    """Java's calcOptThr + ratio in 400-digit arithmetic (independent of the module under test)."""
    getcontext().prec = 400
    w = [Decimal(comb(K, t) * comb(d - K, h - t)) for t in range(h + 1)]
    e = Decimal(eps).exp()
    best, best_t = Decimal(0), 0
    for t in range(1, h + 1):
        z = sum(w[:t]) + e * sum(w[t:])
        n = sum(i * w[i] for i in range(t)) + e * sum(i * w[i] for i in range(t, h + 1))
        if n / z > best:
            best, best_t = n / z, t
        else:
            break
    return max(best_t, 1), best / h


def test_cap_binds_and_uncapped_h_is_exact():
    pl = plan(SignDSParams(k=0.2, eps=100.0), 266084)
    assert pl.capped and pl.h == 100
    assert pl.h_uncapped == 238  # exact; the spec's 146 is a double-precision artefact
    assert pl.nu_th == optimal_threshold(53216, 266084, 100, 100.0)
    # independent high-precision check of the stopping point of findOptOutputDim
    t238, r238 = _decimal_ratio(53216, 266084, 238, 100)
    t239, r239 = _decimal_ratio(53216, 266084, 239, 100)
    assert r238 >= Decimal("0.6") > r239
    assert optimal_threshold(53216, 266084, 238, 100.0) == t238 == 143
    assert optimal_threshold(53216, 266084, 239, 100.0) == t239


def test_plan_reports_uncapped_h_when_cap_is_lower():
    pl = plan(SignDSParams(k=0.01, eps=100.0, max_dim_out=20), 66404)
    assert pl.capped and pl.h == 20 and pl.h_uncapped == 43
    assert pl.nu_th == optimal_threshold(664, 66404, 20, 100.0)
    assert pl.describe()["capped"] is True


def test_plan_with_fixed_dim_out_and_cache():
    params = SignDSParams(k=0.01, eps=100.0, dim_out=10)
    pl = plan(params, 66404)
    assert pl.h == 10 and not pl.capped and pl.nu_th == optimal_threshold(664, 66404, 10, 100.0)
    assert plan(params, 66404) is pl
    with pytest.raises(ValueError, match="exceeds the model dimension d = 5"):
        plan(params, 5)


def _brute_force_nu_pmf(K: int, d: int, h: int, eps: float, nu_th: int) -> np.ndarray:
    top = set(range(K))
    w = np.zeros(h + 1)
    for J in itertools.combinations(range(d), h):
        nu = len(top.intersection(J))
        w[nu] += math.exp(eps * (nu >= nu_th))
    return w / w.sum()


@pytest.mark.parametrize(("K", "d", "h", "eps", "nu_th"), [(3, 12, 4, 1.3, 2), (5, 9, 5, 3.0, 4)])
def test_pmf_matches_subset_enumeration(K, d, h, eps, nu_th):
    np.testing.assert_allclose(
        nu_pmf(K, d, h, eps, nu_th), _brute_force_nu_pmf(K, d, h, eps, nu_th), rtol=1e-12
    )


def _java_style_search(rho: float, K: int, d: int, eps: float) -> int:
    """findOptOutputDim in plain doubles on exact integer binomials (fine for small d)."""

    def expectation(h: int, t: int) -> float:
        w = [
            comb(K, v) * comb(d - K, h - v) * (math.exp(eps) if v >= t else 1.0)
            for v in range(h + 1)
        ]
        return sum(i * x for i, x in enumerate(w)) / sum(w)

    def thr(h: int) -> int:
        best, best_t = 0.0, 0
        for t in range(1, h + 1):
            e = expectation(h, t)
            if e > best:
                best, best_t = e, t
            else:
                break
        return max(best_t, 1)

    h = 1
    while expectation(h, thr(h)) / h >= rho:
        h += 1
    return max(1, h - 1)


@pytest.mark.parametrize(
    ("rho", "K", "d", "eps"),
    [(0.6, 4, 20, 1.0), (0.6, 10, 100, 5.0), (0.5, 25, 100, 8.0), (0.8, 30, 200, 12.0)],
)
def test_optimal_output_dim_matches_direct_search(rho, K, d, eps):
    assert optimal_output_dim(rho, K, d, eps) == _java_style_search(rho, K, d, eps)


def _audit_probabilities(K: int, d: int, h: int, eps: float, nu_th: int) -> tuple[float, float]:
    """Exact P_A(E*), P_B(E*) for disjoint top-k sets (privacy spec 5.1), via hypergeometrics."""
    pmf = nu_pmf(K, d, h, eps, nu_th)
    rest = d - K  # contains the other input's K top-k coordinates

    def other_count(m: int, j: int) -> float:  # j of the other top set among m picks from rest
        return comb(K, j) * comb(rest - K, m - j) / comb(rest, m)

    p_a = sum(
        pmf[nu] * sum(other_count(h - nu, j) for j in range(min(nu_th, h - nu + 1)))
        for nu in range(nu_th, h + 1)
    )
    p_b = sum(
        pmf[nu] * sum(other_count(h - nu, j) for j in range(nu_th, h - nu + 1))
        for nu in range(nu_th)
    )
    return p_a, p_b


@pytest.mark.parametrize(
    ("h_arg", "h", "nu_th", "p_a", "p_b"),
    [(None, 1, 1, 0.404610, 0.148848), (4, 4, 2, 0.328712, 0.120926)],
)
def test_audit_example_probabilities(h_arg, h, nu_th, p_a, p_b):
    pl = plan_from_counts(4, 20, 1.0, 0.6, 0 if h_arg is None else h_arg)
    assert (pl.h, pl.nu_th) == (h, nu_th)
    a, b = _audit_probabilities(4, 20, pl.h, 1.0, pl.nu_th)
    assert a == pytest.approx(p_a, abs=5e-7)
    assert b == pytest.approx(p_b, abs=5e-7)
    assert a / b == pytest.approx(math.e, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Selection


def _check_selection(sel, pl, u):
    idx = sel.indices
    assert idx.dtype == np.uint32 and idx.shape == (pl.h,)
    assert (np.diff(idx.astype(np.int64)) > 0).all()
    assert int(idx[-1]) < pl.d
    order = np.argsort(u, kind="stable")
    top = order[-pl.topk :] if sel.sign > 0 else order[: pl.topk]
    assert np.isin(idx, top).sum() == sel.nu


def test_selection_is_valid_and_counts_follow_nu():
    rng = seeded_generator(1)
    u = rng.standard_normal(3000)  # distinct values: the top-k sets are unique
    pl = plan(SignDSParams(k=0.05, eps=8.0), 3000)
    signs = []
    for _ in range(300):
        sel = select(u, pl, rng)
        _check_selection(sel, pl, u)
        signs.append(sel.sign)
    assert set(signs) == {1, -1}
    for s in (1, -1):
        _check_selection(select(u, pl, rng, sign=s), pl, u)


def test_sign_is_fair():
    rng = seeded_generator(2)
    u = np.arange(100, dtype=np.float32)
    pl = plan(SignDSParams(k=0.1, eps=1.0), 100)
    n = 4000
    plus = sum(select(u, pl, rng).sign == 1 for _ in range(n))
    assert abs(plus - n / 2) <= 4 * math.sqrt(n / 4)  # 4 sigma


def _chi_square_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square with bins of expected count < 5 pooled into one."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def test_nu_distribution_matches_pmf_single_calls():
    rng = seeded_generator(3)
    d = 400
    pl = plan(SignDSParams(k=0.05, eps=3.0, dim_out=12), d)
    u = rng.standard_normal(d)
    nus = np.array([select(u, pl, rng).nu for _ in range(4000)])
    observed = np.bincount(nus, minlength=pl.h + 1)
    assert _chi_square_pvalue(observed, 4000 * np.exp(pl.log_pmf)) > 1e-3


def test_nu_distribution_matches_pmf_batch():
    rng = seeded_generator(4)
    pl = plan(SignDSParams(k=0.2, eps=10.0), 66404)
    u = rng.standard_normal(66404).astype(np.float32)
    batch = select_batch(u, pl, rng, 20000, sign=-1)
    observed = np.bincount(batch.nu, minlength=pl.h + 1)
    assert _chi_square_pvalue(observed, 20000 * np.exp(pl.log_pmf)) > 1e-3
    top = np.argsort(u)[: pl.topk]
    rows = batch.indices[:200]
    np.testing.assert_array_equal(np.isin(rows, top).sum(axis=1), batch.nu[:200])


@pytest.mark.parametrize("force_large", [False, True])
def test_subset_sampler_uniform_over_pairs(force_large, monkeypatch):
    # Both code paths (random keys for small populations, Generator.choice for large ones) must give
    # every 2-subset of a 6-element population the same probability.
    if force_large:
        monkeypatch.setattr(sd, "_SMALL_POPULATION", 0)
    rng = seeded_generator(5)
    n = 15000
    pos = sd._first_of_permutations(6, np.full(n, 2), 3, rng)[:, :2]
    assert (pos[:, 0] != pos[:, 1]).all()
    pairs = np.sort(pos, axis=1)
    code = pairs[:, 0] * 6 + pairs[:, 1]
    observed = np.array(
        [np.count_nonzero(code == a * 6 + b) for a, b in itertools.combinations(range(6), 2)]
    )
    assert observed.sum() == n
    assert stats.chisquare(observed).pvalue > 1e-3


def test_inclusion_is_uniform_within_topk_and_rest():
    # d = 2000, K = 100 (random-key path), rest = 1900 (Generator.choice path).
    rng = seeded_generator(6)
    d = 2000
    pl = plan(SignDSParams(k=0.05, eps=2.0, dim_out=10), d)
    u = rng.standard_normal(d)
    batch = select_batch(u, pl, rng, 20000, sign=1)
    top = np.argsort(u)[-pl.topk :]
    counts = np.bincount(batch.indices.reshape(-1).astype(np.int64), minlength=d)
    in_top = np.zeros(d, dtype=bool)
    in_top[top] = True
    assert counts[in_top].sum() == batch.nu.sum()
    assert stats.chisquare(counts[in_top]).pvalue > 1e-3
    assert stats.chisquare(counts[~in_top]).pvalue > 1e-3


def test_one_million_parameter_update():
    rng = seeded_generator(7)
    d = 1_000_000
    u = rng.standard_normal(d).astype(np.float32)
    pl = plan(SignDSParams(k=0.01, eps=100.0), d)
    assert (pl.topk, pl.h, pl.nu_th) == (10000, 43, 26)
    for s in (1, -1):
        sel = select(u, pl, rng, sign=s)
        _check_selection(sel, pl, u)
        assert sel.nu >= 15  # P(nu < 15) is below 1e-40 at eps = 100


def test_select_rejects_bad_input():
    pl = plan(SignDSParams(k=0.1, eps=1.0), 100)
    rng = seeded_generator(8)
    with pytest.raises(ValueError, match="99 elements but the plan is for d = 100"):
        select(np.zeros(99), pl, rng)
    bad = np.zeros(100)
    bad[3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        select(bad, pl, rng)
    with pytest.raises(ValueError, match="sign = 0"):
        select(np.zeros(100), pl, rng, sign=0)


def test_tiny_model_with_empty_topk_still_selects():
    pl = plan(SignDSParams(k=0.1, eps=1.0), 5)  # K = 0: nothing to prefer
    assert pl.topk == 0 and pl.h == 1
    sel = select(np.arange(5.0), pl, seeded_generator(9))
    assert sel.nu == 0 and sel.indices.shape == (1,)


# ---------------------------------------------------------------------------------------------
# Reconstruction


def test_vote_and_global_update():
    sels = [
        (1, np.array([0, 2, 5], dtype=np.uint32), 10),
        (-1, np.array([2, 3], dtype=np.uint32), 30),
        (1, np.array([5], dtype=np.uint32), 20),
    ]
    votes = signds_vote(6, sels)
    np.testing.assert_array_equal(votes, [10, 0, -20, -30, 0, 30])
    w = np.ones(6, dtype=np.float32)
    step = 3.0 * 3 * 1e-3  # 3 N r_est
    new = signds_global_update(w, votes, 60, step)
    assert new.dtype == np.float32
    np.testing.assert_allclose(new, 1 + step * votes / 60, rtol=1e-6)


@pytest.mark.parametrize(
    ("sel", "message"),
    [
        ((1, np.array([2, 2]), 1), "strictly ascending"),
        ((1, np.array([3, 1]), 1), "strictly ascending"),
        ((1, np.array([6]), 1), "strictly ascending"),
        ((0, np.array([1]), 1), "sign = 0"),
        ((1, np.array([1]), -1), "weight = -1"),
    ],
)
def test_vote_rejects_bad_selections(sel, message):
    with pytest.raises(ValueError, match=message):
        signds_vote(6, [sel])


def test_global_update_rejects_bad_input():
    with pytest.raises(ValueError, match="total_n = 0"):
        signds_global_update(np.zeros(3), np.zeros(3), 0, 0.1)
    with pytest.raises(ValueError, match="does not match"):
        signds_global_update(np.zeros(3), np.zeros(4), 1, 0.1)


# ---------------------------------------------------------------------------------------------
# Privacy descriptors and audit


def test_dp_events():
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.privacy_accountant import NeighboringRelation

    em, rr = signds_dp_events(SignDSParams(eps=7.5))
    assert em == PureDpRelease(7.5, "signds.exponential_mechanism")
    assert isinstance(rr, dp_event.RandomizedResponseDpEvent) and rr.num_buckets == 2
    assert rr.noise_parameter == pytest.approx(2 / (1 + math.exp(5.0)))
    acc = PLDAccountant(NeighboringRelation.REPLACE_ONE).compose(rr)
    assert acc.get_epsilon(1e-12) == pytest.approx(5.0, abs=1e-3)
    assert signds_dp_events(SignDSParams(eps=7.5), rr_eps=None) == [em]


@pytest.mark.parametrize(("h", "p_a", "p_b"), [(None, 0.404610, 0.148848), (4, 0.328712, 0.120926)])
def test_audit_correct_mechanism(h, p_a, p_b):
    n = 100_000
    res = audit_signds(1.0, n, seeded_generator(10), h=h)
    assert res["mechanism"] == "signds" and res["claimed_epsilon"] == 1.0 and res["n"] == n
    assert res["epsilon_lower_bound"] <= 1.0
    assert res["epsilon_lower_bound"] > 0.9  # the test has power (typical 0.97-0.98)
    # calibration: both rates and their log-ratio agree with the exact values
    for k, p in ((res["k1"], p_a), (res["k0"], p_b)):
        assert abs(k - n * p) <= 5 * math.sqrt(n * p * (1 - p))
    se = math.sqrt((1 - p_a) / (n * p_a) + (1 - p_b) / (n * p_b))
    assert res["epsilon_estimate_se"] == pytest.approx(se, rel=0.05)
    assert abs(res["epsilon_estimate"] - 1.0) <= 6 * se
    assert (res["h"], res["sampler_epsilon"]) == (1 if h is None else h, 1.0)


@pytest.mark.parametrize("h", [None, 4])
def test_audit_catches_doubled_epsilon(h):
    res = audit_signds(1.0, 100_000, seeded_generator(11), h=h, sampler_eps=2.0)
    assert res["claimed_epsilon"] == 1.0
    assert res["epsilon_lower_bound"] > 1.0


def test_add_vote_rejects_descending_unsigned_indices():
    """uint32 differences wrap around: [5, 1, 5] must still be seen as unsorted (a double vote)."""
    from edge_fl.privacy.signds import add_vote

    votes = np.zeros(650)
    for bad in ([5, 1, 5], [700, 1]):
        with pytest.raises(ValueError, match="strictly ascending"):
            add_vote(votes, 1, np.array(bad, dtype=np.uint32), 1.0)
    assert not votes.any()
