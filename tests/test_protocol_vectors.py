"""Wire-protocol test vectors: files another implementation can check itself against, offline.

``tests/vectors/*.json`` hold inputs and the exact bytes (hex) of global messages (signed and
unsigned), dense and SignDS updates, statuses and acks, index codings, SignDS plans and MagRR bits,
model layouts, input preprocessing, the config digest, and negative vectors with the rejection
reason each must get. ``docs/protocol.md`` ("Test vectors") describes the format.

These tests prove that the project's own encoders reproduce every vector byte for byte, that its
decoders read every positive vector back and reject every negative one with its documented reason,
and that the hex examples in docs/protocol.md are the vectors. The files are produced by
:func:`build_vectors`; after a deliberate protocol change regenerate them (and the doc's hex
blocks) with::

    .venv/bin/python tests/test_protocol_vectors.py --write
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import edge_fl.mechanisms  # noqa: F401  (registers the built-in mechanisms' mp schemas)
from edge_fl.protocol import (
    REJECT_MEANING,
    Ack,
    DenseUpdate,
    GlobalModel,
    PayloadRejected,
    Reject,
    SignDSUpdate,
    Status,
    Topics,
    UpdateLimits,
    decode_ack,
    decode_global,
    decode_status,
    decode_update,
    encode_ack,
    encode_global,
    encode_status,
    encode_update,
    envelope,
    global_body,
    mechanism_params,
    sign_bits,
)
from edge_fl.protocol.indices import (
    CODE_BITPACK,
    CODE_DELTA_VARINT,
    decode_indices,
    encode_bitpack,
    encode_delta_varint,
    encode_indices_coded,
)
from edge_fl.protocol.params import COMMON, schemas
from edge_fl.protocol.signing import Signer, Verifier

ROOT = Path(__file__).resolve().parent.parent
VECTORS = Path(__file__).resolve().parent / "vectors"
DOC = ROOT / "docs" / "protocol.md"
FILES = ("messages", "rejections", "indices", "signds", "models", "preprocessing", "digest")

SEED = bytes(range(32))  # the test vectors' Ed25519 private seed: public, never use it for real
NONCE = bytes.fromhex("00112233445566778899aabbccddeeff")
RUN = bytes.fromhex("0f1e2d3c4b5a69788796a5b4c3d2e1f0")  # a run id (docs/protocol.md, "Run id")
JOB = "demo"
DEVICE = "d00001"
TOPICS = Topics(JOB)

# ---------------------------------------------------------------- JSON <-> Python helpers


def jsonable(value: Any) -> Any:
    """The JSON form used in the vector files: bin as {"bin": hex}, arrays as lists."""
    if isinstance(value, bytes | bytearray):
        return {"bin": bytes(value).hex()}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return [jsonable(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"bin"}:
            return bytes.fromhex(value["bin"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def wire_map(payload: bytes) -> Any:
    return jsonable(msgpack.unpackb(payload, raw=False))


def _vec(values: list[float], dtype: str) -> np.ndarray:
    """The values as the wire carries them (q8: the float32 model, quantised by the encoder)."""
    wire = np.dtype("<f4" if dtype == "q8" else "<" + dtype)
    return np.asarray(values, dtype=np.float32).astype(wire).astype(np.float32)


# semantic message <-> dataclass


def global_from(m: dict[str, Any]) -> GlobalModel:
    return GlobalModel(
        job=m["job"],
        version=m["version"],
        round=m["round"],
        params=_vec(m["params"], m["wire_dtype"]),
        mode=m["mode"],
        selected=None if m["selected"] is None else tuple(m["selected"]),
        deadline_s=m["deadline_s"],
        config_digest=m["config_digest"],
        wire_dtype=m["wire_dtype"],
        mechanism_state=m["mechanism_state"],
        sample_rate=m["sample_rate"],
        done=m["done"],
        issued_at=m["issued_at"],
        nonce=None if m["nonce"] is None else bytes.fromhex(m["nonce"]),
        mechanism_params=m["mechanism_params"],
        run=bytes.fromhex(m["run"]) if m.get("run") is not None else None,
    )


def global_to(g: GlobalModel) -> dict[str, Any]:
    return {
        "job": g.job,
        "version": g.version,
        "round": g.round,
        "mode": g.mode,
        "wire_dtype": g.wire_dtype,
        "params": [float(x) for x in g.params],
        "deadline_s": g.deadline_s,
        "config_digest": g.config_digest,
        "issued_at": g.issued_at,
        "selected": None if g.selected is None else list(g.selected),
        "sample_rate": g.sample_rate,
        "mechanism_state": g.mechanism_state,
        "mechanism_params": g.mechanism_params,
        "done": g.done,
        "nonce": None if g.nonce is None else g.nonce.hex(),
        # only when present: the vectors written before run ids existed stay as they were
        **({} if g.run is None else {"run": g.run.hex()}),
    }


def update_from(m: dict[str, Any], device: str) -> DenseUpdate | SignDSUpdate:
    nonce = None if m["nonce"] is None else bytes.fromhex(m["nonce"])
    if m["kind"] == "dense":
        return DenseUpdate(
            device,
            m["round"],
            m["base_version"],
            m["n_samples"],
            _vec(m["delta"], m["wire_dtype"] if "coded" not in m else "f4"),
            m["wire_dtype"],
            m["mechanism"],
            nonce,
        )
    return SignDSUpdate(
        device,
        m["round"],
        m["base_version"],
        m["n_samples"],
        m["sign"],
        np.asarray(m["indices"], np.uint32),
        m["magrr_bit"],
        nonce,
    )


def update_to(u: DenseUpdate | SignDSUpdate, dim: int) -> dict[str, Any]:
    common = {
        "round": u.round,
        "base_version": u.base_version,
        "n_samples": u.n_samples,
        "nonce": None if u.nonce is None else u.nonce.hex(),
    }
    if isinstance(u, DenseUpdate):
        return {
            "kind": "dense",
            **common,
            "mechanism": u.mechanism,
            "wire_dtype": u.wire_dtype,
            "delta": [float(x) for x in u.delta],
        }
    return {
        "kind": "signds",
        **common,
        "dim": dim,
        "sign": u.sign,
        "magrr_bit": u.magrr_bit,
        "indices": [int(i) for i in u.indices],
    }


def limits_from(spec: dict[str, Any]) -> UpdateLimits:
    return UpdateLimits(
        n_params=spec["n_params"],
        max_indices=spec.get("max_indices", 100),
        allowed_kinds=frozenset(spec.get("allowed_kinds", ["u", "s"])),
        mechanism=spec.get("mechanism"),
        signds_h=spec.get("signds_h"),
        max_abs=spec.get("max_abs", 1e4),
    )


# ---------------------------------------------------------------- the vectors


D_DENSE = 8
W8 = [0.5, -0.25, 0.125, 1.0, -1.5, 0.0, 2.0, -0.0625]
DELTA8 = [0.015625, -0.0078125, 0.001953125, 0.0, -0.03125, 0.0625, -0.00390625, 0.0009765625]
D_SIGNDS = 40
W40 = [round(i / 32 - 0.5, 6) for i in range(D_SIGNDS)]
#: a quantised global model spanning two blocks of 256 (the second one 4 long)
D_Q8 = 260
W260 = [round((i % 17) / 8 - 1 + i / 1000, 6) for i in range(D_Q8)]
SIGNDS_CFG = {"k": 0.25, "eps": 10.0, "rho": 0.6, "hout": 0, "hmax": 100}
MAGRR = {"r_est": 1e-05, "reached": False, "reached_count": 0}


def signds_mp(d: int, *, k: float, eps: float, rho: float, hout: int, hmax: int) -> dict:
    from edge_fl.privacy.signds import SignDSParams, plan

    p = plan(SignDSParams(k=k, eps=eps, thr_ratio=rho, dim_out=hout, max_dim_out=hmax), d)
    return mechanism_params(
        "signds", lr=0.05, ep=1, bs=8, d=d, k=k, eps=eps, rho=rho, hout=hout, hmax=hmax,
        K=p.topk, h=p.h, nth=p.nu_th, rr=5.0, r0=1e-05, glr=0.1,
    )  # fmt: skip


def _globals() -> list[tuple[str, GlobalModel, bool, str]]:
    none_mp = mechanism_params("none", lr=0.3, ep=5, bs=8)
    sd_mp = signds_mp(D_SIGNDS, **SIGNDS_CFG)
    common = dict(job=JOB, deadline_s=30.0, config_digest="0123456789ab", nonce=NONCE)
    return [
        (
            "global_sync_dense",
            GlobalModel(
                version=3,
                round=4,
                params=np.asarray(W8, np.float32),
                selected=("d00001", "d00007"),
                issued_at=1700000000.5,
                mechanism_params=none_mp,
                **common,
            ),
            False,
            "sync round 4 of a plain FedAvg job (mechanism none): selection list, unsigned",
        ),
        (
            "global_signed_signds",
            GlobalModel(
                version=7,
                round=8,
                params=np.asarray(W40, np.float32),
                selected=("d00001", "d00002", "d00003"),
                issued_at=1700000100.0,
                mechanism_state=dict(MAGRR),
                mechanism_params=sd_mp,
                **common,
            ),
            True,
            "signed sync round 8 of a SignDS job (d = 40): MagRR state sd, SignDS plan in mp",
        ),
        (
            "global_poisson_f2",
            GlobalModel(
                version=2,
                round=3,
                params=np.asarray(W8, np.float32),
                wire_dtype="f2",
                sample_rate=0.25,
                issued_at=1700000200.25,
                mechanism_params=mechanism_params(
                    "gaussian-central", lr=0.3, ep=5, bs=8, clip=1.0, z=1.1
                ),
                **common,
            ),
            False,
            "Poisson round (q instead of a selection), float16 parameters, central Gaussian",
        ),
        (
            "global_fedbuff",
            GlobalModel(
                version=12,
                round=12,
                params=np.asarray(W8, np.float32),
                mode="fedbuff",
                issued_at=1700000300.0,
                mechanism_params=mechanism_params(
                    "gaussian", lr=0.3, ep=5, bs=8, clip=1.0, z=1.5, L=20
                ),
                **common,
            ),
            True,
            "asynchronous (fedbuff) version 12: no selection, round = version; local Gaussian",
        ),
        (
            "global_done",
            GlobalModel(
                job=JOB,
                version=20,
                round=20,
                params=np.asarray(W8, np.float32),
                deadline_s=30.0,
                config_digest="0123456789ab",
                done=True,
                issued_at=1700000400.0,
                mechanism_params=none_mp,
            ),
            True,
            "the done marker (signed, retained, no nonce): the job is over",
        ),
        (
            "global_done_run",
            GlobalModel(
                job=JOB,
                version=20,
                round=20,
                params=np.asarray(W8, np.float32),
                deadline_s=30.0,
                config_digest="0123456789ab",
                done=True,
                issued_at=1700000400.0,
                mechanism_params=none_mp,
                run=RUN,
            ),
            True,
            "the done marker of run 0f1e...f0: a device of another run refuses it (Run id)",
        ),
        (
            "global_sync_q8",
            GlobalModel(
                version=5,
                round=6,
                params=np.asarray(W260, np.float32),
                wire_dtype="q8",
                selected=("d00001",),
                issued_at=1700000500.0,
                mechanism_params=none_mp,
                **common,
            ),
            False,
            "quantised global model (compression.downlink: q8), d = 260: two blocks of 256 and 4; "
            "params are the aggregator's float32 model, decoded_params what a device decodes",
        ),
    ]


def _updates() -> list[tuple[str, DenseUpdate | SignDSUpdate, int, dict, str]]:
    dense_limits = {"n_params": D_DENSE, "allowed_kinds": ["u"], "mechanism": "none"}
    return [
        (
            "update_dense_f4",
            DenseUpdate(DEVICE, 4, 3, 40, np.asarray(DELTA8, np.float32), "f4", "none", NONCE),
            D_DENSE,
            dense_limits,
            "dense float32 delta for global_sync_dense (round 4, base version 3)",
        ),
        (
            "update_dense_f2",
            DenseUpdate(
                DEVICE, 3, 2, 40, np.asarray(DELTA8, np.float32), "f2", "gaussian-central", NONCE
            ),
            D_DENSE,
            {**dense_limits, "mechanism": "gaussian-central"},
            "dense float16 delta for global_poisson_f2",
        ),
        (
            "update_signds_bitpack",
            SignDSUpdate(
                DEVICE,
                8,
                7,
                40,
                -1,
                np.asarray([0, 3, 7, 12, 13, 21, 25, 30, 33, 38, 39], np.uint32),
                1,
                NONCE,
            ),
            D_SIGNDS,
            {"n_params": D_SIGNDS, "allowed_kinds": ["s"], "mechanism": "signds", "signds_h": 11},
            "SignDS vote for global_signed_signds (h = 11, d = 40: bit-packing, c = 0)",
        ),
        (
            "update_signds_varint",
            SignDSUpdate(DEVICE, 2, 2, 12, 1, np.asarray([1000, 1001, 1005], np.uint32), 0, NONCE),
            66404,
            {"n_params": 66404, "allowed_kinds": ["s"], "mechanism": "signds", "signds_h": 3},
            "SignDS vote with clustered indices, d = 66404, h = 3: delta-varint (c = 1)",
        ),
    ]


class _FixedCoins:
    """The randomness of the compressed-update vectors: every uniform draw is 0.5 and every
    random byte 0xA5, so the vectors do not depend on a PRNG's stream (a decoder needs none)."""

    def random(self, size: int) -> np.ndarray:
        return np.full(size, 0.5)

    def bytes(self, n: int) -> bytes:
        return b"\xa5" * n


