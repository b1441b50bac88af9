"""signds: sign + exponential-mechanism index selection + a MagRR bit on the device; sample-weighted
vote with step step_ratio * N * r_est on the server; MagRR state carried in the global message."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from edge_fl.mechanisms.signds import SignDS, SignDSAggregate
from edge_fl.models import make_model
from edge_fl.models.training import LocalTraining
from edge_fl.privacy.accountants import best_epsilon
from edge_fl.privacy.events import NeighboringRelation
from edge_fl.privacy.magrr import MagRRState
from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import DenseUpdate, SignDSUpdate, decode_global, encode_global

ORDERS = [1 + x / 10 for x in range(1, 100)] + list(range(12, 64))
D, EXPECTED = 650, 10  # logreg 64 features x 10 classes; 10 uploads expected per round
TRAIN = LocalTraining(epochs=1, batch_size=8, lr=0.1)


@pytest.fixture
def signds(make_facts, make_mechanism):
    def factory(expected=float(EXPECTED), n_params=D, **privacy):
        privacy = {"signds__sign_k": 0.1, **privacy}
        facts = make_facts(n_params=n_params, expected_participants=expected, n_devices=20)
        return make_mechanism("signds", facts, **privacy)

    return factory


@pytest.fixture
def device650(ref, make_device):
    X, y = ref.data(n=40, n_features=64, n_classes=10, seed=12)
    model = make_model("logreg", 64, 10)
    return lambda seed, name="dev-1": make_device(
        seed, X=X, y=y, model=model, training=TRAIN, device_id=name
    )


def signed_topk(u, k, sign):
    order = np.argsort(sign * u, kind="stable")
    return order[-k:]


def test_state_round_trip_through_the_global_message(signds, global_msg):
    mech = signds(magrr__r_est0=2e-4)
    s0 = mech.initial_state()
    assert s0 == MagRRState(2e-4, False, 0)
    for state in (s0, MagRRState(0.03, True, 12), MagRRState(1e-7, False, 3)):
        encoded = mech.encode_state(state)
        assert encoded == {
            "r_est": state.r_est,
            "reached": state.is_reached,
            "reached_count": state.reached_count,
        }
        msg = decode_global(
            encode_global(global_msg(np.zeros(4, np.float32), mechanism_state=encoded))
        )
        assert mech.decode_state(msg.mechanism_state) == state
    with pytest.raises(ValueError, match="MagRR state keys"):
        mech.decode_state({"r_est": 0.1})
    with pytest.raises(ValueError, match="must be a dict"):
        mech.decode_state(None)


def test_update_shape_h_and_selection_bias(signds, device650, global_msg, ref):
    mech = signds()
    w0 = np.zeros(D, np.float32)
    for seed in range(5):
        upd = mech.device_update(device650(seed), global_msg(w0, round=6, version=8), 0)
        assert isinstance(upd, SignDSUpdate)
        assert (upd.round, upd.base_version, upd.n_samples, upd.device) == (6, 8, 40, "dev-1")
        assert len(upd.indices) == mech.plan.h == 86 and upd.indices.dtype == np.uint32
        assert np.all(np.diff(upd.indices.astype(np.int64)) > 0) and upd.indices[-1] < D
        assert upd.sign in (1, -1) and upd.magrr_bit in (0, 1)
        # sign_eps = 100: at least nu_th indices come from the signed top-k of the real update
        u = ref.local_sgd(w0, device650(0).X, device650(0).y, TRAIN, seeded_generator(seed)) - w0
        top = signed_topk(u, mech.plan.topk, upd.sign)
        assert len(np.intersect1d(top, upd.indices)) >= mech.plan.nu_th


@pytest.mark.parametrize(
    ("factor", "reached", "bit"),
    [
        (1 / 1.5, False, 1),  # fast phase: 1 iff r < 2 r_est
        (1 / 3, False, 0),
        (1 / 1.5, True, 0),  # shrink phase: 1 iff r < r_est / 2
        (3.0, True, 1),
    ],
)
def test_device_reads_r_est_from_the_global_message(
    signds, device650, global_msg, ref, factor, reached, bit
):
    mech = signds(magrr__rr_eps=60.0)  # flip probability e^-60: the reported bit is the true bit
    w0 = np.zeros(D, np.float32)
    first = mech.device_update(device650(3), global_msg(w0), 0)
    u = ref.local_sgd(w0, device650(3).X, device650(3).y, TRAIN, seeded_generator(3)) - w0
    r = abs(u[signed_topk(u, mech.plan.topk, first.sign)].mean())
    assert 0 < r * 3 < 1
    state = {"r_est": r * factor, "reached": reached, "reached_count": 0}
    upd = mech.device_update(device650(3), global_msg(w0, mechanism_state=state), 0)
    assert upd.sign == first.sign and np.array_equal(upd.indices, first.indices)
    assert upd.magrr_bit == bit


def test_device_without_state_or_with_bad_r_est(signds, device650, global_msg):
    mech = signds(magrr__rr_eps=60.0)
    w0 = np.zeros(D, np.float32)
    assert mech.device_update(device650(3), global_msg(w0), 0).magrr_bit == 0  # r_est0 = 1e-5
    # r_est outside [0, 1) is replaced by 1.0, as the reference client does: r < 2 -> bit 1
    bad = {"r_est": 5.0, "reached": 0}
    assert mech.device_update(device650(3), global_msg(w0, mechanism_state=bad), 0).magrr_bit == 1


def test_chain_wire_vote_and_step(signds, device650, global_msg, wire, ref):
    mech = signds()
    assert mech.wire_kind == "s" and mech.expected_n == EXPECTED
    w0 = np.random.default_rng(1).normal(size=D).astype(np.float32) * 0.1
    state = MagRRState(0.002, False, 0)
    msg = global_msg(w0, mechanism_state=mech.encode_state(state))
    ups = [wire(mech.device_update(device650(s, f"d{s}"), msg, 0), mech, D) for s in range(3)]
    weights = [1.0, 0.5, 1.0]
    strategy = mech.new_strategy(state, 1.0, seeded_generator(0))
    assert isinstance(strategy, SignDSAggregate) and strategy.state == state
    for u, wt in zip(ups, weights, strict=True):
        strategy.add(u, wt)
    assert strategy.count == 3
    new, info = strategy.finish(w0)
    votes = np.zeros(D)
    for u, wt in zip(ups, weights, strict=True):
        votes[u.indices.astype(np.int64)] += wt * u.n_samples * u.sign
    step = 3.0 * EXPECTED * 0.002
    np.testing.assert_allclose(new, w0 + step * votes / (3 * 40), rtol=1e-6, atol=1e-8)
    assert info["signds_step"] == pytest.approx(step)
    assert info["magrr_ones"] == sum(u.magrr_bit for u in ups)
    assert strategy.state != state and strategy.state.r_est == info["magrr_r_est"]


def _vote(bit, idx=(1, 5)):
    return SignDSUpdate("d", 1, 1, 10, 1, np.array(idx, np.uint32), bit)


@pytest.mark.parametrize(
    ("start", "bits", "action", "after"),
    [
        (MagRRState(1e-3, False, 0), [0, 0, 1], "grow", MagRRState(5e-3, False, 0)),
        (MagRRState(1e-3, False, 0), [1, 1, 0], "count", MagRRState(1e-3, False, 1)),
        (MagRRState(1e-3, False, 10), [1, 1, 0], "switch", MagRRState(1e-3, True, 11)),
        (MagRRState(3e-3, True, 11), [1, 1, 0], "shrink", MagRRState(2e-3, True, 11)),
        (MagRRState(3e-3, True, 11), [0, 1, 0], "hold", MagRRState(3e-3, True, 11)),
        # no bits at all (< 5% of N): fallback to step = sign_global_lr, i.e. r_est = lr / (3 N)
        (MagRRState(3e-3, True, 11), [], "fallback", MagRRState(0.1 / 3 / EXPECTED, True, 11)),
    ],
)
def test_magrr_moves_the_state(signds, start, bits, action, after):
    mech = signds()
    strategy = mech.new_strategy(start, 1.0, seeded_generator(0))
    for b in bits:
        strategy.add(_vote(b), 1.0)
    w0 = np.zeros(D, np.float32)
    new, info = strategy.finish(w0)
    assert info["magrr_action"] == action
    assert strategy.state.is_reached == after.is_reached
    assert strategy.state.reached_count == after.reached_count
    assert strategy.state.r_est == pytest.approx(after.r_est, rel=1e-12)
    assert info["signds_step"] == pytest.approx(3.0 * EXPECTED * start.r_est)
    if bits:
        assert new[1] == pytest.approx(3.0 * EXPECTED * start.r_est)  # every voter picked 1 and 5
        assert new[0] == 0.0
    else:
        np.testing.assert_array_equal(new, w0)  # an empty round leaves the model alone


def test_aggregate_refuses_dense_and_bad_indices(signds):
    strategy = signds().new_strategy(MagRRState(), 1.0, seeded_generator(0))
    with pytest.raises(TypeError, match="SignDS takes SignDS updates"):
        strategy.add(DenseUpdate("d", 1, 1, 5, np.zeros(D, np.float32)), 1.0)
    # uint32 indices as decoded; unsorted, repeated or out-of-range ones never reach the votes
    for bad in ((5, 1), (5, 1, 5), (700, 1), (3, 3)):
        with pytest.raises(ValueError, match="strictly ascending"):
            strategy.add(_vote(1, idx=bad), 1.0)
    assert strategy.count == 0
    new, _ = strategy.finish(np.zeros(D, np.float32))
    np.testing.assert_array_equal(new, np.zeros(D, np.float32))


def test_events_and_composed_epsilon(signds):
    mech = signds(signds__sign_eps=1.0, magrr__rr_eps=0.5)
    events = mech.release_events(40, 0)
    assert [(e.mechanism, e.relation, e.unit) for e in events] == [
        ("signds", NeighboringRelation.REPLACE_ONE, "device"),
        ("magrr-bit", NeighboringRelation.REPLACE_ONE, "device"),
    ]
    for e, eps in zip(events, (1.0, 0.5), strict=True):
        # pure eps as binary RR: P(truth) = e^eps / (1 + e^eps), noise parameter 2 / (1 + e^eps)
        assert isinstance(e.event, dpa.RandomizedResponseDpEvent) and e.event.num_buckets == 2
        assert e.event.noise_parameter == pytest.approx(2 / (1 + math.exp(eps)), rel=1e-12)
        assert e.pure_epsilon == pytest.approx(eps, rel=1e-12)
    k = 4
    ledger = [e for i in range(k) for e in mech.release_events(40, i)]
    bound = best_epsilon(ledger, 1e-5)
    assert bound.values["basic"] == pytest.approx(k * 1.5, rel=1e-12)
    acc = RdpAccountant(ORDERS, dpa.NeighboringRelation.REPLACE_ONE)
    for e in ledger:
        acc.compose(e.event)
    assert bound.values["rdp"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert bound.epsilon <= k * 1.5
    assert mech.max_exposures() is None and mech.round_events() == [] and mech.accounts


def test_describe_warnings_and_size_checks(signds, make_device, global_msg):
    mech = signds(signds__sign_eps=2.0, magrr__rr_eps=1.0)
    assert isinstance(mech, SignDS)
    d = mech.describe()
    assert (d["sign_eps"], d["rr_eps"], d["epsilon_per_upload"]) == (2.0, 1.0, 3.0)
    assert d["plan"]["h"] == mech.plan.h and d["plan"]["topk"] == 65
    assert d["expected_uploads_per_round"] == EXPECTED
    assert d["guarantee"]["kind"] == "pure" and d["guarantee"]["unit"] == "device"
    assert mech.warnings() == []
    small = signds(n_params=21)
    assert "k*d > 50" in small.warnings()[0]
    assert signds(expected=0.4).expected_n == 1
    with pytest.raises(ValueError, match="model has 21 parameters, the SignDS plan 650"):
        mech.device_update(make_device(1), global_msg(np.zeros(21, np.float32)), 0)
