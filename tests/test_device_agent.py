"""The device agent core: answer once per round, secret Poisson coin, own budget, privatise before
encoding. Broker-free: global models in, encoded updates out."""

from __future__ import annotations

import math
from typing import Any

import dp_accounting as dpa
import numpy as np
import pytest

from edge_fl.config import load_config
from edge_fl.device.agent import DeviceAgent, DeviceBudget
from edge_fl.mechanisms import JobFacts, Mechanism, build_mechanism
from edge_fl.mechanisms.none import NoPrivacy
from edge_fl.models import make_model
from edge_fl.models.training import LocalTraining
from edge_fl.privacy.accountants import best_epsilon
from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import (
    DenseUpdate,
    GlobalModel,
    SignDSUpdate,
    UpdateLimits,
    decode_status,
    decode_update,
)

N_FEAT, N_CLS = 4, 3
D = N_FEAT * N_CLS + N_CLS  # 15
TRAIN = LocalTraining(epochs=1, batch_size=4, lr=0.1)
LIMITS = UpdateLimits(D, 100, frozenset({"u"}))


def data(n: int = 12, seed: int = 0, n_features: int = N_FEAT, n_classes: int = N_CLS):
    g = np.random.default_rng(seed)
    X = g.normal(size=(n, n_features)).astype(np.float32)
    y = np.argmax(X @ g.normal(size=(n_features, n_classes)), axis=1).astype(np.int64)
    return X, y


def facts(**kw: Any) -> JobFacts:
    base: dict[str, Any] = dict(
        rounds=20, n_devices=10, expected_participants=5.0, n_params=D, local_lr=0.1,
        local_epochs=1, batch_size=4, min_dataset_size=12, max_uploads=3,
    )  # fmt: skip
    base.update(kw)
    return JobFacts(**base)


def mechanism(name: str, job: JobFacts | None = None, **privacy: Any) -> Mechanism:
    overrides = {"privacy.mechanism": name}
    overrides.update({f"privacy.{k.replace('__', '.')}": v for k, v in privacy.items()})
    return build_mechanism(load_config(None, overrides).privacy, job or facts())


def agent(device_id="dev-1", seed=1, mech=None, budget=None, X=None, y=None, model=None):
    Xd, yd = data() if X is None else (X, y)
    return DeviceAgent(
        device_id, Xd, yd, model or make_model("logreg", N_FEAT, N_CLS), TRAIN,
        seeded_generator(seed), mech, budget,
    )  # fmt: skip


def gm(round: int, version: int | None = None, d: int = D, **kw: Any) -> GlobalModel:
    return GlobalModel(
        "job", round if version is None else version, round, np.zeros(d, np.float32), **kw
    )


def spy(mech: Mechanism) -> list[int]:
    """Record the exposure index of every device_update call (instance attribute override)."""
    calls: list[int] = []
    inner = mech.device_update

    def wrapped(device, msg, exposure):
        calls.append(exposure)
        return inner(device, msg, exposure)

    mech.device_update = wrapped  # type: ignore[method-assign]
    return calls


# ---------------------------------------------------------------------------------------------
# Answer once per round


def test_answers_each_round_once_and_ignores_redelivery():
    a = agent()
    assert isinstance(a.mechanism, NoPrivacy)
    first = a.on_global(gm(1))
    assert first is not None
    upd = decode_update(first, LIMITS, topic_device="dev-1")
    assert isinstance(upd, DenseUpdate) and (upd.round, upd.base_version, upd.n_samples) == (
        1,
        1,
        12,
    )
    assert a.on_global(gm(1)) is None  # QoS 1 redelivery of the retained model
    assert a.on_global(gm(1, version=5)) is None  # same round, whatever the version
    assert a.on_global(gm(0)) is None  # an older round
    assert a.state.last_version == 5  # versions are tracked even when nothing is sent
    assert a.on_global(gm(2, version=6)) is not None
    assert (a.state.updates_sent, a.state.exposures, a.state.answered_round) == (2, 2, 2)


