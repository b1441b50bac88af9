"""The seven SecAgg+ messages as msgpack maps (schema: docs/specs/secagg.md section 6).

Every message carries ``v`` (1), ``k`` (its kind), ``r`` (the round) and ``nc`` (the round's
16-byte nonce); arrays that hold one entry per neighbour follow the receiving or sending device's
sorted neighbour list (:meth:`edge_fl.secagg.graph.Graph.neighbours`), so no device id travels
inside a message: the topic names the device. Decoding follows the project's wire rules (strict
msgpack, exact types, no unknown or repeated keys) and raises
:class:`edge_fl.protocol.PayloadRejected` for anything else.

| k | direction | fields |
|---|---|---|
| ``ak`` | device -> aggregator | ``ck`` ``sk`` (X25519 public keys), ``bh`` (seed commitment), ``sig`` (opt.) |
| ``nk`` | aggregator -> device | ``keys``: per neighbour nil or [ck, sk] or [ck, sk, sig] |
| ``sh`` | device -> aggregator | ``c``: per neighbour nil or its sealed shares (80 bytes) |
| ``sf`` | aggregator -> device | ``c``: per neighbour nil or the shares it sealed for this device |
| ``mx`` | device -> aggregator | ``b`` (bits), ``m`` (bitmap: masked with neighbour i), ``y`` (masked vector, ceil(b/8) bytes per value), ``sig`` (opt.) |
| ``uq`` | aggregator -> device | ``a``: per neighbour 0 (nothing), 1 (survived: its seed share), 2 (dropped: its key share); ``z`` (opt., true: send your noise) |
| ``ua`` | device -> aggregator | ``s``: per neighbour nil or the asked share (32 bytes); ``z`` (when asked: the device's own noise, packed as ``y``) |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

import edge_fl.protocol.fields as F
from edge_fl.protocol import NONCE_BYTES, SCHEMA_VERSION, PayloadRejected, Reject
from edge_fl.secagg.primitives import KEY_BYTES, SEALED_BYTES, SHARE_BYTES, context

SIG_BYTES = 64
KINDS = ("ak", "nk", "sh", "sf", "mx", "uq", "ua")
ASK_NOTHING, ASK_SEED, ASK_KEY = 0, 1, 2
_HEAD = ("v", "k", "r", "nc")
_KEYS: dict[str, frozenset[str]] = {
    "ak": frozenset({*_HEAD, "ck", "sk", "bh", "sig"}),
    "nk": frozenset({*_HEAD, "keys"}),
    "sh": frozenset({*_HEAD, "c"}),
    "sf": frozenset({*_HEAD, "c"}),
    "mx": frozenset({*_HEAD, "b", "m", "y", "sig"}),
    "uq": frozenset({*_HEAD, "a", "z"}),
    "ua": frozenset({*_HEAD, "s", "z"}),
}
MAX_COUNTER = 2**40


@dataclass(frozen=True)
class Message:
    """A decoded message: its kind, round, nonce and its own fields (``body``)."""

    kind: str
    round: int
    nonce: bytes
    body: dict[str, Any]


def encode(kind: str, rnd: int, nonce: bytes, **fields: Any) -> bytes:
    """The message's bytes: ``v k r nc`` then ``fields`` in the order given."""
    if kind not in KINDS:
        raise ValueError(f"unknown secagg message kind {kind!r}")
    body = {"v": SCHEMA_VERSION, "k": kind, "r": rnd, "nc": nonce, **fields}
    return msgpack.packb(body, use_bin_type=True)


def _bin(value: Any, key: str, what: str, size: int) -> bytes:
    if type(value) is not bytes:
        raise F.bad_type(key, what, value, "bin")
    if len(value) != size:
        raise F.out_of_range(key, what, value, f"bin of exactly {size} bytes")
    return value


def _array(obj: dict[str, Any], key: str, what: str, size: int | None) -> list[Any]:
    value = F.get(obj, key, list, what, "array")
    if size is not None and len(value) != size:
        raise F.out_of_range(key, what, value, f"an array of {size} entries (one per neighbour)")
    return value


def _optional_bins(items: list[Any], key: str, what: str, size: int) -> list[bytes | None]:
    return [
        None if item is None else _bin(item, f"{key}[{i}]", what, size)
        for i, item in enumerate(items)
    ]


