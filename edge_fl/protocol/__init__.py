"""Wire protocol: topics, message types, the validating msgpack codec, the uplink and downlink
vector codecs (``edge_fl.protocol.codecs``, with their registry), the public parameters of the
job's mechanism validated through the schemas mechanisms register (``edge_fl.protocol.params``),
the device's acceptance window for global messages. Imports nothing else of ours. Ed25519 signing
lives in ``edge_fl.protocol.signing`` (imported on demand: it needs the ``cryptography``
package). Normative specification: ``docs/protocol.md``."""

from edge_fl.protocol.codec import (
    DEFAULT_MAX_ABS,
    UpdateLimits,
    ack_for,
    decode_ack,
    decode_global,
    decode_status,
    decode_update,
    encode_ack,
    encode_global,
    encode_status,
    encode_update,
    global_body,
    sign_bits,
)
from edge_fl.protocol.messages import (
    GLOBAL_CONTEXT,
    NONCE_BYTES,
    REJECT_MEANING,
    RUN_BYTES,
    SCHEMA_VERSION,
    SIGNATURE_BYTES,
    Ack,
    DenseUpdate,
    GlobalModel,
    PayloadRejected,
    Reject,
    SignDSUpdate,
    Status,
    Update,
    new_nonce,
)
from edge_fl.protocol.params import check_mechanism_params, mechanism_params
from edge_fl.protocol.topics import Topics
from edge_fl.protocol.window import DEFAULT_MAX_AHEAD, GlobalWindow, check_global

__all__ = [
    "DEFAULT_MAX_ABS",
    "DEFAULT_MAX_AHEAD",
    "GLOBAL_CONTEXT",
    "NONCE_BYTES",
    "REJECT_MEANING",
    "RUN_BYTES",
    "SCHEMA_VERSION",
    "SIGNATURE_BYTES",
    "Ack",
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
    "ack_for",
    "check_global",
    "check_mechanism_params",
    "decode_ack",
    "decode_global",
    "decode_status",
    "decode_update",
    "encode_ack",
    "encode_global",
    "encode_status",
    "encode_update",
    "global_body",
    "mechanism_params",
    "new_nonce",
    "sign_bits",
]
