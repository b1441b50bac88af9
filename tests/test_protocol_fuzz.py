"""Fuzzing every decoder: any input either decodes or raises PayloadRejected, nothing else.

Three kinds of input per decoder: arbitrary bytes; a valid message's bytes with a few bytes
flipped, inserted or cut; and a valid message's map with one field set to any msgpack value
(or removed, or a new field added, or an entry of a nested map/list replaced). Global messages
are also fuzzed inside a signed envelope (re-signed after the mutation, so the body parser runs
behind a verifier) and with envelope fields mutated. A decoded message must satisfy the
invariants its consumers rely on.
"""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edge_fl.mechanisms  # noqa: F401  (registers the built-in mechanisms' mp schemas)
from edge_fl.protocol import (
    GLOBAL_CONTEXT,
    Ack,
    DenseUpdate,
    GlobalModel,
    PayloadRejected,
    Reject,
    SignDSUpdate,
    Status,
    UpdateLimits,
    decode_ack,
    decode_global,
    decode_status,
    decode_update,
    encode_ack,
    encode_global,
    encode_status,
    encode_update,
    mechanism_params,
)
from edge_fl.protocol.signing import Signer

D = 24
LIMITS = UpdateLimits(n_params=D, max_indices=8)
# the job's mechanism and SignDS plan checked too (wrong_mechanism, wrong_h)
STRICT = UpdateLimits(n_params=D, max_indices=8, mechanism="signds", signds_h=3)
SIGNER = Signer.generate()
VERIFIER = SIGNER.verifier
# CI runs 300 examples per test (< 20 s in all); EDGE_FL_FUZZ_EXAMPLES=20000 for a deep run
FUZZ = settings(
    max_examples=int(os.environ.get("EDGE_FL_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------- strategies

ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # what a decoded job or device id must be
NAME_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-"
names = st.text(NAME_CHARS, min_size=1, max_size=12)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.sampled_from([0, 1, -1, 2**40, 2**40 + 1, 2**63 - 1, 2**64 - 1, -(2**63)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(width=32)
    | st.sampled_from([0.0, 1.0, -0.0, math.nan, math.inf, -math.inf, 1e308, 5e-324])
    | st.text(max_size=24)
    | st.sampled_from(["", "g", "gs", "u", "s", "st", "f4", "f2", "sync", "d1", "d1\n", "a/b", "+"])
    | st.binary(max_size=48)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**33), st.integers(0, 999_999_999))
)
keys = st.text(max_size=6) | st.binary(max_size=4) | st.integers(-5, 5) | names
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(keys, inner, max_size=6),
    max_leaves=12,
)
nonces = st.none() | st.binary(min_size=16, max_size=16)
# vectors from a seed: drawing D floats one by one is what would make the fuzzers slow
vectors = st.integers(0, 2**32 - 1).map(
    lambda seed: np.random.default_rng(seed).standard_normal(D).astype(np.float32)
)


@st.composite
def dense_updates(draw: st.DrawFn) -> DenseUpdate:
    dt = draw(st.sampled_from(["f4", "f2"]))
    return DenseUpdate(
        device="d1",
        round=draw(st.integers(0, 2**40)),
        base_version=draw(st.integers(0, 2**40)),
        n_samples=draw(st.integers(1, 10_000_000)),
        delta=draw(vectors),
        wire_dtype=dt,
        mechanism=draw(st.sampled_from(["none", "gaussian", "nbafl", "dpsgd"])),
        nonce=draw(nonces),
    )


@st.composite
def signds_updates(draw: st.DrawFn) -> SignDSUpdate:
    idx = sorted(draw(st.sets(st.integers(0, D - 1), min_size=1, max_size=LIMITS.max_indices)))
    return SignDSUpdate(
        device="d1",
        round=draw(st.integers(0, 2**40)),
        base_version=draw(st.integers(0, 2**40)),
        n_samples=draw(st.integers(1, 10_000_000)),
        sign=draw(st.sampled_from([-1, 1])),
        indices=np.array(idx, np.uint32),
        magrr_bit=draw(st.integers(0, 1)),
        nonce=draw(nonces),
    )


@st.composite
def global_models(draw: st.DrawFn) -> GlobalModel:
    state = draw(
        st.none()
        | st.fixed_dictionaries(
            {
                "r_est": st.floats(1e-9, 1.0),
                "reached": st.booleans(),
                "reached_count": st.integers(0, 99),
            }
        )
    )
    mp = draw(
        st.none()
        | st.just(mechanism_params("none", lr=0.1, ep=1, bs=8))
        | st.just(mechanism_params("gaussian", lr=0.1, ep=1, bs=8, clip=1.0, z=1.2, L=9))
        | st.just(
            mechanism_params(
                "signds",
                lr=0.1,
                ep=1,
                bs=8,
                d=D,
                k=0.25,
                eps=10.0,
                rho=0.6,
                hout=0,
                hmax=100,
                K=6,
                h=7,
                nth=5,
                rr=5.0,
                r0=1e-5,
            )
        )
    )
    return GlobalModel(
        job=draw(names),
        version=draw(st.integers(0, 2**40)),
        round=draw(st.integers(0, 2**40)),
        params=draw(vectors),
        mode=draw(st.sampled_from(["sync", "fedbuff", "fedasync"])),
        selected=draw(st.none() | st.lists(names, max_size=5, unique=True).map(tuple)),
        deadline_s=draw(st.floats(0, 1e6)),
        config_digest=draw(st.sampled_from(["", "0123456789ab"])),
        wire_dtype=draw(st.sampled_from(["f4", "f2"])),
        mechanism_state=state,
        sample_rate=draw(st.none() | st.floats(1e-6, 1.0)),
        done=draw(st.booleans()),
        issued_at=draw(st.floats(-1e12, 1e12)),
        nonce=draw(nonces),
        mechanism_params=mp,
    )


statuses = st.builds(
    Status,
    device=names,
    online=st.booleans(),
    n_samples=st.integers(0, 10_000_000),
    info=st.dictionaries(
        names.filter(lambda k: k != "stopped"),
        st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(-1e9, 1e9),
        max_size=4,
    )
    | st.just({"stopped": "budget_exhausted"}),
)

acks = st.builds(
    Ack,
    device=st.just("d1"),
    round=st.none() | st.integers(0, 2**40),
    ok=st.booleans(),
    detail=st.none() | st.text(max_size=300),
).map(lambda a: a if a.ok else Ack(a.device, a.round, False, "late", a.detail))

FIELD_NAMES = sorted(
    {"v", "k", "dev", "r", "bv", "n", "nc", "dt", "m", "x", "sb", "h", "c", "ix"}
    | {"job", "ver", "rnd", "mode", "w", "dl", "cfg", "ts", "sel", "sd", "q", "done", "mp"}
    | {"on", "i", "b", "sig", "ok", "why", "d"}
)


@st.composite
def mutated(draw: st.DrawFn, obj: dict[Any, Any]) -> dict[Any, Any]:
    """``obj`` with one change: a field set to any value, removed or added, or a nested entry."""
    obj = dict(obj)
    op = draw(st.sampled_from(["set", "set", "delete", "add", "nested"]))
    present = sorted(obj, key=repr)
    if op == "set" or (op == "delete" and not present):
        key = draw(st.sampled_from(present) | st.sampled_from(FIELD_NAMES))
        obj[key] = draw(msgpack_values)
    elif op == "delete":
        del obj[draw(st.sampled_from(present))]
    elif op == "add":
        obj[draw(keys | st.sampled_from(FIELD_NAMES))] = draw(msgpack_values)
    else:
        nested = [k for k in present if isinstance(obj[k], dict | list) and obj[k]]
        if not nested:
            obj[draw(st.sampled_from(FIELD_NAMES))] = draw(msgpack_values)
        else:
            key = draw(st.sampled_from(nested))
            inner = obj[key]
            if isinstance(inner, list):
                inner = list(inner)
                inner[draw(st.integers(0, len(inner) - 1))] = draw(msgpack_values)
            else:
                inner = dict(inner)
                sub = draw(st.sampled_from(sorted(inner, key=repr)) | keys)
                inner[sub] = draw(msgpack_values)
            obj[key] = inner
    return obj


@st.composite
def byte_mutations(draw: st.DrawFn, payload: bytes) -> bytes:
    data = bytearray(payload)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(
                st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC4, 0xCF, 0xD9, 0xFF])
            )
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and data:
            del data[pos]
        else:
            del data[pos:]
    return bytes(data)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def raw(payload: bytes) -> dict[Any, Any]:
    return msgpack.unpackb(payload, raw=False)


