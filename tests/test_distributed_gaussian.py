"""distributed-gaussian (edge_fl/mechanisms/distributed_gaussian.py): calibration for the minimum
surviving count, the layout, its refusals outside secure sync rounds, the ledger's epsilon against
``ddg.epsilon`` and dp-accounting's Gaussian, the end-to-end noise of encode + sum + decode over
many simulated devices, the public parameters and the CLI. Pure and broker-free, except the CLI
tests, which run ``edge-fl`` as a process."""

from __future__ import annotations

import copy
import json
import math
import os
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp
from test_secure_sum import N_PARAMS, devices

from edge_fl.config import load_config
from edge_fl.mechanisms import build_mechanism, check_combination
from edge_fl.mechanisms.base import JobFacts, local_update
from edge_fl.mechanisms.distributed_gaussian import (
    NAME,
    ROUNDING_SLACK,
    SECURE_ONLY,
    DistributedGaussian,
    default_gamma,
)
from edge_fl.mechanisms.secure import SecureJob, secure_plan, secure_sum
from edge_fl.privacy.accountants import RDP_ORDERS
from edge_fl.privacy.ledger import PrivacyLedger
from edge_fl.protocol import GlobalModel, PayloadRejected, Reject, check_mechanism_params
from edge_fl.protocol.codecs import codec_names
from edge_fl.secagg import RoundParams, Summed, ddg
from edge_fl.secagg.driver import run_round
from edge_fl.server.aggregator import PrivacyAccounting

DELTA = 1e-5


def facts(**kw) -> JobFacts:
    base = dict(
        rounds=20,
        n_devices=100,
        expected_participants=20.0,
        n_params=N_PARAMS,
        local_lr=0.5,
        local_epochs=1,
        batch_size=10,
        min_dataset_size=30,
        max_uploads=20,
    )
    base.update(kw)
    return JobFacts(**base)


def mechanism(f: JobFacts | None = None, **privacy) -> DistributedGaussian:
    privacy.setdefault("epsilon", 4.0)
    overrides = {"privacy.mechanism": NAME, **{f"privacy.{k}": v for k, v in privacy.items()}}
    mech = build_mechanism(load_config(None, overrides).privacy, f or facts())
    assert isinstance(mech, DistributedGaussian)
    return mech


def message(round: int = 2, mp: dict | None = None) -> GlobalModel:
    w = np.random.default_rng(5).normal(size=N_PARAMS).astype(np.float32) * 0.1
    return GlobalModel("job", params=w, round=round, version=round, mechanism_params=mp)


# ------------------------------------------------------------------------------ calibration


def test_it_calibrates_for_the_minimum_survivors_and_its_grid():
    mech = mechanism(clip=0.5)
    job = SecureJob(N_PARAMS, 20, 12)
    layout = mech.secure_layout(job)
    p = mech.calibration(job).params
    gamma = default_gamma(0.5, 32)
    direct = ddg.calibrate(4.0, DELTA, 20, 0.5, gamma, N_PARAMS, 12)
    assert (p.clip, p.gamma, p.sigma2, p.dim, p.n_min) == (0.5, gamma, direct.sigma2, 21, 12)
    assert layout.length == 32 and layout.modular and layout.max_int == math.ceil(p.l2)
    assert layout.bits == ddg.ring_bits(p, 20)
    assert ddg.epsilon(p, 20, DELTA) <= 4.0
    # calibrated for 12 shares: with 11 the claim would break, so the floor is what counts
    fewer = ddg.DdgParams(p.clip, p.gamma, p.sigma2, p.beta, p.dim, 11)
    assert ddg.epsilon(fewer, 20, DELTA) > 4.0
    # the job's step is the grid when it names one
    stepped = mech.calibration(SecureJob(N_PARAMS, 20, 12, step=0.01)).params
    assert stepped.gamma == 0.01
    assert stepped.sigma2 == ddg.calibrate(4.0, DELTA, 20, 0.5, 0.01, N_PARAMS, 12).sigma2


