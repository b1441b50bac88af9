"""What a device does when something happens to it: events in, effects out; no I/O, no clock.

The one home of the device's reaction to a global model (docs/protocol.md, "Device state
machine"). A runtime feeds :meth:`DevicePolicy.handle` the events it sees and executes the effects
it gets back: :mod:`edge_fl.device.runtime` (one device, its own MQTT session) and
:mod:`edge_fl.fleet.runtime` (thousands of devices, one shared downlink) run the same rules and add
only sockets and modelled time. Training is an effect too (:class:`Train`): the runtime runs
:meth:`edge_fl.device.agent.DeviceAgent.on_global` where it likes (a worker thread) and reports
the outcome as :class:`Trained`; an upload is reported as :class:`Uploaded`.

The rules, in order, for a global model that passed the connection's checks
(:mod:`edge_fl.device.trust`: signature, window, job, digest):

1. Not selected (``sel`` without this device): nothing, not even a re-send. In FedBuff/FedAsync
   the aggregator re-publishes a version to dispatch replacements; a device that already answered
   that version is not among them and must stay quiet (before, every such device re-sent).
2. Busy training or uploading: the newest model it would answer waits for the device to finish.
3. The round of the update it kept: publish the same bytes again. The aggregator re-broadcasts an
   open round after it lost the broker, and a PUBACK from a broker that then died proves nothing;
   it admits (device, round) once and counts a copy it has as a duplicate.
4. A round it has not answered (and not stopped): train.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_fl.protocol import GlobalModel

__all__ = [
    "DevicePolicy",
    "DeviceState",
    "Disconnected",
    "Effect",
    "Event",
    "JobEnded",
    "ModelArrived",
    "PublishStatus",
    "Resend",
    "Stop",
    "Train",
    "Trained",
    "Upload",
    "Uploaded",
]


@dataclass
class DeviceState:
    answered_round: int = -1
    last_version: int = -1
    updates_sent: int = 0
    exposures: int = 0  # privatised releases made so far
    stopped_reason: str | None = None  # e.g. "budget_exhausted": the device no longer uploads
    last_release: tuple[int, bytes] | None = None  # (round, payload): kept for a re-send
    training: GlobalModel | None = None  # the model being trained on or answered (until Uploaded)
    queued: GlobalModel | None = None  # the newest model that arrived while training
    stopped_before: str | None = None  # stopped_reason when the current training began


# ------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class ModelArrived:
    """A global model the connection admitted (not the end marker): live, retained on a
    (re)subscribe, or handed again to a device whose own session re-opened."""

    msg: GlobalModel


@dataclass(frozen=True)
class JobEnded:
    """This run's end marker."""

    msg: GlobalModel


@dataclass(frozen=True)
class Trained:
    """The outcome of a :class:`Train` effect: the update's payload, or None (not sampled, budget
    spent, training failed, or the runtime could not train: the device went away)."""

    msg: GlobalModel
    payload: bytes | None


@dataclass(frozen=True)
class Uploaded:
    """The outcome of an :class:`Upload` effect. ``dropped``: the device never sent it (a dropout
    in the simulated fleet): nothing is kept to re-send. A publish that failed is not dropped: the
    bytes are re-sent when the round comes again."""

    round: int
    dropped: bool = False


@dataclass(frozen=True)
class Disconnected:
    """The device's session dropped while it trained or uploaded: that work is abandoned (the
    model comes again on the next session); an update it released is kept, to re-send."""


Event = ModelArrived | JobEnded | Trained | Uploaded | Disconnected


# ------------------------------------------------------------------------------------ effects


@dataclass(frozen=True)
class Train:
    """Run ``DeviceAgent.on_global(msg)`` (CPU-bound), then report :class:`Trained`."""

    msg: GlobalModel


@dataclass(frozen=True)
class Upload:
    """Publish a new update on ``up/<device>`` (QoS 1), then report :class:`Uploaded`."""

    round: int
    payload: bytes


@dataclass(frozen=True)
class Resend:
    """Publish the kept update of ``round`` again, unchanged (no new release)."""

    round: int
    payload: bytes


@dataclass(frozen=True)
class PublishStatus:
    """Publish the device's retained status (``DeviceAgent.status(online)``)."""

    online: bool


@dataclass(frozen=True)
class Stop:
    """The job is over: leave."""


Effect = Train | Upload | Resend | PublishStatus | Stop


class DevicePolicy:
    """The device state machine; ``state`` is shared with the agent that trains."""

    def __init__(self, device_id: str, state: DeviceState | None = None) -> None:
        self.device_id = device_id
        self.state = state if state is not None else DeviceState()

    def wants(self, msg: GlobalModel) -> bool:
        """Whether ``msg`` asks this device for an update it has not yet given."""
        if msg.done or self.state.stopped_reason is not None:
            return False
        if msg.round <= self.state.answered_round:
            return False
        return msg.selects(self.device_id)

    def kept_for(self, msg: GlobalModel) -> bytes | None:
        """The update this device released for ``msg``'s round, if it keeps one."""
        kept = self.state.last_release
        if kept is None or msg.done:
            return None
        rnd, payload = kept
        return payload if rnd == msg.round else None

    def handle(self, event: Event) -> list[Effect]:
        """The effects of ``event``, in the order the runtime must execute them."""
        if isinstance(event, ModelArrived):
            return self._arrived(event.msg)
        if isinstance(event, Trained):
            return self._trained(event)
        if isinstance(event, Uploaded):
            return self._uploaded(event)
        if isinstance(event, JobEnded):
            return [PublishStatus(online=False), Stop()]
        if isinstance(event, Disconnected):
            self.state.training = self.state.queued = None
            return []
        raise TypeError(f"not a device event: {event!r}")

    def _arrived(self, msg: GlobalModel) -> list[Effect]:
        state = self.state
        state.last_version = max(state.last_version, msg.version)
        if not msg.selects(self.device_id):
            return []  # rule 1: selection before any re-send
        if state.training is not None:  # rule 2
            if self.wants(msg) and msg.round > state.training.round:
                state.queued = msg
            return []
        kept = self.kept_for(msg)
        if kept is not None:  # rule 3
            return [Resend(msg.round, kept)]
        return self._train(msg)  # rule 4

    def _train(self, msg: GlobalModel | None) -> list[Effect]:
        if msg is None or not self.wants(msg):
            return []
        self.state.training = msg
        self.state.stopped_before = self.state.stopped_reason
        return [Train(msg)]

    def _trained(self, event: Trained) -> list[Effect]:
        state = self.state
        effects: list[Effect] = []
        if state.stopped_reason is not None and state.stopped_reason != state.stopped_before:
            # e.g. its privacy budget is spent: the aggregator must not select it again
            effects.append(PublishStatus(online=True))
        if event.payload is not None:
            return [*effects, Upload(event.msg.round, event.payload)]
        return effects + self._next()

    def _uploaded(self, event: Uploaded) -> list[Effect]:
        state = self.state
        kept = state.last_release
        if event.dropped and kept is not None and kept[0] == event.round:
            state.last_release = None  # never sent: nothing to deliver again
        return self._next()

    def _next(self) -> list[Effect]:
        """Done with the current model: train on the newest one that came meanwhile."""
        state = self.state
        state.training = None
        queued, state.queued = state.queued, None
        return self._train(queued)