# ---------------------------------------------------------------- the property and invariants


def check_update(payload: Any, limits: UpdateLimits = LIMITS) -> None:
    try:
        update = decode_update(payload, limits, topic_device="d1")
    except PayloadRejected as exc:
        assert isinstance(exc.reason, Reject) and exc.detail
        assert exc.round is None or type(exc.round) is int
        return
    assert update.device == "d1"
    for value in (update.round, update.base_version, update.n_samples):
        assert type(value) is int and 0 <= value <= 2**40
    assert update.nonce is None or (type(update.nonce) is bytes and len(update.nonce) == 16)
    if isinstance(update, DenseUpdate):
        assert update.delta.dtype == np.float32 and update.delta.shape == (D,)
        assert np.isfinite(update.delta).all() and np.abs(update.delta).max() <= 1e4
        assert limits.mechanism is None or update.mechanism == limits.mechanism
        if limits.mechanism == "gaussian-central":  # only codecs that keep the clipped norm
            assert update.wire_dtype in ("f4", "f2")
    else:
        assert update.sign in (-1, 1) and update.magrr_bit in (0, 1)
        idx = update.indices
        assert 1 <= idx.size <= limits.max_indices and (idx < D).all()
        assert limits.signds_h is None or idx.size == limits.signds_h
        assert (np.diff(idx.astype(np.int64)) > 0).all()