@pytest.mark.parametrize("padded", [32, 8192, 65536])
def test_the_default_grid_costs_at_most_one_percent_of_the_sensitivity(padded):
    gamma = default_gamma(1.0, padded)
    l2 = ddg.rounded_bound(1.0 / gamma, padded, math.exp(-0.5))
    assert l2 <= (1 + ROUNDING_SLACK) / gamma * (1 + 1e-12)
    assert l2 >= (1 + ROUNDING_SLACK) / gamma * (1 - 1e-9)  # the largest such step: tight
    assert default_gamma(3.0, padded) == pytest.approx(3 * gamma)


def test_a_noise_multiplier_sets_the_summed_noise_directly():
    mech = mechanism(epsilon=None, noise_multiplier=1.5)
    cal = mech.calibration(SecureJob(N_PARAMS, 20, 10))
    assert cal.params.sigma2.denominator == 1  # integer: the vectorised exact sampler's domain
    assert 1.5 <= cal.noise_multiplier < 1.5 * (1 + 1e-3)


def test_it_refuses_async_rounds_and_a_missing_target_in_one_line():
    with pytest.raises(
        ValueError, match=r"needs rounds\.mode = 'sync' or 'fedbuff'.*got 'fedasync'"
    ):
        mechanism(facts(mode="fedasync"))
    mechanism(facts(mode="fedbuff"))  # one secure round per cohort
    with pytest.raises(ValueError, match=r"needs privacy\.epsilon or privacy\.noise_multiplier"):
        mechanism(epsilon=None)
    with pytest.raises(ValueError, match="the secure job has 20 parameters, the model 21"):
        mechanism().secure_layout(SecureJob(20, 10, 7))


def test_without_secure_aggregation_it_cannot_run():
    mech = mechanism()
    dev = devices(1)[0]
    with pytest.raises(ValueError, match="runs only under secure aggregation") as err:
        mech.device_update(dev, message(), 0)
    assert str(err.value) == SECURE_ONLY and "\n" not in SECURE_ONLY
    strategy = mech.new_strategy(None, 1.0, np.random.default_rng(0))
    with pytest.raises(PayloadRejected) as rejected:
        strategy.add(object(), 1.0)  # type: ignore[arg-type]
    assert rejected.value.reason == Reject.WRONG_MECHANISM and strategy.count == 0
    assert mech.robust_support() == frozenset()
    assert all(check_combination(NAME, codec) for codec in codec_names())
    assert secure_sum(mech) is mech


# ------------------------------------------------------------------------------ accounting


def test_the_ledger_charges_ddg_epsilon_and_the_gaussian_of_sigma_sum_over_delta2():
    """Large noise (tau = 0): a device in R secure rounds has ddg.epsilon(params, R, delta) in
    the ledger, in its best bound and in the aggregator's metrics, and that is dp-accounting's
    GaussianDpEvent composed R times with noise multiplier sigma_sum / Delta_2."""
    mech = mechanism()
    job = SecureJob(N_PARAMS, 20, 14)
    mech.secure_layout(job)
    p = mech.calibration(job).params
    assert ddg.tau(float(p.sigma2), p.n_min) == 0.0
    z = math.sqrt(p.n_min * float(p.sigma2)) / p.l2
    events = mech.secure_events(job)
    assert len(events) == 1 and events[0].relation.name == "REPLACE_SPECIAL"
    assert mech.release_events(30, 0) == events  # what a device's budget counts
    ledger = PrivacyLedger()
    accounting = PrivacyAccounting(mech, DELTA)
    for r in range(1, 21):
        for ev in events:
            ledger.add(ev, device="a", round=r)
        accounting.record_upload("a", 30, r)
        if r in (1, 7, 20):
            want = ddg.epsilon(p, r, DELTA, orders=list(RDP_ORDERS))
            acc = rdp.RdpAccountant(list(RDP_ORDERS))
            acc.compose(dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z), r))
            assert ledger.epsilon(DELTA, "rdp", device="a") == pytest.approx(want, rel=1e-12)
            assert ledger.best(DELTA, "a")[0].epsilon == pytest.approx(want, rel=1e-12)
            assert accounting.metrics()["epsilon"] == pytest.approx(want, rel=1e-12)
            assert want == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
    # dp-accounting's default orders agree with the ledger's, and the job's rounds meet the target
    assert ddg.epsilon(p, 20, DELTA) == pytest.approx(ledger.epsilon(DELTA, device="a"), rel=1e-9)
    assert ledger.epsilon(DELTA, device="a") <= 4.0
    assert mech.describe()["epsilon_total"] == pytest.approx(ledger.epsilon(DELTA, device="a"))


