"""The dispatch message: who trains on the current model version, without the model.

In FedBuff/FedAsync with a concurrency limit the aggregator asks devices to train whenever a slot
frees up (an update arrived, a device timed out or left), many times per model version. Publishing
the whole global model again for each such selection sent every online device the model once per
selection (the README's fedbuff example: ~9x the bytes of one model per version and device). The
model now goes out once per version on ``global``; each later selection on that version goes out on
``dispatch`` (retained, QoS 1) as a small message that names the version and carries its nonce, so
it adds to exactly one published model and to no other (an earlier run's, a forged one).

Normative wire format (docs/protocol.md, "Dispatch message")
-------------------------------------------------------------

``BODY`` is a msgpack map, written in this order::

    {"v": 1, "k": "d", "job": str, "ver": int, "nc": bin(16), "sel": [str, ...]}

Signed (the aggregator has a signing key): ``{"v": 1, "k": "ds", "b": BODY, "sig": SIG}`` with
``SIG`` = Ed25519 over ``DISPATCH_CONTEXT || BODY``, ``DISPATCH_CONTEXT =
b"edge-fl/dispatch/v1\\x00"``, verified over ``b`` as received before it is parsed. Unsigned: the
BODY map itself. Decoding is as strict as a global message's: exact types, no unknown or repeated
keys, the reasons of docs/protocol.md's "Rejection reasons".
"""

from __future__ import annotations

from typing import Any

import msgpack

import edge_fl.protocol.fields as F
from edge_fl.protocol.envelope import Signs, Verifies, open_signed, seal
from edge_fl.protocol.messages import (
    DISPATCH_CONTEXT,
    NONCE_BYTES,
    SCHEMA_VERSION,
    Dispatch,
    PayloadRejected,
    Reject,
)

__all__ = ["DISPATCH_CONTEXT", "MAX_DISPATCH_BYTES", "decode_dispatch", "encode_dispatch"]

#: a dispatch names at most a few thousand devices; 1 MiB holds 15,000 of the longest ids
MAX_DISPATCH_BYTES = 1 << 20
MAX_COUNTER = 2**40
_BODY_KEYS = frozenset({"v", "k", "job", "ver", "nc", "sel"})


def _pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def dispatch_body(d: Dispatch) -> bytes:
    """The unsigned dispatch message: the exact bytes a signature covers."""
    if not isinstance(d.nonce, bytes) or len(d.nonce) != NONCE_BYTES:
        raise ValueError(f"a dispatch carries its version's {NONCE_BYTES}-byte nonce")
    if not d.selected or len(set(d.selected)) != len(d.selected):
        raise ValueError("a dispatch names at least one device, each once")
    for device in d.selected:
        if not isinstance(device, str) or not F.NAME.fullmatch(device):
            raise ValueError(f"device id {device!r} is not a str of {F.NAME_DOMAIN}")
    return _pack(
        {
            "v": SCHEMA_VERSION,
            "k": "d",
            "job": d.job,
            "ver": int(d.version),
            "nc": d.nonce,
            "sel": list(d.selected),
        }
    )


def encode_dispatch(d: Dispatch, signer: Signs | None = None) -> bytes:
    """The dispatch message; with a ``signer``, the signed envelope."""
    body = dispatch_body(d)
    if signer is None:
        return body
    return seal(body, "ds", DISPATCH_CONTEXT, signer)


def _unpack(payload: Any, what: str) -> dict[str, Any]:
    obj = F.unpack_map(payload, MAX_DISPATCH_BYTES, what, max_str_len=4096)
    version = obj.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise PayloadRejected(
            Reject.WRONG_VERSION,
            f"{what}: schema version 'v' is {F.describe(version)}; this peer speaks the int "
            f"{SCHEMA_VERSION}",
            field="v",
        )
    return obj


def decode_dispatch(payload: bytes, *, verifier: Verifies | None = None) -> Dispatch:
    """Decode and validate a dispatch message, signed (``k: ds``) or not (``k: d``).

    ``verifier``: the aggregator's public key; then an unsigned message is ``UNSIGNED`` and a
    signature that does not verify over the exact body bytes ``BAD_SIGNATURE``. For any input it
    returns a :class:`Dispatch` or raises :class:`PayloadRejected`."""
    obj = _unpack(payload, "dispatch message")
    kind = obj.get("k")
    if kind == "ds" and type(kind) is str:
        obj = open_signed(
            obj,
            DISPATCH_CONTEXT,
            verifier,
            what="a signed dispatch message",
            unpack=lambda body: _unpack(body, "signed dispatch body"),
            kind="d",
            label="a dispatch",
        )
    elif kind != "d" or type(kind) is not str:
        shown = "absent" if "k" not in obj else F.describe(kind)
        raise PayloadRejected(
            Reject.WRONG_KIND, f"kind 'k' is {shown}; a dispatch has k = 'd' or 'ds'", field="k"
        )
    elif verifier is not None:
        raise PayloadRejected(
            Reject.UNSIGNED, "an unsigned dispatch message (k = 'd') where a signature is required"
        )
    return _decode_body(obj)


def _decode_body(obj: dict[str, Any]) -> Dispatch:
    F.check_keys(obj, _BODY_KEYS, "a dispatch message")
    job = F.name_field(obj, "job", "job id")
    version = F.int_field(obj, "ver", "version", 0, MAX_COUNTER)
    nonce = F.get(obj, "nc", bytes, "the version's nonce", "bin")
    if len(nonce) != NONCE_BYTES:
        raise F.out_of_range(
            "nc", "the version's nonce", nonce, f"bin of exactly {NONCE_BYTES} bytes"
        )
    sel = F.get(obj, "sel", list, "selection", "array of str")
    if not sel:
        raise F.out_of_range("sel", "selection", sel, "at least one device id")
    seen: set[str] = set()
    for i, device in enumerate(sel):
        F.name(device, f"sel[{i}]", "selected device id")
        if device in seen:
            raise F.out_of_range("sel", "selection", device, "distinct device ids (named twice)")
        seen.add(device)
    return Dispatch(job=job, version=version, nonce=nonce, selected=tuple(sel))