def test_not_selected_and_done_produce_nothing():
    a = agent()
    assert a.on_global(gm(1, selected=("dev-2", "dev-3"))) is None
    assert a.state.answered_round == -1  # not asked: the round is still open for this device
    assert a.on_global(gm(1, selected=("dev-1",))) is not None
    assert a.on_global(gm(2, done=True)) is None
    assert a.on_global(gm(3, done=True, selected=("dev-1",))) is None
    assert a.state.updates_sent == 1


def test_status_message():
    a = agent()
    st = decode_status(a.status(True), topic_device="dev-1")
    assert (st.device, st.online, st.n_samples, st.info) == ("dev-1", True, 12, {})
    assert decode_status(a.status(False)).online is False


# ---------------------------------------------------------------------------------------------
# Poisson self-selection


def test_poisson_coin_rate_is_q():
    q, n_agents, rounds = 0.3, 250, 4
    agents = [agent(f"d{i}", seed=1000 + i) for i in range(n_agents)]
    answered = sum(
        a.on_global(gm(r, sample_rate=q)) is not None for r in range(1, rounds + 1) for a in agents
    )
    trials = n_agents * rounds
    assert abs(answered - q * trials) < 4.5 * math.sqrt(trials * q * (1 - q))
    assert sum(a.state.updates_sent for a in agents) == answered


def test_declined_coin_is_final_for_the_round():
    agents = [agent(f"d{i}", seed=i) for i in range(40)]
    declined = [a for a in agents if a.on_global(gm(1, sample_rate=0.5)) is None]
    assert 5 < len(declined) < 35
    for a in declined:  # redelivery gives no second coin
        assert all(a.on_global(gm(1, sample_rate=0.5)) is None for _ in range(20))
        assert a.state.exposures == 0 and a.state.answered_round == 1


@pytest.mark.parametrize(("q", "expected"), [(0.0, 0), (1.0, 30)])
def test_poisson_coin_extremes(q, expected):
    agents = [agent(f"d{i}", seed=i) for i in range(30)]
    assert sum(a.on_global(gm(1, sample_rate=q)) is not None for a in agents) == expected


# ---------------------------------------------------------------------------------------------
# The device's own budget


def test_budget_stops_before_the_release_that_would_exceed_it():
    z, delta = 20.0, 1e-5
    mech = mechanism("gaussian", noise_multiplier=z, clip=0.5)
    assert mech.max_exposures() is None  # only the epsilon budget can stop it
    # k releases of multiplier z/2 compose to one Gaussian of multiplier z / (2 sqrt(k))
    eps = [dpa.get_epsilon_gaussian(z / 2 / math.sqrt(k), delta) for k in (1, 2, 3, 4)]
    budget_eps = (eps[2] + eps[3]) / 2  # three releases fit, a fourth does not
    budget = DeviceBudget(mech, budget_eps, delta)
    calls = spy(mech)
    a = agent(mech=mech, budget=budget)
    sent = [a.on_global(gm(r)) for r in range(1, 7)]
    assert [s is not None for s in sent] == [True, True, True, False, False, False]
    assert calls == [0, 1, 2]  # the refused release was never computed
    assert a.state.stopped_reason == "budget_exhausted"
    assert (a.state.exposures, a.state.updates_sent) == (3, 3)
    [event] = mech.release_events(12, 0)
    assert budget.events == [event] * 3
    assert (
        best_epsilon(budget.events, delta).epsilon
        <= budget_eps
        < best_epsilon([event] * 4, delta).epsilon
    )
    st = decode_status(a.status(True), topic_device="dev-1")
    assert st.info == {"stopped": "budget_exhausted"}


def test_max_exposures_stops_a_laplace_device():
    mech = mechanism("laplace", epsilon=1.5, max_uploads=3)
    assert mech.max_exposures() == 3
    budget = DeviceBudget(mech, None, 1e-5)
    calls = spy(mech)
    a = agent(mech=mech, budget=budget)
    sent = [a.on_global(gm(r)) for r in range(1, 6)]
    assert [s is not None for s in sent] == [True, True, True, False, False]
    assert calls == [0, 1, 2] and a.state.stopped_reason == "budget_exhausted"
    assert [e.event for e in budget.events] == [dpa.LaplaceDpEvent(1 / 0.5)] * 3
    assert math.fsum(e.pure_epsilon for e in budget.events) == pytest.approx(1.5)