#: a delta of d = 40 for the top-k bitmap vector
DELTA40 = [((-1) ** i) * (i % 7) / 64 for i in range(40)]


def _coded_updates() -> list[tuple[str, DenseUpdate, str, dict[str, Any], int, str]]:
    """(name, header, dt, codec fields, d, note): dense updates through an uplink codec."""
    from edge_fl.protocol.codecs import build_codec

    coins = _FixedCoins()
    out = []
    for name, codec, delta, note in (
        (
            "update_q8",
            build_codec("q8"),
            DELTA8,
            "8-bit stochastic quantisation of update_dense_f4",
        ),
        ("update_q4", build_codec("q4"), DELTA8, "4-bit stochastic quantisation, two per byte"),
        (
            "update_topk_bitpack",
            build_codec("topk", fraction=0.25, error_feedback=False),
            DELTA8,
            "top-k, h = 2 of d = 8, indices bit-packed (c = 0, 3 bits each)",
        ),
        (
            "update_topk_bitmap",
            build_codec("topk", fraction=0.5, error_feedback=False),
            DELTA40,
            "top-k, h = 20 of d = 40, index bitmap (c = 2, 5 bytes)",
        ),
        ("update_rot1", build_codec("rot1"), DELTA8, "Hadamard rotation + 1 bit + max, rs fixed"),
    ):
        fields, _ = codec.encode(np.asarray(delta, np.float64), coins)
        header = DenseUpdate(DEVICE, 4, 3, 40, np.zeros(0, np.float32), codec.dt, "none", NONCE)
        out.append((name, header, codec.dt, fields, len(delta), note))
    return out


