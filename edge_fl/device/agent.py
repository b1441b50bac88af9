"""The device agent core: global model in, encoded update out. No sockets, no clocks.

The same core runs thousands of times inside the fleet simulator and once on a Raspberry Pi; the
runtime around it only moves bytes. An agent answers each (job, round) at most once, so a broker
redelivering the retained global model (QoS 1 is at-least-once) never produces two updates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_fl.models.base import Model
from edge_fl.protocol import DenseUpdate, GlobalModel, Status, Update, encode_status, encode_update

from .trainer import LocalTraining, local_sgd

# A local update rule turns (model, global params, data, rng) into the update to publish. Plain
# FedAvg by default; privacy mechanisms provide their own rules.
UpdateRule = Callable[["DeviceAgent", GlobalModel], Update | None]


@dataclass
class DeviceState:
    answered_round: int = -1
    last_version: int = -1
    updates_sent: int = 0
    exposures: int = 0  # privatised releases made so far
    stopped_reason: str | None = None  # e.g. "budget_exhausted": the device no longer uploads


@dataclass
class DeviceBudget:
    """The device's own privacy ledger: it refuses a release that would exceed its budget."""

    mechanisms: Any  # edge_fl.privacy.release.Mechanisms (imported lazily: it pulls dp-accounting)
    budget_epsilon: float | None
    delta: float
    accountant: str
    events: list = field(default_factory=list)

    def next_events(self, n_samples: int, exposure: int) -> list:
        return self.mechanisms.device_events(n_samples, exposure)

    def allows(self, events: list, exposure: int) -> bool:
        limit = self.mechanisms.max_exposures()
        if limit is not None and exposure >= limit:
            return False  # the budget's schedule covers only this many releases
        if self.budget_epsilon is None:
            return True
        return self._epsilon([*self.events, *events]) <= self.budget_epsilon * (1 + 1e-9)

    def _epsilon(self, events: list) -> float:
        """The smallest valid bound: the accountant's, or basic composition for pure-DP events."""
        from edge_fl.privacy.accounting import compose_epsilon

        eps = compose_epsilon(events, self.delta, self.accountant).epsilon
        pure = [e.pure_epsilon for e in events]
        if all(p is not None for p in pure):
            eps = min(eps, float(sum(pure)))
        return eps


class DeviceAgent:
    """One device: its data, its model architecture, its local rule and its randomness."""

    def __init__(
        self,
        device_id: str,
        X: np.ndarray,
        y: np.ndarray,
        model: Model,
        training: LocalTraining,
        rng: np.random.Generator,
        rule: UpdateRule | None = None,
        budget: DeviceBudget | None = None,
    ) -> None:
        self.device_id = device_id
        self.X = X
        self.y = y
        self.model = model
        self.training = training
        self.rng = rng
        self.rule: UpdateRule = rule or fedavg_rule
        self.budget = budget
        self.state = DeviceState()

    @property
    def n_samples(self) -> int:
        return len(self.y)

    def wants(self, msg: GlobalModel) -> bool:
        """Whether this global model asks this device for an update it has not yet given."""
        if msg.done or self.state.stopped_reason is not None:
            return False
        if msg.round <= self.state.answered_round:
            return False
        return msg.selects(self.device_id)

    def on_global(self, msg: GlobalModel) -> bytes | None:
        """Train on the broadcast model if asked to; return the encoded update or None."""
        self.state.last_version = max(self.state.last_version, msg.version)
        if not self.wants(msg):
            return None
        self.state.answered_round = msg.round
        if msg.sample_rate is not None and self.rng.random() >= msg.sample_rate:
            return None  # not sampled this round (a secret coin from the device's CSPRNG)
        events: list = []
        if self.budget is not None:
            events = self.budget.next_events(self.n_samples, self.state.exposures)
            if not self.budget.allows(events, self.state.exposures):
                self.state.stopped_reason = "budget_exhausted"
                return None
        update = self.rule(self, msg)
        if update is None:
            return None
        if self.budget is not None:
            self.budget.events.extend(events)
        self.state.exposures += 1
        self.state.updates_sent += 1
        return encode_update(update, dim=len(msg.params))

    def status(self, online: bool) -> bytes:
        info = {"stopped": self.state.stopped_reason} if self.state.stopped_reason else {}
        return encode_status(Status(self.device_id, online, self.n_samples, info))


def fedavg_rule(agent: DeviceAgent, msg: GlobalModel) -> DenseUpdate:
    """Non-private local SGD; the update is the parameter delta."""
    trained = local_sgd(agent.model, msg.params, agent.X, agent.y, agent.training, agent.rng)
    return DenseUpdate(
        device=agent.device_id,
        round=msg.round,
        base_version=msg.version,
        n_samples=agent.n_samples,
        delta=trained - msg.params,
        wire_dtype=msg.wire_dtype,
        mechanism="none",
    )
