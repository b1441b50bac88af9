"""Message types on the wire. Plain frozen dataclasses; the codec maps them to msgpack."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

SCHEMA_VERSION = 1
NONCE_BYTES = 16  # the per-round nonce the aggregator puts in the signed global message
# Signed global messages (normative format: edge_fl/protocol/signing.py): Ed25519 over
# GLOBAL_CONTEXT || body. Defined here so the codec needs no crypto import.
GLOBAL_CONTEXT = b"edge-fl/global/v1\x00"
SIGNATURE_BYTES = 64
MODES = ("sync", "fedbuff", "fedasync")  # GlobalModel.mode values on the wire


def new_nonce() -> bytes:
    """A fresh random round nonce (``NONCE_BYTES`` bytes from the OS CSPRNG)."""
    return os.urandom(NONCE_BYTES)


class Reject(StrEnum):
    """Why an incoming update was not accepted; counted per reason in the round metrics."""

    OVERSIZED = "oversized"
    MALFORMED = "malformed"
    WRONG_VERSION = "wrong_version"
    WRONG_KIND = "wrong_kind"
    BAD_FIELD = "bad_field"
    WRONG_SHAPE = "wrong_shape"
    NON_FINITE = "non_finite"
    BAD_INDICES = "bad_indices"
    TOPIC_MISMATCH = "topic_mismatch"
    WRONG_MECHANISM = "wrong_mechanism"
    UNSIGNED = "unsigned"  # a verifier was given and the global message carries no signature
    BAD_SIGNATURE = "bad_signature"  # the signature does not verify under the aggregator's key
    # decided by the aggregation state, not the decoder:
    LATE = "late"
    FUTURE = "future"
    NOT_SELECTED = "not_selected"
    DUPLICATE = "duplicate"
    STALE = "stale"
    BUDGET_EXHAUSTED = "budget_exhausted"
    WRONG_NONCE = "wrong_nonce"  # the update's nonce is not the one of the round it names


class PayloadRejected(ValueError):
    """A payload that must not touch aggregation state: a counted reason and a precise detail."""

    def __init__(self, reason: Reject, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


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