def _statuses() -> list[tuple[str, Status, str]]:
    return [
        ("status_online", Status(DEVICE, True, 40), "retained status after connecting"),
        (
            "status_stopped",
            Status(DEVICE, True, 40, {"stopped": "budget_exhausted"}),
            "a device whose privacy budget is spent: online, never selected again",
        ),
        ("status_last_will", Status(DEVICE, False, 40), "the last will (set at CONNECT)"),
    ]


def _acks() -> list[tuple[str, Ack, str]]:
    return [
        ("ack_accepted", Ack(DEVICE, 4, True), "update of round 4 accepted"),
        (
            "ack_rejected",
            Ack(DEVICE, 4, False, "wrong_nonce", "'nc' is not the nonce of round 4"),
            "update of round 4 rejected",
        ),
        (
            "ack_unreadable",
            Ack(DEVICE, None, False, "malformed", "not valid msgpack"),
            "a payload without a readable round",
        ),
    ]


def message_vectors() -> dict[str, Any]:
    signer = Signer.from_seed(SEED)
    out: list[dict[str, Any]] = []
    for name, msg, signed, note in _globals():
        payload = encode_global(msg, signer if signed else None)
        entry: dict[str, Any] = {
            "name": name,
            "type": "global",
            "note": note,
            "topic": TOPICS.global_model,
            "message": global_to(msg),
            "signed": signed,
        }
        if signed:
            body = global_body(msg)
            entry["body_hex"] = body.hex()
            entry["body"] = wire_map(body)
        entry["wire"] = wire_map(payload)
        entry["hex"] = payload.hex()
        if msg.wire_dtype == "q8":
            decoded = decode_global(payload, expected_dim=len(msg.params)).params
            entry["decoded_params"] = [float(x) for x in decoded]
        out.append(entry)
    for name, upd, dim, limits, note in _updates():
        payload = encode_update(upd, dim=dim)
        out.append(
            {
                "name": name,
                "type": "update",
                "note": note,
                "topic": TOPICS.update(DEVICE),
                "limits": limits,
                "message": update_to(upd, dim),
                "wire": wire_map(payload),
                "hex": payload.hex(),
            }
        )
    for name, upd, dt, fields, dim, note in _coded_updates():
        payload = encode_update(upd, coded=(dt, fields))
        decoded = decode_update(payload, UpdateLimits(dim, allowed_kinds=frozenset({"u"})))
        message = {**update_to(decoded, dim), "coded": jsonable(fields)}
        out.append(
            {
                "name": name,
                "type": "compressed_update",
                "note": note + "; delta = what the decoder returns (float32)",
                "topic": TOPICS.update(DEVICE),
                "limits": {"n_params": dim, "allowed_kinds": ["u"], "mechanism": "none"},
                "message": message,
                "wire": wire_map(payload),
                "hex": payload.hex(),
            }
        )
    for name, status, note in _statuses():
        payload = encode_status(status)
        out.append(
            {
                "name": name,
                "type": "status",
                "note": note,
                "topic": TOPICS.status(DEVICE),
                "message": {
                    "device": status.device,
                    "online": status.online,
                    "n_samples": status.n_samples,
                    "info": status.info,
                },
                "wire": wire_map(payload),
                "hex": payload.hex(),
            }
        )
    for name, ack, note in _acks():
        payload = encode_ack(ack)
        out.append(
            {
                "name": name,
                "type": "ack",
                "note": note,
                "topic": TOPICS.ack(DEVICE),
                "message": {
                    "round": ack.round,
                    "ok": ack.ok,
                    "reason": ack.reason,
                    "detail": ack.detail,
                },
                "wire": wire_map(payload),
                "hex": payload.hex(),
            }
        )
    return {
        "format": "edge-fl wire protocol v1 message vectors; see docs/protocol.md, Test vectors",
        "signing_key": {
            "seed": SEED.hex(),
            "public_key": signer.verifier.hex(),
            "context": b"edge-fl/global/v1\x00".hex(),
            "note": "RFC 8032 Ed25519 (deterministic); a public test key: never deploy it",
        },
        "vectors": out,
    }


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _mutate(payload: bytes, **changes: Any) -> bytes:
    obj = msgpack.unpackb(payload, raw=False)
    for key, value in changes.items():
        if value is _DELETE:
            del obj[key]
        else:
            obj[key] = value
    return _pack(obj)


_DELETE = object()


def _realistic_delta(d: int = 64) -> np.ndarray:
    """A delta like local SGD's: small, full mantissas; byte-swapped it becomes huge, not NaN."""
    rng = np.random.default_rng(7)
    for _ in range(1000):
        delta = (rng.standard_normal(d) * 0.01).astype(np.float32)
        if all(
            np.isfinite(np.frombuffer(delta.astype(">" + dt).tobytes(), "<" + dt)).all()
            for dt in ("f4", "f2")
        ):
            return delta
    raise AssertionError("no finite byte-swapped draw")


