"""The codec registry: the one place that maps an uplink codec's name to its module.

A codec is one module in this package that defines ``CODEC``, a subclass of
:class:`~edge_fl.codecs.base.Codec` whose ``name`` is the module name (``q8``, ``topk``). Modules are
imported only when asked for. The wire tag of a codec (an update's ``dt``) is its ``dt``; the
registry maps both ways so the protocol decoder can find the codec of a received update.

Soundness with privacy mechanisms is decided by the mechanism (``Mechanism.accepts_codec``) and
checked here (:func:`check_combination`), at config load and again when a job is built.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from typing import Any

from edge_fl.codecs.base import Codec, CodecState

__all__ = [
    "Codec",
    "CodecState",
    "UnknownCodecError",
    "accepted_tags",
    "build_codec",
    "check_combination",
    "codec_class",
    "codec_for_tag",
    "codec_names",
    "codec_tags",
]

_NOT_CODECS = {"base"}
#: wire tags (``dt``) of every registered codec; fixed here so the decoder needs no import scan
_TAGS = {"f32": "f4", "f16": "f2", "q8": "q8", "q4": "q4", "topk": "tk", "rot1": "r1"}


class UnknownCodecError(ValueError):
    pass


@cache
def codec_names() -> tuple[str, ...]:
    """Every registered codec's name (module names, no import), f32 first."""
    found = [
        m.name
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in _NOT_CODECS
    ]
    order = list(_TAGS)
    return tuple(sorted(found, key=lambda n: (order.index(n) if n in order else len(order), n)))


def codec_tags() -> dict[str, str]:
    """Wire tag (``dt``) -> codec name, for every registered codec."""
    return {_TAGS[n]: n for n in codec_names() if n in _TAGS}


@cache
def codec_class(name: str) -> type[Codec]:
    if name not in codec_names():
        raise UnknownCodecError(f"unknown codec {name!r}; one of: {', '.join(codec_names())}")
    module = importlib.import_module(f"{__name__}.{name}")
    cls = module.CODEC
    if cls.name != name or cls.dt != _TAGS.get(name):
        raise RuntimeError(f"module {module.__name__} registers {cls.name!r}/{cls.dt!r}")
    return cls


def build_codec(name: str, **options: Any) -> Codec:
    """The named codec with its options (e.g. ``topk``: ``fraction``). ValueError names a bad one."""
    return codec_class(name)(**options)


@cache
def codec_for_tag(dt: str) -> Codec:
    """A decoder for wire tag ``dt`` (decoding needs no encoder options)."""
    return codec_class(codec_tags()[dt])()


def check_combination(mechanism: str, codec: str) -> str | None:
    """Why ``codec`` cannot carry ``mechanism``'s updates, or None when the combination is sound.

    Asks the mechanism (``Mechanism.accepts_codec``); an unknown mechanism is not this function's
    to report (None: the job build names it)."""
    from edge_fl.mechanisms import mechanism_class, mechanism_names

    codec_class(codec)
    if mechanism not in mechanism_names():
        return None
    return mechanism_class(mechanism).accepts_codec(codec)


@cache
def accepted_tags(mechanism: str | None) -> frozenset[str]:
    """Wire tags of the dense updates an aggregator running ``mechanism`` decodes (None: all)."""
    tags = codec_tags()
    if mechanism is None:
        return frozenset(tags)
    return frozenset(dt for dt, name in tags.items() if check_combination(mechanism, name) is None)
