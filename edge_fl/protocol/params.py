"""Public parameters of the job's privacy mechanism, carried in the signed global message (``mp``).

A device must be able to run the job's mechanism from the global message alone: the aggregator
puts every public number the device rule needs into ``mp``, a flat map from short names to
scalars, inside the signed body. ``docs/protocol.md`` ("Mechanism parameters") is the normative
description; :data:`SCHEMAS` is the same table as code, used by the encoder (which refuses to
publish an incomplete or ill-typed map) and by the decoder (which rejects one with a specific
reason: ``missing_field``, ``bad_type``, ``out_of_range``, ``unknown_field``).

Every map has ``m`` (the mechanism name) and the local-training keys ``lr``, ``ep``, ``bs``. For a
mechanism this module knows, the keys are exactly its schema's (required ones present, no others);
for a mechanism it does not know, any flat map of at most 64 scalar entries is accepted (a device
that does not implement that mechanism cannot take part anyway).

Values: ``int`` is a msgpack int; ``number`` is a msgpack int or float (the encoder always writes
a float64), finite; ``name`` is a str of the topic-segment alphabet; ``choice`` is one of a list.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from edge_fl.protocol import fields as F
from edge_fl.protocol.messages import PayloadRejected, Reject

__all__ = [
    "COMMON",
    "MAX_PARAMS",
    "SCHEMAS",
    "SIGNDS",
    "ParamSpec",
    "check_mechanism_params",
    "mechanism_params",
]

MAX_PARAMS = 64  # entries in ``mp``
SIGNDS = "signds"  # the one mechanism whose updates are votes (kind "s"), not dense deltas
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


def _num(
    key: str,
    required: bool,
    meaning: str,
    lo: float,
    hi: float = math.inf,
    *,
    lo_open: bool = True,
    hi_open: bool = False,
) -> ParamSpec:
    return ParamSpec(key, "number", required, meaning, lo, hi, lo_open, hi_open or hi == math.inf)


def _int(key: str, required: bool, meaning: str, lo: int, hi: int) -> ParamSpec:
    return ParamSpec(key, "int", required, meaning, lo, hi)


COMMON: tuple[ParamSpec, ...] = (
    ParamSpec("m", "name", True, "mechanism name (equals the 'm' a dense update must carry)"),
    _num("lr", True, "local SGD learning rate eta", 0, 100),
    _int("ep", True, "local epochs (passes over the device's data per round)", 1, 1_000_000),
    _int("bs", True, "local minibatch size", 1, 10_000_000),
)

_L = "uploads L a device may make before it stops (its budget is spent)"

SCHEMAS: dict[str, tuple[ParamSpec, ...]] = {
    "none": (),
    "gaussian": (
        _num("clip", True, "L2 clip bound S of the delta", 0),
        _num("z", True, "noise multiplier z: the device adds N(0, (z S)^2) per coordinate", 0),
        _int("L", False, _L + "; absent: no limit", 1, MAX_COUNT),
    ),
    "gaussian-central": (
        _num("clip", True, "L2 clip bound S of the delta (the device only clips)", 0),
        _num("z", False, "noise multiplier of the aggregator's noise (informational)", 0),
    ),
    "laplace": (
        _num("clip", True, "L1 clip bound C of each per-example gradient", 0),
        _num("eps", True, "total epsilon, split over L uploads by the schedule", 0),
        _int("L", True, _L, 1, MAX_COUNT),
        ParamSpec("sched", "choice", True, "budget schedule", choices=("uniform", "geometric")),
        _num(
            "decay",
            False,
            "geometric schedule decay (required when sched = geometric)",
            0,
            1,
            hi_open=True,
        ),
    ),
    "dpsgd": (
        _num("clip", True, "L2 clip bound of each per-example gradient", 0),
        _num(
            "z",
            False,
            "noise multiplier sigma; absent: calibrated per dataset size (Python only)",
            0,
        ),
        _num("q", False, "Poisson sampling rate; absent: min(1, bs / dataset size)", 0, 1),
        _int("L", False, _L + "; absent: no limit", 1, MAX_COUNT),
    ),
    "nbafl": (
        _num("clip", True, "L2 clip bound C (gradients clipped to C/lr, parameters to C)", 0),
        _num("sigma", True, "uplink noise standard deviation sigma_U", 0),
        _int("L", True, _L, 1, MAX_COUNT),
        _int(
            "mmin",
            True,
            "m: the smallest dataset size the noise is calibrated for; a device "
            "with fewer examples must not upload",
            1,
            10_000_000,
        ),
    ),
    SIGNDS: (
        _int("d", True, "model dimension the plan is for (= number of parameters)", 1, MAX_DIM),
        _num("k", True, "sign_k: top-k fraction", 0, 0.25),
        _num("eps", True, "sign_eps: exponential-mechanism epsilon", 0, 100),
        _num(
            "rho",
            True,
            "sign_thr_ratio: target top-k fraction of the outputs",
            0.5,
            1,
            lo_open=False,
        ),
        _int("hout", True, "sign_dim_out as configured (0: h was optimised)", 0, 50),
        _int("hmax", True, "max_dim_out: the cap on h", 1, 100_000),
        _int("K", True, "top-k size K = floor(k d)", 0, MAX_DIM),
        _int(
            "h",
            True,
            "output dimension h: indices per vote (the plan's, after the cap)",
            1,
            100_000,
        ),
        _int("nth", True, "threshold nu_th of the exponential mechanism", 1, 100_000),
        _num("rr", True, "rr_eps: randomized-response epsilon of the MagRR bit", 0),
        _num(
            "r0",
            True,
            "initial r_est (used when the global message has no 'sd')",
            0,
            1,
            hi_open=True,
        ),
        _num("glr", False, "sign_global_lr: the server step on MagRR fallback (informational)", 0),
    ),
}


def _fail(reason: Reject, key: str, detail: str) -> PayloadRejected:
    return PayloadRejected(reason, detail, field=f"mp.{key}")


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
    :class:`PayloadRejected`. ``n_params``: the model dimension (SignDS's ``d`` must equal it)."""
    if type(mp) is not dict:
        raise F.bad_type("mp", "mechanism parameters", mp, "map")
    if len(mp) > MAX_PARAMS:
        raise F.out_of_range("mp", "mechanism parameters", mp, f"at most {MAX_PARAMS} entries")
    for name, value in mp.items():
        _generic(name, value)
    mechanism = F.name_field(mp, "m", "mechanism name", prefix="mp.")
    schema = SCHEMAS.get(mechanism)
    if schema is None:
        return dict(mp)
    specs = COMMON + schema
    F.check_keys(mp, frozenset(s.key for s in specs), f"mp of mechanism {mechanism!r}", "mp.")
    out: dict[str, Any] = {}
    for spec in specs:
        if spec.key not in mp:
            if spec.required:
                raise F.missing(f"mp.{spec.key}", spec.meaning)
            continue
        out[spec.key] = _value(spec, mp[spec.key], spec.meaning)
    if mechanism == SIGNDS:
        _check_signds(out, n_params)
    if mechanism == "laplace" and out["sched"] == "geometric" and "decay" not in out:
        raise F.missing("mp.decay", "geometric schedule decay (required when sched = geometric)")
    return out