def rejection_vectors() -> dict[str, Any]:
    msgs = {name: (msg, signed) for name, msg, signed, _ in _globals()}
    ups = {name: (u, dim, lim) for name, u, dim, lim, _ in _updates()}
    signer = Signer.from_seed(SEED)
    dense, _, dense_lim = ups["update_dense_f4"]
    vote, _, vote_lim = ups["update_signds_bitpack"]
    good_dense = encode_update(dense)
    good_vote = encode_update(vote, dim=D_SIGNDS)
    swapped_delta = _realistic_delta()
    cases: list[tuple[str, str, bytes, dict, str, str | None, str]] = []

    def update_case(name, payload, reason, field, note, limits=dense_lim):
        cases.append((name, "update", payload, {"limits": limits}, reason, field, note))

    update_case("malformed_msgpack", b"\xc1", "malformed", None, "0xc1 is never used in msgpack")
    dup = msgpack.Packer(use_bin_type=True).pack_map_pairs(
        [*msgpack.unpackb(good_dense, raw=False).items(), ("n", 41)]
    )
    update_case("malformed_repeated_key", dup, "malformed", None, "the key 'n' appears twice")
    update_case(
        "wrong_version", _mutate(good_dense, v=2), "wrong_version", "v", "v = 2 is not spoken"
    )
    update_case(
        "wrong_kind",
        encode_status(Status(DEVICE, True, 40)),
        "wrong_kind",
        "k",
        "a status published on an update topic",
    )
    update_case(
        "missing_field", _mutate(good_dense, n=_DELETE), "missing_field", "n", "no sample count"
    )
    update_case(
        "unknown_field", _mutate(good_dense, note="hi"), "unknown_field", "note", "extra key"
    )
    update_case(
        "bad_type", _mutate(good_dense, n=40.0), "bad_type", "n", "n must be an int, not 40.0"
    )
    update_case("out_of_range", _mutate(good_dense, n=0), "out_of_range", "n", "n must be >= 1")
    update_case(
        "bad_dtype", _mutate(good_dense, dt="f8"), "bad_dtype", "dt", "only f4 and f2 exist"
    )
    update_case(
        "wrong_shape",
        _mutate(good_dense, x=np.zeros(7, "<f4").tobytes()),
        "wrong_shape",
        "x",
        "7 values for a model of 8",
    )
    nan = np.asarray(DELTA8, "<f4")
    nan[2] = np.nan
    update_case("non_finite", _mutate(good_dense, x=nan.tobytes()), "non_finite", "x", "a NaN")
    big_lim = {"n_params": swapped_delta.size, "allowed_kinds": ["u"], "mechanism": "none"}
    update_case(
        "implausible_byte_swapped",
        _mutate(good_dense, x=swapped_delta.astype(">f4").tobytes()),
        "implausible",
        "x",
        "a realistic delta (N(0, 0.01^2), d = 64) sent big-endian: finite but |x| >> 1e4",
        big_lim,
    )
    update_case(
        "implausible_byte_swapped_f2",
        _mutate(good_dense, dt="f2", x=swapped_delta.astype(">f2").tobytes()),
        "implausible",
        "x",
        "the same delta as big-endian float16",
        big_lim,
    )
    update_case(
        "wrong_mechanism_m",
        _mutate(good_dense, m="gaussian"),
        "wrong_mechanism",
        "m",
        "a 'gaussian' delta sent to a job that runs 'none'",
    )
    update_case(
        "wrong_mechanism_kind",
        good_vote,
        "wrong_mechanism",
        "k",
        "a SignDS vote sent to a dense job",
    )
    update_case(
        "topic_mismatch",
        _mutate(good_dense, dev="d00002"),
        "topic_mismatch",
        "dev",
        "names d00002 but published on up/d00001",
    )
    update_case(
        "wrong_h",
        encode_update(
            SignDSUpdate(DEVICE, 8, 7, 40, 1, np.arange(10, dtype=np.uint32), 0, NONCE), dim=40
        ),
        "wrong_h",
        "h",
        "10 indices where the plan says h = 11",
        vote_lim,
    )
    unsorted_bp = _bitpack_raw([3, 1, 7, 8, 9, 10, 11, 12, 13, 14, 15], 6)
    update_case(
        "bad_indices_unsorted",
        _mutate(good_vote, ix=unsorted_bp),
        "bad_indices",
        "ix",
        "index 1 follows 3 (indices must be strictly ascending)",
        vote_lim,
    )
    update_case(
        "out_of_range_coding",
        _mutate(good_vote, c=2),
        "out_of_range",
        "c",
        "c is 0 (bit-packing) or 1 (delta-varint)",
        vote_lim,
    )
    update_case(
        "out_of_range_sb",
        _mutate(good_vote, sb=4),
        "out_of_range",
        "sb",
        "sb has two bits: 0..3",
        vote_lim,
    )

    # compressed dense updates (docs/protocol.md, "Compressed dense updates")
    coded = {name: (u, dt, f, dim) for name, u, dt, f, dim, _ in _coded_updates()}
    q8_u, _, q8_f, _ = coded["update_q8"]
    good_q8 = encode_update(q8_u, coded=("q8", q8_f))
    update_case(
        "codec_refused",
        encode_update(
            DenseUpdate(DEVICE, 4, 3, 40, np.zeros(0, np.float32), "q8", "gaussian-central", NONCE),
            coded=("q8", q8_f),
        ),
        "bad_dtype",
        "dt",
        "q8 with gaussian-central (its norm bound needs the delta as clipped: f4 or f2 only)",
        {**dense_lim, "mechanism": "gaussian-central"},
    )
    update_case(
        "codec_negative_step",
        _mutate(good_q8, qp=np.array([0.0, -1.0], "<f4").tobytes()),
        "out_of_range",
        "qp",
        "a block's step is negative",
    )
    update_case(
        "codec_field_of_another_dt",
        _mutate(good_q8, h=1),
        "unknown_field",
        "h",
        "q8 has no key h (that is top-k's)",
    )
    update_case(
        "codec_levels_short",
        _mutate(good_q8, x=b"\x00" * 7),
        "wrong_shape",
        "x",
        "q8 levels: exactly d bytes",
    )
    q4_u, _, q4_f, _ = coded["update_q4"]
    update_case(
        "codec_q4_padding",
        _mutate(encode_update(q4_u, coded=("q4", q4_f)), x=b"\x00\x00\x00\x10"),
        "out_of_range",
        "x",
        "d = 7 is odd: the last byte's high nibble is padding and must be 0",
        {**dense_lim, "n_params": 7},
    )
    tk_u, _, tk_f, tk_dim = coded["update_topk_bitmap"]
    update_case(
        "codec_topk_bitmap_count",
        _mutate(encode_update(tk_u, coded=("tk", tk_f)), ix=bytes(b | 0x01 for b in tk_f["ix"])),
        "bad_indices",
        "ix",
        "the bitmap sets more bits than h = 20 (bit 0 of every byte set)",
        {**dense_lim, "n_params": tk_dim},
    )

    # global messages (as a device decodes them: with the aggregator's key and its model size)
    key = signer.verifier.hex()
    signed_msg, _ = msgs["global_signed_signds"]
    signed = encode_global(signed_msg, signer)
    unsigned_sync = encode_global(msgs["global_sync_dense"][0])
    flipped = bytearray(signed)
    flipped[-1] ^= 0x01

    def global_case(name, payload, reason, field, note, dim, verify=True):
        opts = {"expected_dim": dim, "public_key": key if verify else None}
        cases.append((name, "global", payload, opts, reason, field, note))

    global_case(
        "bad_signature", bytes(flipped), "bad_signature", "sig", "last signature bit flipped", 40
    )
    global_case(
        "unsigned", unsigned_sync, "unsigned", None, "a device with a key needs signatures", 8
    )
    body = msgpack.unpackb(global_body(signed_msg), raw=False)
    for name, change, reason, field, note in (
        ("mp_missing_key", {"nth": _DELETE}, "missing_field", "mp.nth", "the plan lacks nu_th"),
        ("mp_wrong_d", {"d": 41}, "out_of_range", "mp.d", "the plan is for d = 41, w has 40"),
        ("mp_bad_type", {"h": 11.0}, "bad_type", "mp.h", "h must be an int"),
    ):
        mp = dict(body["mp"])
        for k, v in change.items():
            if v is _DELETE:
                del mp[k]
            else:
                mp[k] = v
        forged = _pack({**body, "mp": mp})
        global_case(
            f"global_{name}",
            _pack(
                {
                    "v": 1,
                    "k": "gs",
                    "b": forged,
                    "sig": signer.sign(b"edge-fl/global/v1\x00" + forged),
                }
            ),
            reason,
            field,
            note + " (correctly signed)",
            40,
        )
    q8 = msgpack.unpackb(encode_global(msgs["global_sync_q8"][0]), raw=False)
    negative_step = np.frombuffer(q8["qp"], "<f4").copy()
    negative_step[1] = -negative_step[1]
    global_case(
        "q8_negative_step",
        _mutate(encode_global(msgs["global_sync_q8"][0]), qp=negative_step.tobytes()),
        "out_of_range",
        "qp",
        "block 0's step is negative (a q8 global's steps are finite and >= 0)",
        D_Q8,
        verify=False,
    )
    global_case(
        "global_run_short",
        _mutate(unsigned_sync, run=RUN[:15]),
        "out_of_range",
        "run",
        "a run id is exactly 16 bytes",
        8,
        verify=False,
    )
    global_case(
        "global_wrong_shape",
        unsigned_sync,
        "wrong_shape",
        "w",
        "8 parameters for a device whose model has 40",
        40,
        verify=False,
    )
    status = encode_status(Status(DEVICE, True, 40))
    cases.append(
        ("status_bad_type", "status", _mutate(status, on=1), {}, "bad_type", "on", "on is a bool")
    )
    cases.append(
        (
            "oversized",
            "ack",
            encode_ack(Ack(DEVICE, 4, True)) + b"\x00" * 1020,
            {},
            "oversized",
            None,
            "1025 bytes: longer than an ack may be (checked before parsing; an update may have "
            "4 d + 4096 bytes)",
        )
    )
    cases.append(
        (
            "ack_missing_reason",
            "ack",
            _pack({"v": 1, "k": "a", "r": 4, "ok": False}),
            {},
            "missing_field",
            "why",
            "a negative ack must say why",
        )
    )
    # appended after the cases above, which keep their places in the file
    envelope = msgpack.unpackb(signed, raw=False)
    global_case(
        "signed_envelope_unknown_field",
        _pack({**envelope, "x": 1}),
        "unknown_field",
        "x",
        "a signed envelope has exactly the keys v k b sig (checked with or without a key)",
        40,
    )
    global_case(
        "signed_envelope_sig_not_bin",
        _pack({**envelope, "sig": envelope["sig"].hex()}),
        "bad_type",
        "sig",
        "the signature sent as a hex str: bad_type, not bad_signature",
        40,
    )
    global_case(
        "q8_missing_qp",
        _mutate(encode_global(msgs["global_sync_q8"][0]), qp=_DELETE),
        "missing_field",
        "qp",
        "a q8 global message without its block parameters",
        D_Q8,
        verify=False,
    )
    return {
        "format": "edge-fl wire protocol v1 negative vectors; see docs/protocol.md, Test vectors",
        "vectors": [
            {
                "name": name,
                "decoder": decoder,
                "topic_device": DEVICE if decoder in ("update", "status", "ack") else None,
                **jsonable(opts),
                "hex": payload.hex(),
                "reason": reason,
                "field": field,
                "note": note,
            }
            for name, decoder, payload, opts, reason, field, note in cases
        ],
    }


