"""The signed envelope every signed message shares: ``{"v": 1, "k": KIND, "b": BODY, "sig": SIG}``.

``SIG`` is Ed25519 over ``CONTEXT || BODY`` (a context per message kind, docs/protocol.md
"Signed global messages"), checked over ``b`` as received before the body is parsed: one
implementation for the global message, the dispatch and the job document, so a fix to one reaches
all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgpack

import edge_fl.protocol.fields as F
from edge_fl.protocol.messages import SCHEMA_VERSION, SIGNATURE_BYTES, PayloadRejected, Reject

SIGNED_KEYS = frozenset({"v", "k", "b", "sig"})


class Signs(Protocol):
    def sign(self, data: bytes) -> bytes: ...


class Verifies(Protocol):
    def verify(self, data: bytes, signature: bytes) -> bool: ...


def seal(body: bytes, kind: str, context: bytes, signer: Signs) -> bytes:
    """The envelope of kind ``kind`` around ``body``, signed over ``context + body``."""
    signature = signer.sign(context + body)
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise ValueError(f"the signer returned {signature!r}, not {SIGNATURE_BYTES} bytes")
    return msgpack.packb(
        {"v": SCHEMA_VERSION, "k": kind, "b": body, "sig": signature}, use_bin_type=True
    )


def verifies(verifier: Verifies, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` verifies; a verifier that raises says no (hostile input)."""
    try:
        return verifier.verify(data, signature) is True
    except Exception:  # a verifier must say no, not raise; treat it as a no
        return False


def open_signed(
    obj: dict[str, Any],
    context: bytes,
    verifier: Verifies | None,
    *,
    what: str,
    unpack: Callable[[bytes], dict[str, Any]],
    kind: str,
    label: str,
) -> dict[str, Any]:
    """The body map of the envelope ``obj`` (unpacked), its signature checked when ``verifier``.

    ``what`` names the envelope ("a signed dispatch message"); ``unpack`` reads the body bytes
    (the decoder's own strict reading); the body must have kind ``kind``, a ``label``
    ("a dispatch") naming it in the rejection."""
    F.check_keys(obj, SIGNED_KEYS, what)
    body = F.get(obj, "b", bytes, "signed body", "bin")
    signature = F.get(obj, "sig", bytes, "signature", "bin")
    if len(signature) != SIGNATURE_BYTES:
        raise PayloadRejected(
            Reject.BAD_SIGNATURE,
            f"field 'sig' (signature) has {len(signature)} bytes, expected {SIGNATURE_BYTES}",
            field="sig",
        )
    if verifier is not None and not verifies(verifier, context + body, signature):
        raise PayloadRejected(
            Reject.BAD_SIGNATURE,
            f"the signature does not verify under the aggregator key over {repr(context)[1:]} + b",
            field="sig",
        )
    inner = unpack(body)
    if inner.get("k") != kind or type(inner.get("k")) is not str:
        raise PayloadRejected(
            Reject.WRONG_KIND,
            f"the signed body has kind {F.describe(inner.get('k'))}, not {kind!r} ({label})",
            field="b",
        )
    return inner