def _check_signds(mp: dict[str, Any], n_params: int | None) -> None:
    d, h = mp["d"], mp["h"]
    if n_params is not None and d != n_params:
        raise _fail(
            Reject.OUT_OF_RANGE,
            "d",
            f"field 'mp.d' (SignDS plan dimension) = {d}, but the model has {n_params} parameters",
        )
    if mp["K"] > d:
        raise F.out_of_range("mp.K", "top-k size", mp["K"], f"an int in [0, d = {d}]")
    if h > min(d, mp["hmax"]):
        raise F.out_of_range("mp.h", "output dimension", h, "an int in [1, min(d, hmax)]")
    if mp["hout"] and h != mp["hout"]:
        raise F.out_of_range("mp.h", "output dimension", h, f"= hout = {mp['hout']}")
    if mp["nth"] > h:
        raise F.out_of_range("mp.nth", "threshold nu_th", mp["nth"], f"an int in [1, h = {h}]")


def _canonical(mp: dict[str, Any]) -> dict[str, Any]:
    """``m`` first, then the other keys in byte order (the encoder's deterministic order)."""
    return {"m": mp["m"], **{k: mp[k] for k in sorted(mp) if k != "m"}}


def mechanism_params(mechanism: str, **values: Any) -> dict[str, Any]:
    """Build the ``mp`` map for ``mechanism`` (the aggregator's side), normalised for the wire:
    ints as Python ints, numbers as floats, ``m`` first. Raises ValueError naming the key if the
    map would be rejected by a device (e.g. a required key is missing)."""
    mp: dict[str, Any] = {"m": mechanism}
    schema = {s.key: s for s in COMMON + SCHEMAS.get(mechanism, ())}
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
