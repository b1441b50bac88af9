"""Wire protocol: topics, message types and the validating msgpack codec (imports nothing of ours)."""

from edge_fl.protocol.codec import (
    UpdateLimits,
    decode_global,
    decode_status,
    decode_update,
    encode_global,
    encode_status,
    encode_update,
)
from edge_fl.protocol.messages import (
    SCHEMA_VERSION,
    DenseUpdate,
    GlobalModel,
    PayloadRejected,
    Reject,
    SignDSUpdate,
    Status,
    Update,
)
from edge_fl.protocol.topics import Topics

__all__ = [
    "SCHEMA_VERSION",
    "DenseUpdate",
    "GlobalModel",
    "PayloadRejected",
    "Reject",
    "SignDSUpdate",
    "Status",
    "Topics",
    "Update",
    "UpdateLimits",
    "decode_global",
    "decode_status",
    "decode_update",
    "encode_global",
    "encode_status",
    "encode_update",
]