def _bitpack_raw(values: list[int], width: int) -> bytes:
    bits = "".join(format(v, f"0{width}b") for v in values)
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))


def index_vectors() -> dict[str, Any]:
    cases = [
        (1, [0]),
        (2, [0, 1]),
        (40, [0, 3, 7, 12, 13, 21, 25, 30, 33, 38, 39]),
        (1000, [1, 5, 300]),
        (66404, [1, 66403]),
        (66404, [1000, 1001, 1005]),
        (2**20, [0, 127, 128, 16511]),
        (2**32, [0, 2**32 - 1]),
    ]
    out = []
    for d, idx in cases:
        arr = np.asarray(idx, np.uint64)
        code, blob = encode_indices_coded(arr, d)
        out.append(
            {
                "d": d,
                "indices": idx,
                "bits_per_index": max(1, (d - 1).bit_length()),
                "c0_bitpack_hex": encode_bitpack(arr, d).hex(),
                "c1_delta_varint_hex": encode_delta_varint(arr, d).hex(),
                "chosen_c": code,
                "chosen_hex": blob.hex(),
            }
        )
    return {
        "format": "index codings: c = 0 bit-packing (MSB first, zero-padded), c = 1 first index "
        "and gaps as unsigned LEB128; the encoder sends the shorter, c = 0 on a tie",
        "vectors": out,
    }


PLAN_CASES = [
    (40, 0.25, 10.0, 0.6, 0, 100),
    (40, 0.25, 100.0, 0.6, 0, 100),
    (1000, 0.05, 1.0, 0.6, 0, 100),
    (650, 0.01, 100.0, 0.6, 0, 100),
    (650, 0.1, 5.0, 0.6, 8, 100),
    (4810, 0.01, 100.0, 0.6, 0, 100),
    (66404, 0.01, 100.0, 0.6, 0, 100),
    (66404, 0.2, 10.0, 0.6, 0, 100),
    (266084, 0.2, 100.0, 0.6, 0, 100),
]


def signds_vectors() -> dict[str, Any]:
    from edge_fl.privacy.magrr import magrr_bit, rr_keep_probability, topk_abs_mean
    from edge_fl.privacy.signds import SignDSParams, plan, topk_indices

    plans = []
    for d, k, eps, rho, hout, hmax in PLAN_CASES:
        p = plan(SignDSParams(k=k, eps=eps, thr_ratio=rho, dim_out=hout, max_dim_out=hmax), d)
        entry: dict[str, Any] = {
            "d": d,
            "sign_k": k,
            "sign_eps": eps,
            "sign_thr_ratio": rho,
            "sign_dim_out": hout,
            "max_dim_out": hmax,
            "K": p.topk,
            "h": p.h,
            "nu_th": p.nu_th,
            "h_uncapped": p.h_uncapped,
            "capped": p.capped,
            "p_nu_ge_nu_th": round(p.p_topk_threshold, 12),
            "mp": signds_mp(d, k=k, eps=eps, rho=rho, hout=hout, hmax=hmax),
        }
        if p.h <= 16:
            entry["nu_pmf"] = [float(f"{x:.15g}") for x in np.exp(p.log_pmf)]
        plans.append(entry)
    u = [0.03, -0.2, 0.011, 0.5, -0.07, 0.0, 0.25, -0.4, 0.09, -0.001]
    bits = []
    for sign, K, r_est, reached in (
        (1, 3, 0.1, False),
        (1, 3, 0.5, True),
        (-1, 2, 0.1, False),
        (-1, 2, 0.7, True),
        (-1, 4, 1e-05, False),
    ):
        top = sorted(int(i) for i in topk_indices(np.asarray(u), K, sign))
        bits.append(
            {
                "update": u,
                "sign": sign,
                "K": K,
                "r_est": r_est,
                "reached": reached,
                "topk": top,
                "r": round(topk_abs_mean(np.asarray(u), sign, K), 15),
                "bit": magrr_bit(np.asarray(u), sign, K, r_est, reached),
            }
        )
    return {
        "format": "SignDS plans (K, h, nu_th from d and the job's settings; nu_pmf = "
        "P(nu = tau), tau = 0..h), MagRR bits before randomized response, sb packing",
        "plans": plans,
        "magrr_bits": bits,
        "rr_keep_probability": {"rr_eps": 5.0, "p": rr_keep_probability(5.0)},
        "sb": [{"sign": s, "magrr_bit": b, "sb": sign_bits(s, b)} for s in (-1, 1) for b in (0, 1)],
    }


