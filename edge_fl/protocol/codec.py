"""msgpack encoding and strict validation of every message.

Vectors travel as raw little-endian bytes (msgpack ``bin``); keys are short. Decoding never trusts
the payload: it checks size first, then types, schema version, shapes, finiteness and index sets,
and raises :class:`PayloadRejected` with a counted reason before anything touches aggregator state.

The decoders' contract: for ANY input (any object, any bytes) they return a message or raise
:class:`PayloadRejected`; no other exception escapes (``tests/test_protocol_fuzz.py`` fuzzes this).
Types are exact: a bool is not an int, a float is not an int (``v: 1.0`` is not version 1), an
int or float field must be finite and in range; maps may not repeat a key nor carry a key the
schema does not define.

Global messages may be signed (Ed25519, format in :mod:`edge_fl.protocol.signing`): pass a
``signer`` to :func:`encode_global` and a ``verifier`` to :func:`decode_global`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import numpy as np

from edge_fl.protocol.messages import (
    GLOBAL_CONTEXT,
    MODES,
    NONCE_BYTES,
    SCHEMA_VERSION,
    SIGNATURE_BYTES,
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
MAX_COUNTER = 2**40  # rounds and versions
MAX_DEADLINE_S = 1e9
MAX_STATUS_BYTES = 64 * 1024
MAX_MAP_ENTRIES = 64  # mechanism state ``sd`` and status info ``i``
MAX_INFO_STR = 256
# device ids, job ids, mechanism names, map keys: the topic-segment alphabet
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_DIGEST = re.compile(r"^[A-Za-z0-9_.\-]{0,128}$")


class Signs(Protocol):
    def sign(self, data: bytes) -> bytes: ...


class Verifies(Protocol):
    def verify(self, data: bytes, signature: bytes) -> bool: ...


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


def _check_nonce(nonce: bytes | None) -> None:
    if nonce is not None and (not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES):
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes, got {nonce!r}")


# ---------------------------------------------------------------- encoding


def global_body(msg: GlobalModel) -> bytes:
    """The unsigned global message: the exact bytes a signature covers."""
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
    if msg.nonce is not None:
        _check_nonce(msg.nonce)
        body["nc"] = msg.nonce
    return _pack(body)


def encode_global(msg: GlobalModel, signer: Signs | None = None) -> bytes:
    """The global message; with a ``signer``, the signed envelope (see ``signing.py``)."""
    body = global_body(msg)
    if signer is None:
        return body
    signature = signer.sign(GLOBAL_CONTEXT + body)
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise ValueError(f"the signer returned {signature!r}, not {SIGNATURE_BYTES} bytes")
    return _pack({"v": SCHEMA_VERSION, "k": "gs", "b": body, "sig": signature})


# SignDS index codings as one-byte codes on the wire
_CODING_CODE = {"bp": 0, "dv": 1}
_CODING_TAG = {v: k for k, v in _CODING_CODE.items()}


def encode_update(update: Update, dim: int | None = None) -> bytes:
    """Encode an update; SignDS needs the model dimension ``dim`` to choose its index coding.

    The device id is NOT in the payload: the topic ``up/<device>`` is the identity, and the
    broker's ACL lets a device publish only there. A SignDS update packs sign and MagRR bit into
    one small integer ``sb`` (bit 0: sign is +1, bit 1: MagRR bit): every byte counts there.
    The round's nonce (from the global message), when the update has one, travels as ``nc``.
    """
    common: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "r": update.round,
        "bv": update.base_version,
        "n": update.n_samples,
    }
    if update.nonce is not None:
        _check_nonce(update.nonce)
        common["nc"] = update.nonce
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


class _DuplicateKey(Exception):
    pass


def _map_without_duplicates(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    # msgpack keeps the last of repeated keys silently; two parsers could then disagree
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _describe(value: Any) -> str:
    """A short, safe description of a hostile value for a rejection detail.

    Never ``repr`` a container (msgpack nests up to 1023 levels, deeper than Python's recursion
    limit: ``repr`` raised RecursionError) nor a whole str/bin (up to the payload size)."""
    kind = type(value)
    if kind in (list, dict):
        return f"<{'list' if kind is list else 'map'} of {len(value)}>"
    if kind in (str, bytes):
        cut = 40 if kind is str else 16  # a byte may take 4 characters
        text = repr(value[:cut])
        return text if len(value) <= cut else f"{text[:-1]}...{text[-1]} ({len(value)} long)"
    if kind in (int, float, bool) or value is None:
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"<{kind.__name__}>"


def _unpack(payload: Any, max_bytes: int) -> dict[str, Any]:
    if isinstance(payload, memoryview):
        try:
            payload = payload.tobytes()
        except Exception:  # a released view, an exotic format
            raise PayloadRejected(Reject.MALFORMED, "payload is an unreadable memoryview") from None
    if not isinstance(payload, bytes | bytearray):
        raise PayloadRejected(Reject.MALFORMED, f"payload is {type(payload).__name__}, not bytes")
    if len(payload) > max_bytes:
        raise PayloadRejected(
            Reject.OVERSIZED, f"payload of {len(payload)} bytes exceeds the limit of {max_bytes}"
        )
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=4096,
            object_pairs_hook=_map_without_duplicates,
        )
    except _DuplicateKey as exc:
        raise PayloadRejected(
            Reject.MALFORMED, f"a map repeats the key {_describe(exc.args[0])}"
        ) from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise PayloadRejected(Reject.MALFORMED, f"not valid msgpack ({exc})") from None
    if type(obj) is not dict:
        raise PayloadRejected(Reject.MALFORMED, f"top level is {type(obj).__name__}, not a map")
    version = obj.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise PayloadRejected(
            Reject.WRONG_VERSION,
            f"schema version {_describe(version)} ({type(version).__name__}), "
            f"expected the int {SCHEMA_VERSION}",
        )
    return obj


def _check_keys(obj: dict[Any, Any], allowed: frozenset[str], what: str) -> None:
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        names = ", ".join(_describe(k) for k in unknown[:5])
        raise PayloadRejected(Reject.BAD_FIELD, f"unknown field(s) in {what}: {names}")


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """A required field of exactly one of the types ``kind`` (no subclasses: bool is not int)."""
    if key not in obj:
        raise PayloadRejected(Reject.BAD_FIELD, f"missing field {key!r} ({what})")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if type(value) not in kinds:
        expected = " or ".join(k.__name__ for k in kinds)
        raise PayloadRejected(
            Reject.BAD_FIELD,
            f"field {key!r} ({what}) has type {type(value).__name__}, expected {expected}",
        )
    return value


def _int_field(obj: dict[str, Any], key: str, what: str, lo: int, hi: int) -> int:
    value = _field(obj, key, int, what)
    if not lo <= value <= hi:
        raise PayloadRejected(Reject.BAD_FIELD, f"{what} {key!r} = {value} outside [{lo}, {hi}]")
    return value


def _number(value: Any, key: str, what: str, lo: float, hi: float) -> float:
    """An int or float (never a bool), finite, in [lo, hi], as a float."""
    if type(value) not in (int, float):
        raise PayloadRejected(
            Reject.BAD_FIELD,
            f"field {key!r} ({what}) has type {type(value).__name__}, expected a number",
        )
    if not math.isfinite(value) or not lo <= value <= hi:
        raise PayloadRejected(
            Reject.BAD_FIELD, f"field {key!r} ({what}) = {value!r} is not finite in [{lo}, {hi}]"
        )
    return float(value)


def _name_field(obj: dict[str, Any], key: str, what: str) -> str:
    value = _field(obj, key, str, what)
    if not _NAME.fullmatch(value):
        raise PayloadRejected(
            Reject.BAD_FIELD,
            f"field {key!r} ({what}) = {_describe(value)} is not 1-64 of A-Z a-z 0-9 _ . -",
        )
    return value


def _optional_nonce(obj: dict[str, Any]) -> bytes | None:
    if "nc" not in obj:
        return None
    nonce = _field(obj, "nc", bytes, "round nonce")
    if len(nonce) != NONCE_BYTES:
        raise PayloadRejected(
            Reject.BAD_FIELD, f"round nonce 'nc' has {len(nonce)} bytes, expected {NONCE_BYTES}"
        )
    return nonce


def _vector(blob: bytes, wire_dtype: str, n_params: int, what: str) -> np.ndarray:
    dtype = WIRE_DTYPES.get(wire_dtype)
    if dtype is None:
        raise PayloadRejected(
            Reject.BAD_FIELD,
            f"field 'dt' (wire dtype) = {_describe(wire_dtype)} is unknown (use f4 or f2)",
        )
    if len(blob) != n_params * dtype.itemsize:
        raise PayloadRejected(
            Reject.WRONG_SHAPE,
            f"{what} has {len(blob)} bytes; expected {n_params} x {dtype.itemsize} "
            f"= {n_params * dtype.itemsize}",
        )
    vec = np.frombuffer(blob, dtype=dtype).astype(np.float32)
    finite = np.isfinite(vec)
    if not finite.all():
        bad = int((~finite).sum())
        raise PayloadRejected(Reject.NON_FINITE, f"{what} has {bad} non-finite values")
    return vec


_UPDATE_COMMON = frozenset({"v", "k", "dev", "r", "bv", "n", "nc"})
_DENSE_KEYS = _UPDATE_COMMON | {"dt", "m", "x"}
_SIGNDS_KEYS = _UPDATE_COMMON | {"sb", "h", "c", "ix"}


def decode_update(payload: bytes, limits: UpdateLimits, topic_device: str | None = None) -> Update:
    """Decode and validate one update; raise PayloadRejected with the reason otherwise.

    The returned update's ``nonce`` is the payload's ``nc`` (None if absent); comparing it with
    the nonce of the round (or version) it names is the aggregator's job (``Reject.WRONG_NONCE``).
    """
    obj = _unpack(payload, limits.max_bytes)
    kind = obj.get("k")
    if kind not in ("u", "s") or type(kind) is not str:
        raise PayloadRejected(
            Reject.WRONG_KIND, f"kind {_describe(kind)} is not an update (u or s)"
        )
    if kind not in limits.allowed_kinds:
        raise PayloadRejected(
            Reject.WRONG_MECHANISM, f"update kind {kind!r} is not the job's mechanism"
        )
    _check_keys(obj, _DENSE_KEYS if kind == "u" else _SIGNDS_KEYS, f"an update of kind {kind!r}")
    device = topic_device or ""
    if "dev" in obj:  # optional: the topic is the identity; if a payload names one, it must agree
        named = _name_field(obj, "dev", "device id")
        if topic_device is not None and named != topic_device:
            raise PayloadRejected(
                Reject.TOPIC_MISMATCH,
                f"device {named!r} published on the topic of {topic_device!r}",
            )
        device = named
    rnd = _int_field(obj, "r", "round", 0, MAX_COUNTER)
    base = _int_field(obj, "bv", "base version", 0, MAX_COUNTER)
    n = _int_field(obj, "n", "sample count", 1, MAX_SAMPLES)
    nonce = _optional_nonce(obj)
    if kind == "u":
        dt = _field(obj, "dt", str, "wire dtype")
        mech = _name_field(obj, "m", "mechanism") if "m" in obj else "none"
        delta = _vector(_field(obj, "x", bytes, "delta vector"), dt, limits.n_params, "delta")
        return DenseUpdate(device, rnd, base, n, delta, dt, mech, nonce)
    return _decode_signds(obj, limits, device, rnd, base, n, nonce)


def _decode_signds(
    obj: dict[str, Any],
    limits: UpdateLimits,
    device: str,
    rnd: int,
    base: int,
    n: int,
    nonce: bytes | None,
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
    return SignDSUpdate(device, rnd, base, n, sign, indices, bit, nonce)


_SIGNED_KEYS = frozenset({"v", "k", "b", "sig"})
_GLOBAL_KEYS = frozenset(
    {"v", "k", "job", "ver", "rnd", "mode", "dt", "w", "dl", "cfg", "ts", "sel", "sd", "q"}
    | {"done", "nc"}
)


def decode_global(
    payload: bytes,
    max_bytes: int = 1 << 30,
    *,
    verifier: Verifies | None = None,
    expected_dim: int | None = None,
) -> GlobalModel:
    """Decode and validate a global message, signed (``k: gs``) or not (``k: g``).

    ``verifier``: the aggregator's public key; then an unsigned message is ``UNSIGNED`` and a
    signature that does not verify over the exact body bytes is ``BAD_SIGNATURE`` (checked before
    the body is parsed). Without one, a signed message still decodes (its signature unchecked).
    ``expected_dim``: the device's model size; a parameter vector of another length is
    ``WRONG_SHAPE``. Round/version freshness is :class:`edge_fl.protocol.window.GlobalWindow`'s.
    """
    obj = _unpack(payload, max_bytes)
    kind = obj.get("k")
    if kind == "gs" and type(kind) is str:
        _check_keys(obj, _SIGNED_KEYS, "a signed global message")
        body = _field(obj, "b", bytes, "signed body")
        signature = _field(obj, "sig", bytes, "signature")
        if len(signature) != SIGNATURE_BYTES:
            raise PayloadRejected(
                Reject.BAD_SIGNATURE,
                f"signature has {len(signature)} bytes, expected {SIGNATURE_BYTES}",
            )
        if verifier is not None:
            try:
                valid = verifier.verify(GLOBAL_CONTEXT + body, signature) is True
            except Exception:  # a verifier must say no, not raise; treat it as a no
                valid = False
            if not valid:
                raise PayloadRejected(
                    Reject.BAD_SIGNATURE, "the signature does not verify under the aggregator key"
                )
        obj = _unpack(body, len(body))
        inner = obj.get("k")
        if inner != "g" or type(inner) is not str:
            raise PayloadRejected(
                Reject.WRONG_KIND, f"signed body of kind {_describe(inner)}, not a global model"
            )
    elif kind == "g" and type(kind) is str:
        if verifier is not None:
            raise PayloadRejected(
                Reject.UNSIGNED, "an unsigned global message where a signature is required"
            )
    else:
        raise PayloadRejected(
            Reject.WRONG_KIND, f"kind {_describe(kind)} is not a global model (g or gs)"
        )
    return _decode_global_body(obj, expected_dim)


def _decode_global_body(obj: dict[str, Any], expected_dim: int | None) -> GlobalModel:
    _check_keys(obj, _GLOBAL_KEYS, "a global message")
    job = _name_field(obj, "job", "job id")
    version = _int_field(obj, "ver", "version", 0, MAX_COUNTER)
    rnd = _int_field(obj, "rnd", "round", 0, MAX_COUNTER)
    mode = _field(obj, "mode", str, "mode")
    if mode not in MODES:
        raise PayloadRejected(
            Reject.BAD_FIELD, f"field 'mode' = {_describe(mode)} is not one of {', '.join(MODES)}"
        )
    digest = _field(obj, "cfg", str, "config digest")
    if not _DIGEST.fullmatch(digest):
        raise PayloadRejected(
            Reject.BAD_FIELD,
            f"field 'cfg' (config digest) = {_describe(digest)} is not 0-128 of A-Z a-z 0-9 _ . -",
        )
    deadline = _number(
        _field(obj, "dl", (int, float), "deadline"), "dl", "deadline", 0, MAX_DEADLINE_S
    )
    issued = 0.0
    if "ts" in obj:
        issued = _number(obj["ts"], "ts", "issue time", -math.inf, math.inf)
    selected = _optional_selection(obj)
    state = _optional_state(obj)
    rate = None
    if "q" in obj:
        rate = _number(obj["q"], "q", "sample rate", 0.0, 1.0)
        if rate == 0.0:
            raise PayloadRejected(Reject.BAD_FIELD, "sample rate 'q' = 0 is not in (0, 1]")
    done = _field(obj, "done", bool, "done marker") if "done" in obj else False
    nonce = _optional_nonce(obj)
    dt = _field(obj, "dt", str, "wire dtype")
    dtype = WIRE_DTYPES.get(dt)
    if dtype is None:
        raise PayloadRejected(
            Reject.BAD_FIELD, f"field 'dt' (wire dtype) = {_describe(dt)} is unknown (use f4 or f2)"
        )
    blob = _field(obj, "w", bytes, "parameters")
    if len(blob) % dtype.itemsize or not blob:
        raise PayloadRejected(
            Reject.WRONG_SHAPE,
            f"parameters 'w' have {len(blob)} bytes: not a non-empty multiple of {dtype.itemsize}",
        )
    n_params = len(blob) // dtype.itemsize
    if expected_dim is not None and n_params != expected_dim:
        raise PayloadRejected(
            Reject.WRONG_SHAPE,
            f"parameters 'w' have {n_params} values; this model has {expected_dim}",
        )
    params = _vector(blob, dt, n_params, "parameters")
    return GlobalModel(
        job=job,
        version=version,
        round=rnd,
        params=params,
        mode=mode,
        selected=selected,
        deadline_s=deadline,
        config_digest=digest,
        wire_dtype=dt,
        mechanism_state=state,
        sample_rate=rate,
        done=done,
        issued_at=issued,
        nonce=nonce,
    )


def _optional_selection(obj: dict[str, Any]) -> tuple[str, ...] | None:
    if "sel" not in obj:
        return None
    sel = _field(obj, "sel", list, "selection")
    for i, device in enumerate(sel):
        if type(device) is not str or not _NAME.fullmatch(device):
            raise PayloadRejected(
                Reject.BAD_FIELD, f"field 'sel' entry {i} = {_describe(device)} is not a device id"
            )
    if len(set(sel)) != len(sel):
        raise PayloadRejected(Reject.BAD_FIELD, "field 'sel' (selection) names a device twice")
    return tuple(sel)


def _scalar_map(value: Any, key: str, what: str, *, text: bool) -> dict[str, Any]:
    """A flat map of names to finite numbers and bools (and, with ``text``, short strings/nil)."""
    if type(value) is not dict:
        raise PayloadRejected(
            Reject.BAD_FIELD, f"field {key!r} ({what}) has type {type(value).__name__}, not map"
        )
    if len(value) > MAX_MAP_ENTRIES:
        raise PayloadRejected(
            Reject.BAD_FIELD,
            f"field {key!r} ({what}) has {len(value)} entries (max {MAX_MAP_ENTRIES})",
        )
    for name, item in value.items():
        if type(name) is not str or not _NAME.fullmatch(name):
            raise PayloadRejected(
                Reject.BAD_FIELD, f"field {key!r} ({what}) has a bad key {_describe(name)}"
            )
        kind = type(item)
        ok = (
            kind is bool
            or kind is int
            or (kind is float and math.isfinite(item))
            or (text and (item is None or (kind is str and len(item) <= MAX_INFO_STR)))
        )
        if not ok:
            raise PayloadRejected(
                Reject.BAD_FIELD,
                f"field {key!r} ({what}) entry {name!r} = {_describe(item)} is not allowed",
            )
    return value


def _optional_state(obj: dict[str, Any]) -> dict[str, Any] | None:
    if "sd" not in obj:
        return None
    return _scalar_map(obj["sd"], "sd", "mechanism state", text=False)


_STATUS_KEYS = frozenset({"v", "k", "dev", "on", "n", "i"})


def decode_status(payload: bytes, topic_device: str | None = None) -> Status:
    obj = _unpack(payload, MAX_STATUS_BYTES)
    kind = obj.get("k")
    if kind != "st" or type(kind) is not str:
        raise PayloadRejected(Reject.WRONG_KIND, f"kind {_describe(kind)} is not a status")
    _check_keys(obj, _STATUS_KEYS, "a status")
    device = _name_field(obj, "dev", "device id")
    if topic_device is not None and device != topic_device:
        raise PayloadRejected(
            Reject.TOPIC_MISMATCH, f"status of {device!r} on the topic of {topic_device!r}"
        )
    online = _field(obj, "on", bool, "online flag")
    n = _int_field(obj, "n", "sample count", 0, MAX_SAMPLES) if "n" in obj else 0
    info: dict[str, Any] = {}
    if "i" in obj:
        info = _scalar_map(obj["i"], "i", "status info", text=True)
        stopped = info.get("stopped")
        if "stopped" in info and (type(stopped) is not str or not stopped):
            raise PayloadRejected(
                Reject.BAD_FIELD,
                f"status info 'stopped' = {_describe(stopped)} is not a non-empty reason",
            )
    return Status(device, online, n, info)
