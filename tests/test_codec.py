"""The wire codec: round trips, and every rejection path with its reason."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_fl.protocol import (
    DenseUpdate,
    GlobalModel,
    PayloadRejected,
    Reject,
    Status,
    Topics,
    UpdateLimits,
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
    back = decode_update(encode_update(update), LIMITS)
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


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values(bad):
    delta = np.zeros(D, np.float32)
    delta[7] = bad
    err = rejected(encode_update(dense(delta=delta)))
    assert err.reason is Reject.NON_FINITE


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("n", 0),
        ("n", -5),
        ("n", True),
        ("n", "12"),
        ("r", -1),
        ("bv", 1.5),
        ("dev", 7),
        ("dt", "f8"),
        ("m", 3),
    ],
)
def test_bad_fields(key, value):
    obj = raw(dense())
    obj[key] = value
    err = rejected(msgpack.packb(obj, use_bin_type=True), device=None)
    assert err.reason is Reject.BAD_FIELD
    assert repr(key) in err.detail or key in err.detail


@pytest.mark.parametrize("key", ["r", "bv", "n", "x", "dt"])
def test_missing_fields(key):
    obj = raw(dense())
    del obj[key]
    err = rejected(msgpack.packb(obj, use_bin_type=True), device=None)
    assert err.reason is Reject.BAD_FIELD
    assert "missing" in err.detail


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