def model_vectors() -> dict[str, Any]:
    from edge_fl.models import make_model

    out = []
    for name, kw, n_features, n_classes in (("logreg", {}, 3, 2), ("mlp", {"hidden": 2}, 3, 2)):
        model = make_model(name, n_features, n_classes, **kw)
        layout = model.layout()  # type: ignore[attr-defined]
        tensors = {}
        start = 0
        for tname, shape in layout:
            size = int(np.prod(shape))
            values = (np.arange(start, start + size) % 7 - 3) / 8.0
            tensors[tname] = values.reshape(shape).tolist()
            start += size
        from edge_fl.models import flatten

        flat = flatten(model, {k: np.asarray(v) for k, v in tensors.items()})
        x = [[1.0, 0.5, -0.25]]
        logits = model.logits(flat, np.asarray(x, np.float32))
        out.append(
            {
                "model": name,
                "options": kw,
                "n_features": n_features,
                "n_classes": n_classes,
                "layout": [[n, list(s)] for n, s in layout],
                "tensors": tensors,
                "flat": [float(v) for v in flat],
                "flat_f4_hex": flat.astype("<f4").tobytes().hex(),
                "x": x,
                "logits": [[round(float(v), 6) for v in row] for row in logits],
            }
        )
    return {
        "format": "flattening order: each tensor in layout order, C order (row-major); "
        "logits = the model's forward pass on x (float32, to 1e-6)",
        "vectors": out,
    }


def preprocessing_vectors() -> dict[str, Any]:
    digits = list(range(17))
    mnist = [0, 1, 2, 127, 128, 254, 255]
    return {
        "format": "input preprocessing: float32 division of the raw value, as little-endian hex",
        "digits": {
            "rule": "x = float32(pixel) / float32(16), pixel in 0..16 (8x8 image, row-major, 64)",
            "pixels": digits,
            "f4_hex": (np.asarray(digits, np.float32) / np.float32(16))
            .astype("<f4")
            .tobytes()
            .hex(),
        },
        "mnist": {
            "rule": "x = float32(byte) / float32(255) (28x28 image, row-major, 784)",
            "bytes": mnist,
            "f4_hex": (np.asarray(mnist, np.float32) / np.float32(255))
            .astype("<f4")
            .tobytes()
            .hex(),
        },
    }


def canonical_json(obj: Any) -> str:
    """The digest's serialisation: Python ``json.dumps(obj, sort_keys=True, default=str)``."""
    return json.dumps(obj, sort_keys=True, default=str)


def digest_of(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode("ascii")).hexdigest()[:12]


def digest_vectors() -> dict[str, Any]:
    sample = {
        "job": "demo",
        "model": {"name": "logreg", "hidden": 64, "wire_dtype": "f4"},
        "training": {"epochs": 5, "batch_size": 8, "lr": 0.3},
        "privacy": {"mechanism": "none", "delta": 1e-05, "epsilon": None, "note": "é"},
    }
    text = canonical_json(sample)
    return {
        "format": "cfg = first 12 hex digits of SHA-256 over the canonical JSON (ASCII)",
        "vectors": [{"input": sample, "canonical_json": text, "digest": digest_of(sample)}],
    }


def build_vectors() -> dict[str, Any]:
    return {
        "messages": message_vectors(),
        "rejections": rejection_vectors(),
        "indices": index_vectors(),
        "signds": signds_vectors(),
        "models": model_vectors(),
        "preprocessing": preprocessing_vectors(),
        "digest": digest_vectors(),
    }


def dump(content: Any) -> str:
    return json.dumps(content, indent=1, ensure_ascii=True) + "\n"


def load(name: str) -> Any:
    return json.loads((VECTORS / f"{name}.json").read_text())


def params(name: str, key: str = "vectors") -> list[Any]:
    """The entries to parametrize a test with; none while a file is missing (the files-current
    test then fails and says how to generate them)."""
    path = VECTORS / f"{name}.json"
    return json.loads(path.read_text())[key] if path.exists() else []


# ---------------------------------------------------------------- the doc's hex blocks

_DOC_BLOCK = re.compile(r"<!-- vector: (\w+)/(\w+) -->\n```text\n(.*?)```", re.S)


def hex_lines(hexstr: str, per_line: int = 32) -> str:
    pairs = [hexstr[i : i + 2] for i in range(0, len(hexstr), 2)]
    lines = [" ".join(pairs[i : i + per_line]) for i in range(0, len(pairs), per_line)]
    return "\n".join(lines) + "\n"


def _vector_hex(files: dict[str, Any], file: str, name: str) -> str:
    for v in files[file]["vectors"]:
        if v["name"] == name:
            return v["hex"]
    raise KeyError(f"{file}/{name}")


def render_doc(text: str, files: dict[str, Any]) -> str:
    def sub(m: re.Match) -> str:
        block = hex_lines(_vector_hex(files, m.group(1), m.group(2)))
        return f"<!-- vector: {m.group(1)}/{m.group(2)} -->\n```text\n{block}```"

    return _DOC_BLOCK.sub(sub, text)


# ---------------------------------------------------------------- tests: files are current


def test_vector_files_are_what_the_encoders_produce():
    built = build_vectors()
    assert set(built) == set(FILES)
    for name, content in built.items():
        on_disk = (VECTORS / f"{name}.json").read_text()
        assert on_disk == dump(content), (
            f"tests/vectors/{name}.json is out of date: the encoder's output changed. If that is "
            "deliberate (a protocol change), run `.venv/bin/python tests/test_protocol_vectors.py "
            "--write` and document it in docs/protocol.md"
        )


def test_vector_files_are_small():
    for name in FILES:
        assert (VECTORS / f"{name}.json").stat().st_size < 64_000, name


def test_doc_hex_examples_are_the_vectors():
    files = {name: load(name) for name in FILES}
    text = DOC.read_text()
    blocks = _DOC_BLOCK.findall(text)
    assert len(blocks) >= 8, "docs/protocol.md lost its hex examples"
    for file, name, block in blocks:
        assert "".join(block.split()) == _vector_hex(files, file, name), f"{file}/{name}"


# ---------------------------------------------------------------- tests: positive vectors


def _by_type(kind: str) -> list[dict[str, Any]]:
    return [v for v in params("messages") if v["type"] == kind]


def test_signing_key_vector():
    key = load("messages")["signing_key"]
    signer = Signer.from_seed(bytes.fromhex(key["seed"]))
    assert signer.verifier.hex() == key["public_key"]
    assert bytes.fromhex(key["context"]) == b"edge-fl/global/v1\x00"


@pytest.mark.parametrize("vector", _by_type("global"), ids=lambda v: v["name"])
def test_global_vectors(vector):
    msg = global_from(vector["message"])
    key = load("messages")["signing_key"]
    signer = Signer.from_seed(bytes.fromhex(key["seed"]))
    payload = bytes.fromhex(vector["hex"])
    assert encode_global(msg, signer if vector["signed"] else None) == payload
    assert wire_map(payload) == vector["wire"]
    verifier = Verifier.from_hex(key["public_key"]) if vector["signed"] else None
    back = decode_global(payload, verifier=verifier, expected_dim=len(msg.params))
    if msg.wire_dtype == "q8":  # lossy: the device gets the levels' values, not the model
        assert [float(x) for x in back.params] == vector["decoded_params"]
        step = np.frombuffer(bytes.fromhex(vector["wire"]["qp"]["bin"]), "<f4")[1::2]
        error = np.abs(back.params.astype(np.float64) - np.asarray(vector["message"]["params"]))
        assert (error <= np.repeat(step, 256)[: error.size] / 2 * (1 + 1e-6)).all()
        back = replace(back, params=msg.params)
    assert global_to(back) == vector["message"]
    if vector["signed"]:
        body = bytes.fromhex(vector["body_hex"])
        assert vector["wire"]["b"] == {"bin": vector["body_hex"]}
        assert wire_map(body) == vector["body"]
        sig = bytes.fromhex(vector["wire"]["sig"]["bin"])
        assert Verifier.from_hex(key["public_key"]).verify(
            bytes.fromhex(key["context"]) + body, sig
        )


