"""msgpack encoding and strict validation of every message (normative spec: docs/protocol.md).

Vectors travel as raw little-endian IEEE 754 bytes (msgpack ``bin``); keys are short. Decoding
never trusts the payload: it checks size first, then the schema version and kind, unknown keys,
then each field's presence, msgpack type and domain, then shapes, finiteness, plausibility and
index sets, and raises :class:`PayloadRejected` with a specific reason (``missing_field``,
``bad_type``, ``out_of_range``, ``bad_dtype``, ...) and a detail naming the key, the expected type
and domain and the received value, before anything touches aggregator state.

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
from typing import Any

import msgpack
import numpy as np

import edge_fl.protocol.fields as F
from edge_fl.protocol.codecs import codec_for_tag, codec_tags, registered_tags
from edge_fl.protocol.codecs.base import HEADER_KEYS
from edge_fl.protocol.codecs.q8 import Q8
from edge_fl.protocol.codecs.quantised import BLOCK, dequantise, n_blocks, quantise_nearest
from edge_fl.protocol.envelope import Signs, Verifies, open_signed, seal
from edge_fl.protocol.indices import (
    CODES,
    CODINGS,
    IndexCodingError,
    decode_indices,
    encode_indices,
)
from edge_fl.protocol.messages import (
    GLOBAL_CONTEXT,
    MODES,
    NONCE_BYTES,
    RUN_BYTES,
    SCHEMA_VERSION,
    Ack,
    DenseUpdate,
    GlobalModel,
    PayloadRejected,
    Reject,
    SignDSUpdate,
    Status,
    Update,
)
from edge_fl.protocol.params import check_mechanism_params, mechanism_schema
from edge_fl.protocol.secure import check_secure_params

WIRE_DTYPES: dict[str, np.dtype[Any]] = {"f4": np.dtype("<f4"), "f2": np.dtype("<f2")}
_FLOAT_TAGS = frozenset(WIRE_DTYPES)
#: the global model's third dtype: 8-bit levels per block of 256 values (downlink compression)
GLOBAL_Q8 = Q8.dt
MAX_SAMPLES = 10_000_000
MAX_COUNTER = 2**40  # rounds and versions
MAX_DEADLINE_S = 1e9
MAX_STATUS_BYTES = 64 * 1024
MAX_ACK_BYTES = 1024
MAX_ACK_DETAIL = 256  # characters of an ack's detail ``d``
MAX_MAP_ENTRIES = 64  # mechanism state ``sd`` and status info ``i``
MAX_INFO_STR = 256
MAX_STR = 4096  # any msgpack str in any message
DEFAULT_MAX_ABS = 1e4  # plausibility bound on a dense delta's values (see UpdateLimits.max_abs)
_DIGEST = re.compile(r"^[A-Za-z0-9_.\-]{0,128}$")
_LITTLE_ENDIAN_HINT = (
    "vectors are little-endian IEEE 754 (f4: float32, f2: float16); a byte-swapped "
    "(big-endian) vector looks like this"
)


@dataclass(frozen=True)
class UpdateLimits:
    """What the aggregator expects of an update; anything else is rejected.

    ``n_params``: the model dimension d. ``max_indices``: the cap on a SignDS vote's h.
    ``allowed_kinds``: "u" (dense) and/or "s" (SignDS vote). ``mechanism``: the job's mechanism
    name; a dense update whose ``m`` differs, or a vote when the job's mechanism does not send
    votes (its registered schema, :mod:`edge_fl.protocol.params`), is ``wrong_mechanism`` (None:
    not checked). ``codecs``: the wire tags ``dt`` a dense update may use (docs/protocol.md,
    "Compressed dense updates"), decided when the job is assembled (which codecs are sound with
    its mechanism); None: f4, f2 and the tags the mechanism's registered schema lists (every
    registered codec when it lists none or ``mechanism`` is None); another is ``bad_dtype``.
    ``signds_h``: the h of the job's SignDS plan; a vote
    with another h is ``wrong_h`` (None: any h up to ``max_indices``). ``max_abs``: a dense delta
    with any |value| above it is ``implausible`` (None: no bound); 1e4 is far beyond any real
    delta and catches byte-swapped float32/float16 vectors.
    """

    n_params: int
    max_indices: int = 100  # SignDS h cap
    allowed_kinds: frozenset[str] = frozenset({"u", "s"})
    mechanism: str | None = None
    signds_h: int | None = None
    max_abs: float | None = DEFAULT_MAX_ABS
    codecs: frozenset[str] | None = None

    def dense_tags(self) -> frozenset[str]:
        """The ``dt`` values a dense update may carry for this job."""
        if self.codecs is not None:
            return self.codecs
        schema = mechanism_schema(self.mechanism)
        if schema is not None and schema.codecs is not None:
            return _FLOAT_TAGS | schema.codecs
        return _FLOAT_TAGS | registered_tags()

    @property
    def max_bytes(self) -> int:
        return 4 * self.n_params + 4096


def _pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _vector_bytes(vec: np.ndarray, wire_dtype: str) -> bytes:
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype {wire_dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
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
        **_model_fields(msg.params, msg.wire_dtype),
        "dl": float(msg.deadline_s),
        "cfg": msg.config_digest,
        "ts": float(msg.issued_at),
    }
    if msg.selected is not None:
        body["sel"] = list(msg.selected)
    if msg.mechanism_state is not None:
        body["sd"] = msg.mechanism_state
    if msg.mechanism_params is not None:
        try:
            mp = check_mechanism_params(msg.mechanism_params, len(msg.params))
        except PayloadRejected as exc:
            raise ValueError(f"mechanism_params would be rejected by devices: {exc}") from None
        body["mp"] = {"m": mp["m"], **{k: mp[k] for k in sorted(mp) if k != "m"}}
    if msg.sample_rate is not None:
        body["q"] = float(msg.sample_rate)
    if msg.done:
        body["done"] = True
    if msg.nonce is not None:
        _check_nonce(msg.nonce)
        body["nc"] = msg.nonce
    if msg.run is not None:
        if not isinstance(msg.run, bytes) or len(msg.run) != RUN_BYTES:
            raise ValueError(f"a run id is {RUN_BYTES} bytes, got {msg.run!r}")
        body["run"] = msg.run
    if msg.secure is not None:
        roster = None if msg.selected is None else len(set(msg.selected))
        try:
            body["sa"] = check_secure_params(
                msg.secure, roster, mode=msg.mode, nonce=msg.nonce is not None and not msg.done
            )
        except PayloadRejected as exc:
            raise ValueError(f"the sa map would be rejected by devices: {exc}") from None
    return _pack(body)


def _model_fields(params: np.ndarray, dt: str) -> dict[str, bytes]:
    """The global parameters as ``w`` (f4, f2) or ``w`` + ``qp`` (q8: per-block 8-bit levels,
    each value rounded to its nearest level; docs/protocol.md, "Quantised global model")."""
    if dt != GLOBAL_Q8:
        return {"w": _vector_bytes(params, dt)}
    vec = np.asarray(params, dtype=np.float64)
    if vec.ndim != 1 or not vec.size or not np.isfinite(vec).all():
        raise ValueError("a q8 global model needs a non-empty, finite, flat parameter vector")
    levels, block_params = quantise_nearest(vec, 8)
    return {"w": levels.tobytes(), "qp": block_params}


def encode_global(msg: GlobalModel, signer: Signs | None = None) -> bytes:
    """The global message; with a ``signer``, the signed envelope (see ``signing.py``)."""
    body = global_body(msg)
    if signer is None:
        return body
    return seal(body, "gs", GLOBAL_CONTEXT, signer)


def sign_bits(sign: int, magrr_bit: int) -> int:
    """The ``sb`` field of a SignDS vote: bit 0 set iff the sign is +1, bit 1 = the MagRR bit."""
    if sign not in (1, -1) or magrr_bit not in (0, 1):
        raise ValueError(f"sign {sign!r} must be +1/-1 and the MagRR bit {magrr_bit!r} 0/1")
    return (1 if sign > 0 else 0) | (int(magrr_bit) << 1)


def encode_update(
    update: Update, dim: int | None = None, coded: tuple[str, dict[str, Any]] | None = None
) -> bytes:
    """Encode an update; SignDS needs the model dimension ``dim`` to choose its index coding.

    ``coded``: for a dense update, ``(dt, fields)`` from an uplink codec
    (:mod:`edge_fl.protocol.codecs`,
    ``codec.dt`` and ``codec.encode(...)[0]``): the update then carries those fields instead of
    ``x`` in ``update.wire_dtype`` (whose ``delta`` is not sent).

    The device id is NOT in the payload: the topic ``up/<device>`` is the identity, and the
    broker's ACL lets a device publish only there. A SignDS update packs sign and MagRR bit into
    one small integer ``sb`` (:func:`sign_bits`): every byte counts there. The round's nonce (from
    the global message), when the update has one, travels as ``nc``.
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
        if coded is not None:
            dt, fields = coded
            if dt not in registered_tags() or not isinstance(fields, dict):
                raise ValueError(f"coded = ({dt!r}, ...) is not a registered codec's output")
            extra = set(fields) - _codec_keys(dt)
            if extra:
                raise ValueError(f"codec {dt!r} fields {sorted(extra)} are not its keys")
            return _pack({**common, "k": "u", "dt": dt, "m": update.mechanism, **fields})
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
    tag, blob = encode_indices(update.indices, dim)
    return _pack(
        {
            **common,
            "k": "s",
            "sb": sign_bits(update.sign, update.magrr_bit),
            "h": len(update.indices),
            "c": CODES[tag],
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


def _truncate(text: str, limit: int = MAX_ACK_DETAIL) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encode_ack(ack: Ack) -> bytes:
    """The aggregator's answer to one update (topic ``ack/<device>``; the device is the topic).

    ``{"v": 1, "k": "a", "r": round, "ok": bool, "why": reason, "d": detail}``; ``r`` is absent
    when the rejected payload had no readable round, ``why`` only when not ok, ``d`` when given
    (truncated to 256 characters)."""
    body: dict[str, Any] = {"v": SCHEMA_VERSION, "k": "a"}
    if ack.round is not None:
        body["r"] = int(ack.round)
    body["ok"] = bool(ack.ok)
    if not ack.ok:
        if not ack.reason:
            raise ValueError("a negative ack needs a reason")
        body["why"] = str(ack.reason)
    elif ack.reason is not None:
        raise ValueError("a positive ack has no reason")
    if ack.detail:
        body["d"] = _truncate(str(ack.detail))
    return _pack(body)


def ack_for(
    device: str, reason: Reject | str | None, detail: str | None = None, round: int | None = None
) -> Ack:
    """The ack of an update: accepted (``reason`` None) or rejected with ``reason``."""
    if reason is None:
        return Ack(device, round, True, None, detail)
    return Ack(device, round, False, str(reason), detail)


# ---------------------------------------------------------------- decoding


def _unpack(payload: Any, max_bytes: int) -> dict[str, Any]:
    obj = F.unpack_map(
        payload,
        max_bytes,
        exceeds="exceeds the limit of",
        max_str_len=MAX_STR,
        max_bin_len=max_bytes,
    )
    version = obj.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        shown = "absent" if "v" not in obj else f"{F.wire_type(version)} {F.describe(version)}"
        raise PayloadRejected(
            Reject.WRONG_VERSION,
            f"schema version 'v' is {shown}; this peer speaks the int {SCHEMA_VERSION}",
            field="v",
        )
    return obj


def _kind(obj: dict[str, Any], allowed: tuple[str, ...], what: str) -> str:
    kind = obj.get("k")
    if type(kind) is not str or kind not in allowed:
        shown = "absent" if "k" not in obj else F.describe(kind)
        raise PayloadRejected(
            Reject.WRONG_KIND,
            f"kind 'k' is {shown}; {what} has k = {' or '.join(map(repr, allowed))}",
            field="k",
        )
    return kind


def _optional_nonce(obj: dict[str, Any]) -> bytes | None:
    if "nc" not in obj:
        return None
    nonce = F.get(obj, "nc", bytes, "round nonce", "bin")
    if len(nonce) != NONCE_BYTES:
        raise F.out_of_range("nc", "round nonce", nonce, f"bin of exactly {NONCE_BYTES} bytes")
    return nonce


def _codec_keys(dt: str) -> frozenset[str]:
    return codec_for_tag(dt).keys


def _dense_dtype(obj: dict[str, Any], accepted: frozenset[str]) -> str:
    """A dense update's ``dt``: f4/f2, or a codec tag this job accepts (``bad_dtype`` else)."""
    dt = F.get(obj, "dt", str, "wire dtype", "str")
    if dt in WIRE_DTYPES and dt in accepted | frozenset(WIRE_DTYPES):
        return dt
    tags = codec_tags()
    if dt not in tags or dt not in accepted:
        extra = sorted(accepted - frozenset(WIRE_DTYPES))
        others = (
            f", or a compressed encoding this job accepts ({', '.join(extra)})" if extra else ""
        )
        refused = f"; {dt!r} is a codec this job does not accept" if dt in tags else ""
        raise PayloadRejected(
            Reject.BAD_DTYPE,
            f"field 'dt' (wire dtype): expected 'f4' (little-endian float32) or 'f2' "
            f"(little-endian float16){others}, got {F.describe(dt)}{refused}",
            field="dt",
        )
    return dt


def _dtype(obj: dict[str, Any]) -> str:
    dt = F.get(obj, "dt", str, "wire dtype", "str")
    if dt not in WIRE_DTYPES:
        raise PayloadRejected(
            Reject.BAD_DTYPE,
            f"field 'dt' (wire dtype): expected 'f4' (little-endian float32) or 'f2' "
            f"(little-endian float16), got {F.describe(dt)}",
            field="dt",
        )
    return dt


def _vector(
    blob: bytes, wire_dtype: str, n_params: int, key: str, what: str
) -> tuple[np.ndarray, float]:
    """The float32 values of a ``dt`` blob (a read-only view for f4), checked to be finite, and
    their largest |value|."""
    dtype = WIRE_DTYPES[wire_dtype]
    if len(blob) != n_params * dtype.itemsize:
        raise PayloadRejected(
            Reject.WRONG_SHAPE,
            f"field {key!r} ({what}) has {len(blob)} bytes; expected {n_params} x "
            f"{dtype.itemsize} = {n_params * dtype.itemsize} ({n_params} {wire_dtype} values)",
            field=key,
        )
    vec = np.frombuffer(blob, dtype=dtype)
    if vec.dtype != np.float32:
        vec = vec.astype(np.float32)
    return vec, _peak(vec, key, what)


def _peak(vec: np.ndarray, key: str, what: str) -> float:
    """max |value|, after checking every value is finite: two reductions on the ingest hot path
    (NaN and inf propagate through min and max); only a bad vector pays for a full scan."""
    if not vec.size:
        return 0.0
    hi, lo = float(vec.max()), float(vec.min())
    if math.isfinite(hi) and math.isfinite(lo):
        return max(hi, -lo)
    bad = np.flatnonzero(~np.isfinite(vec))
    raise PayloadRejected(
        Reject.NON_FINITE,
        f"field {key!r} ({what}) has {bad.size} non-finite values (first at index "
        f"{int(bad[0])}: {vec[bad[0]]!r}); {_LITTLE_ENDIAN_HINT} too",
        field=key,
    )


def _plausible(vec: np.ndarray, peak: float, max_abs: float | None, key: str, what: str) -> None:
    """Check the largest |value| (``peak``) against ``max_abs``."""
    if max_abs is None or peak <= max_abs:
        return
    mags = np.abs(vec)
    over = np.flatnonzero(mags > max_abs)
    i = int(over[0])
    raise PayloadRejected(
        Reject.IMPLAUSIBLE,
        f"field {key!r} ({what}): {over.size} of {vec.size} values exceed |x| <= {max_abs:g} "
        f"(first at index {i}: {float(vec[i]):.6g}); {_LITTLE_ENDIAN_HINT}",
        field=key,
    )


_UPDATE_COMMON = frozenset({"v", "k", "dev", "r", "bv", "n", "nc"})
_DENSE_COMMON = HEADER_KEYS
_DENSE_KEYS = _DENSE_COMMON | {"x"}
_SIGNDS_KEYS = _UPDATE_COMMON | {"sb", "h", "c", "ix"}


def decode_update(payload: bytes, limits: UpdateLimits, topic_device: str | None = None) -> Update:
    """Decode and validate one update; raise PayloadRejected with the reason otherwise.

    The returned update's ``nonce`` is the payload's ``nc`` (None if absent); comparing it with
    the nonce of the round (or version) it names is the aggregator's job (``Reject.WRONG_NONCE``).
    A rejection raised after the round ``r`` was read carries it (``PayloadRejected.round``).
    """
    obj = _unpack(payload, limits.max_bytes)
    kind = _kind(obj, ("u", "s"), "an update")
    if kind not in limits.allowed_kinds:
        kinds = " or ".join(sorted(limits.allowed_kinds)) or "none"
        raise PayloadRejected(
            Reject.WRONG_MECHANISM,
            f"update kind {kind!r} ({'dense delta' if kind == 'u' else 'SignDS vote'}) is not "
            f"the job's (k = {kinds})",
            field="k",
        )
    keys = _SIGNDS_KEYS
    if kind == "u":
        dt = obj.get("dt")
        keys = _DENSE_KEYS
        if type(dt) is str and dt not in WIRE_DTYPES and dt in registered_tags():
            keys = _DENSE_COMMON | _codec_keys(dt)
    F.check_keys(obj, keys, f"an update of kind {kind!r}")
    rnd: int | None = None
    try:
        if "r" in obj and type(obj["r"]) is int and 0 <= obj["r"] <= MAX_COUNTER:
            rnd = obj["r"]  # known early, so that any rejection below can name it
        return _decode_update(obj, kind, limits, topic_device)
    except PayloadRejected as exc:
        if exc.round is None:
            exc.round = rnd
        raise


def _decode_update(
    obj: dict[str, Any], kind: str, limits: UpdateLimits, topic_device: str | None
) -> Update:
    device = topic_device or ""
    if "dev" in obj:  # optional: the topic is the identity; if a payload names one, it must agree
        named = F.name_field(obj, "dev", "device id")
        if topic_device is not None and named != topic_device:
            raise PayloadRejected(
                Reject.TOPIC_MISMATCH,
                f"field 'dev' names device {named!r}, but it was published on the topic of "
                f"{topic_device!r}",
                field="dev",
            )
        device = named
    rnd = F.int_field(obj, "r", "round", 0, MAX_COUNTER)
    base = F.int_field(obj, "bv", "base version", 0, MAX_COUNTER)
    n = F.int_field(obj, "n", "sample count", 1, MAX_SAMPLES)
    nonce = _optional_nonce(obj)
    if kind == "s":
        if limits.mechanism is not None and _update_kind(limits.mechanism) != "s":
            raise PayloadRejected(
                Reject.WRONG_MECHANISM,
                f"a SignDS vote (k = 's'), but this job runs mechanism {limits.mechanism!r}",
                field="k",
            )
        return _decode_signds(obj, limits, device, rnd, base, n, nonce)
    mech = F.name_field(obj, "m", "mechanism") if "m" in obj else "none"
    votes = _update_kind(mech) == "s"
    if votes or (limits.mechanism is not None and mech != limits.mechanism):
        expected = limits.mechanism if limits.mechanism is not None else "a dense mechanism"
        raise PayloadRejected(
            Reject.WRONG_MECHANISM,
            f"field 'm' (mechanism) is {mech!r}{' (the default)' if 'm' not in obj else ''}; "
            f"this job expects {expected!r} (the global message's mp.m)"
            + (f"; {mech} updates are votes of kind 's'" if votes else ""),
            field="m",
        )
    dt = _dense_dtype(obj, limits.dense_tags())
    if dt in WIRE_DTYPES:
        blob = F.get(obj, "x", bytes, "delta vector", "bin")
        delta, peak = _vector(blob, dt, limits.n_params, "x", "delta vector")
    else:
        codec = codec_for_tag(dt)
        delta = codec.decode({k: obj[k] for k in codec.keys if k in obj}, limits.n_params)
        peak = _peak(delta, "x", "delta vector")
    _plausible(delta, peak, limits.max_abs, "x", "delta vector")
    return DenseUpdate(device, rnd, base, n, delta, dt, mech, nonce, peak=peak)


def _update_kind(mechanism: str) -> str | None:
    """The update kind the registered schema of ``mechanism`` gives (None: not registered)."""
    schema = mechanism_schema(mechanism)
    return None if schema is None else schema.update_kind


def _decode_signds(
    obj: dict[str, Any],
    limits: UpdateLimits,
    device: str,
    rnd: int,
    base: int,
    n: int,
    nonce: bytes | None,
) -> SignDSUpdate:
    flags = F.int_field(obj, "sb", "sign/MagRR-bit flags", 0, 3)
    sign, bit = (1 if flags & 1 else -1), (flags >> 1) & 1
    count = F.int_field(obj, "h", "index count", 1, limits.max_indices)
    if limits.signds_h is not None and count != limits.signds_h:
        raise PayloadRejected(
            Reject.WRONG_H,
            f"field 'h' (index count) = {count}; the job's SignDS plan has h = "
            f"{limits.signds_h} (the global message's mp.h)",
            field="h",
        )
    if "c" not in obj:
        raise F.missing("c", "index coding")
    code = obj["c"]
    if type(code) is not int:
        raise F.bad_type("c", "index coding", code, "int")
    if code not in CODINGS:
        raise F.out_of_range(
            "c", "index coding", code, "0 (bit-packing) or 1 (delta + LEB128 varints)"
        )
    blob = F.get(obj, "ix", bytes, "indices", "bin")
    try:
        indices = decode_indices(code, blob, limits.n_params, count, limits.max_indices)
    except IndexCodingError as exc:
        raise PayloadRejected(
            Reject.BAD_INDICES,
            f"field 'ix' (indices, c = {code}) does not decode to {count} strictly ascending "
            f"indices in [0, {limits.n_params}): {exc.reason}: {exc}",
            field="ix",
        ) from None
    return SignDSUpdate(device, rnd, base, n, sign, indices, bit, nonce)


_GLOBAL_KEYS = frozenset(
    {"v", "k", "job", "ver", "rnd", "mode", "dt", "w", "dl", "cfg", "ts", "sel", "sd", "mp", "q"}
    | {"done", "nc", "qp", "run", "sa"}
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
    kind = _kind(obj, ("g", "gs"), "a global message")
    if kind == "gs":
        obj = open_signed(
            obj,
            GLOBAL_CONTEXT,
            verifier,
            what="a signed global message",
            unpack=lambda body: _unpack(body, len(body)),
            kind="g",
            label="a global model",
        )
    elif verifier is not None:
        raise PayloadRejected(
            Reject.UNSIGNED, "an unsigned global message (k = 'g') where a signature is required"
        )
    return _decode_global_body(obj, expected_dim)


def _decode_global_body(obj: dict[str, Any], expected_dim: int | None) -> GlobalModel:
    F.check_keys(obj, _GLOBAL_KEYS, "a global message")
    job = F.name_field(obj, "job", "job id")
    version = F.int_field(obj, "ver", "version", 0, MAX_COUNTER)
    rnd = F.int_field(obj, "rnd", "round", 0, MAX_COUNTER)
    mode = F.get(obj, "mode", str, "mode", "str")
    if mode not in MODES:
        raise F.out_of_range("mode", "mode", mode, "one of " + ", ".join(map(repr, MODES)))
    digest = F.get(obj, "cfg", str, "config digest", "str")
    if not _DIGEST.fullmatch(digest):
        raise F.out_of_range(
            "cfg", "config digest", digest, "a str of 0-128 characters of A-Z a-z 0-9 _ . -"
        )
    if "dl" not in obj:
        raise F.missing("dl", "deadline in seconds")
    deadline = F.number(obj["dl"], "dl", "deadline in seconds", 0, MAX_DEADLINE_S)
    issued = 0.0
    if "ts" in obj:
        issued = F.number(
            obj["ts"], "ts", "issue time", -math.inf, math.inf, hi_open=True, lo_open=True
        )
    selected = _optional_selection(obj)
    state = _optional_state(obj)
    rate = None
    if "q" in obj:
        rate = F.number(obj["q"], "q", "Poisson sample rate", 0.0, 1.0, lo_open=True)
    done = F.boolean(obj, "done", "done marker") if "done" in obj else False
    nonce = _optional_nonce(obj)
    run = None
    if "run" in obj:
        run = F.get(obj, "run", bytes, "run id", "bin")
        if len(run) != RUN_BYTES:
            raise F.out_of_range("run", "run id", run, f"bin of exactly {RUN_BYTES} bytes")
    if obj.get("dt") == GLOBAL_Q8:
        dt, params = GLOBAL_Q8, _global_q8(obj, expected_dim)
    else:
        dt, params = _global_float(obj, expected_dim)
    mp = check_mechanism_params(obj["mp"], len(params)) if "mp" in obj else None
    secure = None
    if "sa" in obj:
        roster = None if selected is None else len(selected)
        secure = check_secure_params(
            obj["sa"], roster, mode=mode, nonce=nonce is not None and not done
        )
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
        mechanism_params=mp,
        run=run,
        secure=secure,
    )


def _global_float(obj: dict[str, Any], expected_dim: int | None) -> tuple[str, np.ndarray]:
    """(dt, parameters) of an ``f4``/``f2`` global message."""
    dt = _dtype(obj)
    if "qp" in obj:
        raise PayloadRejected(
            Reject.UNKNOWN_FIELD, "field 'qp' is only for dt = 'q8' global models", field="qp"
        )
    dtype = WIRE_DTYPES[dt]
    blob = F.get(obj, "w", bytes, "parameters", "bin")
    if len(blob) % dtype.itemsize or not blob:
        raise PayloadRejected(
            Reject.WRONG_SHAPE,
            f"field 'w' (parameters) has {len(blob)} bytes: not a non-empty multiple of "
            f"{dtype.itemsize} ({dt})",
            field="w",
        )
    n_params = len(blob) // dtype.itemsize
    if expected_dim is not None and n_params != expected_dim:
        raise PayloadRejected(
            Reject.WRONG_SHAPE,
            f"field 'w' (parameters) has {n_params} values; this model has {expected_dim}",
            field="w",
        )
    params = _vector(blob, dt, n_params, "w", "parameters")[0]
    return dt, params if params.flags.writeable else params.copy()  # devices train from it


def _global_q8(obj: dict[str, Any], expected_dim: int | None) -> np.ndarray:
    """The parameters of a ``dt = "q8"`` global message: d level bytes in ``w``, per block of 256
    values (lo, step) float32 in ``qp``; value i of block b is lo_b + w_i step_b."""
    levels = F.get(obj, "w", bytes, "parameters (8-bit levels)", "bin")
    if not levels:
        raise PayloadRejected(Reject.WRONG_SHAPE, "field 'w' (parameters) is empty", field="w")
    n_params = len(levels)
    if expected_dim is not None and n_params != expected_dim:
        raise PayloadRejected(
            Reject.WRONG_SHAPE,
            f"field 'w' (parameters) has {n_params} values; this model has {expected_dim}",
            field="w",
        )
    if "qp" not in obj:
        raise F.missing("qp", "block parameters of a q8 global model")
    block_params = F.get(obj, "qp", bytes, "block parameters", "bin")
    if len(block_params) != 8 * n_blocks(n_params):
        raise PayloadRejected(
            Reject.WRONG_SHAPE,
            f"field 'qp' (block parameters) has {len(block_params)} bytes; {n_params} values "
            f"in blocks of {BLOCK} need {8 * n_blocks(n_params)}",
            field="qp",
        )
    params = dequantise(np.frombuffer(levels, np.uint8), block_params, n_params)
    if not np.isfinite(params).all():
        raise PayloadRejected(
            Reject.NON_FINITE, "field 'w' (parameters) decodes to non-finite values", field="w"
        )
    return params


def _optional_selection(obj: dict[str, Any]) -> tuple[str, ...] | None:
    if "sel" not in obj:
        return None
    sel = F.get(obj, "sel", list, "selection", "array of str")
    for i, device in enumerate(sel):
        F.name(device, f"sel[{i}]", "selected device id")
    seen: set[str] = set()
    for device in sel:
        if device in seen:
            raise F.out_of_range("sel", "selection", device, "distinct device ids (named twice)")
        seen.add(device)
    return tuple(sel)


def _scalar_map(value: Any, key: str, what: str, *, text: bool) -> dict[str, Any]:
    """A flat map of names to finite numbers and bools (and, with ``text``, short strings/nil)."""
    if type(value) is not dict:
        raise F.bad_type(key, what, value, "map")
    if len(value) > MAX_MAP_ENTRIES:
        raise F.out_of_range(key, what, value, f"at most {MAX_MAP_ENTRIES} entries")
    for name, item in value.items():
        if type(name) is not str or not F.NAME.fullmatch(name):
            raise F.out_of_range(key, f"{what} key", name, f"a str of {F.NAME_DOMAIN}")
        sub = f"{key}.{name}"
        kind = type(item)
        if kind is float and not math.isfinite(item):
            raise F.out_of_range(sub, what, item, "a finite number")
        if text and kind is str and len(item) > MAX_INFO_STR:
            raise F.out_of_range(sub, what, item, f"a str of at most {MAX_INFO_STR} characters")
        allowed = (bool, int, float, str, type(None)) if text else (bool, int, float)
        if kind not in allowed:
            expected = "bool, int, float, str or nil" if text else "bool, int or float"
            raise F.bad_type(sub, what, item, expected)
    return value


def _optional_state(obj: dict[str, Any]) -> dict[str, Any] | None:
    if "sd" not in obj:
        return None
    return _scalar_map(obj["sd"], "sd", "mechanism state", text=False)


_STATUS_KEYS = frozenset({"v", "k", "dev", "on", "n", "i"})


def decode_status(payload: bytes, topic_device: str | None = None) -> Status:
    obj = _unpack(payload, MAX_STATUS_BYTES)
    _kind(obj, ("st",), "a status")
    F.check_keys(obj, _STATUS_KEYS, "a status")
    device = F.name_field(obj, "dev", "device id")
    if topic_device is not None and device != topic_device:
        raise PayloadRejected(
            Reject.TOPIC_MISMATCH,
            f"field 'dev' names device {device!r}, but it was published on the status topic of "
            f"{topic_device!r}",
            field="dev",
        )
    online = F.boolean(obj, "on", "online flag")
    n = F.int_field(obj, "n", "sample count", 0, MAX_SAMPLES) if "n" in obj else 0
    info: dict[str, Any] = {}
    if "i" in obj:
        info = _scalar_map(obj["i"], "i", "status info", text=True)
        if "stopped" in info:
            stopped = info["stopped"]
            if type(stopped) is not str:
                raise F.bad_type("i.stopped", "why the device stopped", stopped, "str")
            if not stopped:
                raise F.out_of_range(
                    "i.stopped", "why the device stopped", stopped, "a non-empty str"
                )
    return Status(device, online, n, info)


_ACK_KEYS = frozenset({"v", "k", "r", "ok", "why", "d"})


def decode_ack(payload: bytes, topic_device: str | None = None) -> Ack:
    """Decode an ack (what a device reads on ``ack/<device>``); strict like every decoder."""
    obj = _unpack(payload, MAX_ACK_BYTES)
    _kind(obj, ("a",), "an ack")
    F.check_keys(obj, _ACK_KEYS, "an ack")
    rnd = F.int_field(obj, "r", "round", 0, MAX_COUNTER) if "r" in obj else None
    ok = F.boolean(obj, "ok", "accepted")
    reason = None
    if ok and "why" in obj:
        raise F.out_of_range("why", "rejection reason", obj["why"], "absent when ok is true")
    if not ok:
        reason = F.name_field(obj, "why", "rejection reason")
    detail = None
    if "d" in obj:
        detail = F.get(obj, "d", str, "detail", "str")
        if len(detail) > MAX_ACK_DETAIL:
            raise F.out_of_range("d", "detail", detail, f"at most {MAX_ACK_DETAIL} characters")
    return Ack(topic_device or "", rnd, ok, reason, detail)
