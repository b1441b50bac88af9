"""The wire side of secure aggregation (docs/protocol.md, "Secure aggregation"): the ``sa`` map
of a secure round's global message, the round's public seed, and telling a SecAgg+ message on
``up/<device>`` from an update by its ``k``. The SecAgg+ messages themselves are
``edge_fl.secagg.messages`` (docs/specs/secagg.md section 6)."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgpack

import edge_fl.protocol.fields as F
from edge_fl.protocol.messages import PayloadRejected, Reject

#: SecAgg+ kinds a device publishes on ``up/<device>`` (the aggregator dispatches on ``k``)
UP_KINDS = frozenset({"ak", "sh", "mx", "ua"})
#: the ``sa`` map's keys, in the order they are written
SA_KEYS = ("b", "k", "md", "ms", "n", "q", "t")
_CONTEXT = b"edge-fl/secagg/v1/"


def context(label: str, job: str, rnd: int, *names: str) -> bytes:
    """docs/specs/secagg.md section 3's context string: ``edge-fl/secagg/v1/<label> 0x00 <job>
    0x00 <round: 8 bytes big-endian> (<name> 0x00)*``, injective (ids and job never contain
    NUL); HKDF info and AEAD data of the SecAgg+ core and the round seed alike."""
    out = _CONTEXT + label.encode() + b"\x00" + job.encode() + b"\x00" + rnd.to_bytes(8, "big")
    return out + b"".join(n.encode() + b"\x00" for n in names)


def round_seed(job: str, rnd: int, nonce: bytes) -> bytes:
    """HKDF-SHA256(ikm = nonce, salt = empty, info = context("round-seed", job, rnd)), 32
    bytes: public, the same on every device and the aggregator (RFC 5869, one block; with
    hmac, so the codec's import of this module pulls in no crypto library)."""
    prk = hmac.new(bytes(32), nonce, hashlib.sha256).digest()
    return hmac.new(prk, context("round-seed", job, rnd) + b"\x01", hashlib.sha256).digest()


def up_kind(payload: bytes) -> str | None:
    """The SecAgg+ kind of a payload on ``up/<device>`` (``ak``, ``sh``, ``mx``, ``ua``), or
    None for anything else (an update, or bytes the update decoder will judge). Reads only the
    map's first two entries (``v`` then ``k``, as every SecAgg+ message is written)."""
    if not payload or payload[0] not in (0x84, 0x85, 0x86, 0x87, 0x88):  # fixmap of 4-8 entries
        return None
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(payload))
    unpacker.feed(payload)
    try:
        unpacker.read_map_header()
        if unpacker.unpack() != "v" or unpacker.unpack() != 1 or unpacker.unpack() != "k":
            return None
        kind = unpacker.unpack()
    except Exception:
        return None
    return kind if isinstance(kind, str) and kind in UP_KINDS else None


def masked_head(payload: bytes) -> tuple[int, bytes] | None:
    """(round, nonce) of an ``mx`` message (its ``r`` and ``nc``), or None."""
    if up_kind(payload) != "mx":
        return None
    return secure_head(payload)


def secure_head(payload: bytes) -> tuple[int, bytes] | None:
    """(round, nonce) of any SecAgg+ message on ``up/<device>`` (its ``r`` and ``nc``, in any
    order after ``v k``), or None: what routes it to its FedBuff cohort's session and what
    charges a masked input."""
    if up_kind(payload) is None:
        return None
    # key order is not significant (encoding rule 7): the session takes r and nc anywhere, so
    # routing and charging must too (a reordered mx was summed and never charged)
    found = _keys(payload, ("r", "nc"))
    if found is None:
        return None
    rnd, nonce = found
    if type(rnd) is not int or not isinstance(nonce, bytes):
        return None
    return rnd, nonce


def _keys(payload: bytes, wanted: tuple[str, ...]) -> tuple[Any, ...] | None:
    """The values of ``wanted`` in a msgpack map, or None when one is missing, repeated or the
    map does not decode (the other values are skipped, not decoded)."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(payload))
    unpacker.feed(payload)
    found: dict[str, Any] = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in wanted:
                if key in found:
                    return None
                found[key] = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:
        return None
    if len(found) != len(wanted):
        return None
    return tuple(found[k] for k in wanted)


def check_secure_params(
    value: Any, roster: int | None, *, mode: str = "sync", nonce: bool = True
) -> dict[str, Any]:
    """The ``sa`` map validated (docs/protocol.md), or :class:`PayloadRejected`. ``roster``:
    the number of devices in ``sel`` (None: no ``sel``)."""
    if not isinstance(value, dict):
        raise PayloadRejected(Reject.BAD_TYPE, "'sa' must be a map", field="sa")
    for key in value:
        if key not in SA_KEYS:
            raise PayloadRejected(
                Reject.UNKNOWN_FIELD, f"'sa.{key}' is not a key of the sa map", field=f"sa.{key}"
            )
    for key in SA_KEYS:
        if key not in value:
            raise F.missing(f"sa.{key}", "secure aggregation parameter")
    if mode not in ("sync", "fedbuff"):  # fedbuff: a cohort's dispatch (docs/protocol.md)
        raise F.out_of_range("sa", "secure aggregation", mode, "only in sync or fedbuff rounds")
    if roster is None or roster < 2 or not nonce:
        raise F.out_of_range("sa", "secure aggregation", roster, "with sel (>= 2 devices) and nc")
    ints = {
        "b": (2, 64),
        "k": (1, roster - 1),
        "ms": (2, roster),
        "n": (1, 2**31),
        "q": (0, 2**62),
    }
    out: dict[str, Any] = {}
    for key, (lo, hi) in ints.items():
        out[key] = F.int_field(value, key, "secure aggregation parameter", lo, hi, prefix="sa.")
    if out["k"] % 2 and out["k"] < roster - 1:  # a Harary graph has an even degree
        raise F.out_of_range(
            "sa.k", "sa.k", out["k"], f"even, or {roster - 1} (the complete graph)"
        )
    out["t"] = F.int_field(value, "t", "Shamir threshold", 1, out["k"], prefix="sa.")
    md = value["md"]
    if not isinstance(md, bool):
        raise PayloadRejected(Reject.BAD_TYPE, "'sa.md' must be a bool", field="sa.md")
    out["md"] = md
    if not md and roster * out["q"] >= 1 << (out["b"] - 1):
        raise F.out_of_range(
            "sa.q", "sa.q", out["q"], f"below 2^(b-1) / {roster} (the sum must fit Z_2^b)"
        )
    return {k: out[k] for k in SA_KEYS}
