"""The plain secure sum (``none`` under secure aggregation) and the contract's helpers
(edge_fl/mechanisms/secure.py): the layout and its bits, clipping, unbiased stochastic rounding,
the decoded mean, no privacy charged, ``none`` unchanged without secure aggregation, and a whole
SecAgg+ round through the pure driver. Broker-free."""

from __future__ import annotations

import copy
import math
import os

import numpy as np
import pytest
from mechanisms.conftest import FakeDevice as Dev

from edge_fl.config import load_config
from edge_fl.mechanisms import build_mechanism, mechanism_class, mechanism_names
from edge_fl.mechanisms.base import JobFacts, local_update
from edge_fl.mechanisms.none import DEFAULT_LEVELS, NoPrivacy
from edge_fl.mechanisms.secure import (
    SecureJob,
    SecureLayout,
    secure_job,
    secure_job_from,
    secure_plan,
    secure_sum,
    survivors_floor,
)
from edge_fl.models import make_model
from edge_fl.models.training import LocalTraining
from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import GlobalModel
from edge_fl.secagg import RoundParams, Summed
from edge_fl.secagg.calibration import min_bits
from edge_fl.secagg.driver import run_round

N_FEATURES, N_CLASSES = 6, 3
N_PARAMS = N_FEATURES * N_CLASSES + N_CLASSES  # 21


def devices(n: int, seed: int = 0, lr: float = 0.5) -> list[Dev]:
    g = np.random.default_rng(seed)
    W = g.normal(size=(N_FEATURES, N_CLASSES))
    model = make_model("logreg", N_FEATURES, N_CLASSES)
    out = []
    for i in range(n):
        X = g.normal(size=(30, N_FEATURES)).astype(np.float32)
        y = np.argmax(X @ W + g.normal(size=(30, N_CLASSES)), axis=1).astype(np.int64)
        training = LocalTraining(epochs=1, batch_size=10, lr=lr)
        out.append(Dev(f"d{i:03d}", X, y, model, training, seeded_generator(seed, i)))
    return out


def plain(clip: float = 1.0) -> NoPrivacy:
    cfg = load_config(None, {"privacy.clip": clip}).privacy
    mech = build_mechanism(cfg, facts())
    assert type(mech) is NoPrivacy
    return mech


def facts() -> JobFacts:
    return JobFacts(10, 100, 100.0, N_PARAMS, 0.5, 1, 10, 30, 10)


def message(round: int = 3) -> GlobalModel:
    w = np.random.default_rng(1).normal(size=N_PARAMS).astype(np.float32) * 0.1
    return GlobalModel("job", params=w, round=round, version=round)


def clipped(x: np.ndarray, c: float) -> np.ndarray:
    n = float(np.linalg.norm(x))
    return x * min(1.0, c / n)


# ------------------------------------------------------------------------------ the contract


def test_which_mechanisms_offer_a_secure_sum():
    offered = {
        name
        for name in mechanism_names()
        if secure_sum(mechanism_class(name).__new__(mechanism_class(name))) is not None
    }
    assert offered == {"none", "distributed-gaussian"}


def test_a_secure_job_checks_itself_and_its_default_floor_is_30_percent_dropout():
    assert survivors_floor(10) == 7 and survivors_floor(100) == 70 and survivors_floor(3) == 3
    assert survivors_floor(100, 0.0) == 100 and survivors_floor(1, 0.9) == 1
    assert secure_job(21, 50) == SecureJob(21, 50, 35, None)
    assert secure_job(21, 50, min_survivors=40, step=0.01) == SecureJob(21, 50, 40, 0.01)
    for bad in (dict(min_survivors=0), dict(min_survivors=51), dict(step=0.0)):
        with pytest.raises(ValueError, match="secure job"):
            secure_job(21, 50, **bad)
    with pytest.raises(ValueError, match="dropout"):
        survivors_floor(10, 1.0)


