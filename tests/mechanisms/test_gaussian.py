"""gaussian (local DP-FedAvg): clip the local update in L2 to S, add N(0, (zS)^2) on the device."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from scipy import stats

from edge_fl.mechanisms.base import FedAvg
from edge_fl.mechanisms.gaussian import LocalGaussian
from edge_fl.models import make_model
from edge_fl.models.training import LocalTraining
from edge_fl.privacy.accountants import best_epsilon
from edge_fl.privacy.events import NeighboringRelation, PrivacyEvent
from edge_fl.privacy.noise import gaussian_noise
from edge_fl.privacy.rng import seeded_generator

S, Z = 0.05, 0.8
TRAIN = LocalTraining(epochs=2, batch_size=8, lr=0.1)


@pytest.fixture
def big(ref, make_device):
    X, y = ref.data(n=40, n_features=30, n_classes=5, seed=4)
    model = make_model("logreg", 30, 5)
    return lambda seed: make_device(seed, X=X, y=y, model=model, training=TRAIN)


def clipped_local_update(ref, w0, dev, seed):
    """Independent: the same minibatch SGD (same permutation draws), then the L2 clip to S."""
    return ref.clip(ref.local_sgd(w0, dev.X, dev.y, TRAIN, seeded_generator(seed)) - w0, S)


def test_noise_free_part_is_the_clipped_local_update(make_mechanism, make_device, global_msg, ref):
    mech = make_mechanism("gaussian", noise_multiplier=1e-12, clip=S)
    w0 = np.random.default_rng(3).normal(size=21).astype(np.float32)
    dev = make_device(5, training=TRAIN)
    upd = mech.device_update(dev, global_msg(w0), 0)
    raw = ref.local_sgd(w0, dev.X, dev.y, TRAIN, seeded_generator(5)) - w0
    assert np.linalg.norm(raw) > 3 * S  # the clip binds
    np.testing.assert_allclose(upd.delta, ref.clip(raw, S), atol=1e-6)
    assert np.linalg.norm(upd.delta) == pytest.approx(S, rel=1e-5)
    assert upd.mechanism == "gaussian"


def test_device_adds_gaussian_noise_of_std_z_s(make_mechanism, big, global_msg, ref):
    mech = make_mechanism("gaussian", noise_multiplier=Z, clip=S)
    w0 = np.zeros(155, np.float32)
    msg = global_msg(w0)
    # exact replay of one device: permutations for 2 epochs, then the hardened Gaussian sampler
    upd = mech.device_update(big(21), msg, 0)
    g = seeded_generator(21)
    for _epoch in range(TRAIN.epochs):
        g.permutation(40)
    np.testing.assert_allclose(
        upd.delta,
        clipped_local_update(ref, w0, big(0), 21) + gaussian_noise(g, Z * S, 155),
        atol=2e-6,
    )
    raw = ref.local_sgd(w0, big(0).X, big(0).y, TRAIN, seeded_generator(21)) - w0
    assert np.linalg.norm(raw) > 2 * S  # the clip binds: the noise-free part has norm S
    # statistically over 20 generators: noise ~ N(0, (zS)^2)
    noise = np.concatenate(
        [
            mech.device_update(big(s), msg, 0).delta - clipped_local_update(ref, w0, big(0), s)
            for s in range(100, 120)
        ]
    )
    assert noise.std() / (Z * S) == pytest.approx(1.0, abs=0.06)  # se of the std ~1.3%
    assert abs(noise.mean()) < 5 * Z * S / math.sqrt(noise.size)
    assert stats.kstest(noise / (Z * S), stats.norm.cdf).pvalue > 1e-4


def test_two_generators_give_uploads_differing_by_noise(make_mechanism, make_device, global_msg):
    full = LocalTraining(epochs=1, batch_size=64, lr=0.1)  # full batch: same noise-free part
    mech = make_mechanism("gaussian", noise_multiplier=Z, clip=S)
    msg = global_msg(np.zeros(21, np.float32))
    diffs = np.concatenate(
        [
            mech.device_update(make_device(2 * s, training=full), msg, 0).delta
            - mech.device_update(make_device(2 * s + 1, training=full), msg, 0).delta
            for s in range(60)
        ]
    )
    assert np.all(diffs != 0)
    assert diffs.std() / (math.sqrt(2) * Z * S) == pytest.approx(1.0, abs=0.1)


def test_chain_wire_and_fedavg(make_mechanism, make_device, global_msg, wire, ref):
    mech = make_mechanism("gaussian", noise_multiplier=Z, clip=S)
    w0 = np.zeros(21, np.float32)
    msg = global_msg(w0)
    X, y = ref.data(n=10, seed=6)
    ups = [
        wire(mech.device_update(make_device(1, device_id="a"), msg, 0), mech, 21),
        wire(mech.device_update(make_device(2, X=X, y=y, device_id="b"), msg, 0), mech, 21),
    ]
    strategy = mech.new_strategy(None, 2.0, seeded_generator(0))
    assert isinstance(strategy, FedAvg)
    for u in ups:
        strategy.add(u, 1.0)
    new, _ = strategy.finish(w0)
    expected = 2.0 * (40 * ups[0].delta.astype(np.float64) + 10 * ups[1].delta) / 50
    np.testing.assert_allclose(new, expected, rtol=1e-6, atol=1e-7)


def test_event_is_gaussian_z_over_2_replace_one_device(make_mechanism):
    mech = make_mechanism("gaussian", noise_multiplier=Z, clip=S)
    expected = PrivacyEvent(
        dpa.GaussianDpEvent(Z / 2), NeighboringRelation.REPLACE_ONE, "device", "gaussian-local"
    )
    assert mech.release_events(40, 0) == [expected]
    assert mech.release_events(7, 9) == [expected]  # neither |D| nor the exposure change it
    assert mech.round_events() == [] and mech.max_exposures() is None


def test_calibrated_z_spends_exactly_epsilon_over_max_uploads(make_mechanism, make_facts):
    eps, delta, L = 3.0, 1e-5, 5
    mech = make_mechanism("gaussian", epsilon=eps, delta=delta, facts=make_facts(max_uploads=L))
    z = mech.params.noise_multiplier
    assert mech.max_exposures() == L
    # L Gaussians of multiplier z/2 = one Gaussian of multiplier z / (2 sqrt(L)): exact epsilon
    exact = dpa.get_epsilon_gaussian(z / 2 / math.sqrt(L), delta)
    assert exact <= eps and exact == pytest.approx(eps, rel=1e-6)
    assert dpa.get_epsilon_gaussian(0.99 * z / 2 / math.sqrt(L), delta) > eps
    events = [e for k in range(L) for e in mech.release_events(40, k)]
    bound = best_epsilon(events, delta)
    assert exact * (1 - 1e-6) <= bound.epsilon <= eps * (1 + 1e-6)
    d = mech.describe()
    assert (d["noise_multiplier"], d["target_epsilon"], d["max_uploads"], d["clip_l2"]) == (
        z,
        eps,
        L,
        1.0,
    )


def test_config_needs_z_or_epsilon_and_describes(make_mechanism):
    with pytest.raises(ValueError, match=r"needs privacy\.noise_multiplier or privacy\.epsilon"):
        make_mechanism("gaussian")
    mech = make_mechanism("gaussian", noise_multiplier=Z, clip=S, epsilon=9.0)
    assert isinstance(mech, LocalGaussian)
    assert mech.params.noise_multiplier == Z  # an explicit multiplier wins over the target
    d = mech.describe()
    assert (d["noise_multiplier"], d["max_uploads"], d["delta"]) == (Z, None, 1e-5)
    assert (d["guarantee"]["unit"], d["guarantee"]["relation"]) == ("device", "replace_one")
    assert d["guarantee"]["text"].startswith("(eps, delta)-DP per device")
