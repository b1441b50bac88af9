"""Wire protocol: topics, message types, the validating msgpack codec, the device's acceptance
window for global messages (imports nothing of ours). Ed25519 signing lives in
``edge_fl.protocol.signing`` (imported on demand: it needs the ``cryptography`` package)."""

from edge_fl.protocol.codec import (
    UpdateLimits,
    decode_global,
    decode_status,
    decode_update,
    encode_global,
    encode_status,
    encode_update,
    global_body,
)
from edge_fl.protocol.messages import (
    GLOBAL_CONTEXT,
    NONCE_BYTES,
    SCHEMA_VERSION,
    SIGNATURE_BYTES,
    DenseUpdate,
    GlobalModel,
    PayloadRejected,
    Reject,
    SignDSUpdate,
    Status,
    Update,
    new_nonce,
)
from edge_fl.protocol.topics import Topics
from edge_fl.protocol.window import DEFAULT_MAX_AHEAD, GlobalWindow, check_global

__all__ = [
    "DEFAULT_MAX_AHEAD",
    "GLOBAL_CONTEXT",
    "NONCE_BYTES",
    "SCHEMA_VERSION",
    "SIGNATURE_BYTES",
    "DenseUpdate",
    "GlobalModel",
    "GlobalWindow",
    "PayloadRejected",
    "Reject",
    "SignDSUpdate",
    "Status",
    "Topics",
    "Update",
    "UpdateLimits",
    "check_global",
    "decode_global",
    "decode_status",
    "decode_update",
    "encode_global",
    "encode_status",
    "encode_update",
    "global_body",
    "new_nonce",
]
