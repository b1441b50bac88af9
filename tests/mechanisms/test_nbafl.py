"""nbafl: ONE full-batch step on per-example gradients clipped to C/lr, projection onto the C-ball,
uplink N(0, sigma_U^2) on the device; FedAvg plus downlink N(0, sigma_D^2) iff T > L sqrt(N)."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest

from edge_fl.mechanisms.nbafl import NbAfl, NbAflFedAvg
from edge_fl.models.training import LocalTraining, local_sgd
from edge_fl.privacy.accountants import best_epsilon
from edge_fl.privacy.events import NeighboringRelation, PrivacyEvent
from edge_fl.privacy.noise import gaussian_noise
from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import DenseUpdate, SignDSUpdate

C, LR, EPS, DELTA = 0.15, 0.1, 0.5, 1e-5
T, L, N, M = 40, 2, 100, 20  # T^2 = 1600 > L^2 N = 400: downlink noise on
CC = math.sqrt(2 * math.log(1.25 / DELTA))
SIGMA_U = 2 * CC * C * L / (M * EPS)
SIGMA_D = 2 * CC * C * math.sqrt(T**2 - L**2 * N) / (M * N * EPS)


@pytest.fixture
def nbafl(make_facts, make_mechanism):
    def factory(rounds=T, uploads=L, n_params=21, **privacy):
        privacy = {"epsilon": EPS, "delta": DELTA, "clip": C, **privacy}
        facts = make_facts(
            rounds=rounds, max_uploads=uploads, n_devices=N, expected_participants=5.0,
            min_dataset_size=M, local_lr=LR, n_params=n_params,
        )  # fmt: skip
        return make_mechanism("nbafl", facts, **privacy)

    return factory


def noise_free(ref, w0, X, y):
    """Independent: w0 - lr * mean(L2-clip(g_i, C/lr)), projected onto the C-ball, as a delta."""
    g = ref.clip_rows(ref.per_sample_grads(w0, X, y), C / LR, ord=2)
    return ref.clip(w0 - LR * g.mean(axis=0), C) - w0


@pytest.mark.parametrize("w_norm", [0.0, 3.0])  # projection idle / binding
def test_local_step_is_one_clipped_full_batch_step_then_projection(
    nbafl, make_device, global_msg, ref, w_norm
):
    mech = nbafl(epsilon=1e12)  # sigma_U ~ 1e-12: the noise-free upload
    v = np.random.default_rng(5).normal(size=21)
    w0 = (w_norm * v / np.linalg.norm(v)).astype(np.float32)
    dev = make_device(2, training=LocalTraining(epochs=7, batch_size=3, lr=0.9))  # all unused
    upd = mech.device_update(dev, global_msg(w0), 0)
    expected = noise_free(ref, w0, dev.X, dev.y)
    np.testing.assert_allclose(upd.delta, expected, atol=1e-6)
    assert np.linalg.norm(w0 + upd.delta) <= C * (1 + 1e-5)
    raw = ref.per_sample_grads(w0, dev.X, dev.y)
    assert (np.linalg.norm(raw, axis=1) > C / LR).any()  # the per-example clip binds somewhere


def test_device_adds_uplink_noise_sigma_u(nbafl, make_device, global_msg, ref):
    mech = nbafl()
    assert mech.params.sigma_uplink == pytest.approx(SIGMA_U, rel=1e-12)
    w0 = np.zeros(21, np.float32)
    msg = global_msg(w0)
    clean = noise_free(ref, w0, make_device().X, make_device().y)
    upd = mech.device_update(make_device(17), msg, 0)
    np.testing.assert_allclose(
        upd.delta, clean + gaussian_noise(seeded_generator(17), SIGMA_U, 21), atol=1e-5
    )
    noise = np.concatenate(
        [mech.device_update(make_device(s), msg, 0).delta - clean for s in range(150)]
    )
    assert noise.std() / SIGMA_U == pytest.approx(1.0, abs=0.06)  # 3150 draws, se ~1.3%
    assert abs(noise.mean()) < 5 * SIGMA_U / math.sqrt(noise.size)


def crafted_neighbours(X, y, j):
    """Replace sample j by extreme crafted samples (huge feature vectors, every label)."""
    out = []
    for scale in (1e3, -1e3, 50.0):
        for label in range(3):
            Xn, yn = X.copy(), y.copy()
            Xn[j] = scale * np.sign(X[j] + 1e-3)
            yn[j] = label
            out.append((Xn, yn))
    return out


@pytest.mark.parametrize("w_norm", [0.0, 3.0])
def test_replacing_one_sample_moves_the_upload_by_at_most_2c_over_d(
    nbafl, make_device, global_msg, ref, w_norm
):
    mech = nbafl()  # real noise: same generator seed on both sides, so the noise cancels
    v = np.random.default_rng(6).normal(size=21)
    w0 = (w_norm * v / np.linalg.norm(v)).astype(np.float32)
    msg = global_msg(w0)
    X, y = make_device().X, make_device().y
    X2, y2 = ref.data(n=40, seed=11)
    bound = 2 * C / len(y)
    base = mech.device_update(make_device(99, X=X, y=y), msg, 0).delta.astype(np.float64)
    moved = []
    for j in (0, 7, 23, 39):
        neighbours = crafted_neighbours(X, y, j)
        Xr, yr = X.copy(), y.copy()
        Xr[j], yr[j] = X2[j], y2[j]  # a real replacement
        neighbours.append((Xr, yr))
        for Xn, yn in neighbours:
            other = mech.device_update(make_device(99, X=Xn, y=yn), msg, 0).delta
            moved.append(np.linalg.norm(other - base))
    assert max(moved) <= bound * (1 + 1e-4)
    if w_norm == 0.0:  # no projection: a crafted sample reaches a good part of the bound
        assert max(moved) > 0.5 * bound


def test_multi_epoch_training_would_break_the_bound(make_device, ref):
    """Power check of the test above: the old local training (several minibatch epochs, then the
    projection) moves the parameters by far more than 2C/|D| for a crafted sample."""
    dev = make_device()
    X, y = dev.X, dev.y
    training = LocalTraining(epochs=5, batch_size=8, lr=LR)
    w0 = np.zeros(21, np.float32)

    def old(Xd, yd):
        return ref.clip(
            local_sgd(dev.model, w0, Xd, yd, training, seeded_generator(1)).astype(np.float64), C
        )

    moved = max(np.linalg.norm(old(Xn, yn) - old(X, y)) for Xn, yn in crafted_neighbours(X, y, 3))
    assert moved > 2 * (2 * C / len(y))


def test_device_below_m_samples_is_refused(nbafl, make_device, global_msg, ref):
    mech = nbafl()
    X, y = ref.data(n=M - 1, seed=3)
    with pytest.raises(ValueError, match=r"19 examples is below m = 20"):
        mech.device_update(make_device(1, X=X, y=y), global_msg(np.zeros(21, np.float32)), 0)
    X, y = ref.data(n=M, seed=3)
    mech.device_update(make_device(1, X=X, y=y), global_msg(np.zeros(21, np.float32)), 0)


def test_downlink_noise_when_t_exceeds_l_sqrt_n(nbafl):
    mech = nbafl(n_params=30_000)
    assert mech.params.sigma_downlink == pytest.approx(SIGMA_D, rel=1e-12)
    assert mech.describe()["sigma_downlink"] == pytest.approx(SIGMA_D, rel=1e-12)
    strategy = mech.new_strategy(None, 1.0, seeded_generator(4))
    assert isinstance(strategy, NbAflFedAvg)
    g = np.random.default_rng(0)
    a, b = g.normal(size=30_000) * 0.01, g.normal(size=30_000) * 0.01
    strategy.add(DenseUpdate("a", 3, 3, 20, a.astype(np.float32)), 1.0)
    strategy.add(DenseUpdate("b", 3, 3, 60, b.astype(np.float32)), 1.0)
    w0 = np.full(30_000, 0.1, np.float32)
    new, info = strategy.finish(w0)
    fedavg = w0 + (20 * a.astype(np.float32).astype(np.float64) + 60 * b.astype(np.float32)) / 80
    residual = new.astype(np.float64) - fedavg
    assert residual.std() / SIGMA_D == pytest.approx(1.0, abs=0.02)  # se ~0.4%
    assert abs(residual.mean()) < 5 * SIGMA_D / math.sqrt(residual.size)
    assert info["sigma_downlink"] == pytest.approx(SIGMA_D)
    # and it is exactly the hardened sampler's draw from the aggregator's generator
    replay = fedavg.astype(np.float32).astype(np.float64) + gaussian_noise(
        seeded_generator(4), SIGMA_D, 30_000
    )
    np.testing.assert_allclose(new, replay, atol=2e-6)


@pytest.mark.parametrize(("rounds", "uploads"), [(20, 2), (40, 4), (10, 2)])  # T <= L sqrt(N)
def test_no_downlink_noise_otherwise(nbafl, rounds, uploads):
    mech = nbafl(rounds=rounds, uploads=uploads)
    assert mech.params.sigma_downlink == 0.0
    strategy = mech.new_strategy(None, 0.5, seeded_generator(4))
    d = np.linspace(-1, 1, 21)
    strategy.add(DenseUpdate("a", 3, 3, 30, d.astype(np.float32)), 1.0)
    w0 = np.zeros(21, np.float32)
    new, info = strategy.finish(w0)
    np.testing.assert_allclose(new, 0.5 * d.astype(np.float32), rtol=1e-7)
    assert info["sigma_downlink"] == 0.0


def test_empty_round_gets_no_downlink_noise(nbafl):
    strategy = nbafl().new_strategy(None, 1.0, seeded_generator(4))
    w0 = np.arange(21, dtype=np.float32)
    new, _ = strategy.finish(w0)
    np.testing.assert_array_equal(new, w0)
    with pytest.raises(TypeError, match="FedAvg takes dense updates"):
        strategy.add(SignDSUpdate("d", 3, 3, 20, 1, np.array([2], np.uint32), 0), 1.0)


def test_chain_wire_and_weighted_fedavg(nbafl, make_device, global_msg, wire, ref):
    mech = nbafl(rounds=20)  # no downlink noise: finish is the plain weighted mean
    w0 = np.zeros(21, np.float32)
    msg = global_msg(w0)
    X, y = ref.data(n=60, seed=9)
    ups = [
        wire(mech.device_update(make_device(1, device_id="a"), msg, 0), mech, 21),
        wire(mech.device_update(make_device(2, X=X, y=y, device_id="b"), msg, 1), mech, 21),
    ]
    strategy = mech.new_strategy(None, 1.0, seeded_generator(0))
    for u in ups:
        strategy.add(u, 1.0)
    new, _ = strategy.finish(w0)
    np.testing.assert_allclose(
        new, (40 * ups[0].delta.astype(np.float64) + 60 * ups[1].delta) / 100, rtol=1e-6, atol=1e-7
    )


def test_events_and_composed_epsilon(nbafl):
    mech = nbafl()
    event = PrivacyEvent(
        dpa.GaussianDpEvent(CC * L / EPS), NeighboringRelation.REPLACE_ONE, "example", "nbafl"
    )
    [got] = mech.release_events(40, 0)
    assert got.event.noise_multiplier == pytest.approx(CC * L / EPS, rel=1e-12)
    assert (got.relation, got.unit, got.mechanism) == (event.relation, event.unit, event.mechanism)
    assert mech.release_events(20, 1) == [got] and mech.round_events() == []
    assert mech.max_exposures() == L
    # L uploads of multiplier cL/eps = one Gaussian of multiplier cL/(eps sqrt(L)): exact epsilon
    exact = dpa.get_epsilon_gaussian(CC * L / EPS / math.sqrt(L), DELTA)
    assert exact < EPS  # the paper's calibration holds for eps < 1
    bound = best_epsilon([got] * L, DELTA)
    assert exact * (1 - 1e-6) <= bound.epsilon <= exact * 1.01


def test_config_describe_and_warnings(nbafl, make_mechanism):
    with pytest.raises(ValueError, match=r"needs privacy\.epsilon"):
        make_mechanism("nbafl")
    with pytest.raises(ValueError, match="exposures must be in"):
        nbafl(rounds=5, uploads=6)
    mech = nbafl()
    assert isinstance(mech, NbAfl) and mech.warnings() == []
    d = mech.describe()
    assert (d["rounds_T"], d["uploads_L"], d["devices_N"], d["min_dataset_size_m"]) == (T, L, N, M)
    assert (d["clip_l2"], d["epsilon_target"], d["delta"]) == (C, EPS, DELTA)
    assert d["c"] == pytest.approx(CC) and d["sigma_uplink"] == pytest.approx(SIGMA_U)
    assert d["noise_multiplier_per_upload"] == pytest.approx(CC * L / EPS)
    assert "one full-batch local step" in d["notes"][0]
    loud = nbafl(epsilon=2.0)
    [w] = loud.warnings()
    assert w.startswith("nbafl: epsilon 2.0 >= 1")
