"""gaussian-central: devices only clip; the aggregator adds N(0, (zS)^2) to the sum every round,
also an empty one, and divides by the EXPECTED participant count."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from edge_fl.mechanisms.gaussian_central import CentralGaussian, CentralGaussianSum
from edge_fl.models.training import LocalTraining
from edge_fl.privacy.accountants import best_epsilon
from edge_fl.privacy.events import NeighboringRelation, PrivacyEvent
from edge_fl.privacy.noise import gaussian_noise
from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import DenseUpdate, SignDSUpdate

ORDERS = [1 + x / 10 for x in range(1, 100)] + list(range(12, 64))
S, Z, E, N_DEV, T = 0.1, 1.2, 5.0, 100, 10  # q = E / N = 0.05
TRAIN = LocalTraining(epochs=1, batch_size=8, lr=0.1)


@pytest.fixture
def central(make_facts, make_mechanism):
    def factory(n_params: int = 21, **privacy):
        privacy.setdefault("noise_multiplier", Z)
        privacy.setdefault("clip", S)
        facts = make_facts(n_devices=N_DEV, expected_participants=E, rounds=T, n_params=n_params)
        return make_mechanism("gaussian-central", facts, **privacy)

    return factory


@pytest.fixture(scope="module")
def calibrated(make_facts, make_mechanism):
    facts = make_facts(n_devices=N_DEV, expected_participants=E, rounds=T)
    return make_mechanism(
        "gaussian-central", facts, epsilon=2.0, delta=1e-5, poisson_selection=True
    )


def dense(delta, n=10, device="d"):
    return DenseUpdate(device, 3, 3, n, np.asarray(delta, np.float32))


def test_device_only_clips(central, make_device, global_msg, ref):
    mech = central(noise_multiplier=50.0)  # a huge z: any noise on the device would show
    w0 = np.random.default_rng(0).normal(size=21).astype(np.float32)
    upd = mech.device_update(make_device(4, training=TRAIN), global_msg(w0), 0)
    raw = ref.local_sgd(w0, make_device().X, make_device().y, TRAIN, seeded_generator(4)) - w0
    assert np.linalg.norm(raw) > 2 * S
    np.testing.assert_allclose(upd.delta, ref.clip(raw, S), atol=1e-6)
    assert upd.mechanism == "gaussian-central"
    assert mech.release_events(40, 0) == []  # the cost is the round's, not the upload's


def test_empty_round_adds_noise_with_the_fixed_denominator(central):
    mech = central(n_params=40_000)
    assert mech.acts_on_empty_round is True
    strategy = mech.new_strategy(None, 1.0, seeded_generator(9))
    assert isinstance(strategy, CentralGaussianSum) and strategy.count == 0
    w0 = np.full(40_000, 0.5, np.float32)
    new, info = strategy.finish(w0)
    step = new.astype(np.float64) - w0
    sd = Z * S / E
    assert step.std() / sd == pytest.approx(1.0, abs=0.02)  # se of the std ~0.35%
    assert abs(step.mean()) < 5 * sd / math.sqrt(step.size)
    assert info["noise_std"] == pytest.approx(Z * S)
    assert info["update_norm"] == pytest.approx(float(np.linalg.norm(step)), rel=1e-4)
    assert strategy.state is None


def test_finish_is_unweighted_sum_over_expected_count(central, make_device, global_msg, wire, ref):
    mech = central(noise_multiplier=1e-12)  # noise-free: the denominator alone
    w0 = np.zeros(21, np.float32)
    msg = global_msg(w0)
    X, y = ref.data(n=10, seed=2)
    ups = [
        wire(mech.device_update(make_device(1, device_id="a"), msg, 0), mech, 21),
        wire(mech.device_update(make_device(2, X=X, y=y, device_id="b"), msg, 0), mech, 21),
    ]
    strategy = mech.new_strategy(None, 2.0, seeded_generator(0))
    for u in ups:
        strategy.add(u, 1.0)
    new, _ = strategy.finish(w0)
    # 2 arrived, 5 expected: divide by 5, not 2, and ignore sample counts (device-level DP)
    expected = 2.0 * (ups[0].delta.astype(np.float64) + ups[1].delta) / E
    np.testing.assert_allclose(new, expected, rtol=1e-6, atol=1e-8)


def test_finish_adds_exactly_the_aggregator_noise(central):
    mech = central()
    d = np.random.default_rng(1).normal(size=21)
    a, b = S * 0.9 * d / np.linalg.norm(d), -S * 0.5 * d / np.linalg.norm(d)
    strategy = mech.new_strategy(None, 1.0, seeded_generator(33))
    strategy.add(dense(a), 1.0)
    strategy.add(dense(b), 0.1)  # weights (staleness) do not apply to the central sum
    w0 = np.ones(21, np.float32)
    new, _ = strategy.finish(w0)
    noise = gaussian_noise(seeded_generator(33), Z * S, 21)
    expected = w0 + (a.astype(np.float32).astype(np.float64) + b.astype(np.float32) + noise) / E
    np.testing.assert_allclose(new, expected, rtol=1e-6, atol=1e-7)


def test_over_norm_update_is_rejected_and_changes_nothing(central):
    mech = central()
    v = np.random.default_rng(2).normal(size=21)
    ok, bad = S * v / np.linalg.norm(v), 2 * S * v / np.linalg.norm(v)
    s1 = mech.new_strategy(None, 1.0, seeded_generator(5))
    s2 = mech.new_strategy(None, 1.0, seeded_generator(5))
    s1.add(dense(ok), 1.0)
    s2.add(dense(ok), 1.0)
    with pytest.raises(ValueError, match="exceeds the clip bound"):
        s1.add(dense(bad), 1.0)
    with pytest.raises(TypeError, match="central Gaussian takes dense updates"):
        s1.add(SignDSUpdate("d", 3, 3, 10, 1, np.array([0, 4], np.uint32), 1), 1.0)
    assert s1.count == 1
    w0 = np.zeros(21, np.float32)
    np.testing.assert_array_equal(s1.finish(w0)[0], s2.finish(w0)[0])


@pytest.mark.parametrize("poisson", [False, True])
def test_round_event_and_selection_rate(central, poisson):
    mech = central(poisson_selection=poisson)
    inner = dpa.GaussianDpEvent(Z)
    event = dpa.PoissonSampledDpEvent(E / N_DEV, inner) if poisson else inner
    assert mech.round_events() == [
        PrivacyEvent(event, NeighboringRelation.ADD_OR_REMOVE_ONE, "device", "gaussian-central")
    ]
    assert mech.selection_rate() == (pytest.approx(0.05) if poisson else None)
    assert mech.max_exposures() is None
    d = mech.describe()
    assert d["sampling_rate"] == (pytest.approx(0.05) if poisson else 1.0)
    assert (d["noise_std"], d["expected_participants"], d["population"], d["rounds"]) == (
        pytest.approx(Z * S),
        E,
        N_DEV,
        T,
    )
    assert bool(mech.notes) is not poisson  # without Poisson selection: no amplification, said so


def test_calibrated_z_composes_to_epsilon_over_all_rounds(calibrated):
    z = calibrated.params.noise_multiplier
    assert calibrated.round_events() == [
        PrivacyEvent(
            dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(z)),
            NeighboringRelation.ADD_OR_REMOVE_ONE,
            "device",
            "gaussian-central",
        )
    ]

    def rdp_eps(mult):
        acc = RdpAccountant(ORDERS)
        acc.compose(dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(mult)), T)
        return acc.get_epsilon(1e-5)

    assert rdp_eps(z) <= 2.0 * (1 + 1e-9) and rdp_eps(z) == pytest.approx(2.0, rel=1e-3)
    assert rdp_eps(0.98 * z) > 2.0
    events = [e for _ in range(T) for e in calibrated.round_events()]
    assert best_epsilon(events, 1e-5).epsilon <= 2.0 * (1 + 1e-6)


def test_config_refusals(central, make_facts, make_mechanism):
    for mode in ("fedbuff", "fedasync"):
        with pytest.raises(ValueError, match=f"needs rounds.mode = 'sync'.*got '{mode}'"):
            make_mechanism("gaussian-central", make_facts(mode=mode), noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"needs privacy\.noise_multiplier or privacy\.epsilon"):
        make_mechanism("gaussian-central")
    mech = central()
    assert isinstance(mech, CentralGaussian)
    assert mech.guarantee.relation == "add_or_remove_one" and mech.guarantee.unit == "device"


def test_rounding_level_excess_is_projected_onto_the_clip_ball(central):
    """A delta clipped to S and sent as float16 may come back a hair above S: the aggregator
    projects it (the sum's sensitivity stays S) instead of refusing an honest device."""
    mech = central()
    v = np.random.default_rng(3).normal(size=21)
    hair = S * (1 + 4e-4) * v / np.linalg.norm(v)
    s = mech.new_strategy(None, 1.0, seeded_generator(5))
    s.add(dense(hair), 1.0)
    assert np.linalg.norm(s._sum.value()) == pytest.approx(S, rel=1e-9)