def test_a_resumed_device_goes_on_from_its_releases_not_from_its_first():
    """A resumed simulation rebuilds its devices; ``resume(releases, last_round)`` (from the
    aggregator's ledger) makes the next release the schedule's next one, not its first, least
    noisy one (an outside audit: 14.19 spent where 8.0 was reported), keeps max_uploads, fills
    its own budget, and does not answer again the round it answered before the restart."""
    mech = mechanism("laplace", epsilon=1.5, max_uploads=3)
    assert mech.max_exposures() == 3
    budget = DeviceBudget(mech, None, 1e-5)
    calls = spy(mech)
    a = agent(mech=mech, budget=budget)
    a.resume(1, 3)
    assert a.on_global(gm(3)) is None  # answered before the restart: no fresh noise for it
    sent = [a.on_global(gm(r)) for r in range(4, 8)]
    assert [s is not None for s in sent] == [True, True, False, False]
    assert calls == [1, 2] and a.state.stopped_reason == "budget_exhausted"
    assert budget.events == [e for j in range(3) for e in mech.release_events(12, j)]


def test_a_generous_budget_lets_every_scheduled_release_through():
    mech = mechanism("laplace", epsilon=1.5, max_uploads=3)
    budget = DeviceBudget(mech, 1.5, 1e-5)  # exactly the schedule's total: not exceeded
    a = agent(mech=mech, budget=budget)
    assert sum(a.on_global(gm(r)) is not None for r in range(1, 5)) == 3
    assert len(budget.events) == 3


# ---------------------------------------------------------------------------------------------
# Privatised on the device, before encoding


@pytest.mark.parametrize(
    ("name", "privacy"),
    [
        ("gaussian", {"noise_multiplier": 1.0, "clip": 0.1}),
        ("laplace", {"epsilon": 1.0}),
        ("nbafl", {"epsilon": 0.5}),
    ],
)
def test_encoded_bytes_carry_the_privatised_update(name, privacy):
    mech = mechanism(name, **privacy)
    a = agent(seed=7, mech=mech, budget=DeviceBudget(mech, None, 1e-5))
    msg = gm(1)
    payload = a.on_global(msg)
    assert payload is not None
    got = decode_update(payload, LIMITS, topic_device="dev-1")
    # the same device rule on an identical device with the same generator
    twin = agent(seed=7)
    expected = mech.device_update(twin, msg, 0)
    np.testing.assert_array_equal(got.delta, expected.delta)
    assert got.mechanism == name
    # never the raw trained values: plain local SGD from the same generator differs by the noise
    raw = NoPrivacy(None, None).device_update(agent(seed=7), msg, 0).delta
    assert raw.astype("<f4").tobytes() not in payload
    assert expected.delta.astype("<f4").tobytes() in payload
    assert np.abs(got.delta - raw).max() > 1e-3


def test_signds_agent_sends_a_vote():
    X, y = data(n=24, n_features=64, n_classes=10)
    job = facts(n_params=650)
    mech = mechanism("signds", job, signds__sign_k=0.1)
    a = agent(
        mech=mech,
        budget=DeviceBudget(mech, None, 1e-5),
        X=X,
        y=y,
        model=make_model("logreg", 64, 10),
    )
    payload = a.on_global(gm(1, d=650, mechanism_state=mech.encode_state(mech.initial_state())))
    upd = decode_update(payload, UpdateLimits(650, 100, frozenset({"s"})), topic_device="dev-1")
    assert isinstance(upd, SignDSUpdate) and len(upd.indices) == mech.plan.h
    assert len(a.budget.events) == 2  # the selection and the MagRR bit


def test_device_budget_allows_directly():
    lap = mechanism("laplace", epsilon=1.5, max_uploads=3)
    budget = DeviceBudget(lap, None, 1e-5)
    assert budget.allows(lap.release_events(12, 2)) is True
    gauss = mechanism("gaussian", noise_multiplier=20.0)
    [event] = gauss.release_events(12, 0)
    one = best_epsilon([event], 1e-5).epsilon
    assert DeviceBudget(gauss, one, 1e-5).allows([event]) is True
    assert DeviceBudget(gauss, one * 0.99, 1e-5).allows([event]) is False
    assert DeviceBudget(gauss, None, 1e-5).allows([event] * 1000) is True


