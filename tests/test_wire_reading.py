"""The one strict msgpack reading (``fields.unpack_map``) and the one signed envelope
(``protocol.envelope``) that the global, update/status/ack, dispatch, job document and secagg
decoders share: each decoder keeps its own wording, and a fix in one place reaches all of them."""

from __future__ import annotations

import msgpack
import pytest

from edge_fl.protocol import PayloadRejected, Reject, decode_global, decode_status
from edge_fl.protocol.dispatch import decode_dispatch
from edge_fl.protocol.envelope import open_signed, seal
from edge_fl.protocol.fields import unpack_map
from edge_fl.protocol.jobdoc import JobDocument, encode_job_document
from edge_fl.protocol.signing import Signer
from edge_fl.secagg.messages import decode as decode_secagg

MIB = 1 << 20
INPUTS = {
    "int": 5,
    "invalid": b"\xc1",
    "array": msgpack.packb([1]),
    "repeat": b"\x82\xa1v\x01\xa1v\x01",
    "big": b"\x00" * (MIB + 1),
    "longstr": msgpack.packb({"v": 1, "x": "a" * 5000}),
}
DECODERS = {
    "status": decode_status,
    "global": lambda p: decode_global(p, MIB),
    "dispatch": decode_dispatch,
    "secagg": lambda p: decode_secagg(p, MIB),
}
# (decoder, input) -> (reason, detail): the wording each decoder had before they shared a reader
EXPECTED = {
    ("status", "int"): ("malformed", "payload is int, not bytes"),
    ("status", "invalid"): ("malformed", "not valid msgpack ()"),
    ("status", "array"): ("malformed", "top level is msgpack array, not a map"),
    ("status", "repeat"): ("malformed", "a map repeats the key 'v'"),
    ("status", "big"): ("oversized", "payload of 1048577 bytes exceeds the limit of 65536"),
    ("status", "longstr"): ("malformed", "not valid msgpack (5000 exceeds max_str_len(4096))"),
    ("global", "int"): ("malformed", "payload is int, not bytes"),
    ("global", "invalid"): ("malformed", "not valid msgpack ()"),
    ("global", "array"): ("malformed", "top level is msgpack array, not a map"),
    ("global", "repeat"): ("malformed", "a map repeats the key 'v'"),
    ("global", "big"): ("oversized", "payload of 1048577 bytes exceeds the limit of 1048576"),
    ("global", "longstr"): ("malformed", "not valid msgpack (5000 exceeds max_str_len(4096))"),
    ("dispatch", "int"): ("malformed", "dispatch message is int, not bytes"),
    ("dispatch", "invalid"): ("malformed", "dispatch message is not valid msgpack ()"),
    ("dispatch", "array"): ("malformed", "dispatch message: top level is not a msgpack map"),
    ("dispatch", "repeat"): ("malformed", "a map repeats the key 'v'"),
    ("dispatch", "big"): ("oversized", "dispatch message of 1048577 bytes exceeds 1048576"),
    ("dispatch", "longstr"): (
        "malformed",
        "dispatch message is not valid msgpack (5000 exceeds max_str_len(4096))",
    ),
    ("secagg", "int"): ("malformed", "payload is int, not bytes"),
    ("secagg", "invalid"): ("malformed", "not valid msgpack ()"),
    ("secagg", "array"): ("malformed", "top level is msgpack array, not a map"),
    ("secagg", "repeat"): ("malformed", "a map repeats the key 'v'"),
    ("secagg", "big"): ("oversized", "payload of 1048577 bytes exceeds 1048576"),
    ("secagg", "longstr"): ("wrong_kind", "'k' is None, not a secagg kind"),  # no str limit
}


@pytest.mark.parametrize(("decoder", "name"), sorted(EXPECTED))
def test_each_decoder_keeps_its_wording(decoder, name):
    with pytest.raises(PayloadRejected) as err:
        DECODERS[decoder](INPUTS[name])
    assert (err.value.reason.value, err.value.detail) == EXPECTED[(decoder, name)]


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_every_decoder_reads_a_memoryview_and_refuses_a_released_one(decoder):
    with pytest.raises(PayloadRejected) as err:
        DECODERS[decoder](memoryview(b"\x80"))  # an empty map: read, then no version
    assert err.value.reason is Reject.WRONG_VERSION
    view = memoryview(b"\x80")
    view.release()
    with pytest.raises(PayloadRejected) as err:  # the dispatch decoder raised ValueError here
        DECODERS[decoder](view)
    assert err.value.reason is Reject.MALFORMED and "unreadable memoryview" in err.value.detail


def test_unpack_map_returns_the_map_and_leaves_the_version_to_the_decoder():
    assert unpack_map(bytearray(msgpack.packb({"v": 9, "x": b"\x01"})), 64) == {
        "v": 9,
        "x": b"\x01",
    }
    with pytest.raises(PayloadRejected) as err:
        unpack_map(b"\x81\xa1m\x82\xa1k\x01\xa1k\x02", 64, "nested")  # in a nested map too
    assert err.value.detail == "a map repeats the key 'k'"


class _Raising:
    def verify(self, data, signature):
        raise RuntimeError("a verifier that raises")


def test_seal_and_open_signed_round_trip_and_refuse_what_does_not_verify():
    signer, context = Signer.from_seed(bytes(32)), b"edge-fl/test/v1\x00"
    body = msgpack.packb({"v": 1, "k": "t", "x": 1})
    envelope = msgpack.unpackb(seal(body, "ts", context, signer))
    assert envelope["k"] == "ts" and envelope["b"] == body

    def opened(obj, verifier, kind="t"):
        return open_signed(
            obj, context, verifier, what="a test", unpack=msgpack.unpackb, kind=kind, label="a t"
        )

    assert opened(envelope, signer.verifier) == {"v": 1, "k": "t", "x": 1}
    for verifier in (Signer.from_seed(bytes([1]) * 32).verifier, _Raising()):
        with pytest.raises(PayloadRejected) as err:
            opened(envelope, verifier)
        assert err.value.reason is Reject.BAD_SIGNATURE
        assert err.value.detail.endswith("over 'edge-fl/test/v1\\x00' + b")
    with pytest.raises(PayloadRejected) as err:
        opened(envelope, None, kind="u")
    assert err.value.reason is Reject.WRONG_KIND and err.value.field == "b"
    with pytest.raises(PayloadRejected) as err:
        opened({**envelope, "extra": 1}, None)
    assert err.value.reason is Reject.UNKNOWN_FIELD and "in a test" in err.value.detail


class _ShortSigner:
    def sign(self, data):
        return b"\x00" * 63


def test_the_job_document_refuses_to_seal_with_a_broken_signer():
    doc = JobDocument("demo", "d", {"job": "demo"})
    with pytest.raises(ValueError, match="not 64 bytes"):  # it published a bad envelope before
        encode_job_document(doc, _ShortSigner())  # type: ignore[arg-type]
