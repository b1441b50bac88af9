"""dpsgd: round(epochs / q) DP-SGD steps per round on the device; sigma given or calibrated so that
L = max_uploads uploads compose to at most epsilon."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from edge_fl.mechanisms.base import FedAvg
from edge_fl.mechanisms.dpsgd import DpSgd
from edge_fl.models import make_model
from edge_fl.privacy.accountants import best_epsilon
from edge_fl.privacy.events import NeighboringRelation, PrivacyEvent
from edge_fl.privacy.rng import seeded_generator

ORDERS = [1 + x / 10 for x in range(1, 100)] + list(range(12, 64))
C, LR, SIGMA, EPS, L = 0.5, 0.1, 1.1, 2.0, 3


class CountingModel:
    """Wraps a model and records the parameters every per-sample-gradient call was made at."""

    def __init__(self, model):
        self.inner = model
        self.at: list[np.ndarray] = []

    def per_sample_grads(self, params, X, y):
        self.at.append(np.array(params, copy=True))
        return self.inner.per_sample_grads(params, X, y)


@pytest.fixture(scope="module")
def calibrated(make_facts, make_mechanism):
    facts = make_facts(batch_size=8, local_epochs=1, max_uploads=L, dataset_sizes=(80, 160, 80))
    return make_mechanism("dpsgd", facts, epsilon=EPS, delta=1e-5, clip=C)


def test_steps_and_rate_per_dataset_size(make_mechanism, make_facts):
    mech = make_mechanism("dpsgd", noise_multiplier=SIGMA)  # batch 8, epochs 1
    assert [(mech.rate(n), mech.steps(n)) for n in (40, 20, 80, 4)] == [
        (0.2, 5),
        (0.4, 2),  # round(2.5) = 2
        (0.1, 10),
        (1.0, 1),  # |D| < batch: q = 1, one step per epoch
    ]
    three = make_mechanism("dpsgd", make_facts(local_epochs=3), noise_multiplier=SIGMA)
    assert three.steps(40) == 15
    fixed = make_mechanism("dpsgd", noise_multiplier=SIGMA, sample_rate=0.5)
    assert (fixed.rate(40), fixed.steps(40), fixed.rate(1000), fixed.steps(1000)) == (
        0.5,
        2,
        0.5,
        2,
    )


def test_release_event_is_self_composed_poisson_gaussian(make_mechanism):
    mech = make_mechanism("dpsgd", noise_multiplier=SIGMA)
    rel = NeighboringRelation.REPLACE_SPECIAL
    assert mech.release_events(40, 0) == [
        PrivacyEvent(
            dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.2, dpa.GaussianDpEvent(SIGMA)), 5),
            rel,
            "example",
            "dpsgd",
        )
    ]
    assert mech.release_events(40, 7) == mech.release_events(40, 0)
    assert mech.release_events(4, 0)[0].event == dpa.SelfComposedDpEvent(
        dpa.GaussianDpEvent(SIGMA), 1
    )
    assert mech.max_exposures() is None and mech.round_events() == []


@pytest.mark.parametrize("n", [80, 160])
def test_calibrated_sigma_spends_epsilon_over_max_uploads(calibrated, n):
    assert calibrated.max_exposures() == L
    q, steps = 8 / n, round(1 / (8 / n))
    [event] = calibrated.release_events(n, 0)
    sigma = event.event.event.event.noise_multiplier
    assert event.event == dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps
    )

    def rdp_eps(s):
        acc = RdpAccountant(ORDERS)
        acc.compose(
            dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s)), steps), L
        )
        return acc.get_epsilon(1e-5)

    assert rdp_eps(sigma) <= EPS * (1 + 1e-9)
    assert rdp_eps(sigma) == pytest.approx(EPS, rel=1e-3)
    assert rdp_eps(0.98 * sigma) > EPS
    assert best_epsilon([event] * L, 1e-5).epsilon <= EPS * (1 + 1e-6)


def test_describe_lists_every_dataset_size(calibrated, make_mechanism):
    d = calibrated.describe()
    by = d["by_dataset_size"]
    assert [(e["sampling_rate"], e["steps_per_round"]) for e in by] == [(0.05, 20), (0.1, 10)]
    sigmas = [e["noise_multiplier"] for e in by]
    assert sigmas[0] < sigmas[1]  # smaller q amplifies more: less noise for the same epsilon
    assert all(e["clip_l2"] == C for e in by)
    assert (d["target_epsilon"], d["max_uploads"], d["clip_l2"], d["delta"]) == (EPS, L, C, 1e-5)
    explicit = make_mechanism("dpsgd", noise_multiplier=SIGMA).describe()  # sizes (20, 40, 40, 80)
    assert [
        (e["sampling_rate"], e["steps_per_round"], e["noise_multiplier"])
        for e in explicit["by_dataset_size"]
    ] == [
        (0.1, 10, SIGMA),
        (0.2, 5, SIGMA),
        (0.4, 2, SIGMA),
    ]
    assert explicit["max_uploads"] is None
    assert explicit["guarantee"]["relation"] == "replace_special"


def test_device_steps_are_clipped_full_batch_gradients(
    make_mechanism, make_facts, make_device, global_msg, ref
):
    w0 = np.random.default_rng(4).normal(size=21).astype(np.float32)
    # q = 1, epochs 2, sigma ~ 0: two deterministic full-batch steps, the second at the first's result
    mech = make_mechanism(
        "dpsgd", make_facts(local_epochs=2), noise_multiplier=1e-12, sample_rate=1.0, clip=C
    )
    dev = make_device(3)
    counting = CountingModel(dev.model)
    dev.model = counting
    upd = mech.device_update(dev, global_msg(w0), 0)
    w1 = w0 - LR * ref.clip_rows(ref.per_sample_grads(w0, dev.X, dev.y), C, ord=2).mean(axis=0)
    w2 = w1 - LR * ref.clip_rows(ref.per_sample_grads(w1, dev.X, dev.y), C, ord=2).mean(axis=0)
    np.testing.assert_allclose(upd.delta, w2 - w0, atol=1e-6)
    assert len(counting.at) == 2
    np.testing.assert_allclose(counting.at[0], w0, atol=0)
    np.testing.assert_allclose(counting.at[1], w1, atol=1e-7)
    assert np.linalg.norm(w2 - w1) > 0.01  # the clip binds and both steps move the model


def test_device_noise_has_std_lr_sigma_c_over_expected_batch(
    make_mechanism, make_device, global_msg, ref
):
    X, y = ref.data(n=40, n_features=30, n_classes=5, seed=4)
    model = make_model("logreg", 30, 5)
    mech = make_mechanism("dpsgd", noise_multiplier=2.0, sample_rate=1.0, clip=C)
    w0 = np.zeros(155, np.float32)
    msg = global_msg(w0)
    clean = -LR * ref.clip_rows(ref.per_sample_grads(w0, X, y), C, ord=2).mean(axis=0)
    ups = [
        mech.device_update(make_device(s, X=X, y=y, model=model), msg, 0).delta for s in range(20)
    ]
    noise = np.concatenate([u - clean for u in ups])
    sd = LR * 2.0 * C / 40
    assert noise.std() / sd == pytest.approx(1.0, abs=0.06)
    assert abs(noise.mean()) < 5 * sd / math.sqrt(noise.size)
    assert not np.array_equal(ups[0], ups[1])


def test_poisson_steps_run_on_the_device(make_mechanism, make_device, global_msg):
    mech = make_mechanism("dpsgd", noise_multiplier=SIGMA, clip=C)  # q = 8/40, 5 steps
    dev = make_device(8)
    counting = CountingModel(dev.model)
    dev.model = counting
    mech.device_update(dev, global_msg(np.zeros(21, np.float32)), 0)
    assert len(counting.at) == 5  # one gradient evaluation per (non-empty) Poisson batch
    assert all(not np.array_equal(a, b) for a, b in zip(counting.at, counting.at[1:], strict=False))


def test_chain_wire_and_fedavg(make_mechanism, make_device, global_msg, wire):
    mech = make_mechanism("dpsgd", noise_multiplier=SIGMA, clip=C)
    assert isinstance(mech, DpSgd)
    w0 = np.zeros(21, np.float32)
    msg = global_msg(w0)
    ups = [
        wire(mech.device_update(make_device(s, device_id=f"d{s}"), msg, 0), mech, 21)
        for s in (1, 2)
    ]
    strategy = mech.new_strategy(None, 1.0, seeded_generator(0))
    assert isinstance(strategy, FedAvg)
    for u in ups:
        strategy.add(u, 1.0)
    new, _ = strategy.finish(w0)
    np.testing.assert_allclose(
        new, (ups[0].delta.astype(np.float64) + ups[1].delta) / 2, rtol=1e-6, atol=1e-8
    )


def test_needs_sigma_or_finite_epsilon(make_mechanism):
    with pytest.raises(ValueError, match=r"needs privacy\.noise_multiplier or a finite"):
        make_mechanism("dpsgd")