def test_with_tau_the_ledger_charges_the_curve_that_proves_the_least_at_the_jobs_rounds():
    """Small noise (tau > 0): the three curves differ; the event is the one whose epsilon over
    the job's rounds is smallest, so the ledger at those rounds equals ddg.epsilon (the minimum
    over curves) and at any other count is a valid bound (>= the minimum), and equals a direct
    computation of that curve: eps = min_a R (xi + rho a) + log(1 - 1/a) - log(delta a)/(a - 1)."""
    f = facts(rounds=6)
    mech = mechanism(f, epsilon=None, noise_multiplier=0.3)
    job = SecureJob(N_PARAMS, 4, 3, step=0.5)  # a coarse grid: sigma^2 below one grid unit
    mech.secure_layout(job)
    p = mech.calibration(job).params
    assert ddg.tau(float(p.sigma2), p.n_min) > 1e-4
    curves = ddg.zcdp_curves(p)
    assert len({round(rho, 9) for _, rho in curves}) == 3  # they differ
    (event,) = mech.secure_events(job)
    chosen = (event.event.xi, event.event.rho)
    assert chosen in curves
    orders = np.asarray(RDP_ORDERS)
    ledger = PrivacyLedger()
    for r in range(1, 13):
        ledger.add(event, device="a", round=r)
        got = ledger.epsilon(DELTA, device="a")
        best = ddg.epsilon(p, r, DELTA, orders=list(RDP_ORDERS))
        direct = float(
            np.min(
                r * (chosen[0] + chosen[1] * orders)
                + np.log1p(-1 / orders)
                - np.log(DELTA * orders) / (orders - 1)
            )
        )
        assert got == pytest.approx(direct, rel=1e-9)
        assert got >= best * (1 - 1e-12)
        if r == 6:
            assert got == pytest.approx(best, rel=1e-12)


# ------------------------------------------------------------------------------ the noise


def test_encode_sum_decode_is_unbiased_with_the_calibrated_variance():
    """Many simulated devices through the mechanism itself (training included): the decoded mean
    minus the true mean of the clipped updates has mean 0 within 5 standard errors and variance
    sigma_sum^2 gamma^2 / n^2 = sigma^2 gamma^2 / n per coordinate (plus at most gamma^2 / (4n)
    of rounding), by chi-square bounds at 1e-6 on both sides."""
    from scipy import stats

    n, trials, clip = 12, 25, 0.3
    mech = mechanism(clip=clip, epsilon=None, noise_multiplier=0.8)
    job = SecureJob(N_PARAMS, n, n)
    layout = mech.secure_layout(job)
    p = mech.calibration(job).params
    msg = message()
    errs = []
    for trial in range(trials):
        seed = os.urandom(32)
        total = np.zeros(layout.length, np.int64)
        truth = np.zeros(N_PARAMS)
        for dev in devices(n, seed=300 + trial):
            x = local_update(copy.deepcopy(dev), msg)
            truth += x * min(1.0, clip / float(np.linalg.norm(x)))
            ints = mech.secure_encode(dev, msg, layout, seed).values
            assert ints.dtype == np.int64 and ints.shape == (layout.length,)
            total += ints
        mean = mech.secure_decode(total, n, layout, seed)
        assert mean.dtype == np.float32 and mean.shape == (N_PARAMS,)
        errs.append(mean.astype(np.float64) - truth / n)
    err = np.concatenate(errs)
    v_lo = float(p.sigma2) * p.gamma**2 / n
    v_hi = (float(p.sigma2) + 0.25) * p.gamma**2 / n
    df = err.size
    assert float(np.sum(err**2)) / v_hi < stats.chi2.ppf(1 - 1e-6, df)
    assert float(np.sum(err**2)) / v_lo > stats.chi2.ppf(1e-6, df)
    assert abs(float(err.mean())) < 5 * math.sqrt(v_hi / df)
    # the noise is what was promised: z = sigma_sum / Delta_2 in model units is clip-relative
    assert math.sqrt(v_lo) * n == pytest.approx(0.8 * p.l2 * p.gamma, rel=2e-3)


