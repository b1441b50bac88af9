"""The device agent core: global model in, encoded update out. No sockets, no clocks.

The same core runs thousands of times inside the fleet simulator and once on a Raspberry Pi; the
runtime around it only moves bytes. An agent answers each (job, round) at most once, so a broker
redelivering the retained global model (QoS 1 is at-least-once) never produces two updates. What
the device does when a model, an outcome or the end of the job arrives is :meth:`DeviceAgent.handle`
(the rules: :mod:`edge_fl.device.policy`); :meth:`DeviceAgent.on_global` is the training itself.

An uplink codec (:mod:`edge_fl.protocol.codecs`, ``compression.uplink``) encodes a dense update after the
mechanism has privatised it (post-processing); its state (top-k error feedback) lives here, on
the device, and advances once per release.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge_fl.device.policy import DevicePolicy, DeviceState, Effect, Event
from edge_fl.mechanisms import Mechanism
from edge_fl.mechanisms.none import NoPrivacy
from edge_fl.models.base import Model
from edge_fl.models.training import LocalTraining
from edge_fl.protocol import (
    DenseUpdate,
    GlobalModel,
    Status,
    Update,
    encode_status,
    encode_update,
)
from edge_fl.protocol.codecs import Codec, CodecState


@dataclass
class DeviceBudget:
    """The device's own ledger: it refuses a release that would exceed its budget.

    Uses the same events (the mechanism's) and the same bound (the tightest valid accountant,
    :func:`edge_fl.privacy.accountants.best_epsilon`) as the aggregator's ledger.
    """

    mechanism: Mechanism
    budget_epsilon: float | None
    delta: float
    events: list = field(default_factory=list)

    def allows(self, events: list) -> bool:
        """Whether releasing ``events`` on top of what was released keeps within the budget."""
        if self.budget_epsilon is None:
            return True
        from edge_fl.privacy.accountants import best_epsilon

        spent = best_epsilon([*self.events, *events], self.delta).epsilon
        return spent <= self.budget_epsilon * (1 + 1e-9)


class DeviceAgent:
    """One device: its data, its model architecture, its mechanism and its randomness."""

    def __init__(
        self,
        device_id: str,
        X: np.ndarray,
        y: np.ndarray,
        model: Model,
        training: LocalTraining,
        rng: np.random.Generator,
        mechanism: Mechanism | None = None,
        budget: DeviceBudget | None = None,
        codec: Codec | None = None,
    ) -> None:
        """``codec``: the uplink codec of dense updates (None: the global message's wire dtype,
        rounded to nearest, as before codecs existed)."""
        self.device_id = device_id
        self.X = X
        self.y = y
        self.model = model
        self.training = training
        self.rng = rng
        self.mechanism: Mechanism = mechanism or NoPrivacy(None, None)
        self.budget = budget
        self.codec = codec
        self.codec_state: CodecState | None = None  # e.g. the top-k error-feedback residual
        self.state = DeviceState()
        self.policy = DevicePolicy(device_id, self.state)

    @property
    def n_samples(self) -> int:
        return len(self.y)

    def handle(self, event: Event) -> list[Effect]:
        """The effects of ``event`` (:mod:`edge_fl.device.policy`); pure, the runtime does I/O."""
        return self.policy.handle(event)

    def wants(self, msg: GlobalModel) -> bool:
        """Whether this global model asks this device for an update it has not yet given."""
        return self.policy.wants(msg)

    def on_global(self, msg: GlobalModel) -> bytes | None:
        """Train on the broadcast model if asked to; return the encoded update or None."""
        self.state.last_version = max(self.state.last_version, msg.version)
        if not self.wants(msg):
            return None
        self.state.answered_round = msg.round
        if msg.sample_rate is not None and self.rng.random() >= msg.sample_rate:
            return None  # not sampled this round (a secret coin from the device's CSPRNG)
        limit = self.mechanism.max_exposures()
        if limit is not None and self.state.exposures >= limit:
            self.state.stopped_reason = "budget_exhausted"  # the schedule covers no more releases
            return None
        events: list = []
        if self.budget is not None:
            events = self.mechanism.release_events(self.n_samples, self.state.exposures)
            if not self.budget.allows(events):
                self.state.stopped_reason = "budget_exhausted"
                return None
        # privatised on the device, before anything is encoded
        update = self.mechanism.device_update(self, msg, self.state.exposures)
        if self.budget is not None:
            self.budget.events.extend(events)
        self.state.exposures += 1
        self.state.updates_sent += 1
        payload = self.encode(update, len(msg.params))
        self.state.last_release = (msg.round, payload)
        return payload

    def encode(self, update: Update, dim: int) -> bytes:
        """The update's payload; a dense one through the uplink codec, whose state advances."""
        if self.codec is None or not isinstance(update, DenseUpdate):
            return encode_update(update, dim=dim)
        fields, self.codec_state = self.codec.encode(update.delta, self.rng, self.codec_state)
        return encode_update(update, coded=(self.codec.dt, fields))

    def pending_for(self, msg: GlobalModel) -> bytes | None:
        """The update this device released for ``msg``'s round (what a re-send publishes, the
        same bytes: no new release), or None; whether to re-send is :meth:`handle`'s call."""
        return self.policy.kept_for(msg)

    def status(self, online: bool) -> bytes:
        info = {"stopped": self.state.stopped_reason} if self.state.stopped_reason else {}
        return encode_status(Status(self.device_id, online, self.n_samples, info))