def check_global(payload: Any, **kw: Any) -> GlobalModel | None:
    try:
        msg = decode_global(payload, **kw)
    except PayloadRejected as exc:
        assert isinstance(exc.reason, Reject) and exc.detail
        return None
    assert ID.fullmatch(msg.job) and type(msg.version) is int and type(msg.round) is int
    assert msg.params.dtype == np.float32 and msg.params.size >= 1
    assert np.isfinite(msg.params).all()
    if kw.get("expected_dim") is not None:
        assert msg.params.size == kw["expected_dim"]
    assert type(msg.done) is bool and type(msg.issued_at) is float
    assert math.isfinite(msg.issued_at) and math.isfinite(msg.deadline_s)
    assert msg.sample_rate is None or 0 < msg.sample_rate <= 1
    assert msg.selected is None or all(ID.fullmatch(s) for s in msg.selected)
    if msg.mechanism_state is not None:
        for key, value in msg.mechanism_state.items():
            assert type(key) is str and type(value) in (bool, int, float)
    if msg.mechanism_params is not None:
        assert ID.fullmatch(msg.mechanism_params["m"])
        for key, value in msg.mechanism_params.items():
            assert ID.fullmatch(key) and type(value) in (bool, int, float, str)
        if msg.mechanism_params["m"] == "signds":
            assert msg.mechanism_params["d"] == msg.params.size
    msg.selects("d1")
    return msg


def check_ack(payload: Any) -> None:
    try:
        ack = decode_ack(payload, topic_device="d1")
    except PayloadRejected as exc:
        assert isinstance(exc.reason, Reject) and exc.detail
        return
    assert type(ack.ok) is bool and (ack.reason is None) == ack.ok
    assert ack.round is None or 0 <= ack.round <= 2**40
    assert ack.detail is None or len(ack.detail) <= 256


def check_status(payload: Any) -> None:
    try:
        status = decode_status(payload)
    except PayloadRejected as exc:
        assert isinstance(exc.reason, Reject) and exc.detail
        return
    assert ID.fullmatch(status.device)
    assert type(status.online) is bool and type(status.n_samples) is int
    stopped = status.info.get("stopped")
    assert stopped is None or (type(stopped) is str and stopped)


# ---------------------------------------------------------------- arbitrary input


@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes(payload):
    check_update(payload)
    check_update(payload, STRICT)
    check_global(payload)
    check_global(payload, verifier=VERIFIER, expected_dim=D)
    check_status(payload)
    check_ack(payload)


@FUZZ
@given(msgpack_values)
def test_arbitrary_msgpack_values(value):
    payload = pack(value)
    check_update(payload)
    check_update(payload, STRICT)
    check_global(payload)
    check_status(payload)
    check_ack(payload)


@FUZZ
@given(
    st.sampled_from(["update", "global", "status", "ack"]),
    st.sampled_from([*FIELD_NAMES, "zz"]),
    st.integers(990, 1030) | st.integers(0, 1100),  # around the 1000 / 1023 limits
    st.sampled_from([b"\x91", b"\x81\xa1a"]),
    st.binary(max_size=2),
)
def test_deeply_nested_field(which, key, depth, opener, leaf):
    # msgpack.packb refuses > 511 levels, but the unpacker accepts 1023, deeper than Python's
    # recursion limit: found a RecursionError from repr() in a rejection detail
    valid = {
        "update": encode_update(DenseUpdate("d1", 1, 1, 5, np.zeros(D, np.float32)), dim=D),
        "global": encode_global(GlobalModel("j", 1, 1, np.zeros(D, np.float32))),
        "status": encode_status(Status("d1", True, 5)),
        "ack": encode_ack(Ack("d1", 1, True)),
    }[which]
    obj = raw(valid)
    obj.pop(key, None)
    head = msgpack.Packer(use_bin_type=True).pack_map_header(len(obj) + 1)
    body = b"".join(pack(k) + pack(v) for k, v in obj.items())
    payload = head + body + pack(key) + opener * depth + (leaf or b"\xc0")
    # Hypothesis raises the recursion limit while a test runs; production has Python's default
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        check_update(payload)
        check_global(payload)
        check_status(payload)
        check_ack(payload)
    finally:
        sys.setrecursionlimit(limit)


# ---------------------------------------------------------------- updates