def test_a_secagg_round_of_ddg_integers_decodes_through_the_ring():
    """The layout passes SecAgg+'s RoundParams; the modular sum of the survivors, lifted to
    signed, decodes; fewer contributors than the floor are refused."""
    n = 6
    mech = mechanism(epsilon=None, noise_multiplier=1.0)
    layout = mech.secure_layout(SecureJob(N_PARAMS, n, 4))
    seed, msg = os.urandom(32), message()
    ints = {
        d.device_id: mech.secure_encode(d, msg, layout, seed).values for d in devices(n, seed=9)
    }
    roster = tuple(sorted(ints))
    # max_int 0: a modular layout's values are unbounded (noise), as the server passes it
    rp = RoundParams("job1", 2, os.urandom(16), roster, n - 1, 3, layout.bits, layout.length,
                     0)  # fmt: skip
    trace = run_round(rp, ints, {roster[0]: "mask"}, modular=True)
    assert isinstance(trace.outcome, Summed)
    total = sum(ints[d] for d in roster[1:])
    assert np.array_equal(trace.outcome.total, total)
    mean = mech.secure_decode(trace.outcome.total, n - 1, layout, seed)
    p = mech.calibration(SecureJob(N_PARAMS, n, 4)).params
    # the sum times gamma, rotated back (an orthogonal map: the inverse of the rotation), over
    # the five contributors (not the floor of four the noise is calibrated for)
    rotated_back = ddg.unrotate(total.astype(np.float64) * p.gamma, seed, N_PARAMS)
    np.testing.assert_allclose(mean, rotated_back / (n - 1), rtol=1e-5, atol=1e-6)
    x = np.random.default_rng(2).normal(size=N_PARAMS)
    np.testing.assert_allclose(ddg.unrotate(ddg.rotate(x, seed), seed, N_PARAMS), x, atol=1e-12)
    with pytest.raises(ValueError, match="3 contributors < min_survivors 4"):
        mech.secure_decode(trace.outcome.total, n - 3, layout, seed)


def test_encode_refuses_an_unknown_layout_a_bad_seed_or_other_parameters():
    mech = mechanism()
    job = SecureJob(N_PARAMS, 10, 7)
    layout = mech.secure_layout(job)
    dev = devices(1)[0]
    with pytest.raises(ValueError, match="round seed is 32 bytes"):
        mech.secure_encode(dev, message(), layout, b"short")
    other = type(layout)(layout.length, layout.max_int, layout.bits + 1, True)
    with pytest.raises(ValueError, match="call secure_layout"):
        mech.secure_encode(dev, message(), other, os.urandom(32))
    mp = mech.public_params()
    assert mp["nmin"] == 7 and mp["dp"] == 32 and mp["b"] == layout.bits
    mech.secure_encode(dev, message(mp=mp), layout, os.urandom(32))  # its own: fine
    with pytest.raises(ValueError, match="differ from this device's calibration"):
        mech.secure_encode(dev, message(mp={**mp, "s2": mp["s2"] / 2}), layout, os.urandom(32))


# ------------------------------------------------------------------------------ public, report


def test_public_parameters_pass_the_wire_schema_and_a_wrong_dimension_is_rejected():
    mech = mechanism()
    mp = mech.public_params()
    assert check_mechanism_params(mp, N_PARAMS) == mp
    with pytest.raises(PayloadRejected) as err:
        check_mechanism_params({**mp, "dp": 64}, N_PARAMS)
    assert err.value.reason == Reject.OUT_OF_RANGE and "mp.dp" in str(err.value)


def test_describe_says_what_it_assumed_and_warns_of_few_shares():
    mech = mechanism(facts(expected_participants=8.0))
    d = mech.describe()
    assert d["secure_job"].startswith("default") and d["min_survivors"] == 6
    assert d["selected"] == 8 and d["epsilon_total"] <= 4.0 and d["ring_bits"] >= 2
    assert d["guarantee"]["relation"] == "replace_special"
    assert "min_survivors" in d["guarantee"]["text"]
    assert mech.warnings() == [
        f"{NAME}: the noise is calibrated for 6 honest shares (min_survivors less "
        "secure_aggregation.collude's colluders); each further device that colludes with the "
        "aggregator removes 1/6 of it"
    ]
    mech.secure_layout(SecureJob(N_PARAMS, 40, 30))
    d = mech.describe()
    assert (d["secure_job"], d["min_survivors"], d["selected"]) == ("secure_aggregation", 30, 40)
    assert mech.warnings() == [] and mech.public_params()["nmin"] == 30
    plan = secure_plan(mech, SecureJob(N_PARAMS, 40, 30))
    assert plan["modular"] is True and plan["length"] == 32 and plan["events_per_round"] == 1


