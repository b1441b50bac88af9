"""What every privacy mechanism is: the contract between a mechanism module and the rest.

A mechanism owns both halves of a release and its cost: the device rule (train, privatise, build
the update), the server strategy (fold updates, finish the round, carry typed state), the
dp-accounting events per release and per round, the wire kind of its updates, and the text of its
guarantee. Device agents, the aggregator, the ledger, the CLI and the reports only talk to this
interface; the registry (``edge_fl.mechanisms``) is the one place that maps names to classes.

Pure: rules and strategies take an injected generator and never touch sockets or clocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
from pydantic import BaseModel, ValidationError

from edge_fl.mechanisms.exact_sum import ExactSum
from edge_fl.models.training import LocalTraining, local_sgd
from edge_fl.protocol import DenseUpdate, GlobalModel, Update, mechanism_params
from edge_fl.protocol.codecs import codec_class, codec_names
from edge_fl.protocol.params import MechanismSchema, ParamSpec

if TYPE_CHECKING:  # dp-accounting is imported only by mechanisms that account
    from edge_fl.models.base import Model
    from edge_fl.privacy.events import PrivacyEvent


#: what a mechanism whose guarantee does not cover the sample count must name as public: every
#: update and the retained status carry ``n`` = |D| in the clear (the aggregator weights by it)
N_IN_THE_CLEAR = "|D| (every update and status carries n in the clear)"

#: the meaning of a mechanism's public parameter ``L``
UPLOADS = "uploads L a device may make before it stops (its budget is spent)"


@dataclass(frozen=True)
class JobFacts:
    """What a mechanism needs to know about the job besides the privacy config (all public)."""

    rounds: int
    n_devices: int
    expected_participants: float
    n_params: int
    local_lr: float
    local_epochs: int
    batch_size: int
    min_dataset_size: int
    max_uploads: int  # L: uploads a device's budget is split over
    mode: str = "sync"  # sync | fedbuff | fedasync
    dataset_sizes: tuple[int, ...] = ()  # every device's |D|, for run.json parameters


@dataclass(frozen=True)
class Guarantee:
    """What the reported epsilon means: unit, neighbouring relation, and what is assumed public."""

    unit: str  # "example" | "device" | "none"
    relation: str  # "replace_one" | "add_or_remove_one" | "replace_special" | "none"
    kind: str  # "pure" | "approximate" | "none"
    public: tuple[str, ...] = ()

    def text(self) -> str:
        if self.kind == "none":
            return "no privacy guarantee"
        what = "pure eps-DP" if self.kind == "pure" else "(eps, delta)-DP"
        relation = {
            "add_or_remove_one": "add/remove-one",
            "replace_one": "replace-one",
            "replace_special": "replace-one-by-null",
        }
        out = f"{what} per {self.unit}, {relation.get(self.relation, self.relation)} neighbours"
        if self.public:
            out += "; assumed public: " + ", ".join(self.public)
        return out

    def refusal(self, event: PrivacyEvent, mechanism: str = "") -> str | None:
        """Why ``event`` cannot be charged under this guarantee (one line), or None.

        The ledger reports the composition of a mechanism's events next to this guarantee's
        text, so every event must hold under a relation and unit that imply the declared ones
        (``edge_fl.privacy.events.implies``): the same relation and unit, or device-level
        replace-one (local DP) under an example-level guarantee, which claims less than the
        event proves. Everything else is refused, even a mismatch that looks conservative: an
        epsilon accounted under replace-one is no add/remove-one epsilon (a release of |D| is
        replace-one 0-DP and not add/remove DP at all; the bound needs an argument about the
        mechanism, which the ledger cannot check), an add/remove-one epsilon holds under
        replace-one only doubled, a replace-special one only if the null element is a real
        input, and an example-level epsilon says nothing of a device's whole data. Such a
        mechanism must emit its events under the relation it declares (with the noise
        multiplier relative to that relation's sensitivity) or declare what its events prove.
        """
        from edge_fl.privacy.events import as_relation, implies, relation_name

        if implies(event.relation, event.unit, (as_relation(self.relation), self.unit)):
            return None
        who = f"privacy.mechanism = {mechanism!r} " if mechanism else ""
        return (
            f"{who}declares Guarantee(unit={self.unit!r}, relation={self.relation!r}) but its "
            f"event {event.mechanism!r} holds under relation "
            f"{relation_name(event.relation)!r}, unit {event.unit!r}, which does not imply it: "
            "its epsilon would be reported under a guarantee it does not prove; emit events "
            f"under relation {self.relation!r} and unit {self.unit!r}, or declare the guarantee "
            "the events hold under"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "relation": self.relation,
            "kind": self.kind,
            "public": list(self.public),
            "text": self.text(),
        }


class GuaranteeMismatch(ValueError):
    """A mechanism emitted an event its declared :class:`Guarantee` does not cover."""


class Device(Protocol):
    """What a device rule may see of the device: its data, model, training settings and RNG."""

    device_id: str
    X: np.ndarray
    y: np.ndarray
    model: Model
    training: LocalTraining
    rng: np.random.Generator

    @property
    def n_samples(self) -> int: ...


class Strategy(Protocol):
    """One round's (or async batch's) aggregation: fold updates as they are accepted."""

    def add(self, update: Update, weight: float) -> None:
        """Fold in one accepted update; raise TypeError/ValueError if it cannot be (nothing
        changes then)."""
        ...

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """New global parameters and extra metrics for the round record."""
        ...

    def remove(self, update: Update, weight: float) -> None:
        """Take back an update folded with ``add`` with the same ``weight``, exactly (an ingest
        worker leaves out what the coordinator judged a duplicate or late)."""
        ...

    def partial(self) -> dict[str, Any]:
        """What was folded so far, msgpack-safe (an ingest worker's share of the round)."""
        ...

    def merge(self, data: dict[str, Any]) -> None:
        """Fold in another strategy's :meth:`partial`. Exact: merging the partials of any
        split of a round's updates gives bit-for-bit what one strategy folding them all gives
        (docs/scale.md); ValueError if ``data`` is not a partial of this strategy."""
        ...

    @property
    def count(self) -> int: ...

    @property
    def state(self) -> Any:
        """The mechanism state to carry into the next round (None if stateless)."""
        ...


class Mechanism:
    """Base class: plain FedAvg with no privacy. Subclasses override what they change."""

    name: ClassVar[str] = "none"
    #: update kind on the wire: "u" dense delta, "s" SignDS vote (see edge_fl.protocol.codec)
    wire_kind: ClassVar[str] = "u"
    #: the strategy runs (and the round counts as a release) even when no update arrived
    acts_on_empty_round: ClassVar[bool] = False
    guarantee: ClassVar[Guarantee] = Guarantee("none", "none", "none")
    #: the keys of its public parameters ``mp`` besides lr, ep, bs (docs/protocol.md), as
    #: :meth:`public_extra` fills them; the wire layer validates every global message with them
    public_schema: ClassVar[tuple[ParamSpec, ...]] = ()
    #: the model of this mechanism's ``privacy.options`` (a pydantic model; ``extra="forbid"``
    #: makes a misspelt option an error), or None: options are taken as given. The config
    #: validates them through it and writes the defaults in, so the digest and the job
    #: document carry every value.
    options_model: ClassVar[type[BaseModel] | None] = None

    def __init__(self, cfg: Any, facts: JobFacts | None) -> None:
        """``cfg``: the job's ``privacy`` config section (``edge_fl.config.PrivacyConfig``);
        ``None``/``None`` only for the device half of plain FedAvg (no server, no ledger)."""
        self.cfg: Any = cfg
        self.facts: Any = facts
        self.notes: list[str] = []
        #: ``privacy.options`` as an instance of :attr:`options_model` (None without a model)
        self.options: Any = None
        if self.options_model is not None:
            raw = cfg.options if cfg is not None else {}
            self.options = self.options_model.model_validate(raw)

    @classmethod
    def validate_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """``privacy.options`` checked by :attr:`options_model`, defaults filled in; as given
        without a model. ValueError names the option and its domain."""
        if cls.options_model is None:
            return dict(options)
        try:
            return cls.options_model.model_validate(options).model_dump()
        except ValidationError as exc:
            lines = []
            for err in exc.errors():
                key = ".".join(["options", *(str(p) for p in err["loc"])])
                lines.append(f"{key} = {err.get('input')!r}: {err['msg']}")
            raise ValueError("; ".join(lines)) from None

    # --- device half ---------------------------------------------------------------------
    def device_update(self, device: Device, msg: GlobalModel, exposure: int) -> Update:
        """Train on ``msg`` and privatise; ``exposure`` = releases this device made before."""
        return dense_update(device, msg, local_update(device, msg), self.name)

    # --- server half ---------------------------------------------------------------------
    def new_strategy(self, state: Any, server_lr: float, rng: np.random.Generator) -> Strategy:
        return FedAvg(self.facts.n_params, server_lr)

    def initial_state(self) -> Any:
        return None

    def encode_state(self, state: Any) -> dict | None:
        """The state as a msgpack/JSON-safe dict (global message ``sd``, checkpoints)."""
        return None

    def decode_state(self, data: Any) -> Any:
        return None

    def vote_size(self) -> int | None:
        """For vote updates (wire kind "s"): the exact number of indices every vote carries."""
        return None

    def selection_rate(self) -> float | None:
        """Poisson rate q when devices select themselves with secret coins, else None."""
        return None

    def robust_support(self) -> frozenset[str]:
        """What the server may do against poisoned updates (``robust`` config,
        :mod:`edge_fl.server.robust`): ``"norm_bound"`` (clip or refuse a dense delta by its L2
        norm), ``"sample_cap"`` (cap the sample count an update is weighted by), ``"aggregator"``
        (a coordinate-wise trimmed mean or median instead of this mechanism's strategy).

        All of it is post-processing of what devices released, so it costs no privacy; what
        restricts it is the server half's own calibration. Central noise (a mechanism that acts
        on empty rounds) already bounds every contribution by its clip over an unweighted sum
        with a fixed denominator, and its participation counts may be secret: nothing. Votes
        (not dense deltas) have no norm: only the sample cap. A mechanism with its own strategy
        (e.g. NbAFL's downlink noise) must keep it: norm bound and sample cap. Plain FedAvg of
        (locally privatised) deltas: everything. Override to say otherwise.
        """
        if self.acts_on_empty_round:
            return frozenset()
        if self.wire_kind != "u":
            return frozenset({"sample_cap"})
        if type(self).new_strategy is not Mechanism.new_strategy:
            return frozenset({"norm_bound", "sample_cap"})
        return frozenset({"norm_bound", "sample_cap", "aggregator"})

    @classmethod
    def accepts_codec(cls, codec: str) -> str | None:
        """Why this mechanism's updates must not travel through uplink codec ``codec``
        (:mod:`edge_fl.protocol.codecs`), or None when the combination is sound. Checked when the
        config is loaded and when the job is assembled (the decoder's accepted tags).

        A codec runs on the device after the mechanism: for a local mechanism (the release is
        the privatised delta) it is post-processing, so any codec is sound, error feedback
        included (the residual is a function of earlier, already accounted releases). Votes
        (wire kind other than "u") have their own wire format: no codec. Central noise (a
        mechanism that acts on empty rounds) calibrates to a norm bound the server checks on the
        delta as it arrives: only codecs that keep that norm (``Codec.preserves_norm``:
        float32, float16 within the server's rounding slack); stochastic quantisation and
        rotation add noise that pushes a clipped delta over the bound, and top-k error feedback
        adds the previous rounds' residual to it. Override to say otherwise.
        """
        if cls.wire_kind != "u":
            return (
                f"{cls.name} defines its own wire format (updates of kind {cls.wire_kind!r}); "
                "no uplink codec applies to it: leave compression.uplink unset"
            )
        if cls.acts_on_empty_round and not codec_class(codec).preserves_norm:
            keep = [n for n in codec_names() if codec_class(n).preserves_norm]
            return (
                f"{cls.name} adds noise calibrated to a clip bound that the server checks on "
                f"each delta as sent; {codec} changes the delta's norm (stochastic rounding, "
                "rotation or error feedback) so clipped updates would exceed the bound: use "
                f"one of {', '.join(sorted(keep))}"
            )
        return None

    @classmethod
    def check_public(cls, mp: Mapping[str, Any], n_params: int | None) -> None:
        """Cross-field checks of a global message's ``mp`` once every key passed its own
        (``public_schema``); raise :class:`~edge_fl.protocol.PayloadRejected`. ``n_params``: the
        model dimension, when known."""

    @classmethod
    def wire_schema(cls, codec_tags: Mapping[str, str]) -> MechanismSchema:
        """What the wire layer needs to know of this mechanism (registered with it). ``codec_tags``:
        the registered codecs (tag -> name); the schema lists the tags of those this mechanism
        accepts, or None when it accepts them all."""
        accepted = frozenset(
            dt for dt, name in codec_tags.items() if cls.accepts_codec(name) is None
        )
        return MechanismSchema(
            name=cls.name,
            params=cls.public_schema,
            update_kind=cls.wire_kind,
            check=cls.check_public,
            codecs=None if accepted == frozenset(codec_tags) else accepted,
        )

    # --- accounting ----------------------------------------------------------------------
    @property
    def accounts(self) -> bool:
        """Whether releases cost privacy (False: no ledger, no dp-accounting import)."""
        return self.guarantee.kind != "none"

    def release_events(self, n_samples: int, exposure: int) -> list[PrivacyEvent]:
        """The events of one upload by a device of ``n_samples``, its ``exposure``-th (0-based)."""
        return []

    def round_events(self) -> list[PrivacyEvent]:
        """Job-level events of one applied round (central noise touches every device)."""
        return []

    def max_exposures(self) -> int | None:
        """Uploads a device may make before its schedule is spent, if the schedule is finite."""
        return None

    def check_events(self, events: list[PrivacyEvent]) -> list[PrivacyEvent]:
        """``events``, once every one is covered by :attr:`guarantee` (``Guarantee.refusal``);
        :class:`GuaranteeMismatch` (one line: this mechanism, the declared relation and unit,
        the event's) otherwise. The aggregator's ledger charges nothing unchecked."""
        for event in events:
            why = self.guarantee.refusal(event, self.name)
            if why is not None:
                raise GuaranteeMismatch(why)
        return events

    def check_guarantee(self, secure_job: Any = None) -> None:
        """Check, before anything runs, that the events this mechanism charges for the job's
        facts are covered by its guarantee (:meth:`check_events`): those of an upload by the
        smallest device (its first and, with a finite schedule, its last), of a round, and of a
        secure round's masked input (``secure_job``: the job's ``SecureJob``, if it has secure
        rounds). Like the aggregator's ledger, it calls ``release_events``, ``round_events``
        and ``secure_events``, which must have no side effects. Nothing without a guarantee."""
        if not self.accounts:
            return
        n = int(self.facts.min_dataset_size) if self.facts is not None else 1
        last = self.max_exposures()
        exposures = (0,) if not last or last <= 1 else (0, last - 1)
        for exposure in exposures:
            self.check_events(self.release_events(n, exposure))
        self.check_events(self.round_events())
        secure = getattr(self, "secure_events", None)
        if secure_job is not None and secure is not None:
            self.check_events(secure(secure_job))

    # --- reporting -----------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Every parameter needed to recompute the job's total epsilon (for run.json)."""
        out: dict[str, Any] = {"mechanism": self.name, "guarantee": self.guarantee.as_dict()}
        if self.accounts:
            out["delta"] = self.cfg.delta
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def warnings(self) -> list[str]:
        """Settings that are valid but likely to disappoint (logged and kept in run.json)."""
        return []

    def public_params(self) -> dict[str, Any]:
        """What a device needs to run this mechanism, for the signed global message (``mp``,
        docs/protocol.md): the local-training settings plus :meth:`public_extra`."""
        f = self.facts
        return mechanism_params(
            self.name, lr=f.local_lr, ep=f.local_epochs, bs=f.batch_size, **self.public_extra()
        )

    def public_extra(self) -> dict[str, Any]:
        """The mechanism's own public parameters (None values are left out)."""
        return {}


# ------------------------------------------------------------------------------------------
# Shared pieces: local training and the dense update, and the FedAvg strategy


def local_update(device: Device, msg: GlobalModel) -> np.ndarray:
    """Plain local SGD from the broadcast model; returns ``w_local - w_global`` in float64."""
    trained = local_sgd(device.model, msg.params, device.X, device.y, device.training, device.rng)
    return trained.astype(np.float64) - msg.params


def dense_update(device: Device, msg: GlobalModel, delta: np.ndarray, mechanism: str) -> Update:
    return DenseUpdate(
        device=device.device_id,
        round=msg.round,
        base_version=msg.version,
        n_samples=device.n_samples,
        delta=np.asarray(delta, np.float64).astype(np.float32),
        wire_dtype=msg.wire_dtype if msg.wire_dtype in ("f4", "f2") else "f4",  # q8: downlink only
        mechanism=mechanism,
        nonce=msg.nonce,
    )


@dataclass
class FedAvg:
    """Sample-count weighted mean of deltas, scaled by a server learning rate."""

    n_params: int
    server_lr: float = 1.0
    _sum: ExactSum = field(init=False)
    _weight: int = field(default=0, init=False)
    _count: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._sum = ExactSum(self.n_params)

    def add(self, update: Update, weight: float) -> None:
        """``weight`` scales an update's influence (staleness); it is NOT renormalised away, so
        FedAsync with one update applies ``server_lr * f(s) * delta``."""
        if not isinstance(update, DenseUpdate):
            raise TypeError(f"FedAvg takes dense updates, got {type(update).__name__}")
        self._sum.add(update.delta, weight * update.n_samples, update.peak)
        self._weight += int(update.n_samples)
        self._count += 1

    def remove(self, update: Update, weight: float) -> None:
        """Take back an update folded with ``add`` (exact: the sum is fixed-point)."""
        assert isinstance(update, DenseUpdate)
        self._sum.add(update.delta, -(weight * update.n_samples), update.peak)
        self._weight -= int(update.n_samples)
        self._count -= 1

    def partial(self) -> dict[str, Any]:
        return {"s": self._sum.to_bytes(), "w": self._weight, "c": self._count}

    def merge(self, data: dict[str, Any]) -> None:
        total, weight, count = partial_fields(data, self.n_params)
        self._sum.merge(total)
        self._weight += weight
        self._count += count

    @property
    def count(self) -> int:
        return self._count

    @property
    def state(self) -> None:
        return None

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        if self._count == 0 or self._weight <= 0:
            return params.copy(), {}
        step = self.server_lr * self._sum.value() / self._weight
        return (params.astype(np.float64) + step).astype(np.float32), {
            "update_norm": float(np.linalg.norm(step))
        }


def partial_fields(data: Any, n_params: int) -> tuple[ExactSum, int, int]:
    """(sum, weight, count) of a summing strategy's partial, checked (ValueError otherwise)."""
    if not isinstance(data, dict) or set(data) != {"s", "w", "c"}:
        raise ValueError("a partial sum is a map with exactly the keys s, w and c")
    weight, count = data["w"], data["c"]
    if not isinstance(data["s"], bytes):
        raise ValueError("a partial sum's 's' must be bytes")
    for key, value in (("w", weight), ("c", count)):
        if type(value) is not int or value < 0:
            raise ValueError(f"a partial sum's {key!r} must be an int >= 0, got {value!r}")
    return ExactSum.from_bytes(data["s"], n_params), weight, count
