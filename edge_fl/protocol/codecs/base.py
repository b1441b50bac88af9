"""What every uplink codec is: a pure map between a float delta and a few msgpack fields.

A codec encodes a device's (already privatised) delta ``x`` into the fields of a dense update
(``dt`` = its wire tag, then its own keys: bins and small ints/floats, docs/protocol.md section
"Compressed dense updates"), and decodes such fields back into a float32 vector of the model's
dimension. Encoding may be random (stochastic rounding, rotations); the generator is injected
(production: the device's ChaCha20 CSPRNG). A codec with memory (top-k
error feedback) returns its next state; the device owns it (:class:`CodecState`), the codec keeps
nothing between calls.

Decoding trusts nothing: every field's presence, msgpack type, exact byte length and domain are
checked before anything of the model's size is allocated, and every failure is a
:class:`~edge_fl.protocol.messages.PayloadRejected` with a reason and a detail naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import numpy as np

import edge_fl.protocol.fields as F
from edge_fl.protocol.messages import PayloadRejected, Reject

#: the keys of a dense update that are the message's, not its codec's (docs/protocol.md)
HEADER_KEYS = frozenset({"v", "k", "dev", "r", "bv", "n", "nc", "dt", "m"})


@dataclass(frozen=True)
class CodecState:
    """What a stateful codec carries from one encode to the next (top-k: the EF residual)."""

    residual: np.ndarray | None = None


def packed_size(fields: dict[str, Any]) -> int:
    """Bytes these entries add to an update's msgpack map (keys and values, no map header)."""
    return sum(
        len(msgpack.packb(k, use_bin_type=True)) + len(msgpack.packb(v, use_bin_type=True))
        for k, v in fields.items()
    )


def bin_size(n: int) -> int:
    """msgpack bin of ``n`` bytes: 2, 3 or 5 header bytes."""
    return n + (2 if n < 2**8 else 3 if n < 2**16 else 5)


def int_size(v: int) -> int:
    """msgpack (non-negative) int."""
    return 1 if v < 128 else 2 if v < 2**8 else 3 if v < 2**16 else 5 if v < 2**32 else 9


class Codec:
    """Base class. ``name``: config name (``compression.uplink``); ``dt``: wire tag; ``keys``:
    the update keys its fields use besides ``dt``; ``unbiased``: E[decode(encode(x))] = x over
    the encoder's randomness; ``stateful``: encode reads and returns a :class:`CodecState`;
    ``preserves_norm``: a decoded delta keeps the norm it was sent with (no stochastic rounding
    beyond float16's, no error feedback), which a mechanism that checks a clip bound on arrival
    needs; ``downlink``: it may also carry the global model (``compression.downlink``);
    ``options``: the keyword options ``__init__`` takes, with their defaults."""

    name: ClassVar[str]
    dt: ClassVar[str]
    keys: ClassVar[frozenset[str]]
    unbiased: ClassVar[bool] = False
    stateful: ClassVar[bool] = False
    preserves_norm: ClassVar[bool] = False
    downlink: ClassVar[bool] = False
    options: ClassVar[dict[str, Any]] = {}

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f"codec {self.name!r} takes no options, got {sorted(options)}")

    def encode(
        self, x: np.ndarray, rng: np.random.Generator, state: CodecState | None = None
    ) -> tuple[dict[str, Any], CodecState | None]:
        """(fields without ``dt``, the next state). ``x``: a flat finite float vector."""
        raise NotImplementedError

    def decode(self, fields: dict[str, Any], dim: int) -> np.ndarray:
        """A float32 vector of ``dim`` values, or PayloadRejected (never another exception)."""
        raise NotImplementedError

    def payload_bytes(self, dim: int) -> int:
        """Exact bytes the encoded fields, ``dt`` included, add to an update of a ``dim`` model."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"codec": self.name, "dt": self.dt, "unbiased": self.unbiased}

    # helpers for strict decoders -------------------------------------------------------------
    @staticmethod
    def blob(fields: dict[str, Any], key: str, what: str, size: int, detail: str) -> bytes:
        """A required bin of exactly ``size`` bytes (``wrong_shape`` otherwise)."""
        value = F.get(fields, key, bytes, what, "bin")
        if len(value) != size:
            raise PayloadRejected(
                Reject.WRONG_SHAPE,
                f"field {key!r} ({what}) has {len(value)} bytes; expected {size} ({detail})",
                field=key,
            )
        return value

    @staticmethod
    def finite(vec: np.ndarray, key: str, what: str) -> np.ndarray:
        bad = np.flatnonzero(~np.isfinite(vec))
        if bad.size:
            raise PayloadRejected(
                Reject.NON_FINITE,
                f"field {key!r} ({what}) decodes to {bad.size} non-finite values (first at index "
                f"{int(bad[0])})",
                field=key,
            )
        return vec


def check_vector(x: Any) -> np.ndarray:
    """The encoder's input as a flat float64 array; ValueError if it is not finite."""
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.isfinite(arr).all():
        raise ValueError("a codec encodes finite vectors only")
    return arr
