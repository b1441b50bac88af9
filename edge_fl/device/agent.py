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

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_fl.device.policy import (
    DevicePolicy,
    DeviceState,
    Effect,
    Event,
    InboxArrived,
    ModelArrived,
    Publish,
    Train,
    Trained,
)
from edge_fl.mechanisms import Mechanism
from edge_fl.mechanisms.none import NoPrivacy
from edge_fl.mechanisms.secure import SecureInput
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
from edge_fl.protocol.secure import round_seed
from edge_fl.secagg import Aborted, Send, params_from_wire, roster_graph

if TYPE_CHECKING:  # the device's SecAgg+ session needs cryptography: imported for a secure round
    from edge_fl.secagg import DeviceSession

log = logging.getLogger("edge_fl.device")


@dataclass(frozen=True)
class SecureDevice:
    """What a device needs for secure rounds: the mechanism's secure side (``SecureSum``), the
    job's facts and layout (checked against each round's signed ``sa``), and where its SecAgg+
    randomness comes from: the OS CSPRNG, or with ``reproducible`` a stream seeded per (seed,
    device, round) for tests only."""

    mechanism: Any  # edge_fl.mechanisms.secure.SecureSum
    job: Any  # edge_fl.mechanisms.secure.SecureJob
    layout: Any  # edge_fl.mechanisms.secure.SecureLayout
    reproducible: bool = False
    seed: int = 0
    #: the device's own Ed25519 key (signs its ``ak`` and ``mx``) and its neighbours' public
    #: keys (``edge_fl.protocol.device_keys``): None = unsigned (honest-but-curious operator)
    signer: Any = None
    peer_key: Callable[[str], Any] | None = None
    #: the job's calibrated graph degree, threshold and survivors floor (``SecurePlan``'s): a
    #: round's signed ``sa`` must carry exactly these, so an operator cannot lower the
    #: threshold to have one share reveal a device's secret
    neighbours: int = 0
    threshold: int = 0
    min_survivors: int = 0

    def signed(self, device: str, signer: Any, keys: Any) -> SecureDevice:
        """This device's secure side with its signing key and the job's key directory;
        ValueError (one line) if the directory does not hold this key for ``device``."""
        own = keys.key_of(device)
        if device not in keys or own.hex() != signer.verifier.hex():
            raise ValueError(
                f"device {device}'s signing key is not the one security.device_keys lists for "
                "it (mint the keys and the directory together: edge-fl keygen DIR --devices N)"
            )
        return dataclasses.replace(self, signer=signer, peer_key=keys.key_of)

    def randbytes(self, device: str, rnd: int, nonce: bytes) -> Callable[[int], bytes]:
        if not self.reproducible:
            return os.urandom
        key = hashlib.sha256(f"edge-fl/secagg-test/{self.seed}/{device}/{rnd}".encode() + nonce)
        return np.random.default_rng(int.from_bytes(key.digest(), "big")).bytes

    def mismatch(self, sa: dict[str, Any], roster: int) -> str | None:
        """Why the round's signed parameters are not this job's, or None: its integers
        (``n q b md``) and, for a roster of ``roster`` devices, its graph (``k t``; 2t > k with
        device keys) and survivors floor (``ms``)."""
        lay = self.layout
        if (sa["n"], sa["q"], sa["b"], sa["md"]) != (
            lay.length,
            lay.max_int,
            lay.bits,
            lay.modular,
        ):
            return "its integers (n, q, b, md) are not this job's"
        k, t = roster_graph(self.neighbours, self.threshold, roster)
        if (sa["k"], sa["t"]) != (k, t):
            return f"its graph (k {sa['k']}, t {sa['t']}) is not this job's (k {k}, t {t})"
        if self.signer is not None and not 2 * t > k:
            # against a malicious operator one neighbour's request of each kind must not
            # reach t shares of both of a device's secrets
            return f"with device keys the threshold must exceed half the neighbours (k {k}, t {t})"
        if sa["ms"] != self.min_survivors:
            return f"its survivors floor ms {sa['ms']} is not this job's {self.min_survivors}"
        return None


