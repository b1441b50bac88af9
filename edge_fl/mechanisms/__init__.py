"""The mechanism registry: the one place that maps a mechanism's name to its module.

A mechanism is one module in this package that defines ``MECHANISM``, a subclass of
:class:`~edge_fl.mechanisms.base.Mechanism` whose ``name`` is the module name with ``_`` as ``-``
(``gaussian_central`` -> ``gaussian-central``). Modules are imported only when asked for, so a
device running without privacy never imports dp-accounting. Adding a mechanism is adding a module.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from typing import TYPE_CHECKING

from edge_fl.mechanisms.base import Device, Guarantee, JobFacts, Mechanism, Strategy

if TYPE_CHECKING:
    from edge_fl.config import PrivacyConfig

__all__ = [
    "Device",
    "Guarantee",
    "JobFacts",
    "Mechanism",
    "Strategy",
    "UnknownMechanismError",
    "build_mechanism",
    "mechanism_class",
    "mechanism_names",
]

_NOT_MECHANISMS = {"base", "exact_sum"}


class UnknownMechanismError(ValueError):
    pass


@cache
def mechanism_names() -> tuple[str, ...]:
    """Every registered mechanism's name (module names, no import)."""
    found = [
        m.name.replace("_", "-")
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in _NOT_MECHANISMS
    ]
    return tuple(sorted(found, key=lambda n: (n != "none", n)))


def mechanism_class(name: str) -> type[Mechanism]:
    if name not in mechanism_names():
        raise UnknownMechanismError(
            f"unknown privacy mechanism {name!r}; one of: {', '.join(mechanism_names())}"
        )
    module = importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
    cls = module.MECHANISM
    if cls.name != name:
        raise RuntimeError(f"module {module.__name__} registers {cls.name!r}, not {name!r}")
    return cls


def build_mechanism(cfg: PrivacyConfig, facts: JobFacts) -> Mechanism:
    """The configured mechanism, calibrated for this job. ValueError names a bad setting."""
    return mechanism_class(cfg.mechanism)(cfg, facts)