def test_the_rounds_update_is_offered_again_only_for_that_round():
    a = agent()
    first = a.on_global(gm(1))
    assert first is not None
    # the aggregator re-broadcasts round 1 (it lost the broker): the same bytes, no new release
    assert a.pending_for(gm(1)) == first and a.on_global(gm(1)) is None
    assert a.state.exposures == 1
    assert a.pending_for(gm(2)) is None and a.pending_for(gm(1, done=True)) is None
    second = a.on_global(gm(2))
    assert a.pending_for(gm(1)) is None and a.pending_for(gm(2)) == second


# ---------------------------------------------------------------------------------------------
# Uplink codecs: encoded after the mechanism, error feedback kept on the agent


def coded_agent(codec_name: str, **options: Any) -> DeviceAgent:
    from edge_fl.protocol.codecs import build_codec

    a = agent(X=data(n=40)[0], y=data(n=40)[1])
    a.codec = build_codec(codec_name, **options)
    return a


@pytest.mark.parametrize("name", ["f16", "q8", "q4", "topk", "rot1"])
def test_codec_encodes_the_update_and_the_aggregator_decodes_it(name: str) -> None:
    from edge_fl.protocol.codecs import build_codec

    plain, coded = agent(X=data(n=40)[0], y=data(n=40)[1]), coded_agent(name)
    ref = decode_update(plain.on_global(gm(1)), LIMITS).delta.astype(np.float64)
    payload = coded.on_global(gm(1))
    upd = decode_update(payload, LIMITS, topic_device="dev-1")
    assert isinstance(upd, DenseUpdate) and upd.wire_dtype == build_codec(name).dt
    # same seed, same training: the codec's input is the plain agent's delta
    if name in ("f16", "q8", "q4"):
        assert np.abs(upd.delta - ref).max() <= np.abs(ref).max() * 0.2 + 1e-6
    if name == "topk":  # ceil(0.01 * 15) = 1 coordinate: the largest one, exactly
        i = int(np.argmax(np.abs(ref)))
        assert np.count_nonzero(upd.delta) == 1 and upd.delta[i] == np.float32(ref[i])
    header = 27  # v, k, r, bv, n, m of this update (no nonce)
    assert len(payload) - header - 1 <= build_codec(name).payload_bytes(D)
    assert coded.pending_for(gm(1)) == payload  # a resend is the same bytes


def test_error_feedback_lives_on_the_agent_and_advances_once_per_release() -> None:
    a = coded_agent("topk", fraction=0.1)
    assert a.codec_state is None
    first = a.on_global(gm(1))
    residual = a.codec_state.residual.copy()
    assert np.count_nonzero(residual) == D - 2  # ceil(1.5) = 2 coordinates sent
    assert a.on_global(gm(1)) is None and a.pending_for(gm(1)) == first
    np.testing.assert_array_equal(a.codec_state.residual, residual)  # no release, no change
    a.on_global(gm(2))
    assert not np.array_equal(a.codec_state.residual, residual)


def test_a_job_limited_to_dense_f4_f2_refuses_a_codec_it_does_not_accept() -> None:
    payload = coded_agent("q8").on_global(gm(1))
    strict = UpdateLimits(D, 100, frozenset({"u"}), codecs=frozenset({"f4", "f2"}))
    with pytest.raises(Exception, match=r"bad_dtype: .*'q8' is a codec this job does not accept"):
        decode_update(payload, strict)
    from edge_fl.protocol import encode_update
    from edge_fl.protocol.codecs import build_codec

    upd = DenseUpdate("dev-1", 1, 1, 5, np.zeros(D, np.float32), mechanism="gaussian-central")
    fields, _ = build_codec("q8").encode(np.ones(D), seeded_generator(0))
    central = UpdateLimits(D, 100, frozenset({"u"}), mechanism="gaussian-central")
    with pytest.raises(Exception, match=r"bad_dtype: .* got 'q8'; 'q8' is a codec"):
        decode_update(encode_update(upd, coded=("q8", fields)), central)
    f16, _ = build_codec("f16").encode(np.ones(D), seeded_generator(0))
    assert decode_update(encode_update(upd, coded=("f2", f16)), central).delta[0] == 1.0
