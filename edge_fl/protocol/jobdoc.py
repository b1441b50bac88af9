"""The job document: what a device needs to join a job, published by the aggregator.

The aggregator publishes it retained on ``<prefix>/<job>/job``, so a device needs only the broker
URL, its credentials, its id and where its data is; it can never train with settings that differ
from the aggregator's (the "digest drift" of hand-copied configs).

Normative wire format (docs/protocol.md, "Job document")
--------------------------------------------------------

``BODY`` is a msgpack map::

    {"v": 1, "k": "j", "job": str, "digest": str, "config": map, "cal": [[kind, *args, value]],
     "run": bin(16)}

- ``config``: the job's settings a device uses (``job, seed, reproducible, data, model, training,
  rounds, privacy, robust`` and any newer section), as the JSON form of ``edge_fl.config``; the
  device validates it with the same schema and rejects unknown keys.
- ``digest``: ``JobConfig.digest()`` of that config; every global message carries it too.
- ``cal``: noise multipliers the aggregator calibrated (``edge_fl.privacy.calibration``), so a
  device without dp-accounting uses the same values.
- ``run`` (optional): the aggregator run's id; every global message of that run carries the same
  ``run``, and a device that joined with this document refuses any other (a replay of an
  earlier run's signed message, docs/protocol.md "Run id").

Signed (the aggregator has a signing key): ``{"v": 1, "k": "js", "b": BODY, "sig": SIG}`` with
``SIG`` = Ed25519 over ``JOB_CONTEXT || BODY``, ``JOB_CONTEXT = b"edge-fl/job/v1\\x00"``. A device
given the aggregator's public key accepts only a signed document that verifies. Unsigned: the
BODY map itself. An empty retained payload clears the topic: no job is running.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from edge_fl.protocol.envelope import SIGNED_KEYS, seal, verifies
from edge_fl.protocol.messages import (
    RUN_BYTES,
    SCHEMA_VERSION,
    SIGNATURE_BYTES,
    PayloadRejected,
    Reject,
)

if TYPE_CHECKING:
    from edge_fl.protocol.signing import Signer, Verifier

JOB_CONTEXT = b"edge-fl/job/v1\x00"
MAX_JOB_DOCUMENT = 1 << 20  # 1 MiB: a config plus a calibration table is a few KB
_BODY_KEYS = {"v", "k", "job", "digest", "config", "cal"}
_OPTIONAL_KEYS = {"run"}


@dataclass(frozen=True)
class JobDocument:
    job: str
    digest: str
    config: dict[str, Any]
    calibration: list[list[Any]] = field(default_factory=list)
    signed: bool = False
    run: bytes | None = None  # the aggregator run's id (every global message of the run has it)


def encode_job_document(doc: JobDocument, signer: Signer | None = None) -> bytes:
    fields: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "k": "j",
        "job": doc.job,
        "digest": doc.digest,
        "config": doc.config,
        "cal": doc.calibration,
    }
    if doc.run is not None:
        if not isinstance(doc.run, bytes) or len(doc.run) != RUN_BYTES:
            raise ValueError(f"a run id is {RUN_BYTES} bytes, got {doc.run!r}")
        fields["run"] = doc.run
    body = msgpack.packb(fields, use_bin_type=True)
    if signer is None:
        return body
    return seal(body, "js", JOB_CONTEXT, signer)


def _no_duplicates(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PayloadRejected(Reject.MALFORMED, f"a map repeats the key {key!r}")
        out[key] = value
    return out


def _map(payload: bytes, what: str) -> dict[str, Any]:
    if len(payload) > MAX_JOB_DOCUMENT:
        raise PayloadRejected(
            Reject.OVERSIZED, f"{what} of {len(payload)} bytes exceeds {MAX_JOB_DOCUMENT}"
        )
    try:
        obj = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, object_pairs_hook=_no_duplicates
        )
    except PayloadRejected:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise PayloadRejected(Reject.MALFORMED, f"{what} is not valid msgpack ({exc})") from None
    if type(obj) is not dict:
        raise PayloadRejected(Reject.MALFORMED, f"{what} is not a msgpack map")
    if obj.get("v") != SCHEMA_VERSION or type(obj.get("v")) is not int:
        raise PayloadRejected(
            Reject.WRONG_VERSION, f"{what}: 'v' must be the int {SCHEMA_VERSION}", field="v"
        )
    return obj


def decode_job_document(payload: bytes, verifier: Verifier | None = None) -> JobDocument:
    """Decode and check a job document; with ``verifier``, only a signed one that verifies."""
    obj = _map(bytes(payload), "job document")
    signed = obj.get("k") == "js"
    if signed:
        if set(obj) != SIGNED_KEYS:
            raise PayloadRejected(Reject.MALFORMED, f"a signed job document has keys {sorted(obj)}")
        body, sig = obj["b"], obj["sig"]
        if type(body) is not bytes or type(sig) is not bytes or len(sig) != SIGNATURE_BYTES:
            raise PayloadRejected(Reject.BAD_SIGNATURE, "'b' and a 64-byte 'sig' must be bin")
        if verifier is not None and not verifies(verifier, JOB_CONTEXT + body, sig):
            raise PayloadRejected(
                Reject.BAD_SIGNATURE,
                "the job document's signature does not verify under the aggregator key",
                field="sig",
            )
        obj = _map(body, "signed job document body")
    elif verifier is not None:
        raise PayloadRejected(
            Reject.UNSIGNED, "an unsigned job document where a signature is required"
        )
    if obj.get("k") != "j":
        raise PayloadRejected(Reject.WRONG_KIND, f"kind {obj.get('k')!r} is not a job document")
    if not _BODY_KEYS <= set(obj) <= _BODY_KEYS | _OPTIONAL_KEYS:
        missing, extra = _BODY_KEYS - set(obj), set(obj) - _BODY_KEYS - _OPTIONAL_KEYS
        raise PayloadRejected(
            Reject.MALFORMED,
            f"job document keys: missing {sorted(missing)}, unknown {sorted(extra)}",
        )
    job, digest, config, cal = obj["job"], obj["digest"], obj["config"], obj["cal"]
    if type(job) is not str or type(digest) is not str:
        raise PayloadRejected(Reject.MALFORMED, "'job' and 'digest' must be strings")
    if type(config) is not dict or config.get("job") != job:
        raise PayloadRejected(Reject.MALFORMED, "'config' must be a map whose 'job' is 'job'")
    if type(cal) is not list:
        raise PayloadRejected(Reject.MALFORMED, "'cal' must be an array of rows")
    run = obj.get("run")
    if "run" in obj and (type(run) is not bytes or len(run) != RUN_BYTES):
        raise PayloadRejected(Reject.MALFORMED, f"'run' must be bin of {RUN_BYTES} bytes")
    return JobDocument(job, digest, config, cal, signed, run)
