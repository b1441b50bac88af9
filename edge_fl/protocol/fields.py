"""Strict readers for the fields of a decoded msgpack map, with actionable rejections.

Every rejection names the key (dotted for a nested map: ``mp.h``), what the key means, what the
schema expects (msgpack type and domain) and what arrived (type and a truncated value):

- ``missing_field``: a required key is absent;
- ``bad_type``: the value has another msgpack type (types are exact: a bool is not an int, a float
  is not an int, ``1.0`` is not ``1``; a *number* is an int or a float, never a bool);
- ``out_of_range``: the right type but outside the domain (numeric range, length, pattern, set);
- ``unknown_field``: a key the schema does not define.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgpack

from edge_fl.protocol.messages import PayloadRejected, Reject

#: device ids, job ids, mechanism names, map keys: the topic-segment alphabet
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
NAME_DOMAIN = "1-64 characters of A-Z a-z 0-9 _ . -"

_WIRE_TYPES: dict[type, str] = {
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    bytes: "bin",
    list: "array",
    dict: "map",
    type(None): "nil",
    msgpack.ExtType: "ext",
    msgpack.Timestamp: "timestamp ext",
}


def wire_type(value: Any) -> str:
    """The msgpack type name of a decoded value (what a non-Python implementer sees)."""
    return _WIRE_TYPES.get(type(value), type(value).__name__)


def describe(value: Any) -> str:
    """A short, safe description of a hostile value for a rejection detail.

    Never ``repr`` a container (msgpack nests up to 1023 levels, deeper than Python's recursion
    limit: ``repr`` raised RecursionError) nor a whole str/bin (up to the payload size)."""
    kind = type(value)
    if kind in (list, dict):
        return f"<{'array' if kind is list else 'map'} of {len(value)}>"
    if kind in (str, bytes):
        cut = 40 if kind is str else 16  # a byte may take 4 characters
        text = repr(value[:cut])
        return text if len(value) <= cut else f"{text[:-1]}...{text[-1]} ({len(value)} long)"
    if kind in (int, float, bool) or value is None:
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"<{wire_type(value)}>"


def missing(key: str, what: str) -> PayloadRejected:
    return PayloadRejected(
        Reject.MISSING_FIELD, f"missing required field {key!r} ({what})", field=key
    )


def bad_type(key: str, what: str, value: Any, expected: str) -> PayloadRejected:
    return PayloadRejected(
        Reject.BAD_TYPE,
        f"field {key!r} ({what}): expected msgpack {expected}, got {wire_type(value)} "
        f"{describe(value)}",
        field=key,
    )


def out_of_range(key: str, what: str, value: Any, domain: str) -> PayloadRejected:
    return PayloadRejected(
        Reject.OUT_OF_RANGE,
        f"field {key!r} ({what}): expected {domain}, got {describe(value)}",
        field=key,
    )


def check_keys(obj: dict[Any, Any], allowed: frozenset[str], what: str, prefix: str = "") -> None:
    """Reject the first key ``allowed`` does not list (``unknown_field``)."""
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        names = ", ".join(describe(k) for k in unknown[:5])
        more = f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""
        first = unknown[0]
        raise PayloadRejected(
            Reject.UNKNOWN_FIELD,
            f"unknown field(s) in {what}: {names}{more}; allowed: {', '.join(sorted(allowed))}",
            field=f"{prefix}{first}" if type(first) is str else None,
        )


def get(
    obj: dict[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    what: str,
    expected: str,
    prefix: str = "",
) -> Any:
    """A required field of exactly one of the types ``kind`` (no subclasses: bool is not int)."""
    full = prefix + key
    if key not in obj:
        raise missing(full, what)
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if type(value) not in kinds:
        raise bad_type(full, what, value, expected)
    return value


def integer(value: Any, key: str, what: str, lo: int, hi: int) -> int:
    """An int (never a bool or a float) in [lo, hi]."""
    if type(value) is not int:
        raise bad_type(key, what, value, "int")
    if not lo <= value <= hi:
        raise out_of_range(key, what, value, f"an int in [{lo}, {hi}]")
    return value


def int_field(obj: dict[str, Any], key: str, what: str, lo: int, hi: int, prefix: str = "") -> int:
    if key not in obj:
        raise missing(prefix + key, what)
    return integer(obj[key], prefix + key, what, lo, hi)


def _interval(lo: float, hi: float, lo_open: bool, hi_open: bool) -> str:
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    return f"{left}{lo:g}, {hi:g}{right}"


def number(
    value: Any,
    key: str,
    what: str,
    lo: float,
    hi: float,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """An int or float (never a bool), finite, in the interval, as a float."""
    if type(value) not in (int, float):
        raise bad_type(key, what, value, "int or float")
    domain = f"a finite number in {_interval(lo, hi, lo_open, hi_open)}"
    if type(value) is float and not math.isfinite(value):
        raise out_of_range(key, what, value, domain)
    below = value <= lo if lo_open else value < lo
    above = value >= hi if hi_open else value > hi
    if below or above:
        raise out_of_range(key, what, value, domain)
    return float(value)


def name(value: Any, key: str, what: str) -> str:
    """A str of the topic-segment alphabet (:data:`NAME`): an id, a job, a map key."""
    if type(value) is not str:
        raise bad_type(key, what, value, "str")
    if not NAME.fullmatch(value):
        raise out_of_range(key, what, value, f"a str of {NAME_DOMAIN}")
    return value


def name_field(obj: dict[str, Any], key: str, what: str, prefix: str = "") -> str:
    if key not in obj:
        raise missing(prefix + key, what)
    return name(obj[key], prefix + key, what)


def boolean(obj: dict[str, Any], key: str, what: str, prefix: str = "") -> bool:
    return get(obj, key, bool, what, "bool", prefix)


class _RepeatedKey(Exception):
    pass


def _refuse_repeats(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    # msgpack keeps the last of repeated keys silently; two parsers could then disagree
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def unpack_map(
    payload: Any,
    max_bytes: int,
    what: str | None = None,
    *,
    exceeds: str = "exceeds",
    max_str_len: int | None = None,
    max_bin_len: int | None = None,
) -> dict[Any, Any]:
    """The top-level msgpack map of ``payload``, read strictly, or :class:`PayloadRejected`.

    One reading for every decoder, so none of them can drift: bytes (a bytearray, or a memoryview
    copied) of at most ``max_bytes``, valid msgpack with str or bin map keys, no map repeating a
    key, a map at the top level. ``what`` names the payload in the rejections ("dispatch
    message is not valid msgpack"); without it the terse wording ("not valid msgpack").
    ``exceeds``: the words between the size and the limit; ``max_str_len``/``max_bin_len``:
    msgpack's limits (None: msgpack's default). The schema version is each decoder's to check."""
    subject = what or "payload"
    if isinstance(payload, memoryview):
        try:
            payload = payload.tobytes()
        except Exception:  # a released view, an exotic format
            raise PayloadRejected(
                Reject.MALFORMED, f"{subject} is an unreadable memoryview"
            ) from None
    if not isinstance(payload, bytes | bytearray):
        raise PayloadRejected(Reject.MALFORMED, f"{subject} is {type(payload).__name__}, not bytes")
    if len(payload) > max_bytes:
        raise PayloadRejected(
            Reject.OVERSIZED, f"{subject} of {len(payload)} bytes {exceeds} {max_bytes}"
        )
    limits = {"max_str_len": max_str_len, "max_bin_len": max_bin_len}
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            object_pairs_hook=_refuse_repeats,
            **{key: limit for key, limit in limits.items() if limit is not None},
        )
    except _RepeatedKey as exc:
        raise PayloadRejected(
            Reject.MALFORMED, f"a map repeats the key {describe(exc.args[0])}"
        ) from None
    except Exception as exc:  # msgpack raises several unrelated types
        prefix = f"{what} is " if what else ""
        raise PayloadRejected(Reject.MALFORMED, f"{prefix}not valid msgpack ({exc})") from None
    if type(obj) is not dict:
        raise PayloadRejected(
            Reject.MALFORMED,
            f"{what}: top level is not a msgpack map"
            if what
            else f"top level is msgpack {wire_type(obj)}, not a map",
        )
    return obj