def test_the_secure_job_a_config_section_asks_for():
    from types import SimpleNamespace as Section

    assert secure_job_from(None, 21, 50) is None
    assert secure_job_from(Section(enabled=False), 21, 50) is None
    assert secure_job_from(Section(), 21, 50) == SecureJob(21, 50, 35)
    assert secure_job_from(Section(dropout=0.0), 21, 50) == SecureJob(21, 50, 50)
    asked = Section(enabled=True, min_survivors=40, dropout=0.1, step=0.01)
    assert secure_job_from(asked, 21, 50) == SecureJob(21, 50, 40, 0.01)
    with pytest.raises(ValueError, match="min_survivors"):
        secure_job_from(Section(min_survivors=60), 21, 50)


# ------------------------------------------------------------------------------ the layout


def test_the_default_grid_is_2_to_the_8_levels_per_clip_with_room_for_every_selected_device():
    mech = plain(clip=2.0)
    layout = mech.secure_layout(SecureJob(N_PARAMS, 100, 70))
    assert layout == SecureLayout(N_PARAMS, DEFAULT_LEVELS, 16, modular=False)
    assert 2 ** (layout.bits - 1) > 100 * DEFAULT_LEVELS  # the signed sum fits
    assert layout.bits == min_bits(100, 2.0, 2.0 / 256)
    # a step that does not divide the clip: the grid is the next finer one, clip / ceil(clip/step)
    asked = mech.secure_layout(SecureJob(N_PARAMS, 1000, 700, step=0.003))
    assert asked.max_int == math.ceil(2.0 / 0.003) == 667 and asked.bits == 21
    with pytest.raises(ValueError, match=r"needs 6\d > 64 bits: raise secure_aggregation.step"):
        mech.secure_layout(SecureJob(N_PARAMS, 1000, 700, step=1e-17))


def test_none_is_unchanged_without_secure_aggregation():
    """No options model (it would write defaults into privacy.options and change every config
    digest), no public parameters, no events, the same describe."""
    assert NoPrivacy.options_model is None and NoPrivacy.public_schema == ()
    cfg = load_config(None, {})
    assert cfg.privacy.options == {}
    assert cfg.digest() == load_config(None, {"privacy.mechanism": "none"}).digest()
    mech = plain()
    assert mech.describe() == {"mechanism": "none", "guarantee": mech.guarantee.as_dict()}
    assert set(mech.public_params()) == {"m", "lr", "ep", "bs"}
    assert mech.secure_events(SecureJob(N_PARAMS, 10, 7)) == []
    assert not mech.accounts


# ------------------------------------------------------------------------------ encode, decode


def test_a_device_submits_its_clipped_update_on_the_grid_within_the_bound():
    mech = plain(clip=0.5)
    job = SecureJob(N_PARAMS, 10, 7)
    layout = mech.secure_layout(job)
    msg = message()
    for dev in devices(5, lr=3.0):  # large steps: every update is clipped
        twin = copy.deepcopy(dev)
        ints = mech.secure_encode(dev, msg, layout, os.urandom(32))
        delta = local_update(twin, msg)
        assert np.linalg.norm(delta) > 0.5
        assert ints.dtype == np.int64 and ints.shape == (N_PARAMS,)
        assert np.abs(ints).max() <= layout.max_int
        target = clipped(delta, 0.5) * (layout.max_int / 0.5)
        # stochastic rounding: each value is the floor or the ceiling of the scaled coordinate
        assert np.all((ints == np.floor(target)) | (ints == np.ceil(target)))


def test_a_coordinate_as_large_as_the_clip_stays_within_max_int(monkeypatch):
    mech = plain(clip=1.0)
    layout = mech.secure_layout(SecureJob(3, 4, 3))
    # an update that is all one coordinate: exactly -clip after clipping, -Q on the grid
    monkeypatch.setattr(
        "edge_fl.mechanisms.none.local_update", lambda device, msg: np.array([0.0, -7.0, 0.0])
    )
    spike = devices(1)[0]
    ints = mech.secure_encode(spike, message(), layout, b"")
    assert ints.tolist() == [0, -layout.max_int, 0]