#: the protocol phase a SecAgg+ message of a device belongs to
PHASE_OF = {"ak": "advertise", "sh": "share", "mx": "mask", "ua": "unmask"}


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
        secure: SecureDevice | None = None,
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
        self.secure = secure
        #: secure aggregation: the round's SecAgg+ session and its (round, nonce); the trained
        #: integers wait here between the training thread and the session (event loop)
        self.session: DeviceSession | None = None
        self.session_key: tuple[int, bytes | None] | None = None
        self._secure_input: dict[tuple[int, bytes | None], SecureInput] = {}
        self._masked_rounds: set[int] = set()  # rounds whose masked input this device sent

    @property
    def n_samples(self) -> int:
        return len(self.y)

    def handle(self, event: Event) -> list[Effect]:
        """The effects of ``event`` (:mod:`edge_fl.device.policy`); pure, the runtime does I/O.
        Secure rounds add to the policy: a model of a round whose session runs (same nonce)
        changes nothing; training starts a session and publishes ``ak`` first; the trained
        integers go to the session; inbox messages go to the session."""
        if isinstance(event, InboxArrived):
            return self._to_session(event.payload)
        if (
            isinstance(event, ModelArrived)
            and event.msg.secure is not None
            and not event.msg.done
            and self.session_key == (event.msg.round, event.msg.nonce)
        ):
            return []  # re-published (same nonce): the session goes on, nothing is re-sent
        if isinstance(event, Trained) and event.msg.secure is not None:
            effects = self._submit(event.msg)
            return effects + self._start_sessions(self.policy.handle(Trained(event.msg, None)))
        return self._start_sessions(self.policy.handle(event))

    # ------------------------------------------------------------ secure rounds

    def _start_sessions(self, effects: list[Effect]) -> list[Effect]:
        """Before training on a secure round: a new session, its ``ak`` published first."""
        out: list[Effect] = []
        for effect in effects:
            if isinstance(effect, Train) and effect.msg.secure is not None:
                out.extend(self._open_session(effect.msg))
            out.append(effect)
        return out

    def _open_session(self, msg: GlobalModel) -> list[Effect]:
        sa, sec = msg.secure, self.secure
        assert sa is not None
        self.session = None
        self.session_key = (msg.round, msg.nonce)
        if sec is None or msg.nonce is None or not msg.selected:
            log.warning("round %d is secure; this device has no secure aggregation", msg.round)
            return []
        problem = sec.mismatch(sa, len(msg.selected))
        if problem is not None:
            log.warning("round %d: refused before advertising keys: %s", msg.round, problem)
            return []
        try:
            from edge_fl.secagg import DeviceSession  # with its cryptography: secure rounds only

            params = params_from_wire(msg.job, msg.round, msg.nonce, tuple(msg.selected), sa)
            self.session = DeviceSession(
                self.device_id,
                params,
                randbytes=sec.randbytes(self.device_id, msg.round, msg.nonce),
                signer=sec.signer,
                peer_key=sec.peer_key,
            )
        except ValueError as exc:
            log.warning("round %d: no secure session: %s", msg.round, exc)
            return []
        return self._effects(self.session.advertise(), msg.round)

    def _effects(self, effects: Any, rnd: int) -> list[Effect]:
        out: list[Effect] = []
        for effect in effects if isinstance(effects, list) else [effects]:
            if isinstance(effect, Send):
                kind = _kind_of(effect.payload)
                out.append(Publish(rnd, kind, effect.payload))
                if kind == "mx" and rnd not in self._masked_rounds:  # its update, sent masked
                    self._masked_rounds.add(rnd)
                    self.state.updates_sent += 1
            elif isinstance(effect, Aborted):
                log.warning("device %s left secure round %d: %s", self.device_id, rnd,
                            effect.reason)  # fmt: skip
        return out

    def _to_session(self, payload: bytes) -> list[Effect]:
        session = self.session
        if session is None:
            return []
        return self._effects(session.receive(payload), session.params.round)

    def _submit(self, msg: GlobalModel) -> list[Effect]:
        key = (msg.round, msg.nonce)
        values = self._secure_input.pop(key, None)
        session = self.session
        if values is None or session is None or self.session_key != key:
            return []
        assert msg.secure is not None
        try:
            submitted = session.submit(values.values, modular=msg.secure["md"], noise=values.noise)
            return self._effects(submitted, msg.round)
        except (ValueError, RuntimeError) as exc:
            log.warning("round %d: the secure input was refused: %s", msg.round, exc)
            return []

    def _secure_train(self, msg: GlobalModel) -> None:
        """Train and encode a secure round's integers (they wait for the session)."""
        sec = self.secure
        if sec is None or not self.wants(msg):
            return
        self.state.answered_round = msg.round
        events: list = []
        if self.budget is not None:
            events = sec.mechanism.secure_events(sec.job)
            if not self.budget.allows(events):
                self.state.stopped_reason = "budget_exhausted"
                return
        assert msg.nonce is not None
        seed = round_seed(msg.job, msg.round, msg.nonce)
        values = sec.mechanism.secure_encode(self, msg, sec.layout, seed)
        if self.budget is not None:
            self.budget.events.extend(events)
        self.state.exposures += 1  # released to its session: counted whatever happens next
        if not isinstance(values, SecureInput):
            values = SecureInput(np.asarray(values, dtype=np.int64))
        self._secure_input = {(msg.round, msg.nonce): values}

    def resume(self, releases: int, last_round: int) -> None:
        """Go on as the device that made ``releases`` releases, the last for ``last_round``: a
        resumed simulation rebuilds its devices, and the aggregator's ledger is their memory.
        The schedule and ``max_uploads`` count on from there (not from its first, least noisy
        release), its own budget holds their events, and a round it answered before the
        restart (reopened from the journal) is not answered again with fresh noise."""
        self.state.exposures = self.state.updates_sent = releases
        self.state.answered_round = max(self.state.answered_round, last_round)
        if self.budget is not None:
            self.budget.events = [
                event for j in range(releases)
                for event in self.mechanism.release_events(self.n_samples, j)
            ]  # fmt: skip

    def wants(self, msg: GlobalModel) -> bool:
        """Whether this global model asks this device for an update it has not yet given."""
        return self.policy.wants(msg)

    def on_global(self, msg: GlobalModel) -> bytes | None:
        """Train on the broadcast model if asked to; return the encoded update or None (a secure
        round's integers are kept for its session: :meth:`handle` of :class:`Trained`)."""
        self.state.last_version = max(self.state.last_version, msg.version)
        if msg.secure is not None:
            self._secure_train(msg)
            return None
        if self.secure is not None:
            return None  # a secure job's round without sa: never a plain update (Trust refuses it)
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


def _kind_of(payload: bytes) -> str:
    from edge_fl.protocol.secure import up_kind

    return up_kind(payload) or "?"
