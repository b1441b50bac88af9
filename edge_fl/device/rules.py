"""Local update rules: how a device turns the global model and its data into what it publishes.

One rule per privacy mechanism. Every rule privatises ON the device, before encoding; nothing
un-noised leaves it. Rules are pure given the agent's generator (a CSPRNG in production).
"""

from __future__ import annotations

import numpy as np

from edge_fl.privacy.magrr import accept_r_est, magrr_bit, randomized_response
from edge_fl.privacy.release import Mechanisms
from edge_fl.privacy.signds import plan as signds_plan
from edge_fl.privacy.signds import select
from edge_fl.protocol import DenseUpdate, GlobalModel, SignDSUpdate, Update

from .agent import DeviceAgent, UpdateRule, fedavg_rule
from .trainer import local_sgd


def _dense(agent: DeviceAgent, msg: GlobalModel, new_params: np.ndarray, mech: str) -> DenseUpdate:
    return DenseUpdate(
        device=agent.device_id,
        round=msg.round,
        base_version=msg.version,
        n_samples=agent.n_samples,
        delta=(np.asarray(new_params, np.float64) - msg.params).astype(np.float32),
        wire_dtype=msg.wire_dtype,
        mechanism=mech,
    )


def _local_update(agent: DeviceAgent, msg: GlobalModel) -> np.ndarray:
    """Plain local SGD from the broadcast model; returns ``w_local - w_global`` in float64."""
    trained = local_sgd(agent.model, msg.params, agent.X, agent.y, agent.training, agent.rng)
    return trained.astype(np.float64) - msg.params


def laplace_rule(mech: Mechanisms) -> UpdateRule:
    cfg = mech.laplace
    assert cfg is not None

    def rule(agent: DeviceAgent, msg: GlobalModel) -> Update:
        grads = agent.model.per_sample_grads(msg.params, agent.X, agent.y)
        release = cfg.release(msg.params, grads, agent.state.exposures, agent.rng)
        return _dense(agent, msg, release.params, "laplace")

    return rule


def gaussian_rule(mech: Mechanisms) -> UpdateRule:
    cfg = mech.local_gaussian
    assert cfg is not None

    def rule(agent: DeviceAgent, msg: GlobalModel) -> Update:
        noisy = cfg.privatize_update(_local_update(agent, msg), agent.rng)
        return _dense(agent, msg, msg.params + noisy.update, "gaussian")

    return rule


def central_gaussian_rule(mech: Mechanisms) -> UpdateRule:
    """Only clipping on the device; the aggregator adds the noise to the sum (central DP)."""
    cfg = mech.central_gaussian
    assert cfg is not None

    def rule(agent: DeviceAgent, msg: GlobalModel) -> Update:
        clipped = cfg.clip_update(_local_update(agent, msg))
        return _dense(agent, msg, msg.params + clipped.values, "gaussian-central")

    return rule


def dpsgd_rule(mech: Mechanisms) -> UpdateRule:
    def rule(agent: DeviceAgent, msg: GlobalModel) -> Update:
        n = agent.n_samples
        cfg = mech.dpsgd(n)
        w = msg.params.astype(np.float64)
        model, X, y = agent.model, agent.X, agent.y
        for _ in range(mech.dpsgd_steps(n)):
            w = cfg.step(
                w, lambda idx, w=w: model.per_sample_grads(w, X[idx], y[idx]), n, agent.rng
            ).params
        return _dense(agent, msg, w, "dpsgd")

    return rule


def nbafl_rule(mech: Mechanisms) -> UpdateRule:
    cfg = mech.nbafl
    assert cfg is not None

    def rule(agent: DeviceAgent, msg: GlobalModel) -> Update:
        upload, _ = cfg.privatize_upload(msg.params + _local_update(agent, msg), agent.rng)
        return _dense(agent, msg, upload, "nbafl")

    return rule


def signds_rule(mech: Mechanisms) -> UpdateRule:
    params, magrr = mech.signds, mech.magrr
    assert params is not None and magrr is not None

    def rule(agent: DeviceAgent, msg: GlobalModel) -> Update:
        update = _local_update(agent, msg)
        plan = signds_plan(params, update.size)
        selection = select(update, plan, agent.rng)
        state = msg.signds or {}
        r_est = accept_r_est(state.get("r_est", magrr.r_est0))
        bit = magrr_bit(update, selection.sign, plan.topk, r_est, bool(state.get("reached", 0)))
        return SignDSUpdate(
            device=agent.device_id,
            round=msg.round,
            base_version=msg.version,
            n_samples=agent.n_samples,
            sign=selection.sign,
            indices=selection.indices,
            magrr_bit=randomized_response(bit, magrr.rr_eps, agent.rng),
        )

    return rule


RULES = {
    "none": lambda _m: fedavg_rule,
    "laplace": laplace_rule,
    "gaussian": gaussian_rule,
    "gaussian-central": central_gaussian_rule,
    "dpsgd": dpsgd_rule,
    "nbafl": nbafl_rule,
    "signds": signds_rule,
}


def rule_for(mech: Mechanisms) -> UpdateRule:
    return RULES[mech.name](mech)
