"""The codec registry: the one place that maps a codec's name and its wire tag to its class.

A codec is a subclass of :class:`~edge_fl.protocol.codecs.base.Codec` that declares its config
``name`` (``q8``, ``topk``), its wire tag ``dt`` (an update's or a global model's ``dt``), the
update keys it uses, whether it may carry the global model (``downlink``) and its ``options``.
The built-in codecs are registered here; :func:`register_codec` adds one defined anywhere else
(a researcher's own), after which everything that looks codecs up by name or by tag finds it: the
config's ``compression.uplink``, the device's encoder and the aggregator's decoder.

Which codec is sound with which privacy mechanism is not the wire layer's business: it is decided
when the job is assembled (``edge_fl.mechanisms.accepted_tags``), and the decoder is given the
accepted tags as data (``UpdateLimits.codecs``).
"""

from __future__ import annotations

from typing import Any

from edge_fl.protocol.codecs.base import HEADER_KEYS, Codec, CodecState
from edge_fl.protocol.codecs.f16 import F16
from edge_fl.protocol.codecs.f32 import F32
from edge_fl.protocol.codecs.q4 import Q4
from edge_fl.protocol.codecs.q8 import Q8
from edge_fl.protocol.codecs.rot1 import Rot1
from edge_fl.protocol.codecs.topk import TopK
from edge_fl.protocol.fields import NAME

__all__ = [
    "Codec",
    "CodecState",
    "UnknownCodecError",
    "build_codec",
    "codec_class",
    "codec_for_tag",
    "codec_names",
    "codec_tags",
    "downlink_names",
    "downlink_tag",
    "register_codec",
    "registered_tags",
]

MAX_TAG = 8  # characters of a wire tag

_BY_NAME: dict[str, type[Codec]] = {}
_BY_TAG: dict[str, type[Codec]] = {}
_DECODERS: dict[str, Codec] = {}
_TAGS: frozenset[str] = frozenset()  # kept with _BY_TAG: the decoder asks on every update


class UnknownCodecError(ValueError):
    pass


def register_codec(codec: type[Codec]) -> type[Codec]:
    """Register ``codec`` under its ``name`` and wire tag ``dt``; returns it (usable as a class
    decorator). Registering the same class again is a no-op; another class under a taken name or
    tag, or keys that collide with an update's own, is a ValueError."""
    if not (isinstance(codec, type) and issubclass(codec, Codec)):
        raise ValueError(f"{codec!r} is not a Codec subclass")
    name, dt, keys = getattr(codec, "name", None), getattr(codec, "dt", None), codec.keys
    if type(name) is not str or not NAME.fullmatch(name):
        raise ValueError(f"codec name {name!r} is not a short lower-case name")
    if type(dt) is not str or not 1 <= len(dt) <= MAX_TAG or not NAME.fullmatch(dt):
        raise ValueError(f"codec {name!r}: wire tag dt = {dt!r} is not a name of 1-{MAX_TAG} chars")
    if not isinstance(keys, frozenset) or not keys or not all(type(k) is str for k in keys):
        raise ValueError(f"codec {name!r}: keys must be a non-empty frozenset of str")
    if keys & HEADER_KEYS:
        raise ValueError(
            f"codec {name!r}: keys {sorted(keys & HEADER_KEYS)} are an update's own fields"
        )
    for table, key, what in ((_BY_NAME, name, "name"), (_BY_TAG, dt, "wire tag")):
        taken = table.get(key)
        if taken is not None and taken is not codec:
            raise ValueError(f"codec {what} {key!r} is already registered ({taken.__name__})")
    global _TAGS
    _BY_NAME[name], _BY_TAG[dt] = codec, codec
    _TAGS = frozenset(_BY_TAG)
    _DECODERS.pop(dt, None)
    return codec


for _builtin in (F32, F16, Q8, Q4, TopK, Rot1):
    register_codec(_builtin)


def codec_names() -> tuple[str, ...]:
    """Every registered codec's name, built-ins first (f32 first), in registration order."""
    return tuple(_BY_NAME)


def codec_tags() -> dict[str, str]:
    """Wire tag (``dt``) -> codec name, for every registered codec."""
    return {dt: cls.name for dt, cls in _BY_TAG.items()}


def registered_tags() -> frozenset[str]:
    """The wire tags of every registered codec."""
    return _TAGS


def codec_class(name: str) -> type[Codec]:
    cls = _BY_NAME.get(name)
    if cls is None:
        raise UnknownCodecError(f"unknown codec {name!r}; one of: {', '.join(codec_names())}")
    return cls


def build_codec(name: str, **options: Any) -> Codec:
    """The named codec with its options (e.g. ``topk``: ``fraction``). ValueError names a bad one."""
    return codec_class(name)(**options)


def codec_for_tag(dt: str) -> Codec:
    """A decoder for wire tag ``dt`` (decoding needs no encoder options); KeyError if unknown."""
    decoder = _DECODERS.get(dt)
    if decoder is None:
        decoder = _DECODERS[dt] = _BY_TAG[dt]()
    return decoder


def downlink_names() -> tuple[str, ...]:
    """The codecs that may carry the global model (``compression.downlink``)."""
    return tuple(name for name, cls in _BY_NAME.items() if cls.downlink)


def downlink_tag(name: str) -> str:
    """The global message's ``dt`` for downlink codec ``name`` (``f32`` -> ``f4``)."""
    cls = codec_class(name)
    if not cls.downlink:
        raise UnknownCodecError(
            f"codec {name!r} does not carry the global model; one of: {', '.join(downlink_names())}"
        )
    return cls.dt