@pytest.mark.parametrize(
    "vector", _by_type("update") + _by_type("compressed_update"), ids=lambda v: v["name"]
)
def test_update_vectors(vector):
    m = vector["message"]
    update = update_from(m, DEVICE)
    payload = bytes.fromhex(vector["hex"])
    dim = m.get("dim", vector["limits"]["n_params"])
    coded = (m["wire_dtype"], from_json(m["coded"])) if "coded" in m else None
    assert encode_update(update, dim=dim, coded=coded) == payload
    assert wire_map(payload) == vector["wire"]
    device = TOPICS.device_of(vector["topic"], "up")
    back = decode_update(payload, limits_from(vector["limits"]), topic_device=device)
    expected = {k: v for k, v in m.items() if k != "coded"}
    assert back.device == DEVICE and update_to(back, dim) == expected
    if m["kind"] == "signds":
        assert vector["wire"]["sb"] == sign_bits(m["sign"], m["magrr_bit"])
        assert vector["wire"]["h"] == len(m["indices"])


@pytest.mark.parametrize("vector", _by_type("status"), ids=lambda v: v["name"])
def test_status_vectors(vector):
    m = vector["message"]
    status = Status(m["device"], m["online"], m["n_samples"], m["info"])
    payload = bytes.fromhex(vector["hex"])
    assert encode_status(status) == payload and wire_map(payload) == vector["wire"]
    assert (
        decode_status(payload, topic_device=TOPICS.device_of(vector["topic"], "status")) == status
    )


@pytest.mark.parametrize("vector", _by_type("ack"), ids=lambda v: v["name"])
def test_ack_vectors(vector):
    m = vector["message"]
    ack = Ack(DEVICE, m["round"], m["ok"], m["reason"], m["detail"])
    payload = bytes.fromhex(vector["hex"])
    assert encode_ack(ack) == payload and wire_map(payload) == vector["wire"]
    assert decode_ack(payload, topic_device=TOPICS.device_of(vector["topic"], "ack")) == ack


# ---------------------------------------------------------------- tests: negative vectors


@pytest.mark.parametrize("vector", params("rejections"), ids=lambda v: v["name"])
def test_rejection_vectors(vector):
    payload = bytes.fromhex(vector["hex"])
    with pytest.raises(PayloadRejected) as info:
        if vector["decoder"] == "update":
            decode_update(payload, limits_from(vector["limits"]), vector["topic_device"])
        elif vector["decoder"] == "global":
            key = vector["public_key"]
            decode_global(
                payload,
                verifier=None if key is None else Verifier.from_hex(key),
                expected_dim=vector["expected_dim"],
            )
        elif vector["decoder"] == "status":
            decode_status(payload, vector["topic_device"])
        else:
            decode_ack(payload, vector["topic_device"])
    err = info.value
    assert err.reason == vector["reason"], err
    assert err.field == vector["field"], err
    assert Reject(vector["reason"]) in REJECT_MEANING


def test_every_decoder_reason_has_a_negative_vector():
    covered = {v["reason"] for v in load("rejections")["vectors"]}
    decoder_reasons = set(Reject) - {  # decided by the aggregation state, not by the bytes
        Reject.LATE,
        Reject.FUTURE,
        Reject.NOT_SELECTED,
        Reject.DUPLICATE,
        Reject.STALE,
        Reject.BUDGET_EXHAUSTED,
        Reject.WRONG_NONCE,
        Reject.NORM_EXCEEDED,
    }
    assert {r.value for r in decoder_reasons} <= covered


def test_byte_swapped_realistic_deltas_are_implausible_not_accepted():
    """The issue: a byte-swapped vector was accepted unless a value happened to become NaN."""
    # realistic: the sizes of logreg and the MLP on digits, deltas of local SGD's scales
    rng = np.random.default_rng(11)
    limits = {d: UpdateLimits(n_params=d, allowed_kinds=frozenset({"u"})) for d in (650, 4810)}
    finite_swaps = 0
    for _ in range(150):
        d = int(rng.choice([650, 4810]))
        scale = rng.choice([1e-4, 1e-3, 1e-2, 1e-1])
        delta = (rng.standard_normal(d) * scale).astype(np.float32)
        for dt in ("f4", "f2"):
            good = encode_update(DenseUpdate(DEVICE, 1, 0, 5, delta, dt))
            assert decode_update(good, limits[d]).delta.shape == (d,)  # the real one is fine
            swapped = np.asarray(delta, dtype=">" + dt).tobytes()
            with pytest.raises(PayloadRejected) as info:  # never accepted
                decode_update(_mutate(good, x=swapped), limits[d])
            assert "little-endian" in info.value.detail, info.value
            if np.isfinite(np.frombuffer(swapped, "<" + dt)).all():
                finite_swaps += 1  # what the old decoder accepted: now implausible
                assert info.value.reason is Reject.IMPLAUSIBLE, info.value
            else:
                assert info.value.reason is Reject.NON_FINITE, info.value
    assert finite_swaps > 0
    # the swaps the old decoder accepted (every value still finite): each one is implausible now
    d, found = 650, 0
    while found < 20:
        delta = (rng.standard_normal(d) * 0.01).astype(np.float32)
        for dt in ("f4", "f2"):
            swapped = np.asarray(delta, dtype=">" + dt).tobytes()
            if not np.isfinite(np.frombuffer(swapped, "<" + dt)).all():
                continue
            found += 1
            good = encode_update(DenseUpdate(DEVICE, 1, 0, 5, delta, dt))
            with pytest.raises(PayloadRejected) as info:
                decode_update(_mutate(good, x=swapped), limits[d])
            assert info.value.reason is Reject.IMPLAUSIBLE and info.value.field == "x"


# ---------------------------------------------------------------- tests: indices, SignDS, models


@pytest.mark.parametrize("vector", params("indices"), ids=lambda v: f"d{v['d']}")
def test_index_vectors(vector):
    d, idx = vector["d"], np.asarray(vector["indices"], np.uint64)
    assert encode_bitpack(idx, d).hex() == vector["c0_bitpack_hex"]
    assert encode_delta_varint(idx, d).hex() == vector["c1_delta_varint_hex"]
    code, blob = encode_indices_coded(idx, d)
    assert (code, blob.hex()) == (vector["chosen_c"], vector["chosen_hex"])
    for c, key in ((CODE_BITPACK, "c0_bitpack_hex"), (CODE_DELTA_VARINT, "c1_delta_varint_hex")):
        out = decode_indices(c, bytes.fromhex(vector[key]), d, idx.size, 100)
        assert out.tolist() == vector["indices"]


