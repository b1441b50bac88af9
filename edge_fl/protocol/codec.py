"""msgpack encoding and strict validation of every message.

Vectors travel as raw little-endian bytes (msgpack ``bin``); keys are short. Decoding never trusts
the payload: it checks size first, then types, schema version, shapes, finiteness and index sets,
and raises :class:`PayloadRejected` with a counted reason before anything touches aggregator state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from edge_fl.protocol.messages import (
    SCHEMA_VERSION,
    DenseUpdate,
    GlobalModel,
    PayloadRejected,
    Reject,
    SignDSUpdate,
    Status,
    Update,
)

WIRE_DTYPES = {"f4": np.dtype("<f4"), "f2": np.dtype("<f2")}
MAX_SAMPLES = 10_000_000


@dataclass(frozen=True)
class UpdateLimits:
    """What the aggregator expects of an update; anything else is rejected."""

    n_params: int
    max_indices: int = 100  # SignDS h cap
    allowed_kinds: frozenset[str] = frozenset({"u", "s"})

    @property
    def max_bytes(self) -> int:
        return 4 * self.n_params + 4096


def _pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _vector_bytes(vec: np.ndarray, wire_dtype: str) -> bytes:
    return np.ascontiguousarray(vec, dtype=WIRE_DTYPES[wire_dtype]).tobytes()


# ---------------------------------------------------------------- encoding


def encode_global(msg: GlobalModel) -> bytes:
    body: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "k": "g",
        "job": msg.job,
        "ver": msg.version,
        "rnd": msg.round,
        "mode": msg.mode,
        "dt": msg.wire_dtype,
        "w": _vector_bytes(msg.params, msg.wire_dtype),
        "dl": float(msg.deadline_s),
        "cfg": msg.config_digest,
        "ts": float(msg.issued_at),
    }
    if msg.selected is not None:
        body["sel"] = list(msg.selected)
    if msg.mechanism_state is not None:
        body["sd"] = msg.mechanism_state
    if msg.sample_rate is not None:
        body["q"] = float(msg.sample_rate)
    if msg.done:
        body["done"] = True
    return _pack(body)


# SignDS index codings as one-byte codes on the wire
_CODING_CODE = {"bp": 0, "dv": 1}
_CODING_TAG = {v: k for k, v in _CODING_CODE.items()}


def encode_update(update: Update, dim: int | None = None) -> bytes:
    """Encode an update; SignDS needs the model dimension ``dim`` to choose its index coding.

    The device id is NOT in the payload: the topic ``up/<device>`` is the identity, and the
    broker's ACL lets a device publish only there. A SignDS update packs sign and MagRR bit into
    one small integer ``sb`` (bit 0: sign is +1, bit 1: MagRR bit): every byte counts there.
    """
    common = {
        "v": SCHEMA_VERSION,
        "r": update.round,
        "bv": update.base_version,
        "n": update.n_samples,
    }
    if isinstance(update, DenseUpdate):
        return _pack(
            {
                **common,
                "k": "u",
                "dt": update.wire_dtype,
                "m": update.mechanism,
                "x": _vector_bytes(update.delta, update.wire_dtype),
            }
        )
    if dim is None:
        raise ValueError("encoding a SignDS update needs the model dimension (dim=...)")
    from edge_fl.protocol.indices import encode_indices

    tag, blob = encode_indices(update.indices, dim)
    return _pack(
        {
            **common,
            "k": "s",
            "sb": (1 if update.sign > 0 else 0) | (int(update.magrr_bit) << 1),
            "h": len(update.indices),
            "c": _CODING_CODE[tag],
            "ix": blob,
        }
    )


def encode_status(status: Status) -> bytes:
    body: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "k": "st",
        "dev": status.device,
        "on": status.online,
        "n": status.n_samples,
    }
    if status.info:
        body["i"] = status.info
    return _pack(body)


# ---------------------------------------------------------------- decoding


def _unpack(payload: bytes, max_bytes: int) -> dict[str, Any]:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise PayloadRejected(Reject.MALFORMED, f"payload is {type(payload).__name__}, not bytes")
    if len(payload) > max_bytes:
        raise PayloadRejected(
            Reject.OVERSIZED, f"payload of {len(payload)} bytes exceeds the limit of {max_bytes}"
        )
    try:
        obj = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=4096
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise PayloadRejected(Reject.MALFORMED, f"not valid msgpack ({exc})") from None
    if not isinstance(obj, dict):
        raise PayloadRejected(Reject.MALFORMED, f"top level is {type(obj).__name__}, not a map")
    version = obj.get("v")
    if version != SCHEMA_VERSION:
        raise PayloadRejected(
            Reject.WRONG_VERSION, f"schema version {version!r}, expected {SCHEMA_VERSION}"
        )
    return obj


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in obj:
        raise PayloadRejected(Reject.BAD_FIELD, f"missing field {key!r} ({what})")
    value = obj[key]
    # bool is an int subclass; never accept it where a number is meant
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise PayloadRejected(Reject.BAD_FIELD, f"field {key!r} ({what}) is a bool")
    if not isinstance(value, kind):
        raise PayloadRejected(
            Reject.BAD_FIELD, f"field {key!r} ({what}) has type {type(value).__name__}"
        )
    return value


def _int_field(obj: dict[str, Any], key: str, what: str, lo: int, hi: int) -> int:
    value = _field(obj, key, int, what)
    if not lo <= value <= hi:
        raise PayloadRejected(Reject.BAD_FIELD, f"{what} {key!r} = {value} outside [{lo}, {hi}]")
    return value


def _vector(blob: bytes, wire_dtype: str, n_params: int, what: str) -> np.ndarray:
    dtype = WIRE_DTYPES.get(wire_dtype)
    if dtype is None:
        raise PayloadRejected(Reject.BAD_FIELD, f"unknown dtype {wire_dtype!r} (use f4 or f2)")
    if len(blob) != n_params * dtype.itemsize:
        raise PayloadRejected(
            Reject.WRONG_SHAPE,
            f"{what} has {len(blob)} bytes; expected {n_params} x {dtype.itemsize} "
            f"= {n_params * dtype.itemsize}",
        )
    vec = np.frombuffer(blob, dtype=dtype).astype(np.float32)
    if not np.isfinite(vec).all():
        bad = int((~np.isfinite(vec)).sum())
        raise PayloadRejected(Reject.NON_FINITE, f"{what} has {bad} non-finite values")
    return vec


def decode_update(payload: bytes, limits: UpdateLimits, topic_device: str | None = None) -> Update:
    """Decode and validate one update; raise PayloadRejected with the reason otherwise."""
    obj = _unpack(payload, limits.max_bytes)
    kind = obj.get("k")
    if kind not in ("u", "s"):
        raise PayloadRejected(Reject.WRONG_KIND, f"kind {kind!r} is not an update (u or s)")
    if kind not in limits.allowed_kinds:
        raise PayloadRejected(
            Reject.WRONG_MECHANISM, f"update kind {kind!r} is not the job's mechanism"
        )
    device = topic_device or ""
    if "dev" in obj:  # optional: the topic is the identity; if a payload names one, it must agree
        named = _field(obj, "dev", str, "device id")
        if topic_device is not None and named != topic_device:
            raise PayloadRejected(
                Reject.TOPIC_MISMATCH,
                f"device {named!r} published on the topic of {topic_device!r}",
            )
        device = named
    rnd = _int_field(obj, "r", "round", 0, 2**40)
    base = _int_field(obj, "bv", "base version", 0, 2**40)
    n = _int_field(obj, "n", "sample count", 1, MAX_SAMPLES)
    if kind == "u":
        dt = _field(obj, "dt", str, "wire dtype")
        mech = obj.get("m", "none")
        if not isinstance(mech, str):
            raise PayloadRejected(Reject.BAD_FIELD, "field 'm' (mechanism) is not a string")
        delta = _vector(_field(obj, "x", bytes, "delta vector"), dt, limits.n_params, "delta")
        return DenseUpdate(device, rnd, base, n, delta, dt, mech)
    return _decode_signds(obj, limits, device, rnd, base, n)


def _decode_signds(
    obj: dict[str, Any], limits: UpdateLimits, device: str, rnd: int, base: int, n: int
) -> SignDSUpdate:
    from edge_fl.protocol.indices import IndexCodingError, decode_indices

    flags = _int_field(obj, "sb", "sign/MagRR-bit flags", 0, 3)
    sign, bit = (1 if flags & 1 else -1), (flags >> 1) & 1
    count = _int_field(obj, "h", "index count", 1, limits.max_indices)
    code = _int_field(obj, "c", "index coding", 0, 255)
    tag = _CODING_TAG.get(code, f"code {code}")
    blob = _field(obj, "ix", bytes, "indices")
    try:
        indices = decode_indices(tag, blob, limits.n_params, count, limits.max_indices)
    except IndexCodingError as exc:
        raise PayloadRejected(Reject.BAD_INDICES, str(exc)) from None
    return SignDSUpdate(device, rnd, base, n, sign, indices, bit)


def decode_global(payload: bytes, max_bytes: int = 1 << 30) -> GlobalModel:
    obj = _unpack(payload, max_bytes)
    if obj.get("k") != "g":
        raise PayloadRejected(Reject.WRONG_KIND, f"kind {obj.get('k')!r} is not a global model")
    dt = _field(obj, "dt", str, "wire dtype")
    blob = _field(obj, "w", bytes, "parameters")
    dtype = WIRE_DTYPES.get(dt)
    if dtype is None or len(blob) % dtype.itemsize:
        raise PayloadRejected(Reject.WRONG_SHAPE, f"parameters: bad dtype {dt!r} or length")
    params = _vector(blob, dt, len(blob) // dtype.itemsize, "parameters")
    sel = obj.get("sel")
    if sel is not None and not (isinstance(sel, list) and all(isinstance(s, str) for s in sel)):
        raise PayloadRejected(Reject.BAD_FIELD, "field 'sel' is not a list of device ids")
    state = obj.get("sd")
    if state is not None and not isinstance(state, dict):
        raise PayloadRejected(Reject.BAD_FIELD, "field 'sd' is not a map")
    q = obj.get("q")
    if q is not None and not (isinstance(q, float | int) and 0 < q <= 1):
        raise PayloadRejected(Reject.BAD_FIELD, f"sample rate {q!r} is not in (0, 1]")
    deadline = _field(obj, "dl", (int, float), "deadline")
    if not math.isfinite(deadline) or deadline < 0:
        raise PayloadRejected(Reject.BAD_FIELD, f"deadline {deadline} is not >= 0")
    return GlobalModel(
        job=_field(obj, "job", str, "job id"),
        version=_int_field(obj, "ver", "version", 0, 2**40),
        round=_int_field(obj, "rnd", "round", 0, 2**40),
        params=params,
        mode=_field(obj, "mode", str, "mode"),
        selected=tuple(sel) if sel is not None else None,
        deadline_s=float(deadline),
        config_digest=_field(obj, "cfg", str, "config digest"),
        wire_dtype=dt,
        mechanism_state=state,
        sample_rate=None if q is None else float(q),
        done=bool(obj.get("done", False)),
        issued_at=float(obj.get("ts", 0.0)),
    )


def decode_status(payload: bytes, topic_device: str | None = None) -> Status:
    obj = _unpack(payload, 64 * 1024)
    if obj.get("k") != "st":
        raise PayloadRejected(Reject.WRONG_KIND, f"kind {obj.get('k')!r} is not a status")
    device = _field(obj, "dev", str, "device id")
    if topic_device is not None and device != topic_device:
        raise PayloadRejected(
            Reject.TOPIC_MISMATCH, f"status of {device!r} on the topic of {topic_device!r}"
        )
    online = _field(obj, "on", bool, "online flag")
    n = obj.get("n", 0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise PayloadRejected(Reject.BAD_FIELD, "field 'n' (sample count) is not an int >= 0")
    info = obj.get("i", {})
    if not isinstance(info, dict):
        raise PayloadRejected(Reject.BAD_FIELD, "field 'i' is not a map")
    return Status(device, online, n, info)
