"""Every registered codec: exact payload size, strict decoding of hostile fields, registry."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from codec_testing import rejects
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_fl.mechanisms import accepted_tags, check_combination
from edge_fl.protocol import PayloadRejected
from edge_fl.protocol.codecs import (
    Codec,
    UnknownCodecError,
    build_codec,
    codec_class,
    codec_for_tag,
    codec_names,
    codec_tags,
    downlink_names,
    downlink_tag,
    register_codec,
)
from edge_fl.protocol.codecs.base import packed_size

ALL = codec_names()


def test_registry_lists_every_codec_with_its_wire_tag() -> None:
    assert ALL == ("f32", "f16", "q8", "q4", "topk", "rot1")
    assert codec_tags() == {
        "f4": "f32",
        "f2": "f16",
        "q8": "q8",
        "q4": "q4",
        "tk": "topk",
        "r1": "rot1",
    }
    assert codec_for_tag("tk").name == "topk"
    with pytest.raises(UnknownCodecError, match="one of: f32"):
        build_codec("q2")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dim", [1, 2, 7, 255, 256, 257, 1000, 4097, 70_000])
def test_payload_bytes_is_the_exact_encoded_size(name: str, dim: int) -> None:
    codec = build_codec(name)
    rng = np.random.default_rng(dim)
    fields, _ = codec.encode(rng.standard_normal(dim), rng)
    assert set(fields) == codec.keys
    assert packed_size({"dt": codec.dt, **fields}) == codec.payload_bytes(dim)
    out = codec.decode(fields, dim)
    assert out.dtype == np.float32 and out.shape == (dim,)


@pytest.mark.parametrize("name", ALL)
def test_a_zero_or_constant_delta_round_trips(name: str) -> None:
    codec = build_codec(name)
    rng = np.random.default_rng(1)
    for x in (np.zeros(300), np.full(300, 0.25)):
        out = codec.decode(codec.encode(x, rng)[0], 300)
        if name in ("topk", "rot1") and x.any():
            continue  # sparsified / 1-bit: checked by their own bounds
        np.testing.assert_allclose(out, x, atol=1e-7)


@pytest.mark.parametrize("name", ALL)
def test_encoders_refuse_non_finite_input(name: str) -> None:
    with pytest.raises(ValueError, match="finite"):
        build_codec(name).encode(np.array([0.0, np.nan]), np.random.default_rng(0))


@pytest.mark.parametrize("name", ALL)
def test_missing_wrong_type_and_wrong_length_fields_are_rejected(name: str) -> None:
    codec = build_codec(name)
    dim = 300
    rng = np.random.default_rng(2)
    fields, _ = codec.encode(rng.standard_normal(dim), rng)
    for key in fields:
        without = {k: v for k, v in fields.items() if k != key}
        exc = rejects(lambda f=without: codec.decode(f, dim))
        assert exc.reason == "missing_field" and exc.field == key
        wrong = {**fields, key: [1]}
        exc = rejects(lambda f=wrong: codec.decode(f, dim))
        assert exc.reason == "bad_type" and exc.field == key
        if isinstance(fields[key], bytes):
            longer = {**fields, key: fields[key] + b"\0"}
            exc = rejects(lambda f=longer: codec.decode(f, dim))
            assert exc.reason in ("wrong_shape", "bad_indices") and exc.field == key
    # the same fields for another dimension: a shape error, never a crash or a wrong answer
    exc = rejects(lambda f=fields: codec.decode(f, dim * 4))
    assert exc.reason in ("wrong_shape", "bad_indices", "out_of_range")


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_decoders_only_ever_return_or_reject(name: str, data: st.DataObject) -> None:
    """Fuzz: any field values (mutated real ones or arbitrary msgpack) decode or raise
    PayloadRejected, and a decoded vector has the model's shape."""
    codec = build_codec(name)
    dim = data.draw(st.integers(1, 600))
    rng = np.random.default_rng(dim)
    fields, _ = codec.encode(rng.standard_normal(dim), rng)
    for key in sorted(fields):
        if data.draw(st.booleans()):
            value = fields[key]
            if isinstance(value, bytes) and value and data.draw(st.booleans()):
                blob = bytearray(value)
                i = data.draw(st.integers(0, len(blob) - 1))
                blob[i] = data.draw(st.integers(0, 255))
                fields[key] = bytes(blob)
            else:
                fields[key] = data.draw(
                    st.one_of(
                        st.integers(-(2**63), 2**64 - 1),
                        st.floats(allow_nan=True),
                        st.binary(max_size=64),
                        st.text(max_size=8),
                        st.none(),
                        st.booleans(),
                    )
                )
    # what survives a msgpack round trip is what a decoder sees
    fields = msgpack.unpackb(msgpack.packb(fields, use_bin_type=True), raw=False)
    try:
        out = codec.decode(fields, dim)
    except PayloadRejected:
        return
    assert out.shape == (dim,) and out.dtype == np.float32 and np.isfinite(out).all()


def test_mechanisms_decide_which_codecs_are_sound() -> None:
    assert check_combination("none", "q4") is None
    assert check_combination("laplace", "topk") is None  # post-processing of a local release
    assert "own wire format" in (check_combination("signds", "q8") or "")
    assert "norm" in (check_combination("gaussian-central", "q8") or "")
    assert check_combination("gaussian-central", "f16") is None
    assert check_combination("no-such-mechanism", "q8") is None  # the job build names it
    assert accepted_tags("gaussian-central") == frozenset({"f4", "f2"})
    assert accepted_tags("none") == frozenset(codec_tags())


def test_codecs_declare_downlink_use_and_norm_preservation() -> None:
    assert downlink_names() == ("f32", "f16", "q8")
    assert [downlink_tag(n) for n in downlink_names()] == ["f4", "f2", "q8"]
    with pytest.raises(UnknownCodecError, match="does not carry the global model"):
        downlink_tag("topk")
    assert [n for n in ALL if codec_class(n).preserves_norm] == ["f32", "f16"]
    assert codec_class("topk").options == {"fraction": 0.01, "error_feedback": True}
    assert build_codec("topk").describe()["fraction"] == 0.01


def test_register_codec_refuses_clashes_and_malformed_codecs() -> None:
    before = codec_tags()
    assert register_codec(codec_class("q8")) is codec_class("q8")  # the same class: a no-op

    def codec(name: str, dt: str, keys: frozenset[str]) -> type[Codec]:
        return type("Own", (Codec,), {"name": name, "dt": dt, "keys": keys})

    cases = [
        (codec("q8", "zz", frozenset({"x"})), "codec name 'q8' is already registered"),
        (codec("own", "f4", frozenset({"x"})), "wire tag 'f4' is already registered"),
        (codec("own", "zz", frozenset({"x", "m"})), r"keys \['m'\] are an update's own fields"),
        (codec("own", "far-too-long", frozenset({"x"})), "is not a name of 1-8 chars"),
        (codec("Own code", "zz", frozenset({"x"})), "is not a short lower-case name"),
        (codec("own", "zz", frozenset()), "non-empty frozenset"),
    ]
    for cls, message in cases:
        with pytest.raises(ValueError, match=message):
            register_codec(cls)
    with pytest.raises(ValueError, match="is not a Codec subclass"):
        register_codec(dict)
    assert codec_tags() == before  # nothing refused was registered