def decode(payload: Any, max_bytes: int, neighbours: int | None = None) -> Message:
    """Decode and check one message; ``neighbours``: the length every per-neighbour array must
    have (None: not checked, the aggregator checks per device)."""
    obj = F.unpack_map(payload, max_bytes)
    if type(obj.get("v")) is not int or obj["v"] != SCHEMA_VERSION:
        raise PayloadRejected(
            Reject.WRONG_VERSION, f"'v' must be the int {SCHEMA_VERSION}", field="v"
        )
    kind = obj.get("k")
    if type(kind) is not str or kind not in KINDS:
        raise PayloadRejected(
            Reject.WRONG_KIND, f"'k' is {F.describe(kind)}, not a secagg kind", field="k"
        )
    F.check_keys(obj, _KEYS[kind], f"a secagg {kind!r} message")
    rnd = F.int_field(obj, "r", "round", 0, MAX_COUNTER)
    nonce = _bin(F.get(obj, "nc", bytes, "round nonce", "bin"), "nc", "round nonce", NONCE_BYTES)
    body: dict[str, Any] = {}
    if kind == "ak":
        body["ck"] = _bin(
            F.get(obj, "ck", bytes, "share-encryption public key", "bin"), "ck", "key", KEY_BYTES
        )
        body["sk"] = _bin(F.get(obj, "sk", bytes, "mask public key", "bin"), "sk", "key", KEY_BYTES)
        body["bh"] = _bin(F.get(obj, "bh", bytes, "seed commitment", "bin"), "bh", "commitment", 32)
        body["sig"] = (
            _bin(obj["sig"], "sig", "device signature", SIG_BYTES) if "sig" in obj else None
        )
    elif kind == "nk":
        keys: list[tuple[bytes, bytes, bytes | None] | None] = []
        for i, item in enumerate(_array(obj, "keys", "neighbour keys", neighbours)):
            if item is None:
                keys.append(None)
                continue
            where = f"keys[{i}]"
            if type(item) is not list or len(item) not in (2, 3):
                raise F.out_of_range(
                    where, "neighbour keys", item, "nil or [ck, sk] or [ck, sk, sig]"
                )
            ck = _bin(item[0], where, "share-encryption public key", KEY_BYTES)
            sk = _bin(item[1], where, "mask public key", KEY_BYTES)
            sig = _bin(item[2], where, "device signature", SIG_BYTES) if len(item) == 3 else None
            keys.append((ck, sk, sig))
        body["keys"] = keys
    elif kind in ("sh", "sf"):
        body["c"] = _optional_bins(
            _array(obj, "c", "sealed shares", neighbours), "c", "sealed shares", SEALED_BYTES
        )
    elif kind == "mx":
        body["b"] = F.int_field(obj, "b", "bit width", 1, 64)
        m = F.get(obj, "m", bytes, "mask set", "bin")
        if neighbours is not None:
            m = _bin(m, "m", "mask set", (neighbours + 7) // 8)
            if neighbours % 8 and m[-1] >> (neighbours % 8):
                raise F.out_of_range("m", "mask set", m, "padding bits 0")
        body["m"] = m
        body["y"] = F.get(obj, "y", bytes, "masked vector", "bin")
        body["sig"] = (
            _bin(obj["sig"], "sig", "device signature", SIG_BYTES) if "sig" in obj else None
        )
    elif kind == "uq":
        asks = _array(obj, "a", "unmask request", neighbours)
        for i, a in enumerate(asks):
            F.integer(a, f"a[{i}]", "unmask request", ASK_NOTHING, ASK_KEY)
        body["a"] = asks
        if "z" in obj and type(obj["z"]) is not bool:
            raise F.bad_type("z", "noise request", obj["z"], "bool")
        if "z" in obj and obj["z"] is not True:
            raise F.out_of_range("z", "noise request", obj["z"], "true, or no key")
        body["z"] = "z" in obj
    else:  # ua
        body["s"] = _optional_bins(
            _array(obj, "s", "shares", neighbours), "s", "share", SHARE_BYTES
        )
        body["z"] = F.get(obj, "z", bytes, "revealed noise", "bin") if "z" in obj else None
    return Message(kind, rnd, nonce, body)


def advert_body(job: str, rnd: int, nonce: bytes, device: str, ck: bytes, sk: bytes) -> bytes:
    """What a device's signing key signs in ``ak``: the keys in their context."""
    return context("advert", job, rnd, device) + nonce + ck + sk


def masked_body(
    job: str, rnd: int, nonce: bytes, device: str, bh: bytes, m: bytes, y: bytes
) -> bytes:
    """What a device's signing key signs in ``mx``: its seed commitment (``bh`` of its ``ak``,
    which the advert's signature does not cover: a broker that replaced it could otherwise
    have the aggregator accept forged seed shares), its mask set and masked vector, in
    context."""
    return context("masked", job, rnd, device) + nonce + bh + m + y


def bitmap(flags: list[bool]) -> bytes:
    """Bit i (least significant first within each byte) set iff flags[i]."""
    out = bytearray((len(flags) + 7) // 8)
    for i, flag in enumerate(flags):
        if flag:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)