def test_the_decoded_mean_is_unbiased_with_the_rounding_variance():
    """Many rounds of 20 devices: decoded mean minus the true mean of the clipped updates has
    mean 0 (within 5 standard errors) and the exact variance of stochastic rounding,
    sum_i f_i (1 - f_i) step^2 / n^2 per coordinate (chi-square bounds at 1e-6)."""
    from scipy import stats

    mech = plain(clip=0.2)
    job = SecureJob(N_PARAMS, 20, 14, step=0.2 / 16)  # a coarse grid: rounding noise is visible
    layout = mech.secure_layout(job)
    step = 0.2 / layout.max_int
    msg = message()
    errs, variances = [], []
    for trial in range(40):
        devs = devices(20, seed=100 + trial)
        truth, total, var = np.zeros(N_PARAMS), np.zeros(N_PARAMS, np.int64), np.zeros(N_PARAMS)
        for dev in devs:
            scaled = clipped(local_update(copy.deepcopy(dev), msg), 0.2) / step
            frac = scaled - np.floor(scaled)
            var += frac * (1 - frac)
            truth += scaled * step
            total += mech.secure_encode(dev, msg, layout, b"")
        mean = mech.secure_decode(total, 20, layout, b"")
        assert mean.dtype == np.float32 and mean.shape == (N_PARAMS,)
        errs.append(mean.astype(np.float64) - truth / 20)
        variances.append(var * step**2 / 400)
    err, v = np.concatenate(errs), np.concatenate(variances)
    keep = v > 0
    chi = float(np.sum(err[keep] ** 2 / v[keep]))
    df = int(keep.sum())
    assert df > 500
    assert stats.chi2.ppf(1e-6, df) < chi < stats.chi2.ppf(1 - 1e-6, df), (chi, df)
    assert abs(float(np.mean(err))) < 5 * math.sqrt(float(np.mean(v)) / err.size)
    # float32 output: the mean's own rounding is far below the grid
    assert np.abs(err).max() < step


def test_decode_refuses_a_wrong_shape_or_no_contributors():
    mech = plain()
    layout = mech.secure_layout(SecureJob(N_PARAMS, 10, 7))
    with pytest.raises(ValueError, match="a secure sum of 21 values"):
        mech.secure_decode(np.zeros(20, np.int64), 3, layout, b"")
    with pytest.raises(ValueError, match="at least 1 contributor"):
        mech.secure_decode(np.zeros(N_PARAMS, np.int64), 0, layout, b"")


def test_a_secagg_round_of_the_plain_sum_decodes_to_the_mean_with_a_dropout():
    """The layout is what SecAgg+ accepts (RoundParams checks the signed sum fits), and the
    unmasked sum of the survivors decodes to their mean."""
    mech = plain(clip=1.0)
    n = 8
    layout = mech.secure_layout(SecureJob(N_PARAMS, n, 6))
    msg = message()
    devs = devices(n, seed=7)
    ints = {d.device_id: mech.secure_encode(d, msg, layout, b"") for d in devs}
    roster = tuple(sorted(ints))
    rp = RoundParams("job1", 3, os.urandom(16), roster, n - 1, 4, layout.bits, layout.length,
                     layout.max_int)  # fmt: skip
    gone = roster[2]
    trace = run_round(rp, ints, {gone: "mask"})  # gone before sending its masked input
    assert isinstance(trace.outcome, Summed)
    survivors = [d for d in roster if d != gone]
    assert list(trace.outcome.contributors) == survivors
    assert np.array_equal(trace.outcome.total, sum(ints[d] for d in survivors))
    mean = mech.secure_decode(trace.outcome.total, len(survivors), layout, b"")
    want = sum(ints[d] for d in survivors) / len(survivors) / layout.max_int
    np.testing.assert_allclose(mean, want, rtol=1e-6, atol=1e-7)


def test_secure_plan_reports_the_layout_and_refuses_a_mechanism_without_a_secure_sum():
    mech = plain(clip=1.0)
    job = SecureJob(4810, 100, 70)
    out = secure_plan(mech, job)
    assert out["length"] == 4810 and out["bits"] == 16 and out["modular"] is False
    assert out["packed_bytes"] == 4810 * 2 and out["vs_float32"] == pytest.approx(0.5)
    assert out["levels_per_clip"] == 256 and out["events_per_round"] == 0
    central = build_mechanism(
        load_config(
            None, {"privacy.mechanism": "gaussian-central", "privacy.noise_multiplier": 1}
        ).privacy,
        facts(),
    )
    with pytest.raises(ValueError, match="'gaussian-central' cannot run under secure aggregation"):
        secure_plan(central, job)
