"""Public parameters of the job's privacy mechanism, carried in the signed global message (``mp``).

A device must be able to run the job's mechanism from the global message alone: the aggregator
puts every public number the device rule needs into ``mp``, a flat map from short names to
scalars, inside the signed body. ``docs/protocol.md`` ("Mechanism parameters") is the normative
description. The wire layer knows no mechanism: each one registers its :class:`MechanismSchema`
(:func:`register_schema`: the keys of its ``mp``, a cross-field check, the kind of update its
devices send), and the encoder (which refuses to publish an incomplete or ill-typed map) and the
decoder (which rejects one with a specific reason: ``missing_field``, ``bad_type``,
``out_of_range``, ``unknown_field``) look it up by the map's ``m``.

Every map has ``m`` (the mechanism name) and the local-training keys ``lr``, ``ep``, ``bs``. For a
registered mechanism, the keys are exactly its schema's (required ones present, no others); for
one that is not registered, any flat map of at most 64 scalar entries is accepted (a device that
does not implement that mechanism cannot take part anyway).

Values: ``int`` is a msgpack int; ``number`` is a msgpack int or float (the encoder always writes
a float64), finite; ``name`` is a str of the topic-segment alphabet; ``choice`` is one of a list.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import edge_fl.protocol.fields as F
from edge_fl.protocol.messages import PayloadRejected, Reject

__all__ = [
    "COMMON",
    "MAX_COUNT",
    "MAX_DIM",
    "MAX_PARAMS",
    "MechanismSchema",
    "ParamSpec",
    "check_mechanism_params",
    "int_param",
    "mechanism_params",
    "mechanism_schema",
    "number_param",
    "register_schema",
    "schemas",
    "set_schema_resolver",
]

MAX_PARAMS = 64  # entries in ``mp``
MAX_COUNT = 2**40
MAX_DIM = 2**32 - 1


@dataclass(frozen=True)
class ParamSpec:
    """One key of ``mp``: its type, domain and meaning."""

    key: str
    kind: str  # "int" | "number" | "name" | "choice" | "bool"
    required: bool
    meaning: str
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] = ()

    def admits(self, value: Any) -> bool:
        """Whether ``value`` is in this key's domain (an int for ``int``, a finite real number in
        range for ``number``: no bools; the name and choice kinds compare strings)."""
        if isinstance(value, bool):
            return self.kind == "bool"
        if self.kind == "int":
            return isinstance(value, numbers.Integral) and self.lo <= int(value) <= self.hi
        if self.kind == "number":
            if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                return False
            v = float(value)
            above = v > self.lo if self.lo_open else v >= self.lo
            below = v < self.hi if self.hi_open else v <= self.hi
            return above and below
        if self.kind == "choice":
            return value in self.choices
        return isinstance(value, str) and bool(F.NAME.fullmatch(value))

    def domain(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind == "name":
            return F.NAME_DOMAIN
        if self.kind == "bool":
            return "true or false"
        if self.kind == "int":
            return f"[{int(self.lo)}, {int(self.hi)}]"
        left = "(" if self.lo_open else "["
        right = ")" if self.hi_open else "]"
        lo = "-inf" if self.lo == -math.inf else f"{self.lo:g}"
        hi = "inf" if self.hi == math.inf else f"{self.hi:g}"
        return f"{left}{lo}, {hi}{right}"


def number_param(
    key: str,
    required: bool,
    meaning: str,
    lo: float,
    hi: float = math.inf,
    *,
    lo_open: bool = True,
    hi_open: bool = False,
) -> ParamSpec:
    """A ``number`` key in (lo, hi] (``lo_open``/``hi_open`` say which ends are excluded)."""
    return ParamSpec(key, "number", required, meaning, lo, hi, lo_open, hi_open or hi == math.inf)


def int_param(key: str, required: bool, meaning: str, lo: int, hi: int) -> ParamSpec:
    """An ``int`` key in [lo, hi]."""
    return ParamSpec(key, "int", required, meaning, lo, hi)


COMMON: tuple[ParamSpec, ...] = (
    ParamSpec("m", "name", True, "mechanism name (equals the 'm' a dense update must carry)"),
    number_param("lr", True, "local SGD learning rate eta", 0, 100),
    int_param("ep", True, "local epochs (passes over the device's data per round)", 1, 1_000_000),
    int_param("bs", True, "local minibatch size", 1, 10_000_000),
)

#: a cross-field check of a validated ``mp`` (and the model dimension, when known); raises
#: PayloadRejected (``edge_fl.protocol.fields`` builds the usual reasons)
CrossCheck = Callable[[Mapping[str, Any], "int | None"], None]


@dataclass(frozen=True)
class MechanismSchema:
    """What the wire layer knows of one mechanism, as its registration gives it.

    ``params``: the keys of its ``mp`` besides :data:`COMMON`. ``update_kind``: the kind of update
    its devices send, ``"u"`` (a dense delta naming the mechanism in ``m``) or ``"s"`` (a SignDS
    vote). ``check``: a cross-field check after every key passed its own. ``codecs``: the wire
    tags its dense updates may use when the job does not say (``UpdateLimits.codecs``); None: any.
    """

    name: str
    params: tuple[ParamSpec, ...] = ()
    update_kind: str = "u"
    check: CrossCheck | None = None
    codecs: frozenset[str] | None = None


_SCHEMAS: dict[str, MechanismSchema] = {}

#: registers the schema of a mechanism that exists but was not imported yet (the mechanism
#: registry imports its built-ins on first use), and the names it can resolve
_resolve: Callable[[str], None] | None = None
_resolvable: Callable[[], Iterable[str]] = tuple


def set_schema_resolver(resolve: Callable[[str], None], names: Callable[[], Iterable[str]]) -> None:
    """Hand the wire layer a way to have a schema registered on demand: ``resolve(name)`` is
    called for a mechanism name with no schema yet (it registers one with
    :func:`register_schema`, or does nothing for a name it does not know); ``names()`` lists
    what it can resolve (for :func:`schemas`). The wire layer still imports no mechanism."""
    global _resolve, _resolvable
    _resolve, _resolvable = resolve, names


def register_schema(schema: MechanismSchema) -> MechanismSchema:
    """Register (or replace) the wire schema of ``schema.name``; ValueError if it is malformed."""
    if type(schema.name) is not str or not F.NAME.fullmatch(schema.name):
        raise ValueError(f"mechanism name {schema.name!r} is not of {F.NAME_DOMAIN}")
    if schema.update_kind not in ("u", "s"):
        raise ValueError(f"update_kind {schema.update_kind!r} is not 'u' (dense) or 's' (vote)")
    keys = [spec.key for spec in COMMON + schema.params]
    if len(set(keys)) != len(keys) or len(keys) > MAX_PARAMS:
        raise ValueError(f"mechanism {schema.name!r}: mp keys {keys} repeat or exceed {MAX_PARAMS}")
    _SCHEMAS[schema.name] = schema
    return schema


def mechanism_schema(name: str | None) -> MechanismSchema | None:
    """The registered schema of mechanism ``name`` (None: not registered)."""
    if type(name) is not str:
        return None
    schema = _SCHEMAS.get(name)
    if schema is None and _resolve is not None:
        _resolve(name)
        schema = _SCHEMAS.get(name)
    return schema


def schemas() -> dict[str, MechanismSchema]:
    """Every registered schema, by mechanism name (those the resolver knows included)."""
    for name in _resolvable():
        mechanism_schema(name)
    return dict(_SCHEMAS)


def _value(spec: ParamSpec, value: Any, what: str) -> Any:
    key = f"mp.{spec.key}"
    if spec.kind == "int":
        return F.integer(value, key, what, int(spec.lo), int(spec.hi))
    if spec.kind == "number":
        return F.number(
            value, key, what, spec.lo, spec.hi, lo_open=spec.lo_open, hi_open=spec.hi_open
        )
    if spec.kind == "bool":
        if type(value) is not bool:
            raise F.bad_type(key, what, value, "bool")
        return value
    if type(value) is not str:
        raise F.bad_type(key, what, value, "str")
    if spec.kind == "name" and not F.NAME.fullmatch(value):
        raise F.out_of_range(key, what, value, f"a str of {F.NAME_DOMAIN}")
    if spec.kind == "choice" and value not in spec.choices:
        raise F.out_of_range(key, what, value, spec.domain())
    return value


def _generic(name: Any, value: Any) -> None:
    key = f"mp.{name}" if type(name) is str else "mp"
    if type(name) is not str or not F.NAME.fullmatch(name):
        raise F.out_of_range(key, "mechanism parameter name", name, f"a str of {F.NAME_DOMAIN}")
    kind = type(value)
    if kind is float and not math.isfinite(value):
        raise F.out_of_range(key, "mechanism parameter", value, "a finite number")
    if kind is str and not F.NAME.fullmatch(value):
        raise F.out_of_range(key, "mechanism parameter", value, f"a str of {F.NAME_DOMAIN}")
    if kind not in (bool, int, float, str):
        raise F.bad_type(key, "mechanism parameter", value, "bool, int, float or str")


def check_mechanism_params(mp: Any, n_params: int | None = None) -> dict[str, Any]:
    """Validate a decoded ``mp``; return it with numbers as Python floats, or raise
    :class:`PayloadRejected`. ``n_params``: the model dimension (for cross-field checks)."""
    if type(mp) is not dict:
        raise F.bad_type("mp", "mechanism parameters", mp, "map")
    if len(mp) > MAX_PARAMS:
        raise F.out_of_range("mp", "mechanism parameters", mp, f"at most {MAX_PARAMS} entries")
    for name, value in mp.items():
        _generic(name, value)
    mechanism = F.name_field(mp, "m", "mechanism name", prefix="mp.")
    schema = mechanism_schema(mechanism)
    if schema is None:
        return dict(mp)
    specs = COMMON + schema.params
    F.check_keys(mp, frozenset(s.key for s in specs), f"mp of mechanism {mechanism!r}", "mp.")
    out: dict[str, Any] = {}
    for spec in specs:
        if spec.key not in mp:
            if spec.required:
                raise F.missing(f"mp.{spec.key}", spec.meaning)
            continue
        out[spec.key] = _value(spec, mp[spec.key], spec.meaning)
    if schema.check is not None:
        try:
            schema.check(out, n_params)
        except PayloadRejected:
            raise
        except Exception as exc:  # a registered check must say why with PayloadRejected
            raise PayloadRejected(
                Reject.OUT_OF_RANGE, f"mp of mechanism {mechanism!r}: {exc}", field="mp"
            ) from None
    return out


def _canonical(mp: dict[str, Any]) -> dict[str, Any]:
    """``m`` first, then the other keys in byte order (the encoder's deterministic order)."""
    return {"m": mp["m"], **{k: mp[k] for k in sorted(mp) if k != "m"}}


def mechanism_params(mechanism: str, **values: Any) -> dict[str, Any]:
    """Build the ``mp`` map for ``mechanism`` (the aggregator's side), normalised for the wire:
    ints as Python ints, numbers as floats, ``m`` first. Raises ValueError naming the key if the
    map would be rejected by a device (e.g. a required key is missing)."""
    mp: dict[str, Any] = {"m": mechanism}
    registered = mechanism_schema(mechanism)
    schema = {s.key: s for s in COMMON + (registered.params if registered else ())}
    for key, value in values.items():
        if value is None:
            continue  # an optional parameter the mechanism does not have
        spec = schema.get(key)
        kind = spec.kind if spec is not None else None
        if isinstance(value, bool):
            pass
        elif kind == "int" and isinstance(value, numbers.Integral):
            value = int(value)
        elif (kind == "number" and isinstance(value, numbers.Real)) or isinstance(value, float):
            value = float(value)
        mp[key] = value
    try:
        return _canonical(check_mechanism_params(mp))
    except PayloadRejected as exc:
        raise ValueError(f"mechanism parameters for {mechanism!r}: {exc}") from None
