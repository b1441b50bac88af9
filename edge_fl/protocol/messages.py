"""Message types on the wire. Plain frozen dataclasses; the codec maps them to msgpack."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

SCHEMA_VERSION = 1
NONCE_BYTES = 16  # the per-round nonce the aggregator puts in the signed global message
RUN_BYTES = 16  # the aggregator run's id in every global message and job document (``run``)
# Signed global messages (normative format: edge_fl/protocol/signing.py): Ed25519 over
# GLOBAL_CONTEXT || body. Defined here so the codec needs no crypto import.
GLOBAL_CONTEXT = b"edge-fl/global/v1\x00"
# Signed dispatch messages (edge_fl/protocol/dispatch.py): a context of their own, so a dispatch
# signature can never pass for a global message's, nor the reverse.
DISPATCH_CONTEXT = b"edge-fl/dispatch/v1\x00"
SIGNATURE_BYTES = 64
MODES = ("sync", "fedbuff", "fedasync")  # GlobalModel.mode values on the wire


def new_nonce() -> bytes:
    """A fresh random round nonce (``NONCE_BYTES`` bytes from the OS CSPRNG)."""
    return os.urandom(NONCE_BYTES)


class Reject(StrEnum):
    """Why a payload was not accepted; counted per reason in the round metrics and sent back to
    the device in an :class:`Ack`. ``docs/protocol.md`` (section "Rejection reasons") is the
    normative list; :data:`REJECT_MEANING` holds the same one-line meanings."""

    # decided by the decoders (the payload alone, plus the job's UpdateLimits)
    OVERSIZED = "oversized"
    MALFORMED = "malformed"
    WRONG_VERSION = "wrong_version"
    WRONG_KIND = "wrong_kind"
    MISSING_FIELD = "missing_field"
    UNKNOWN_FIELD = "unknown_field"
    BAD_TYPE = "bad_type"
    OUT_OF_RANGE = "out_of_range"
    BAD_DTYPE = "bad_dtype"
    WRONG_SHAPE = "wrong_shape"
    NON_FINITE = "non_finite"
    IMPLAUSIBLE = "implausible"
    BAD_INDICES = "bad_indices"
    TOPIC_MISMATCH = "topic_mismatch"
    WRONG_MECHANISM = "wrong_mechanism"
    WRONG_H = "wrong_h"
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    # decided by the aggregation state, not the decoder:
    LATE = "late"
    FUTURE = "future"
    NOT_SELECTED = "not_selected"
    DUPLICATE = "duplicate"
    STALE = "stale"
    BUDGET_EXHAUSTED = "budget_exhausted"
    WRONG_NONCE = "wrong_nonce"
    NORM_EXCEEDED = "norm_exceeded"


#: one line per reason: what it means and what the sender should fix (docs/protocol.md repeats it)
REJECT_MEANING: dict[Reject, str] = {
    Reject.OVERSIZED: "the payload is larger than the limit for its message type",
    Reject.MALFORMED: "not a msgpack map (invalid msgpack, trailing bytes, a repeated key, "
    "a non-string key, or not a map at the top level)",
    Reject.WRONG_VERSION: "'v' is absent, not an int, or not a schema version this peer speaks",
    Reject.WRONG_KIND: "'k' is absent or names another message type than the topic carries",
    Reject.MISSING_FIELD: "a required key is absent",
    Reject.UNKNOWN_FIELD: "a key the schema of this message (version, kind) does not define",
    Reject.BAD_TYPE: "a key's value has another msgpack type than the schema says",
    Reject.OUT_OF_RANGE: "a value of the right type outside its domain (range, length, "
    "pattern or allowed set)",
    Reject.BAD_DTYPE: "'dt' names no known vector encoding (only f4 and f2 exist)",
    Reject.WRONG_SHAPE: "a vector's byte length is not the model's dimension times the item size",
    Reject.NON_FINITE: "a vector holds NaN or an infinity",
    Reject.IMPLAUSIBLE: "a delta has a value beyond the plausibility bound (abs(x) > 1e4 by default): "
    "almost always a byte-swapped (big-endian) or otherwise mis-encoded vector",
    Reject.BAD_INDICES: "a SignDS index list that does not decode to h strictly ascending "
    "indices in [0, d)",
    Reject.TOPIC_MISMATCH: "the payload names another device than the topic it was published on",
    Reject.WRONG_MECHANISM: "the update's kind or mechanism ('m') is not the job's",
    Reject.WRONG_H: "a SignDS vote whose index count h is not the h of the job's SignDS plan",
    Reject.UNSIGNED: "a device that holds the aggregator's key got an unsigned global message",
    Reject.BAD_SIGNATURE: "the Ed25519 signature does not verify over the signed body",
    Reject.LATE: "the update's round has closed (or is already full)",
    Reject.FUTURE: "the update names a round or version that has not been issued",
    Reject.NOT_SELECTED: "the device was not selected for that round",
    Reject.DUPLICATE: "the device already delivered an update for that round (or version)",
    Reject.STALE: "computed on an older model than the round's (sync) or staler than the job's "
    "max_staleness (async)",
    Reject.BUDGET_EXHAUSTED: "the device declared it has stopped (its privacy budget is spent)",
    Reject.WRONG_NONCE: "'nc' is absent or not the nonce of the round (version) the update names",
    Reject.NORM_EXCEEDED: "the delta's L2 norm exceeds the job's bound (gaussian-central's clip, "
    "or the robust norm bound with on_excess = reject)",
}


class PayloadRejected(ValueError):
    """A payload that must not touch aggregation state: a counted reason and a precise detail.

    ``field``: the offending key (dotted for nested maps, e.g. ``mp.h``) when one is to blame;
    ``round``: the round the payload named, when it was read before the rejection (for an ack).
    """

    def __init__(
        self,
        reason: Reject,
        detail: str,
        *,
        field: str | None = None,
        round: int | None = None,
    ) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.field = field
        self.round = round


@dataclass(frozen=True)
class GlobalModel:
    """The retained model broadcast that starts a round (sync) or advances the version (async)."""

    job: str
    version: int  # number of global updates applied so far
    round: int  # round number (sync) or equal to version (async modes)
    params: np.ndarray  # float32, flat
    mode: str = "sync"
    selected: tuple[str, ...] | None = None  # None: every device may contribute
    deadline_s: float = 0.0  # seconds the round stays open (informational for devices)
    config_digest: str = ""
    wire_dtype: str = "f4"  # "f4" or "f2" on the wire
    mechanism_state: dict | None = None  # the mechanism's carried state (SignDS: MagRR)
    sample_rate: float | None = None  # devices self-select with this probability (Poisson)
    done: bool = False  # the job is over: devices disconnect
    issued_at: float = 0.0  # aggregator wall clock, for latency metrics
    nonce: bytes | None = None  # the round's nonce; an update must echo it (signed with the model)
    # public parameters of the job's mechanism (wire ``mp``; each mechanism registers its schema, edge_fl/protocol/params.py)
    mechanism_params: dict | None = None
    run: bytes | None = None  # the aggregator run's id (docs/protocol.md, "Run id")
    # a secure round's public SecAgg+ parameters (wire ``sa``; docs/protocol.md, "Secure aggregation")
    secure: dict | None = None

    def selects(self, device: str) -> bool:
        return self.selected is None or device in self._selected_set

    @property
    def _selected_set(self) -> frozenset[str]:
        cached = self.__dict__.get("_sel_cache")
        if cached is None:
            cached = frozenset(self.selected or ())
            object.__setattr__(self, "_sel_cache", cached)
        return cached


@dataclass(frozen=True)
class Dispatch:
    """Who trains on a published model version, sent without the model (FedBuff/FedAsync with a
    concurrency limit): the devices asked after the version's global message went out, bound to
    it by the version's nonce (docs/protocol.md, "Dispatch message")."""

    job: str
    version: int  # the ``ver`` (= ``rnd``) of the global message it adds to
    nonce: bytes  # that global message's ``nc``: a dispatch applies to that model only
    selected: tuple[str, ...]  # the devices newly asked to train on it

    def selects(self, device: str) -> bool:
        return device in self.selected

    def binds(self, msg: GlobalModel) -> bool:
        """Whether this dispatch adds to ``msg``: same job, version and nonce."""
        return (
            msg.job == self.job
            and msg.version == self.version
            and msg.nonce is not None
            and msg.nonce == self.nonce
        )

    @classmethod
    def of(cls, msg: GlobalModel) -> Dispatch:
        """The dispatch carrying ``msg``'s selection for ``msg``'s version (what an aggregator
        sends instead of publishing the same model again with another selection)."""
        if msg.nonce is None or not msg.selected:
            raise ValueError("a dispatch needs the version's nonce and at least one device")
        return cls(msg.job, msg.version, msg.nonce, tuple(msg.selected))


