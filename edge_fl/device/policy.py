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

1. Not asked (``sel`` without this device, and no dispatch for that version and nonce naming it):
   nothing, not even a re-send. A re-publication that asks others asks nothing of this device.
2. Busy training or uploading: the newest model it would answer waits for the device to finish.
3. The round of the update it kept: publish the same bytes again. The aggregator re-broadcasts an
   open round after it lost the broker, and a PUBACK from a broker that then died proves nothing;
   it admits (device, round) once and counts a copy it has as a duplicate.
4. A round it has not answered (and not stopped): train.

A dispatch message (:class:`DispatchArrived`, FedBuff/FedAsync with a concurrency limit) asks
devices to train on a version whose model went out earlier, without the model. For a device it
names, it makes that version asked (rule 1) and, once the model of that version and nonce is
there, acts as rules 2 and 4; it never causes a re-send (rule 3 is the model's: a dispatch that
names a device which already answered asks nothing new). A dispatch that arrives before its model
waits for it; one for an older version than the newest model is ignored (its model is gone; the
aggregator gives the slot to another device when it times out).
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_fl.protocol import GlobalModel
from edge_fl.protocol.messages import Dispatch

__all__ = [
    "DevicePolicy",
    "DeviceState",
    "Disconnected",
    "DispatchArrived",
    "Effect",
    "Event",
    "InboxArrived",
    "JobEnded",
    "ModelArrived",
    "Publish",
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
    model: GlobalModel | None = None  # the newest model admitted (a dispatch may ask for it)
    assigned: tuple[int, bytes] | None = None  # (version, nonce) a dispatch asked this device for


# ------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class ModelArrived:
    """A global model the connection admitted (not the end marker): live, retained on a
    (re)subscribe, or handed again to a device whose own session re-opened."""

    msg: GlobalModel


@dataclass(frozen=True)
class DispatchArrived:
    """A dispatch message the connection admitted (signature, job, window): devices asked to
    train on a version already published, bound to its model by the version's nonce."""

    dispatch: Dispatch


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


@dataclass(frozen=True)
class InboxArrived:
    """A payload on the device's own ``inbox`` topic (secure aggregation: ``nk``, ``sf``,
    ``uq``); the agent's SecAgg+ session judges it (docs/protocol.md, "Secure aggregation")."""

    payload: bytes


Event = ModelArrived | DispatchArrived | JobEnded | Trained | Uploaded | Disconnected | InboxArrived


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


@dataclass(frozen=True)
class Publish:
    """Publish a SecAgg+ message (``ak``, ``sh``, ``mx``, ``ua``) on ``up/<device>`` (QoS 1);
    no outcome is reported (the session answers a repeated inbox message itself)."""

    round: int
    kind: str
    payload: bytes


Effect = Train | Upload | Resend | PublishStatus | Stop | Publish


class DevicePolicy:
    """The device state machine; ``state`` is shared with the agent that trains."""

    def __init__(self, device_id: str, state: DeviceState | None = None) -> None:
        self.device_id = device_id
        self.state = state if state is not None else DeviceState()

    @property
    def uses_dispatch(self) -> bool:
        """Whether this device's job may send dispatch messages: it is asynchronous (the mode
        of the models admitted so far). A runtime subscribes to ``dispatch`` from then on, so a
        synchronous job's traffic is what it was."""
        model = self.state.model
        return model is not None and model.mode != "sync"

    def asked(self, msg: GlobalModel) -> bool:
        """Whether ``msg``'s round or version asks this device: its selection names it (or it
        has none), or a dispatch for that version and nonce did."""
        if msg.selects(self.device_id):
            return True
        assigned = self.state.assigned
        return assigned is not None and assigned == (msg.version, msg.nonce)

    def wants(self, msg: GlobalModel) -> bool:
        """Whether ``msg`` asks this device for an update it has not yet given."""
        if msg.done or self.state.stopped_reason is not None:
            return False
        if msg.round <= self.state.answered_round:
            return False
        return self.asked(msg)

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
        if isinstance(event, DispatchArrived):
            return self._dispatched(event.dispatch)
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
        if state.model is None or msg.version >= state.model.version:
            state.model = msg
        if not self.asked(msg):
            return []  # rule 1: selection before any re-send
        if state.training is not None:  # rule 2
            return self._wait(msg)
        kept = self.kept_for(msg)
        if kept is not None:  # rule 3
            return [Resend(msg.round, kept)]
        return self._train(msg)  # rule 4

    def _dispatched(self, dispatch: Dispatch) -> list[Effect]:
        state = self.state
        if not dispatch.selects(self.device_id) or dispatch.version < state.last_version:
            return []  # not this device; or its model was replaced by a newer one
        state.assigned = (dispatch.version, dispatch.nonce)
        model = state.model
        if model is None or not dispatch.binds(model):
            return []  # its model has not arrived yet: it asks this device when it does
        if state.training is not None:  # rule 2
            return self._wait(model)
        return self._train(model)  # rule 4; never a re-send (rule 3 is the model's)

    def _wait(self, msg: GlobalModel) -> list[Effect]:
        """Busy: keep ``msg`` as the next model if it asks for a newer round."""
        state = self.state
        assert state.training is not None
        if self.wants(msg) and msg.round > state.training.round:
            state.queued = msg
        return []

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
