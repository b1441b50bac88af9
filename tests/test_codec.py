"""The wire codec: round trips, and every rejection path with its reason."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edge_fl.mechanisms  # noqa: F401  (registers the built-in mechanisms' mp schemas)
from edge_fl.protocol import (
    DenseUpdate,
    GlobalModel,
    GlobalWindow,
    PayloadRejected,
    Reject,
    SignDSUpdate,
    Status,
    Topics,
    UpdateLimits,
    check_global,
    decode_global,
    decode_status,
    decode_update,
    encode_global,
    encode_status,
    encode_update,
)

D = 50
LIMITS = UpdateLimits(n_params=D)


def dense(**kw) -> DenseUpdate:
    base = dict(
        device="d00001",
        round=3,
        base_version=2,
        n_samples=17,
        delta=np.linspace(-1, 1, D, dtype=np.float32),
    )
    base.update(kw)
    return DenseUpdate(**base)


def raw(update: DenseUpdate) -> dict:
    return msgpack.unpackb(encode_update(update), raw=False)


def rejected(payload: bytes, limits: UpdateLimits = LIMITS, device: str | None = "d00001"):
    with pytest.raises(PayloadRejected) as info:
        decode_update(payload, limits, topic_device=device)
    return info.value


def test_dense_round_trip_is_exact_and_compact():
    update = dense()
    payload = encode_update(update)
    back = decode_update(payload, LIMITS, topic_device="d00001")
    assert isinstance(back, DenseUpdate)
    assert (back.device, back.round, back.base_version, back.n_samples) == ("d00001", 3, 2, 17)
    np.testing.assert_array_equal(back.delta, update.delta)
    # raw float32 bytes plus a small header, never a list of floats
    assert 4 * D < len(payload) < 4 * D + 64


def test_float16_wire_halves_the_vector():
    update = dense(wire_dtype="f2")
    payload = encode_update(update)
    back = decode_update(payload, LIMITS)
    assert len(payload) < 2 * D + 64
    np.testing.assert_allclose(back.delta, update.delta, atol=1e-3)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=D, max_size=D),
    st.integers(0, 2**40),
    st.integers(1, 10_000_000),
)
def test_round_trip_property(values, rnd, n):
    update = dense(delta=np.array(values, dtype=np.float32), round=rnd, n_samples=n)
    back = decode_update(encode_update(update), UpdateLimits(n_params=D, max_abs=None))
    np.testing.assert_array_equal(back.delta, update.delta)
    assert back.round == rnd and back.n_samples == n


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1garbage", Reject.MALFORMED),
        (b"", Reject.MALFORMED),
        (msgpack.packb([1, 2, 3]), Reject.MALFORMED),
        (msgpack.packb({"v": 99, "k": "u"}), Reject.WRONG_VERSION),
        (msgpack.packb({"v": 1, "k": "g"}), Reject.WRONG_KIND),
    ],
)
def test_malformed_payloads(payload, reason):
    assert rejected(payload).reason is reason


def test_truncated_payload_is_malformed():
    payload = encode_update(dense())
    for cut in (1, 10, len(payload) // 2, len(payload) - 1):
        assert rejected(payload[:cut]).reason in (Reject.MALFORMED, Reject.WRONG_SHAPE)


def test_oversized_payload_rejected_before_parsing():
    err = rejected(b"\x00" * (LIMITS.max_bytes + 1))
    assert err.reason is Reject.OVERSIZED
    assert str(LIMITS.max_bytes) in err.detail


def test_wrong_shape_names_the_sizes():
    err = rejected(encode_update(dense(delta=np.zeros(D + 1, np.float32))))
    assert err.reason is Reject.WRONG_SHAPE
    assert f"{D} x 4" in err.detail


@pytest.mark.parametrize("dt", ["f4", "f2"])
@pytest.mark.parametrize("where", [(0,), (7,), (D - 1,), (3, 40)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values(bad, where, dt):
    """Anywhere in the vector, alone or beside others (the decoder finds them through min/max)."""
    delta = np.zeros(D, np.float32)
    delta[list(where)] = bad
    err = rejected(encode_update(dense(delta=delta, wire_dtype=dt)))
    assert err.reason is Reject.NON_FINITE
    assert f"{len(where)} non-finite values (first at index {where[0]}:" in err.detail


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=D, max_size=D))
def test_the_decoders_peak_is_max_abs(values):
    """The exact sum paces its carry by this bound: it must be max |x| of what was decoded."""
    delta = np.array(values, np.float32)
    got = decode_update(encode_update(dense(delta=delta)), LIMITS)
    assert isinstance(got, DenseUpdate)
    assert got.peak == float(np.abs(got.delta).max())
    assert not got.delta.flags.writeable  # a view of the payload: nobody edits an accepted update


OOR, TYPE = Reject.OUT_OF_RANGE, Reject.BAD_TYPE


@pytest.mark.parametrize(
    ("key", "value", "reason", "expected"),
    [
        ("n", 0, OOR, "an int in [1, 10000000]"),
        ("n", -5, OOR, "an int in [1, 10000000]"),
        ("n", True, TYPE, "expected msgpack int, got bool True"),
        ("n", "12", TYPE, "expected msgpack int, got str '12'"),
        ("r", -1, OOR, "an int in [0, 1099511627776]"),
        ("bv", 1.5, TYPE, "expected msgpack int, got float 1.5"),
        ("dev", 7, TYPE, "expected msgpack str, got int 7"),
        ("dt", "f8", Reject.BAD_DTYPE, "'f4' (little-endian float32) or 'f2'"),
        ("m", 3, TYPE, "expected msgpack str, got int 3"),
    ],
)
def test_bad_fields(key, value, reason, expected):
    obj = raw(dense())
    obj[key] = value
    err = rejected(msgpack.packb(obj, use_bin_type=True), device=None)
    assert err.reason is reason
    # actionable: the key, what was expected and what arrived
    assert f"field {key!r}" in err.detail and expected in err.detail, err.detail
    assert err.field == key and err.round == (3 if key != "r" else None)


@pytest.mark.parametrize("key", ["r", "bv", "n", "x", "dt"])
def test_missing_fields(key):
    obj = raw(dense())
    del obj[key]
    err = rejected(msgpack.packb(obj, use_bin_type=True), device=None)
    assert err.reason is Reject.MISSING_FIELD
    assert f"missing required field {key!r}" in err.detail and err.field == key


def test_identity_is_the_topic_and_a_named_device_must_agree():
    # the payload carries no device id: the topic (ACL-enforced) says who published it
    back = decode_update(encode_update(dense(device="d00002")), LIMITS, topic_device="d00001")
    assert back.device == "d00001"
    obj = raw(dense())
    obj["dev"] = "d00002"  # a payload that names someone else is rejected
    err = rejected(msgpack.packb(obj, use_bin_type=True), device="d00001")
    assert err.reason is Reject.TOPIC_MISMATCH


def test_kind_not_allowed_for_job():
    limits = UpdateLimits(n_params=D, allowed_kinds=frozenset({"s"}))
    assert rejected(encode_update(dense()), limits).reason is Reject.WRONG_MECHANISM


def test_global_round_trip():
    msg = GlobalModel(
        job="j1",
        version=4,
        round=5,
        params=np.arange(D, dtype=np.float32),
        selected=("d00001", "d00003"),
        deadline_s=12.5,
        config_digest="abc",
        mechanism_state={"r_est": 1e-5, "reached": 0},
    )
    back = decode_global(encode_global(msg))
    np.testing.assert_array_equal(back.params, msg.params)
    assert back.selected == msg.selected and back.mechanism_state == msg.mechanism_state
    assert back.selects("d00001") and not back.selects("d00002")
    assert GlobalModel("j", 0, 0, np.zeros(1, np.float32)).selects("anyone")


def test_status_round_trip_and_topic_check():
    payload = encode_status(Status("d00001", True, 40, {"stopped": "budget_exhausted"}))
    back = decode_status(payload, topic_device="d00001")
    assert back.online and back.n_samples == 40 and back.info["stopped"] == "budget_exhausted"
    with pytest.raises(PayloadRejected):
        decode_status(payload, topic_device="d00002")


def test_topics():
    t = Topics("job-1")
    assert t.update("d1") == "edgefl/job-1/up/d1"
    assert t.device_of("edgefl/job-1/up/d1", "up") == "d1"
    assert t.device_of("edgefl/job-2/up/d1", "up") is None
    assert t.device_of("edgefl/job-1/up/a/b", "up") is None
    with pytest.raises(ValueError, match="topic segment"):
        Topics("bad/job")
    with pytest.raises(ValueError, match="topic segment"):
        Topics("+")


# ---------------------------------------------------------------- strict types (security issue)


def global_msg(**kw) -> GlobalModel:
    base = dict(
        job="j1",
        version=4,
        round=5,
        params=np.arange(D, dtype=np.float32),
        selected=("d00001", "d00003"),
        deadline_s=12.5,
        config_digest="abc",
        mechanism_state={"r_est": 1e-5, "reached": False, "reached_count": 0},
        sample_rate=0.5,
        nonce=bytes(range(16)),
        issued_at=99.0,
    )
    base.update(kw)
    return GlobalModel(**base)


def global_raw(**kw) -> dict:
    return msgpack.unpackb(encode_global(global_msg(**kw)), raw=False)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def global_rejected(payload: bytes, **kw) -> PayloadRejected:
    with pytest.raises(PayloadRejected) as info:
        decode_global(payload, **kw)
    return info.value


@pytest.mark.parametrize("version", [1.0, True, "1", None, [1], 2, 0, -1])
@pytest.mark.parametrize("which", ["update", "global", "status"])
def test_version_must_be_the_int_1(version, which):
    if which == "update":
        obj = raw(dense())
    elif which == "global":
        obj = global_raw()
    else:
        obj = msgpack.unpackb(encode_status(Status("d00001", True, 3)), raw=False)
    obj["v"] = version
    payload = pack(obj)
    decoder = {
        "update": lambda p: decode_update(p, LIMITS),
        "global": decode_global,
        "status": decode_status,
    }[which]
    with pytest.raises(PayloadRejected) as info:
        decoder(payload)
    assert info.value.reason is Reject.WRONG_VERSION


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("ts", [1, 2], TYPE),  # the crash of the issue: float(list) raised TypeError
        ("ts", "now", TYPE),
        ("ts", float("nan"), OOR),
        ("ts", float("inf"), OOR),
        ("ts", True, TYPE),
        ("ts", None, TYPE),
        ("dl", -1.0, OOR),
        ("dl", float("inf"), OOR),
        ("dl", True, TYPE),
        ("ver", 1.0, TYPE),
        ("ver", True, TYPE),
        ("ver", -1, OOR),
        ("ver", 2**40 + 1, OOR),
        ("rnd", 2**64 - 1, OOR),
        ("rnd", "5", TYPE),
        ("job", "a/b", OOR),
        ("job", "", OOR),
        ("job", 7, TYPE),
        ("mode", "turbo", OOR),
        ("mode", 1, TYPE),
        ("cfg", 1, TYPE),
        ("cfg", "has space", OOR),
        ("sel", "d00001", TYPE),
        ("sel", ["d00001", 3], TYPE),
        ("sel", ["d00001", "+"], OOR),
        ("sel", ["d00001", "a/b"], OOR),
        ("sel", ["d00001", "d00001"], OOR),
        ("sel", None, TYPE),
        ("sd", [1], TYPE),
        ("sd", {"r_est": [1]}, TYPE),
        ("sd", {"r_est": float("nan")}, OOR),
        ("sd", {"r_est": "x"}, TYPE),
        ("sd", {"r_est": None}, TYPE),
        ("sd", {"r_est": {"a": 1}}, TYPE),
        ("sd", {"": 1}, OOR),
        ("sd", {f"k{i}": i for i in range(65)}, OOR),
        ("q", 0, OOR),
        ("q", 0.0, OOR),
        ("q", 1.5, OOR),
        ("q", True, TYPE),
        ("q", float("nan"), OOR),
        ("q", None, TYPE),
        ("done", 1, TYPE),
        ("done", "yes", TYPE),
        ("done", None, TYPE),
        ("nc", b"short", OOR),
        ("nc", "0123456789abcdef", TYPE),
        ("nc", None, TYPE),
        ("w", "text", TYPE),
        ("w", None, TYPE),
        ("dt", "f8", Reject.BAD_DTYPE),
        ("dt", 4, TYPE),
        ("mp", [1], TYPE),
        ("mp", {"lr": 0.1}, Reject.MISSING_FIELD),
        ("extra", 1, Reject.UNKNOWN_FIELD),
    ],
)
def test_global_fields_are_strict(key, value, reason):
    obj = global_raw()
    obj[key] = value
    err = global_rejected(pack(obj))
    assert err.reason is reason, err
    assert key in err.detail and err.field is not None and err.field.startswith(key), err


@pytest.mark.parametrize("key", ["job", "ver", "rnd", "mode", "dt", "w", "dl", "cfg"])
def test_global_missing_fields(key):
    obj = global_raw()
    del obj[key]
    err = global_rejected(pack(obj))
    assert err.reason is Reject.MISSING_FIELD and f"missing required field {key!r}" in err.detail


def test_global_optional_fields_default():
    obj = global_raw()
    for key in ("ts", "sel", "sd", "q", "nc"):
        del obj[key]
    back = decode_global(pack(obj))
    assert back.issued_at == 0.0 and back.selected is None and back.mechanism_state is None
    assert back.sample_rate is None and back.nonce is None and not back.done


def test_global_expected_dim_and_shape():
    payload = encode_global(global_msg())
    assert decode_global(payload, expected_dim=D).params.shape == (D,)
    err = global_rejected(payload, expected_dim=D - 1)
    assert err.reason is Reject.WRONG_SHAPE and str(D - 1) in err.detail
    obj = global_raw()
    obj["w"] = b"\x00" * 7  # not a whole number of float32
    assert global_rejected(pack(obj)).reason is Reject.WRONG_SHAPE
    obj["w"] = b""  # no parameters at all
    assert global_rejected(pack(obj)).reason is Reject.WRONG_SHAPE
    bad = np.arange(D, dtype=np.float32)
    bad[3] = np.nan
    assert global_rejected(encode_global(global_msg(params=bad))).reason is Reject.NON_FINITE


def test_global_round_trip_with_every_field():
    msg = global_msg(done=True, mode="fedbuff", wire_dtype="f2")
    back = decode_global(encode_global(msg))
    assert back.done and back.mode == "fedbuff" and back.sample_rate == 0.5
    assert back.nonce == msg.nonce and back.issued_at == 99.0 and back.wire_dtype == "f2"
    # integral numbers are accepted where a float is meant (msgpack may shorten them)
    obj = global_raw()
    obj["ts"], obj["dl"], obj["q"] = 5, 3, 1
    back = decode_global(pack(obj))
    assert (back.issued_at, back.deadline_s, back.sample_rate) == (5.0, 3.0, 1.0)
    assert isinstance(back.issued_at, float)


def test_duplicate_map_keys_are_rejected():
    # msgpack itself would keep the last value; a second parser could keep the first
    pairs = list(global_raw().items())
    packer = msgpack.Packer(use_bin_type=True)
    err = global_rejected(packer.pack_map_pairs([*pairs, ("rnd", 2**40)]))
    assert err.reason is Reject.MALFORMED and "repeats the key 'rnd'" in err.detail
    nested = dict(pairs)
    nested["sd"] = {"r_est": 1.0}
    body = packer.pack(nested).replace(
        packer.pack({"r_est": 1.0}), packer.pack_map_pairs([("r_est", 1.0), ("r_est", 2.0)])
    )
    assert global_rejected(body).reason is Reject.MALFORMED


def test_wrong_kind_for_global_and_status():
    assert global_rejected(encode_update(dense())).reason is Reject.WRONG_KIND
    with pytest.raises(PayloadRejected) as info:
        decode_status(encode_global(global_msg()))
    assert info.value.reason is Reject.WRONG_KIND


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("dev", "a/b", OOR),
        ("dev", "", OOR),
        ("dev", 1, TYPE),
        ("on", 1, TYPE),
        ("on", None, TYPE),
        ("n", -1, OOR),
        ("n", 1.0, TYPE),
        ("n", True, TYPE),
        ("n", 10**8, OOR),
        ("i", [1], TYPE),
        ("i", {"stopped": 1}, TYPE),
        ("i", {"stopped": ""}, OOR),
        ("i", {"stopped": ["budget"]}, TYPE),
        ("i", {"x": [1]}, TYPE),
        ("i", {"x": "y" * 300}, OOR),
        ("i", {"x": float("inf")}, OOR),
        ("i", {"a b": 1}, OOR),
        ("x", 1, Reject.UNKNOWN_FIELD),
    ],
)
def test_status_fields_are_strict(key, value, reason):
    obj = msgpack.unpackb(encode_status(Status("d00001", True, 3, {"stopped": "b"})), raw=False)
    obj[key] = value
    with pytest.raises(PayloadRejected) as info:
        decode_status(pack(obj))
    assert info.value.reason is reason, info.value
    assert key in info.value.detail


def test_status_optional_fields():
    back = decode_status(pack({"v": 1, "k": "st", "dev": "d1", "on": False}))
    assert back == Status("d1", False, 0, {})
    info = {"stopped": "budget_exhausted", "battery": 0.5, "ok": True, "note": None, "n": 3}
    assert decode_status(encode_status(Status("d1", True, 3, info))).info == info


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("r", 1.0, TYPE),
        ("r", True, TYPE),
        ("bv", True, TYPE),
        ("n", 2.0, TYPE),
        ("n", 10**8, OOR),
        ("r", 2**64 - 1, OOR),
        ("dev", "a/b", OOR),
        ("m", "bad name!", OOR),
        ("m", "", OOR),
        ("x", "text", TYPE),
        ("x", [1, 2], TYPE),
        ("dt", 4, TYPE),
        ("nc", b"x" * 15, OOR),
        ("nc", "n" * 16, TYPE),
        ("sb", 1, Reject.UNKNOWN_FIELD),  # a SignDS field in a dense update
        ("extra", None, Reject.UNKNOWN_FIELD),
    ],
)
def test_update_fields_are_strict(key, value, reason):
    obj = raw(dense())
    obj[key] = value
    err = rejected(pack(obj), device=None)
    assert err.reason is reason, err
    assert key in err.detail, err


def test_update_nonce_round_trip():
    nonce = bytes(range(16))
    for update in (dense(nonce=nonce), dense(nonce=None)):
        back = decode_update(encode_update(update), LIMITS, topic_device="d00001")
        assert back.nonce == update.nonce
    vote = SignDSUpdate("d00001", 3, 2, 17, -1, np.array([1, 5, 9], np.uint32), 1, nonce)
    back = decode_update(encode_update(vote, dim=D), LIMITS, topic_device="d00001")
    assert isinstance(back, SignDSUpdate) and back.nonce == nonce
    assert (back.sign, back.magrr_bit, list(back.indices)) == (-1, 1, [1, 5, 9])
    with pytest.raises(ValueError, match="nonce"):
        encode_update(dense(nonce=b"short"))
    with pytest.raises(ValueError, match="nonce"):
        encode_global(global_msg(nonce=b"short"))


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("sb", 4, OOR),
        ("sb", True, TYPE),
        ("h", 0, OOR),
        ("h", 101, OOR),
        ("c", 7, OOR),
        ("c", 1.0, TYPE),
        ("ix", "x", TYPE),
        ("ix", b"", Reject.BAD_INDICES),
        ("x", b"", Reject.UNKNOWN_FIELD),  # a dense field in a SignDS update
    ],
)
def test_signds_fields_are_strict(key, value, reason):
    vote = SignDSUpdate("d00001", 3, 2, 17, 1, np.array([1, 5, 9], np.uint32), 0)
    obj = msgpack.unpackb(encode_update(vote, dim=D), raw=False)
    obj[key] = value
    err = rejected(pack(obj), device=None)
    assert err.reason is reason, err


@pytest.mark.parametrize("payload", ["a str", None, 12, [b"x"], np.zeros(3)])
def test_non_bytes_payloads_are_malformed(payload):
    for decode in (lambda p: decode_update(p, LIMITS), decode_global, decode_status):
        with pytest.raises(PayloadRejected) as info:
            decode(payload)
        assert info.value.reason is Reject.MALFORMED


def test_memoryview_and_bytearray_payloads():
    payload = encode_global(global_msg())
    assert decode_global(memoryview(payload)).round == 5
    assert decode_global(bytearray(payload)).round == 5


# ---------------------------------------------------------------- the device's window


def test_window_monotonic_and_bounded():
    w = GlobalWindow(max_ahead=3)
    assert w.accept(global_msg(round=5, version=4)) is None  # first message: only caps apply
    assert w.accept(global_msg(round=5, version=4)) is None  # QoS 1 redelivery / republish
    assert w.accept(global_msg(round=6, version=5)) is None
    err = w.accept(global_msg(round=4, version=5))  # a replayed older round
    assert err is not None and err.reason is Reject.STALE and "round 4" in err.detail
    err = w.accept(global_msg(round=6, version=4))  # an older version
    assert err is not None and err.reason is Reject.STALE and "version 4" in err.detail
    # the attack of the issue: one message far ahead must not freeze the device
    err = w.accept(global_msg(round=2**40, version=2**40))
    assert err is not None and err.reason is Reject.FUTURE
    assert (w.last_round, w.last_version) == (6, 5)
    assert w.accept(global_msg(round=7, version=6)) is None  # real rounds still accepted
    assert w.accept(global_msg(round=10, version=9)) is None  # +3 is within the window
    assert w.check(global_msg(round=14, version=9)).reason is Reject.FUTURE


def test_window_done_marker_obeys_the_same_rules():
    w = GlobalWindow(max_ahead=2)
    w.accept(global_msg(round=8, version=8))
    assert w.accept(global_msg(round=3, version=3, done=True)).reason is Reject.STALE
    assert w.accept(global_msg(round=8, version=8, done=True)) is None


def test_window_rejoin_lifts_only_the_step_bound():
    w = GlobalWindow(max_ahead=2, max_round=1000)
    w.accept(global_msg(round=5, version=5))
    w.rejoin()  # reconnected: the retained model may be many rounds ahead
    assert w.accept(global_msg(round=4, version=4)).reason is Reject.STALE  # never backwards
    assert w.accept(global_msg(round=2000, version=6)).reason is Reject.FUTURE  # never past caps
    assert w.accept(global_msg(round=500, version=400)) is None
    assert not w.rejoining
    assert w.accept(global_msg(round=900, version=900)).reason is Reject.FUTURE


def test_window_caps_apply_to_the_first_message():
    w = GlobalWindow(max_round=20, max_version=20)
    assert w.accept(global_msg(round=2**40, version=0)).reason is Reject.FUTURE
    assert w.accept(global_msg(round=0, version=21)).reason is Reject.FUTURE
    assert w.last_round is None
    assert check_global(global_msg(round=3, version=3), None, None) is None
    assert check_global(global_msg(round=999, version=3), 3, 3, max_ahead=None) is None
    with pytest.raises(ValueError):
        GlobalWindow(max_ahead=-1)
    with pytest.raises(ValueError):
        GlobalWindow(max_round=True)


@pytest.mark.parametrize("depth", [10, 999, 1000, 1023, 1024, 5000])
@pytest.mark.parametrize("key", ["k", "v", "ts", "sel", "sd", "i", "unknown"])
def test_deeply_nested_values_are_rejected_not_crashing(depth, key):
    # msgpack accepts nesting up to 1023 levels, deeper than Python's recursion limit: a detail
    # built with repr() of such a value raised RecursionError (the old decoder did, for "k")
    nested = b"\x91" * depth + b"\xc0"
    head = {"v": 1, "k": "g", "dev": "d1", "on": True}
    head.pop(key, None)
    payload = bytes([0x80 | (len(head) + 1)]) + b"".join(pack(k) + pack(v) for k, v in head.items())
    payload += pack(key) + nested
    for decode in (lambda p: decode_update(p, LIMITS), decode_global, decode_status):
        with pytest.raises(PayloadRejected) as info:
            decode(payload)
        assert len(info.value.detail) < 300


def test_huge_values_are_described_briefly():
    obj = global_raw()
    obj["k"] = b"x" * 100_000
    err = global_rejected(pack(obj))
    assert err.reason is Reject.WRONG_KIND and "100000 long" in err.detail
    assert len(err.detail) < 200
    obj = global_raw()
    obj[b"\x00" * 50_000] = 1  # a bin key
    err = global_rejected(pack(obj))
    assert err.reason is Reject.UNKNOWN_FIELD and len(err.detail) < 400


def test_a_trailing_newline_is_not_a_valid_id():
    # re's "$" matches before a final newline: ids were checked with match(), not fullmatch()
    with pytest.raises(PayloadRejected) as info:
        decode_status(encode_status(Status("d1\n", True, 1)))
    assert info.value.reason is OOR
    assert global_rejected(encode_global(global_msg(job="j1\n"))).reason is OOR
    assert global_rejected(encode_global(global_msg(selected=("d1\n",)))).reason is OOR
    assert global_rejected(encode_global(global_msg(config_digest="abc\n"))).reason is OOR
    obj = raw(dense())
    obj["dev"] = "d00001\n"
    assert rejected(pack(obj), device=None).reason is OOR
    with pytest.raises(ValueError, match="topic segment"):
        Topics("job\n")
    assert Topics("j").device_of("edgefl/j/up/d1\n", "up") is None


def test_window_reset_for_a_new_run():
    w = GlobalWindow(max_ahead=2)
    w.accept(global_msg(round=9, version=9))
    assert w.accept(global_msg(round=0, version=0)).reason is Reject.STALE
    w.reset()
    assert w.accept(global_msg(round=0, version=0)) is None
    assert (w.last_round, w.last_version) == (0, 0)


# ---------------------------------------------------------------- actionable rejections (issue)


def test_dense_mechanism_must_be_the_jobs():
    limits = UpdateLimits(n_params=D, mechanism="gaussian")
    err = rejected(encode_update(dense(mechanism="none")), limits)
    assert err.reason is Reject.WRONG_MECHANISM and err.field == "m"
    assert "'none'" in err.detail and "'gaussian'" in err.detail
    assert decode_update(encode_update(dense(mechanism="gaussian")), limits).mechanism == "gaussian"
    obj = raw(dense(mechanism="gaussian"))
    del obj["m"]  # the default is "none"
    assert rejected(pack(obj), limits).reason is Reject.WRONG_MECHANISM
    # a dense update never claims SignDS, a vote never reaches a dense job
    assert rejected(encode_update(dense(mechanism="signds"))).reason is Reject.WRONG_MECHANISM
    vote = SignDSUpdate("d00001", 3, 2, 17, 1, np.array([1, 5, 9], np.uint32), 0)
    assert rejected(encode_update(vote, dim=D), limits).reason is Reject.WRONG_MECHANISM
    ok = UpdateLimits(n_params=D, mechanism="signds")
    assert isinstance(decode_update(encode_update(vote, dim=D), ok), SignDSUpdate)


def test_signds_h_must_be_the_plans():
    limits = UpdateLimits(n_params=D, max_indices=10, mechanism="signds", signds_h=3)
    vote = SignDSUpdate("d00001", 3, 2, 17, 1, np.array([1, 5, 9], np.uint32), 0)
    assert decode_update(encode_update(vote, dim=D), limits).indices.tolist() == [1, 5, 9]
    four = SignDSUpdate("d00001", 3, 2, 17, 1, np.array([1, 5, 9, 11], np.uint32), 0)
    err = rejected(encode_update(four, dim=D), limits)
    assert err.reason is Reject.WRONG_H and "h = 3" in err.detail and err.field == "h"
    many = SignDSUpdate("d00001", 3, 2, 17, 1, np.arange(11, dtype=np.uint32), 0)
    assert rejected(encode_update(many, dim=D), limits).reason is Reject.OUT_OF_RANGE


def test_implausible_bound_is_configurable():
    delta = np.zeros(D, np.float32)
    delta[4] = 2e4
    err = rejected(encode_update(dense(delta=delta)))
    assert err.reason is Reject.IMPLAUSIBLE and "index 4" in err.detail
    assert "little-endian" in err.detail and err.round == 3
    assert rejected(encode_update(dense(delta=delta / 4)), UpdateLimits(D, max_abs=1e3)).reason is (
        Reject.IMPLAUSIBLE
    )
    back = decode_update(encode_update(dense(delta=delta)), UpdateLimits(D, max_abs=None))
    assert back.delta[4] == 2e4


def test_rejections_carry_the_round_once_it_was_read():
    obj = raw(dense())
    obj["n"] = 0
    assert rejected(pack(obj)).round == 3
    obj["r"] = "three"
    assert rejected(pack(obj)).round is None


def test_details_name_key_expectation_and_value():
    obj = raw(dense())
    obj["bv"] = "x" * 500
    err = rejected(pack(obj))
    assert err.reason is Reject.BAD_TYPE
    assert "field 'bv' (base version): expected msgpack int, got str 'xxx" in err.detail
    assert "(500 long)" in err.detail and len(err.detail) < 200
    obj = global_raw()
    obj["sel"] = ["d00001", "ok", 7]
    err = global_rejected(pack(obj))
    assert err.reason is Reject.BAD_TYPE and err.field == "sel[2]" and "got int 7" in err.detail


# ---------------------------------------------------------------- mechanism parameters (mp)


def signds_mp(**kw):
    from edge_fl.protocol import mechanism_params

    base = dict(lr=0.05, ep=1, bs=8, d=D, k=0.25, eps=10.0, rho=0.6, hout=0, hmax=100, K=12)
    base.update(h=11, nth=7, rr=5.0, r0=1e-5)
    base.update(kw)
    return mechanism_params("signds", **base)


def test_mechanism_params_round_trip_in_the_signed_body():
    mp = signds_mp()
    assert next(iter(mp)) == "m" and list(mp)[1:] == sorted(list(mp)[1:])
    back = decode_global(encode_global(global_msg(mechanism_params=mp)))
    assert back.mechanism_params == mp
    assert type(back.mechanism_params["h"]) is int and type(back.mechanism_params["k"]) is float


@pytest.mark.parametrize(
    ("change", "reason", "field"),
    [
        ({"h": None}, Reject.MISSING_FIELD, "mp.h"),
        ({"h": 11.0}, Reject.BAD_TYPE, "mp.h"),
        ({"h": True}, Reject.BAD_TYPE, "mp.h"),
        ({"k": 0.5}, Reject.OUT_OF_RANGE, "mp.k"),
        ({"d": D + 1}, Reject.OUT_OF_RANGE, "mp.d"),
        ({"K": D + 1}, Reject.OUT_OF_RANGE, "mp.K"),
        ({"nth": 12}, Reject.OUT_OF_RANGE, "mp.nth"),
        ({"hout": 5}, Reject.OUT_OF_RANGE, "mp.h"),
        ({"r0": 1.0}, Reject.OUT_OF_RANGE, "mp.r0"),
        ({"extra": 1}, Reject.UNKNOWN_FIELD, "mp.extra"),
        ({"rr": float("nan")}, Reject.OUT_OF_RANGE, "mp.rr"),
        ({"rr": [1]}, Reject.BAD_TYPE, "mp.rr"),
        ({"m": None}, Reject.MISSING_FIELD, "mp.m"),
    ],
)
def test_mechanism_params_are_strict(change, reason, field):
    obj = global_raw(mechanism_params=signds_mp())
    mp = dict(obj["mp"])
    for key, value in change.items():
        if value is None:
            del mp[key]
        else:
            mp[key] = value
    obj["mp"] = mp
    err = global_rejected(pack(obj))
    assert err.reason is reason and err.field == field, err


def test_mechanism_params_builder_and_encoder_refuse_what_devices_would_reject():
    from edge_fl.protocol import check_mechanism_params, mechanism_params

    with pytest.raises(ValueError, match=r"mp\.clip"):
        mechanism_params("gaussian", lr=0.1, ep=1, bs=8, z=1.0)
    with pytest.raises(ValueError, match=r"mp\.decay"):
        mechanism_params("laplace", lr=0.1, ep=1, bs=8, clip=1.0, eps=1.0, L=10, sched="geometric")
    assert mechanism_params("gaussian", lr=0.1, ep=1, bs=8, clip=1, z=np.float64(2), L=None) == {
        "m": "gaussian",
        "bs": 8,
        "clip": 1.0,
        "ep": 1,
        "lr": 0.1,
        "z": 2.0,
    }
    with pytest.raises(ValueError, match="mechanism_params"):
        encode_global(global_msg(mechanism_params=signds_mp(), params=np.zeros(D + 1, np.float32)))
    # a mechanism this version does not define: any flat scalar map with a name
    free = {"m": "future-mech", "alpha": 0.5, "mode": "x", "on": True}
    assert check_mechanism_params(free) == free
    with pytest.raises(PayloadRejected) as info:
        check_mechanism_params({"m": "future-mech", "bad": {"nested": 1}})
    assert info.value.reason is Reject.BAD_TYPE


def test_the_wire_layer_knows_mechanisms_only_by_their_registered_schemas():
    from edge_fl.protocol.params import (
        MechanismSchema,
        mechanism_schema,
        number_param,
        register_schema,
        schemas,
    )

    before = schemas()
    assert mechanism_schema("gaussian").update_kind == "u"
    assert mechanism_schema("signds").update_kind == "s"
    assert mechanism_schema("gaussian-central").codecs == frozenset({"f4", "f2"})
    assert mechanism_schema("gaussian").codecs is None and mechanism_schema("nope") is None
    for bad, message in (
        (MechanismSchema("Not a name"), "is not of"),
        (MechanismSchema("own", update_kind="x"), "is not 'u'"),
        (MechanismSchema("own", params=(number_param("lr", True, "again", 0),)), "repeat"),
    ):
        with pytest.raises(ValueError, match=message):
            register_schema(bad)
    assert schemas() == before  # nothing refused was registered


# ---------------------------------------------------------------- acks and the ack topic


def test_ack_round_trip_and_topic():
    from edge_fl.protocol import Ack, ack_for, decode_ack, encode_ack

    t = Topics("job-1")
    assert t.ack("d1") == "edgefl/job-1/ack/d1" and t.device_of(t.ack("d1"), "ack") == "d1"
    for ack in (
        ack_for("d1", None, round=4),
        ack_for("d1", None, "n capped to 40", round=4),
        ack_for("d1", Reject.WRONG_NONCE, "nc differs", round=4),
        ack_for("d1", "internal_error"),
    ):
        assert decode_ack(encode_ack(ack), topic_device="d1") == ack
    long = encode_ack(Ack("d1", 1, False, "malformed", "x" * 1000))
    assert len(decode_ack(long).detail) == 256 and len(long) < 1024
    with pytest.raises(ValueError):
        encode_ack(Ack("d1", 1, False))
    with pytest.raises(ValueError):
        encode_ack(Ack("d1", 1, True, "late"))


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ({"v": 1, "k": "a", "r": 1, "ok": True, "why": "late"}, Reject.OUT_OF_RANGE),
        ({"v": 1, "k": "a", "r": 1, "ok": False}, Reject.MISSING_FIELD),
        ({"v": 1, "k": "a", "r": 1, "ok": 0, "why": "late"}, Reject.BAD_TYPE),
        ({"v": 1, "k": "a", "r": -1, "ok": True}, Reject.OUT_OF_RANGE),
        ({"v": 1, "k": "a", "ok": False, "why": "a b"}, Reject.OUT_OF_RANGE),
        ({"v": 1, "k": "a", "ok": True, "d": "x" * 257}, Reject.OUT_OF_RANGE),
        ({"v": 1, "k": "a", "ok": True, "x": 1}, Reject.UNKNOWN_FIELD),
        ({"v": 1, "k": "st", "ok": True}, Reject.WRONG_KIND),
        ({"v": 2, "k": "a", "ok": True}, Reject.WRONG_VERSION),
    ],
)
def test_ack_is_strict(obj, reason):
    from edge_fl.protocol import decode_ack

    with pytest.raises(PayloadRejected) as info:
        decode_ack(pack(obj))
    assert info.value.reason is reason


def test_index_codings_travel_as_integers():
    from edge_fl.protocol.indices import CODES, CODINGS, decode_indices, encode_indices_coded

    assert CODINGS == {0: "bp", 1: "dv"} and CODES == {"bp": 0, "dv": 1}
    vote = SignDSUpdate("d00001", 3, 2, 17, 1, np.array([1, 5, 9], np.uint32), 0)
    c = msgpack.unpackb(encode_update(vote, dim=D), raw=False)["c"]
    code, blob = encode_indices_coded([1, 5, 9], D)
    assert type(c) is int and c == code
    assert decode_indices(code, blob, D, 3, 10).tolist() == [1, 5, 9]
    assert decode_indices(CODINGS[code], blob, D, 3, 10).tolist() == [1, 5, 9]
