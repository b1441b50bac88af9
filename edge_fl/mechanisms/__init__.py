"""The mechanism registry: the one place that maps a mechanism's name to its class.

A mechanism is a subclass of :class:`~edge_fl.mechanisms.base.Mechanism`; the built-in ones live
in this package, one module each, and are registered here by name and module: a built-in's module
is imported the first time its name is looked up (a plain FedAvg job does not pay for SecAgg's
cryptography, randomgen or the other mechanisms' code). :func:`register_mechanism` adds one
defined anywhere else (a researcher's own), after which everything that looks mechanisms up by
name finds it: ``privacy.mechanism`` in a job, the device agents, the aggregator, the ledger and
``edge-fl privacy mechanisms``. Registering a mechanism also registers its public-parameter
schema with the wire layer (:func:`edge_fl.protocol.params.register_schema`), which validates
every global message's ``mp`` through it without knowing any mechanism; the wire layer is handed
a resolver (:func:`edge_fl.protocol.params.set_schema_resolver`) so that a global message naming a
built-in not imported yet is validated through that built-in's schema all the same.

Which uplink codec is sound with which mechanism is decided here, when a job is assembled
(:func:`check_combination`, :func:`accepted_tags`), by asking the mechanism
(``Mechanism.accepts_codec``); the wire layer is handed the accepted tags as data.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from edge_fl.mechanisms.base import (
    Device,
    Guarantee,
    GuaranteeMismatch,
    JobFacts,
    Mechanism,
    Strategy,
)
from edge_fl.protocol.codecs import codec_class, codec_tags
from edge_fl.protocol.params import register_schema, set_schema_resolver

__all__ = [
    "Device",
    "Guarantee",
    "GuaranteeMismatch",
    "JobFacts",
    "Mechanism",
    "Strategy",
    "UnknownMechanismError",
    "accepted_tags",
    "build_mechanism",
    "check_combination",
    "mechanism_class",
    "mechanism_names",
    "register_mechanism",
    "registered",
]

#: the names ``privacy.mechanism`` accepts (config.py's pattern)
NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")

_REGISTRY: dict[str, type[Mechanism]] = {}

#: the built-in mechanisms: name -> (module, class), imported and registered on first lookup
BUILTINS: dict[str, tuple[str, str]] = {
    "none": ("edge_fl.mechanisms.none", "NoPrivacy"),
    "dpsgd": ("edge_fl.mechanisms.dpsgd", "DpSgd"),
    "gaussian": ("edge_fl.mechanisms.gaussian", "LocalGaussian"),
    "gaussian-central": ("edge_fl.mechanisms.gaussian_central", "CentralGaussian"),
    "distributed-gaussian": ("edge_fl.mechanisms.distributed_gaussian", "DistributedGaussian"),
    "laplace": ("edge_fl.mechanisms.laplace", "Laplace"),
    "nbafl": ("edge_fl.mechanisms.nbafl", "NbAfl"),
    "signds": ("edge_fl.mechanisms.signds", "SignDS"),
}

#: the codecs registered when this registry was imported: a built-in's wire schema lists the
#: codecs it accepts among these, as when every built-in was registered at import (a codec
#: registered later reaches a job through :func:`accepted_tags`, which asks at call time)
_BUILTIN_CODEC_TAGS = codec_tags()


class UnknownMechanismError(ValueError):
    pass


def register_mechanism(name: str, mechanism_class: type[Mechanism]) -> type[Mechanism]:
    """Register ``mechanism_class`` (a :class:`Mechanism` subclass whose ``name`` is ``name``)
    and its wire schema; returns it. Registering the same class again is a no-op; another class
    under a taken name (a built-in's included), or a malformed one, is a ValueError."""
    if type(name) is str and name in BUILTINS:
        _load_builtin(name)  # a built-in's name is taken whether or not it was imported yet
    return _register(name, mechanism_class, codec_tags())


def _register(name: str, mechanism_class: type[Mechanism], tags: dict[str, str]) -> type[Mechanism]:
    if not (isinstance(mechanism_class, type) and issubclass(mechanism_class, Mechanism)):
        raise ValueError(f"{mechanism_class!r} is not a Mechanism subclass")
    if type(name) is not str or not NAME.fullmatch(name):
        raise ValueError(f"mechanism name {name!r} is not of a-z, 0-9 and -, 1-32 characters")
    if mechanism_class.name != name:
        raise ValueError(
            f"{mechanism_class.__name__} is named {mechanism_class.name!r}, not {name!r} "
            "(set its class attribute name)"
        )
    if mechanism_class.wire_kind not in ("u", "s"):
        raise ValueError(f"mechanism {name!r}: wire_kind {mechanism_class.wire_kind!r} is not u/s")
    taken = _REGISTRY.get(name)
    if taken is not None and taken is not mechanism_class:
        raise ValueError(f"mechanism {name!r} is already registered ({taken.__name__})")
    register_schema(mechanism_class.wire_schema(tags))
    _REGISTRY[name] = mechanism_class
    return mechanism_class


def _load_builtin(name: str) -> None:
    """Import and register built-in ``name`` unless it is registered already."""
    if name in _REGISTRY:
        return
    module, attr = BUILTINS[name]
    _register(name, getattr(importlib.import_module(module), attr), _BUILTIN_CODEC_TAGS)


def _lookup(name: str) -> type[Mechanism] | None:
    """The class registered as ``name``, importing a built-in on its first lookup."""
    if type(name) is str and name in BUILTINS:
        _load_builtin(name)
    return _REGISTRY.get(name)


def _resolve_schema(name: str) -> None:
    """The wire layer's resolver: registers the schema of a built-in not imported yet."""
    _lookup(name)


set_schema_resolver(_resolve_schema, lambda: tuple(BUILTINS))


def mechanism_names() -> tuple[str, ...]:
    """Every registered mechanism's name, ``none`` first, then alphabetical."""
    return tuple(sorted({*BUILTINS, *_REGISTRY}, key=lambda n: (n != "none", n)))


def mechanism_class(name: str) -> type[Mechanism]:
    cls = _lookup(name)
    if cls is None:
        raise UnknownMechanismError(
            f"unknown privacy mechanism {name!r}; one of: {', '.join(mechanism_names())}"
        )
    return cls


def registered(name: str) -> bool:
    """Whether a mechanism of that name is registered (a config names one before it may be); a
    built-in is, imported or not."""
    return name in _REGISTRY or name in BUILTINS


def build_mechanism(cfg: Any, facts: JobFacts) -> Mechanism:
    """The mechanism ``cfg`` (the job's ``privacy`` config section) names, calibrated for this
    job. ValueError names a bad setting."""
    return mechanism_class(cfg.mechanism)(cfg, facts)


def check_combination(mechanism: str, codec: str) -> str | None:
    """Why uplink ``codec`` cannot carry ``mechanism``'s updates, or None when the combination is
    sound. Asks the mechanism (``Mechanism.accepts_codec``); an unknown codec is an
    UnknownCodecError, an unknown mechanism is not this function's to report (None: the job
    build names it)."""
    codec_class(codec)
    cls = _lookup(mechanism)
    if cls is None:
        return None
    return cls.accepts_codec(codec)


def accepted_tags(mechanism: str | None) -> frozenset[str]:
    """Wire tags of the codecs whose dense updates a job running ``mechanism`` accepts (None:
    every registered codec): the job's ``UpdateLimits.codecs``."""
    tags = codec_tags()
    if mechanism is None:
        return frozenset(tags)
    return frozenset(dt for dt, name in tags.items() if check_combination(mechanism, name) is None)