@pytest.mark.parametrize(
    "vector", params("signds", "plans"), ids=lambda v: f"d{v['d']}-k{v['sign_k']}-e{v['sign_eps']}"
)
def test_signds_plan_vectors(vector):
    from edge_fl.privacy.signds import SignDSParams, nu_pmf, plan, topk_size

    params = SignDSParams(
        k=vector["sign_k"],
        eps=vector["sign_eps"],
        thr_ratio=vector["sign_thr_ratio"],
        dim_out=vector["sign_dim_out"],
        max_dim_out=vector["max_dim_out"],
    )
    p = plan(params, vector["d"])
    assert (p.topk, p.h, p.nu_th, p.capped) == (
        vector["K"],
        vector["h"],
        vector["nu_th"],
        vector["capped"],
    )
    assert topk_size(vector["sign_k"], vector["d"]) == vector["K"]
    assert math.isclose(p.p_topk_threshold, vector["p_nu_ge_nu_th"], rel_tol=1e-9)
    if "nu_pmf" in vector:
        np.testing.assert_allclose(
            nu_pmf(p.topk, p.d, p.h, p.eps, p.nu_th), vector["nu_pmf"], rtol=1e-9, atol=1e-300
        )
    mp = vector["mp"]  # what a global message of a job with this plan carries
    assert (mp["K"], mp["h"], mp["nth"], mp["d"]) == (p.topk, p.h, p.nu_th, p.d)


def test_magrr_and_sb_vectors():
    from edge_fl.privacy.magrr import magrr_bit, rr_keep_probability, topk_abs_mean
    from edge_fl.privacy.signds import topk_indices

    vectors = load("signds")
    for v in vectors["magrr_bits"]:
        u = np.asarray(v["update"])
        assert sorted(topk_indices(u, v["K"], v["sign"]).tolist()) == v["topk"]
        assert math.isclose(topk_abs_mean(u, v["sign"], v["K"]), v["r"], rel_tol=1e-12)
        assert magrr_bit(u, v["sign"], v["K"], v["r_est"], v["reached"]) == v["bit"]
    rr = vectors["rr_keep_probability"]
    assert math.isclose(rr_keep_probability(rr["rr_eps"]), rr["p"], rel_tol=1e-15)
    assert math.isclose(rr["p"], math.exp(5) / (1 + math.exp(5)), rel_tol=1e-15)
    for v in vectors["sb"]:
        assert sign_bits(v["sign"], v["magrr_bit"]) == v["sb"]


@pytest.mark.parametrize("vector", params("models"), ids=lambda v: v["model"])
def test_model_layout_vectors(vector):
    from edge_fl.models import flatten, make_model, unflatten

    model = make_model(
        vector["model"], vector["n_features"], vector["n_classes"], **vector["options"]
    )
    assert [[n, list(s)] for n, s in model.layout()] == vector["layout"]
    flat = flatten(model, {k: np.asarray(v) for k, v in vector["tensors"].items()})
    assert flat.astype("<f4").tobytes().hex() == vector["flat_f4_hex"]
    assert flat.tolist() == vector["flat"]
    for name, t in unflatten(model, flat).items():
        assert t.tolist() == vector["tensors"][name]
    logits = model.logits(flat, np.asarray(vector["x"], np.float32))
    np.testing.assert_allclose(logits, vector["logits"], atol=1e-6)


def test_preprocessing_vectors_match_the_loaders():
    from edge_fl.data.digits import load_digits_split

    v = load("preprocessing")
    digits = np.frombuffer(bytes.fromhex(v["digits"]["f4_hex"]), "<f4")
    np.testing.assert_array_equal(digits, np.asarray(v["digits"]["pixels"], np.float32) / 16)
    X, _, _, _ = load_digits_split()
    assert X.dtype == np.float32 and X.shape[1] == 64
    assert set(np.unique(X).tolist()) <= set(digits.tolist())  # every feature is pixel / 16
    mnist = np.frombuffer(bytes.fromhex(v["mnist"]["f4_hex"]), "<f4")
    raw = np.asarray(v["mnist"]["bytes"], np.uint8)
    expected = raw.reshape(1, -1).astype(np.float32)
    expected /= np.float32(255.0)  # exactly what edge_fl.data.mnist does
    np.testing.assert_array_equal(mnist, expected[0])


def test_digest_vector_and_the_config_uses_that_algorithm():
    from edge_fl.config import JobConfig

    for v in load("digest")["vectors"]:
        assert canonical_json(v["input"]) == v["canonical_json"]
        assert v["canonical_json"].isascii()
        assert hashlib.sha256(v["canonical_json"].encode()).hexdigest()[:12] == v["digest"]
    cfg = JobConfig()
    shared = cfg.model_dump(include={"job", "model", "data", "training", "privacy"})
    assert cfg.digest() == digest_of(shared)


# ---------------------------------------------------------------- tests: the doc is complete


def _doc_section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_doc_lists_every_rejection_reason_with_its_meaning():
    section = _doc_section("## Rejection reasons")
    for reason, meaning in REJECT_MEANING.items():
        assert f"| `{reason.value}` |" in section, reason
        assert meaning in " ".join(section.split()), reason
    assert set(REJECT_MEANING) == set(Reject)


def test_doc_lists_every_key_of_every_message():
    from edge_fl.protocol import codec

    tables = {
        "### Global message": codec._GLOBAL_KEYS - {"v", "k"},
        "### Signed envelope": envelope.SIGNED_KEYS - {"v", "k"},
        "### Dense update": codec._DENSE_KEYS - {"v", "k"},
        "### SignDS vote": codec._SIGNDS_KEYS - {"v", "k"},
        "### Status and last will": codec._STATUS_KEYS - {"v", "k"},
        "### Ack": codec._ACK_KEYS - {"v", "k"},
    }
    text = DOC.read_text()
    for title, keys in tables.items():
        start = text.index(title)
        section = text[start : text.find("\n### ", start + 1)]
        for key in keys | {"v", "k"}:
            assert f"| `{key}` |" in section, f"{title}: {key}"


def test_doc_lists_every_mechanism_parameter():
    section = _doc_section("## Mechanism parameters")
    for spec in COMMON:
        assert f"| `{spec.key}` |" in section, spec.key
    for mechanism, schema in schemas().items():
        assert f"`{mechanism}`" in section, mechanism
        for spec in schema.params:
            assert f"`{spec.key}`" in section, (mechanism, spec.key)


def test_doc_topics_match_the_code():
    section = _doc_section("## Topics")
    for topic in ("global", "up/<device>", "status/<device>", "ack/<device>", "metrics"):
        assert f"`edgefl/<job>/{topic}`" in section, topic
    topics = Topics("j")
    assert (
        topics.ack("d1") == "edgefl/j/ack/d1" and topics.device_of("edgefl/j/ack/d1", "ack") == "d1"
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_protocol_vectors.py --write")
    VECTORS.mkdir(exist_ok=True)
    built = build_vectors()
    for name, content in built.items():
        (VECTORS / f"{name}.json").write_text(dump(content))
    if DOC.exists():
        DOC.write_text(render_doc(DOC.read_text(), built))
    print(f"wrote {len(built)} vector files to {VECTORS} and the hex blocks of {DOC}")


def test_doc_lists_every_codec_and_its_keys():
    from edge_fl.protocol.codecs import codec_for_tag, codec_tags

    text = DOC.read_text()
    start = text.index("### Compressed dense updates")
    section = text[start : text.find("\n### ", start + 1)]
    for dt in codec_tags():
        if dt in ("f4", "f2"):
            continue
        assert f'"{dt}"' in section and f"**`{dt}`**" in section.replace(
            "**`q8`, `q4`**", "**`q8`**, **`q4`**"
        ), dt
        for key in codec_for_tag(dt).keys:
            assert f"| `{key}` |" in section, (dt, key)