def test_colluders_are_not_counted_as_noise_shares():
    """secure_aggregation.collude: each colluding device knows its own noise share, so the
    guarantee counts on min_survivors - colluders shares, and sigma^2 grows to keep epsilon."""
    from edge_fl.mechanisms.secure import secure_job

    honest = secure_job(N_PARAMS, 40, min_survivors=30)
    colluding = secure_job(N_PARAMS, 40, min_survivors=30, collude=0.1)
    assert (honest.colluders, colluding.colluders) == (0, 4)
    plain = mechanism(facts()).calibration(honest).params
    wary = mechanism(facts()).calibration(colluding).params
    assert (plain.n_min, wary.n_min) == (30, 26)
    assert wary.sigma2 > plain.sigma2
    # the summed noise of the 26 honest shares carries what 30 shares did without colluders
    assert float(wary.sigma2) * 26 == pytest.approx(float(plain.sigma2) * 30, rel=0.02)
    with pytest.raises(ValueError, match="no honest share"):
        SecureJob(N_PARAMS, 40, 30, colluders=30)


# ------------------------------------------------------------------------------ the CLI


def edge_fl(*args: str) -> Any:
    """``edge-fl ARGS`` in this process (the same entry point; no interpreter start-up)."""
    from click.testing import CliRunner

    from edge_fl.cli import main

    return CliRunner().invoke(main, list(args))


def test_privacy_mechanisms_lists_it_with_its_guarantee():
    done = edge_fl("privacy", "mechanisms", "--json")
    assert done.exit_code == 0, done.output
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    row = rows[NAME]
    assert row["guarantee"] == DistributedGaussian.guarantee.text()
    assert "replace-one-by-null" in row["guarantee"] and row["server_noise_every_round"] is False
    assert row["summary"].startswith("Distributed DP under secure aggregation")


def test_privacy_plan_shows_the_calibration_and_the_epsilon_it_promises():
    done = edge_fl(
        "privacy", "plan", "--json", "--set", f"privacy.mechanism={NAME}", "--set",
        "privacy.epsilon=2", "--set", "rounds.rounds=15", "--set", "rounds.clients_per_round=20",
        "--set", "data.devices=40", "--set", "model.name=logreg",
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    out = json.loads(done.stdout)
    assert out["mechanism"] == NAME and out["min_survivors"] == 14 and out["selected"] == 20
    for key in ("sigma2", "gamma", "padded_dim", "ring_bits", "epsilon_per_round"):
        assert out[key] > 0, key
    assert out["epsilon_total"] <= 2.0 and out["epsilon_total"] > 1.99
    assert out["worst_case_uploads_per_device"] == 15
    assert out["worst_case_total"]["epsilon"] == pytest.approx(out["epsilon_total"], rel=1e-9)
    secure = out["secure_aggregation"]
    assert secure["length"] == out["padded_dim"] and secure["bits"] == out["ring_bits"]
    assert secure["modular"] is True and secure["min_survivors"] == 14
    bad = edge_fl("privacy", "plan", "--set", f"privacy.mechanism={NAME}", "--set",
                  "rounds.mode=fedasync", "--set", "privacy.epsilon=2")  # fmt: skip
    assert bad.exit_code == 2 and isinstance(bad.exception, SystemExit)  # no traceback
    assert "needs rounds.mode = 'sync'" in bad.output


def test_a_variance_from_the_calibration_table_gives_the_same_parameters():
    """A device without dp-accounting takes sigma^2 from the job document's calibration rows:
    the value survives the float round trip exactly (an integer, or thousandths)."""
    for value in (Fraction(1494016), Fraction(7, 1000), Fraction(1, 1000)):
        assert Fraction(float(value)).limit_denominator(1000) == value