@dataclass(frozen=True)
class DenseUpdate:
    """A (possibly privatised) model delta ``w_local - w_global`` and its sample count."""

    device: str
    round: int
    base_version: int
    n_samples: int
    delta: np.ndarray  # float32 flat (decoded); float16 on the wire if wire_dtype == "f2"
    wire_dtype: str = "f4"
    mechanism: str = "none"
    nonce: bytes | None = None  # echo of the global message's nonce (binds the update to the round)
    #: max |delta|, when the decoder measured it (not on the wire): saves the aggregator a pass
    peak: float | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SignDSUpdate:
    """A SignDS vote: a random sign, h selected coordinates and the MagRR bit. No values."""

    device: str
    round: int
    base_version: int
    n_samples: int
    sign: int  # +1 or -1
    indices: np.ndarray  # uint32, strictly ascending
    magrr_bit: int  # 0 or 1 (after randomized response)
    nonce: bytes | None = None  # echo of the global message's nonce (binds the update to the round)


Update = DenseUpdate | SignDSUpdate


@dataclass(frozen=True)
class Status:
    """Retained availability of a device; the broker publishes ``online=False`` as its last will."""

    device: str
    online: bool
    n_samples: int = 0
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Ack:
    """The aggregator's optional answer to one update, on ``ack/<device>`` (only that device may
    read it). ``round`` is None when the rejected payload carried no readable round."""

    device: str
    round: int | None
    ok: bool
    reason: str | None = None  # a Reject value (or "internal_error") when not ok
    detail: str | None = None  # what exactly was wrong (or, when ok, what was adjusted)
