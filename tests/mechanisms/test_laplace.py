"""laplace: one full-batch L1-clipped step, Laplace(2 lr C / |D| / eps_r) on the device; pure eps
split over L = max_uploads uploads."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from scipy import stats

from edge_fl.mechanisms.base import FedAvg
from edge_fl.mechanisms.laplace import Laplace
from edge_fl.models import make_model
from edge_fl.models.training import LocalTraining
from edge_fl.privacy.accountants import best_epsilon
from edge_fl.privacy.events import NeighboringRelation, PrivacyEvent
from edge_fl.privacy.noise import laplace_noise
from edge_fl.privacy.rng import seeded_generator

ORDERS = [1 + x / 10 for x in range(1, 100)] + list(range(12, 64))
LR, CLIP, EPS, L = 0.1, 1.0, 2.0, 5


@pytest.fixture
def big(ref, make_device):
    """A 155-parameter logreg device (30 features, 5 classes), for statistics over coordinates."""
    X, y = ref.data(n=40, n_features=30, n_classes=5, seed=4)
    model = make_model("logreg", 30, 5)
    return lambda seed: make_device(seed, X=X, y=y, model=model)


def one_step(ref, w0, X, y):
    """The independent expectation: w0 - lr * mean(L1-clip(g_i, C)), as a delta."""
    g = ref.clip_rows(ref.per_sample_grads(w0, X, y), CLIP, ord=1)
    return -LR * g.mean(axis=0)


def test_noise_free_part_is_one_l1_clipped_full_batch_step(
    make_mechanism, make_device, global_msg, ref
):
    mech = make_mechanism("laplace", epsilon=1e12, clip=CLIP)  # noise scale ~1e-13
    w0 = np.random.default_rng(2).normal(size=21).astype(np.float32)
    # epochs and batch_size are not used: one full-batch step whatever the training settings say
    dev = make_device(7, training=LocalTraining(epochs=5, batch_size=4, lr=0.9))
    upd = mech.device_update(dev, global_msg(w0), exposure=0)
    expected = one_step(ref, w0, dev.X, dev.y)
    np.testing.assert_allclose(upd.delta, expected, atol=1e-6)
    # the L1 clip binds for most examples here: the unclipped step is far from the upload
    raw = ref.per_sample_grads(w0, dev.X, dev.y)
    assert (np.abs(raw).sum(axis=1) > CLIP).mean() > 0.5
    assert np.abs(upd.delta + LR * raw.mean(axis=0)).max() > 0.01
    assert np.abs(upd.delta).sum() <= LR * CLIP * (1 + 1e-5)
    assert upd.mechanism == "laplace"


@pytest.mark.parametrize(
    ("schedule", "exposure"), [("uniform", 0), ("uniform", 4), ("geometric", 3)]
)
def test_device_adds_laplace_of_the_exact_scale(
    make_mechanism, big, global_msg, ref, schedule, exposure
):
    mech = make_mechanism("laplace", epsilon=EPS, clip=CLIP, schedule=schedule, schedule_decay=0.5)
    geometric = EPS * (1 - 0.5) * 0.5**exposure / (1 - 0.5**L)
    eps_r = EPS / L if schedule == "uniform" else geometric
    b = 2 * LR * CLIP / 40 / eps_r
    w0 = np.zeros(155, np.float32)
    msg = global_msg(w0)
    dev = big(11)
    clean = one_step(ref, w0, dev.X, dev.y)
    upd = mech.device_update(dev, msg, exposure)
    # replaying the device's generator: what was added is exactly Laplace(b) noise
    replay = laplace_noise(seeded_generator(11), b, 155)
    np.testing.assert_allclose(upd.delta, clean + replay, atol=2e-6)
    # and statistically, over 20 devices' generators: noise ~ Laplace(0, b), not 0.8 b or 1.25 b
    noise = np.concatenate(
        [mech.device_update(big(100 + s), msg, exposure).delta - clean for s in range(20)]
    )
    assert abs(np.abs(noise).mean() / b - 1) < 0.08  # E|X| = b, se 1.8% at 3100 draws
    assert stats.kstest(noise / b, stats.laplace.cdf).pvalue > 1e-4
    assert stats.kstest(noise / b, stats.laplace(scale=1.25).cdf).pvalue < 1e-4


def test_two_generators_give_different_uploads_with_laplace_difference(
    make_mechanism, big, global_msg
):
    mech = make_mechanism("laplace", epsilon=EPS, clip=CLIP)
    b = 2 * LR * CLIP / 40 / (EPS / L)
    msg = global_msg(np.zeros(155, np.float32))
    diffs = np.concatenate(
        [
            mech.device_update(big(2 * s), msg, 0).delta
            - mech.device_update(big(2 * s + 1), msg, 0).delta
            for s in range(10)
        ]
    )
    assert np.all(diffs != 0)
    # Var(X1 - X2) = 2 * 2 b^2 for Laplace(b): std 2b (std of std at 1550 draws ~ 3.5%)
    assert diffs.std() / (2 * b) == pytest.approx(1.0, abs=0.15)


def test_scale_follows_the_device_dataset_size(make_mechanism, make_device, global_msg, ref):
    mech = make_mechanism("laplace", epsilon=EPS, clip=CLIP)
    w0 = np.zeros(21, np.float32)
    X, y = ref.data(n=20, seed=5)
    dev = make_device(3, X=X, y=y)
    upd = mech.device_update(dev, global_msg(w0), 1)
    b = 2 * LR * CLIP / 20 / (EPS / L)
    np.testing.assert_allclose(
        upd.delta, one_step(ref, w0, X, y) + laplace_noise(seeded_generator(3), b, 21), atol=1e-6
    )


def test_chain_wire_and_fedavg(make_mechanism, make_device, global_msg, wire, ref):
    mech = make_mechanism("laplace", epsilon=EPS, clip=CLIP)
    w0 = np.random.default_rng(1).normal(size=21).astype(np.float32)
    msg = global_msg(w0, round=2)
    X, y = ref.data(n=20, seed=8)
    ups = [
        wire(mech.device_update(make_device(1, device_id="a"), msg, 0), mech, 21),
        wire(mech.device_update(make_device(2, X=X, y=y, device_id="b"), msg, 2), mech, 21),
    ]
    strategy = mech.new_strategy(None, 1.0, seeded_generator(0))
    assert isinstance(strategy, FedAvg)
    for u in ups:
        strategy.add(u, 1.0)
    new, _ = strategy.finish(w0)
    expected = w0 + (40 * ups[0].delta.astype(np.float64) + 20 * ups[1].delta) / 60
    np.testing.assert_allclose(new, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("schedule", ["uniform", "geometric"])
def test_events_schedule_and_composed_epsilon(make_mechanism, schedule):
    mech = make_mechanism("laplace", epsilon=EPS, clip=CLIP, schedule=schedule, schedule_decay=0.8)
    assert mech.max_exposures() == L
    if schedule == "uniform":
        eps_k = [EPS / L] * L
    else:
        eps_k = [EPS * 0.2 * 0.8**k / (1 - 0.8**L) for k in range(L)]
    events = [e for k in range(L) for e in mech.release_events(40, k)]
    assert [(e.relation, e.unit, e.mechanism) for e in events] == [
        (NeighboringRelation.REPLACE_ONE, "example", "laplace")
    ] * L
    assert all(type(e.event) is dpa.LaplaceDpEvent for e in events)
    assert [e.event.noise_multiplier for e in events] == pytest.approx([1 / e for e in eps_k])
    assert events[0] == PrivacyEvent(
        dpa.LaplaceDpEvent(1 / mech.params.epsilon_round(0)),
        NeighboringRelation.REPLACE_ONE,
        "example",
        "laplace",
    )
    assert mech.release_events(10, 0) == mech.release_events(1000, 0)  # |D| is in the scale only
    assert math.fsum(e.pure_epsilon for e in events) == pytest.approx(EPS, rel=1e-12)
    bound = best_epsilon(events, 1e-5)
    assert bound.values["basic"] == pytest.approx(EPS, rel=1e-12)
    rdp = RdpAccountant(ORDERS, dpa.NeighboringRelation.REPLACE_ONE)
    for e in eps_k:
        rdp.compose(dpa.LaplaceDpEvent(1 / e))
    assert bound.values["rdp"] == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-9)
    assert bound.epsilon <= EPS * (1 + 1e-12)
    assert mech.describe()["epsilon_per_round"] == pytest.approx(eps_k, rel=1e-12)


def test_schedule_is_spent_after_max_uploads(make_mechanism, make_device, global_msg):
    mech = make_mechanism("laplace", epsilon=EPS)
    with pytest.raises(ValueError, match=r"round_index must be in \[0, 5\)"):
        mech.device_update(make_device(1), global_msg(np.zeros(21, np.float32)), exposure=L)
    # the aggregator still charges a release past the schedule (a device that lost its count),
    # at the schedule's largest epsilon, instead of failing
    [past] = mech.release_events(40, L)
    assert past.pure_epsilon == pytest.approx(max(mech.params.epsilon_schedule()))


def test_config_describe_and_guarantee(make_mechanism, make_facts):
    with pytest.raises(ValueError, match=r"needs privacy\.epsilon"):
        make_mechanism("laplace")
    mech = make_mechanism(
        "laplace", epsilon=EPS, clip=0.5, facts=make_facts(max_uploads=3, local_lr=0.2)
    )
    assert isinstance(mech, Laplace) and mech.accounts and mech.round_events() == []
    d = mech.describe()
    assert d["mechanism"] == "laplace" and d["delta"] == 1e-5
    assert (d["epsilon_total"], d["clip_l1"], d["local_lr"], d["max_exposures"]) == (
        EPS,
        0.5,
        0.2,
        3,
    )
    assert d["schedule"] == "uniform" and len(d["epsilon_per_round"]) == 3
    assert "one full-batch local step" in d["notes"][0]
    g = d["guarantee"]
    assert (g["unit"], g["relation"], g["kind"]) == ("example", "replace_one", "pure")
    assert g["text"].startswith("pure eps-DP per example")
    assert g["text"].endswith("assumed public: |D| (the device's sample count)")