@FUZZ
@given(dense_updates() | signds_updates(), st.data())
def test_update_one_field_mutated(update, data):
    payload = encode_update(update, dim=D)
    back = decode_update(payload, LIMITS, topic_device="d1")  # the valid message decodes
    assert back.round == update.round and back.nonce == update.nonce
    mutated_payload = pack(data.draw(mutated(raw(payload))))
    check_update(mutated_payload)
    check_update(mutated_payload, STRICT)


@FUZZ
@given(dense_updates() | signds_updates(), st.data())
def test_update_bytes_mutated(update, data):
    mutated_payload = data.draw(byte_mutations(encode_update(update, dim=D)))
    check_update(mutated_payload)
    check_update(mutated_payload, STRICT)


@st.composite
def coded_updates(draw: st.DrawFn) -> bytes:
    """A dense update through an uplink codec (docs/protocol.md, compressed dense updates)."""
    from edge_fl.protocol.codecs import build_codec

    name = draw(st.sampled_from(["f16", "q8", "q4", "topk", "rot1"]))
    options = {"fraction": draw(st.sampled_from([0.05, 0.3, 0.5]))} if name == "topk" else {}
    codec = build_codec(name, **options)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    fields, _ = codec.encode(draw(vectors), rng)
    update = draw(dense_updates())
    return encode_update(update, coded=(codec.dt, fields))


CENTRAL = UpdateLimits(n_params=D, mechanism="gaussian-central")


@FUZZ
@given(coded_updates(), st.data())
def test_coded_update_one_field_mutated(payload, data):
    back = decode_update(payload, LIMITS, topic_device="d1")  # the valid message decodes
    assert back.delta.shape == (D,)
    mutated_payload = pack(data.draw(mutated(raw(payload))))
    for limits in (LIMITS, STRICT, CENTRAL):
        check_update(mutated_payload, limits)


@FUZZ
@given(coded_updates(), st.data())
def test_coded_update_bytes_mutated(payload, data):
    mutated_payload = data.draw(byte_mutations(payload))
    check_update(mutated_payload)
    check_update(mutated_payload, CENTRAL)


# ---------------------------------------------------------------- global messages


@FUZZ
@given(global_models(), st.data())
def test_global_one_field_mutated(msg, data):
    payload = encode_global(msg)
    back = decode_global(payload, expected_dim=D)
    assert (back.round, back.version, back.nonce, back.done) == (
        msg.round,
        msg.version,
        msg.nonce,
        msg.done,
    )
    body = pack(data.draw(mutated(raw(payload))))
    check_global(body)
    check_global(body, expected_dim=D)
    # the same mutated body, correctly signed: the body parser runs behind the verifier
    signed = pack({"v": 1, "k": "gs", "b": body, "sig": SIGNER.sign(GLOBAL_CONTEXT + body)})
    check_global(signed, verifier=VERIFIER, expected_dim=D)


@FUZZ
@given(global_models(), st.data())
def test_global_bytes_mutated(msg, data):
    payload = encode_global(msg, signer=data.draw(st.sampled_from([None, SIGNER])))
    mutated_payload = data.draw(byte_mutations(payload))
    check_global(mutated_payload)
    got = check_global(mutated_payload, verifier=VERIFIER, expected_dim=D)
    if got is not None:  # only the signed content can pass the verifier
        original = decode_global(payload)
        assert (got.round, got.version, got.nonce) == (msg.round, msg.version, msg.nonce)
        np.testing.assert_array_equal(got.params, original.params)


@FUZZ
@given(global_models(), st.data())
def test_signed_envelope_mutated(msg, data):
    payload = encode_global(msg, signer=SIGNER)
    envelope = data.draw(mutated(raw(payload)))
    changed = envelope != raw(payload)
    check_global(pack(envelope))
    got = check_global(pack(envelope), verifier=VERIFIER)
    if got is not None and changed:
        # a change that still verifies can only be a no-op on the signed bytes
        assert envelope.get("b") == raw(payload)["b"]


# ---------------------------------------------------------------- status


@FUZZ
@given(statuses, st.data())
def test_status_one_field_mutated(status, data):
    payload = encode_status(status)
    assert decode_status(payload, topic_device=status.device) == status
    check_status(pack(data.draw(mutated(raw(payload)))))


@FUZZ
@given(statuses, st.data())
def test_status_bytes_mutated(status, data):
    check_status(data.draw(byte_mutations(encode_status(status))))


# ---------------------------------------------------------------- acks


@FUZZ
@given(acks, st.data())
def test_ack_one_field_mutated(ack, data):
    payload = encode_ack(ack)
    back = decode_ack(payload, topic_device="d1")
    assert (back.round, back.ok, back.reason) == (ack.round, ack.ok, ack.reason)
    check_ack(pack(data.draw(mutated(raw(payload)))))
    check_ack(data.draw(byte_mutations(payload)))
