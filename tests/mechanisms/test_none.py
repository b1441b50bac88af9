"""none: plain local SGD on the device, sample-weighted FedAvg on the server; and the registry."""

from __future__ import annotations

import numpy as np
import pytest

from edge_fl.mechanisms import (
    UnknownMechanismError,
    build_mechanism,
    mechanism_class,
    mechanism_names,
    register_mechanism,
)
from edge_fl.mechanisms.base import FedAvg
from edge_fl.mechanisms.laplace import Laplace
from edge_fl.mechanisms.none import NoPrivacy
from edge_fl.models.training import LocalTraining
from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import DenseUpdate, SignDSUpdate

ALL = (
    "none",
    "distributed-gaussian",
    "dpsgd",
    "gaussian",
    "gaussian-central",
    "laplace",
    "nbafl",
    "signds",
)


def test_registry_lists_every_module_with_none_first():
    assert mechanism_names() == ALL
    for name in ALL:
        cls = mechanism_class(name)
        assert cls.name == name
        assert cls.wire_kind == ("s" if name == "signds" else "u")
        assert cls.acts_on_empty_round == (name == "gaussian-central")


def test_registry_refuses_unknown_and_misnamed_mechanisms():
    with pytest.raises(UnknownMechanismError, match=r"unknown privacy mechanism 'lapalce'; one of"):
        mechanism_class("lapalce")
    with pytest.raises(ValueError, match=r"NoPrivacy is named 'none', not 'laplace'"):
        register_mechanism("laplace", NoPrivacy)
    with pytest.raises(ValueError, match=r"'laplace' is already registered \(Laplace\)"):
        register_mechanism("laplace", type("Other", (Laplace,), {}))
    with pytest.raises(ValueError, match="not a Mechanism subclass"):
        register_mechanism("laplace", object)
    assert register_mechanism("laplace", Laplace) is Laplace  # the same class again: a no-op
    assert mechanism_class("laplace") is Laplace


def test_device_rule_is_plain_local_sgd(make_device, global_msg, ref):
    training = LocalTraining(epochs=2, batch_size=8, lr=0.2)
    dev = make_device(seed=5, training=training)
    w0 = np.random.default_rng(9).normal(size=21).astype(np.float32)
    msg = global_msg(w0, round=4, version=6, wire_dtype="f4")
    upd = NoPrivacy(None, None).device_update(dev, msg, exposure=0)  # device half needs no config
    expected = ref.local_sgd(w0, dev.X, dev.y, training, seeded_generator(5)) - w0
    assert isinstance(upd, DenseUpdate)
    assert (upd.device, upd.round, upd.base_version, upd.n_samples) == ("dev-1", 4, 6, 40)
    assert upd.mechanism == "none" and upd.delta.dtype == np.float32
    np.testing.assert_allclose(upd.delta, expected, atol=2e-6)
    assert np.abs(expected).max() > 0.05  # training moved the model: the check has teeth


def test_chain_fedavg_weighted_mean(make_mechanism, make_device, global_msg, wire, ref):
    mech = make_mechanism("none")
    assert isinstance(mech, NoPrivacy)
    w0 = np.zeros(21, np.float32)
    msg = global_msg(w0)
    X, y = ref.data(n=60, seed=3)
    devs = [
        make_device(seed=1, device_id="a"),
        make_device(seed=2, X=X[:20], y=y[:20], device_id="b"),
        make_device(seed=3, X=X, y=y, device_id="c"),
    ]
    got = [wire(mech.device_update(d, msg, 0), mech, 21) for d in devs]
    strategy = mech.new_strategy(mech.initial_state(), 0.5, seeded_generator(0))
    assert isinstance(strategy, FedAvg)
    weights = [1.0, 1.0, 0.25]  # a stale update's weight is not renormalised away
    for u, wt in zip(got, weights, strict=True):
        strategy.add(u, wt)
    assert strategy.count == 3 and strategy.state is None
    new, info = strategy.finish(w0)
    n = np.array([40, 20, 60], np.float64)
    num = sum(
        wt * ni * u.delta.astype(np.float64) for u, wt, ni in zip(got, weights, n, strict=True)
    )
    step = 0.5 * num / n.sum()
    np.testing.assert_allclose(new, w0 + step, rtol=1e-6, atol=1e-7)
    assert new.dtype == np.float32
    assert info == {"update_norm": pytest.approx(float(np.linalg.norm(step)))}
    assert mech.release_events(40, 0) == [] and mech.round_events() == []


def test_fedavg_empty_round_and_wrong_kind():
    strategy = FedAvg(4, 1.0)
    w = np.arange(4, dtype=np.float32)
    new, info = strategy.finish(w)
    np.testing.assert_array_equal(new, w)
    assert new is not w and info == {}
    vote = SignDSUpdate("d", 0, 0, 5, 1, np.array([1, 2], np.uint32), 0)
    with pytest.raises(TypeError, match="FedAvg takes dense updates, got SignDSUpdate"):
        strategy.add(vote, 1.0)
    assert strategy.count == 0
    np.testing.assert_array_equal(strategy.finish(w)[0], w)


def test_no_privacy_interface(make_mechanism):
    mech = make_mechanism("none")
    assert not mech.accounts
    assert mech.max_exposures() is None and mech.selection_rate() is None
    assert mech.initial_state() is None
    assert mech.encode_state(None) is None and mech.decode_state({"x": 1}) is None
    assert mech.guarantee.text() == "no privacy guarantee"
    assert mech.describe() == {"mechanism": "none", "guarantee": mech.guarantee.as_dict()}
    assert "delta" not in mech.describe() and mech.warnings() == []


def test_build_mechanism_uses_the_config_name(make_facts):
    from edge_fl.config import load_config

    cfg = load_config(None, {"privacy.mechanism": "none"}).privacy
    assert type(build_mechanism(cfg, make_facts())) is NoPrivacy
    bad = load_config(None, {"privacy.mechanism": "nope"}).privacy
    with pytest.raises(UnknownMechanismError):
        build_mechanism(bad, make_facts())
