"""The dispatch message (docs/protocol.md, "Dispatch message"): its vectors in
``tests/vectors/dispatch.json``, the doc's hex examples, strict decoding, signatures that cannot
stand for a global message's (nor the reverse), and a fuzz of the decoder.

``python tests/test_dispatch_vectors.py --write`` regenerates the file and the doc's hex blocks
(``<!-- dispatch-vector: NAME -->``) after a deliberate change."""

from __future__ import annotations

import contextlib
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_fl.protocol import GlobalModel, PayloadRejected, Reject, Topics, encode_global
from edge_fl.protocol.dispatch import (
    DISPATCH_CONTEXT,
    MAX_DISPATCH_BYTES,
    decode_dispatch,
    dispatch_body,
    encode_dispatch,
)
from edge_fl.protocol.messages import GLOBAL_CONTEXT, Dispatch
from edge_fl.protocol.signing import Signer

ROOT = Path(__file__).resolve().parents[1]
FILE = ROOT / "tests" / "vectors" / "dispatch.json"
DOC = ROOT / "docs" / "protocol.md"
SEED = bytes(range(32))  # the vectors' public test key (tests/vectors/messages.json)
NONCE = bytes.fromhex("00112233445566778899aabbccddeeff")
_DOC_BLOCK = re.compile(r"<!-- dispatch-vector: (\w+) -->\n```text\n(.*?)```", re.S)


def signer() -> Signer:
    return Signer.from_seed(SEED)


def wire(obj: Any) -> Any:
    """A decoded msgpack map as JSON: bin as {"bin": hex}."""
    if isinstance(obj, bytes):
        return {"bin": obj.hex()}
    if isinstance(obj, dict):
        return {k: wire(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [wire(v) for v in obj]
    return obj


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def body(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "v": 1,
        "k": "d",
        "job": "demo",
        "ver": 7,
        "nc": NONCE,
        "sel": ["d00005", "d00011"],
    }
    for key, value in changes.items():
        if value is None:
            base.pop(key)
        else:
            base[key] = value
    return base


def signed(raw_body: bytes, context: bytes = DISPATCH_CONTEXT) -> bytes:
    return pack({"v": 1, "k": "ds", "b": raw_body, "sig": signer().sign(context + raw_body)})


def build() -> dict[str, Any]:
    d = Dispatch("demo", 7, NONCE, ("d00005", "d00011"))
    unsigned, sealed = encode_dispatch(d), encode_dispatch(d, signer())
    message = {
        "job": d.job,
        "version": d.version,
        "nonce": NONCE.hex(),
        "selected": list(d.selected),
    }
    glob = GlobalModel("demo", 7, 7, np.zeros(2, np.float32), mode="fedbuff", nonce=NONCE)
    envelope = msgpack.unpackb(sealed, raw=False)
    UNKNOWN, BAD = Reject.UNKNOWN_FIELD, Reject.BAD_TYPE
    rejections = [
        ("dispatch_unknown_field", pack(body(cfg="")), None, Reject.UNKNOWN_FIELD, "cfg"),
        ("dispatch_missing_nonce", pack(body(nc=None)), None, Reject.MISSING_FIELD, "nc"),
        ("dispatch_short_nonce", pack(body(nc=NONCE[:15])), None, Reject.OUT_OF_RANGE, "nc"),
        ("dispatch_empty_selection", pack(body(sel=[])), None, Reject.OUT_OF_RANGE, "sel"),
        ("dispatch_named_twice", pack(body(sel=["d1", "d1"])), None, Reject.OUT_OF_RANGE, "sel"),
        ("dispatch_version_as_float", pack(body(ver=7.0)), None, Reject.BAD_TYPE, "ver"),
        ("dispatch_unsigned", unsigned, "key", Reject.UNSIGNED, None),
        (
            "dispatch_signed_with_the_global_context",
            signed(dispatch_body(d), GLOBAL_CONTEXT),
            "key",
            Reject.BAD_SIGNATURE,
            "sig",
        ),
        ("dispatch_global_message", encode_global(glob, signer()), "key", Reject.WRONG_KIND, "k"),
        # appended: the cases above keep their places in the file
        ("dispatch_envelope_unknown_field", pack({**envelope, "x": 1}), "key", UNKNOWN, "x"),
        (
            "dispatch_sig_not_bin",
            pack({**envelope, "sig": envelope["sig"].hex()}),
            None,
            BAD,
            "sig",
        ),
    ]
    return {
        "signing_key": {
            "seed": SEED.hex(),
            "public_key": signer().verifier.hex(),
            "context": DISPATCH_CONTEXT.hex(),
        },
        "vectors": [
            {
                "name": "dispatch_unsigned",
                "signed": False,
                "message": message,
                "wire": wire(msgpack.unpackb(unsigned)),
                "hex": unsigned.hex(),
            },
            {
                "name": "dispatch_signed",
                "signed": True,
                "message": message,
                "wire": wire(msgpack.unpackb(dispatch_body(d))),
                "body_hex": dispatch_body(d).hex(),
                "hex": sealed.hex(),
            },
        ],
        "rejections": [
            {
                "name": name,
                "hex": raw.hex(),
                "public_key": signer().verifier.hex() if key else None,
                "reason": reason.value,
                "field": field,
            }
            for name, raw, key, reason, field in rejections
        ],
    }


def dump(content: dict[str, Any]) -> str:
    return json.dumps(content, indent=1, sort_keys=False) + "\n"


def hex_lines(hexstr: str, per_line: int = 32) -> str:
    pairs = [hexstr[i : i + 2] for i in range(0, len(hexstr), 2)]
    return (
        "\n".join(" ".join(pairs[i : i + per_line]) for i in range(0, len(pairs), per_line)) + "\n"
    )


def render_doc(text: str, content: dict[str, Any]) -> str:
    by_name = {v["name"]: v["hex"] for v in content["vectors"]}

    def sub(m: re.Match) -> str:
        return (
            f"<!-- dispatch-vector: {m.group(1)} -->\n```text\n{hex_lines(by_name[m.group(1)])}```"
        )

    return _DOC_BLOCK.sub(sub, text)


# ------------------------------------------------------------------------------------- tests


def test_the_vector_file_is_what_the_encoder_produces():
    assert FILE.read_text() == dump(build()), (
        "tests/vectors/dispatch.json is out of date; if the change is deliberate run "
        "`python tests/test_dispatch_vectors.py --write` and document it in docs/protocol.md"
    )


def test_the_doc_shows_the_vectors():
    content = json.loads(FILE.read_text())
    blocks = _DOC_BLOCK.findall(DOC.read_text())
    assert {name for name, _ in blocks} == {"dispatch_unsigned", "dispatch_signed"}
    by_name = {v["name"]: v["hex"] for v in content["vectors"]}
    for name, block in blocks:
        assert "".join(block.split()) == by_name[name], name


def test_the_doc_lists_every_key_and_the_topic():
    text = DOC.read_text()
    start = text.index("### Dispatch message")
    section = text[start : text.find("\n### ", start + 1)]
    for key in ("v", "k", "job", "ver", "nc", "sel"):
        assert f"| `{key}` |" in section, key
    assert '`k = "ds"`' in section and "`v k b sig`" in section  # the signed envelope
    assert DISPATCH_CONTEXT.hex() in section
    topics = text[text.index("## Topics") : text.index("## Encoding rules")]
    assert "`edgefl/<job>/dispatch`" in topics
    assert Topics("j").dispatch == "edgefl/j/dispatch"


def test_positive_vectors_decode_to_their_message():
    content = json.loads(FILE.read_text())
    verifier = Signer.from_seed(bytes.fromhex(content["signing_key"]["seed"])).verifier
    assert verifier.hex() == content["signing_key"]["public_key"]
    for v in content["vectors"]:
        m = v["message"]
        expected = Dispatch(m["job"], m["version"], bytes.fromhex(m["nonce"]), tuple(m["selected"]))
        raw = bytes.fromhex(v["hex"])
        assert decode_dispatch(raw) == expected
        if v["signed"]:
            assert decode_dispatch(raw, verifier=verifier) == expected
            assert bytes.fromhex(v["body_hex"]) in raw


def _rejections() -> list[dict[str, Any]]:
    """The negative vectors (none while the file is missing: the files-current test says why)."""
    return json.loads(FILE.read_text())["rejections"] if FILE.exists() else []


@pytest.mark.parametrize("r", _rejections(), ids=lambda r: r["name"])
def test_rejection_vectors(r):
    verifier = Signer.from_seed(SEED).verifier if r["public_key"] else None
    with pytest.raises(PayloadRejected) as err:
        decode_dispatch(bytes.fromhex(r["hex"]), verifier=verifier)
    assert err.value.reason.value == r["reason"]
    assert err.value.field == r["field"]


def test_signatures_of_a_dispatch_and_a_global_message_never_stand_for_each_other():
    """Distinct contexts: the body of a dispatch signed for ``global`` does not verify here, and
    a dispatch envelope is no global message (the global decoder refuses its kind)."""
    from edge_fl.protocol import decode_global

    d = Dispatch("demo", 3, NONCE, ("a",))
    key = signer().verifier
    with pytest.raises(PayloadRejected) as err:
        decode_global(encode_dispatch(d, signer()), verifier=key)
    assert err.value.reason is Reject.WRONG_KIND
    forged = signed(dispatch_body(d), GLOBAL_CONTEXT)
    with pytest.raises(PayloadRejected) as err:
        decode_dispatch(forged, verifier=key)
    assert err.value.reason is Reject.BAD_SIGNATURE
    other = Signer.generate()
    with pytest.raises(PayloadRejected) as err:
        decode_dispatch(encode_dispatch(d, other), verifier=key)
    assert err.value.reason is Reject.BAD_SIGNATURE
    # without a key a signed dispatch decodes (a device without the key reads the body)
    assert decode_dispatch(encode_dispatch(d, other)) == d


def test_a_dispatch_is_made_from_its_versions_global_message_and_binds_only_it():
    msg = GlobalModel("demo", 4, 4, np.zeros(3, np.float32), mode="fedbuff", selected=("x", "y"))
    with pytest.raises(ValueError):
        Dispatch.of(msg)  # no nonce: nothing to bind to
    msg = GlobalModel(
        "demo", 4, 4, np.zeros(3, np.float32), mode="fedbuff", selected=("x", "y"), nonce=NONCE
    )
    d = Dispatch.of(msg)
    assert d == Dispatch("demo", 4, NONCE, ("x", "y")) and d.binds(msg)
    assert d.selects("x") and not d.selects("z")
    other_run = GlobalModel("demo", 4, 4, msg.params, mode="fedbuff", nonce=bytes(16))
    assert not d.binds(other_run)
    assert not d.binds(GlobalModel("demo", 5, 5, msg.params, mode="fedbuff", nonce=NONCE))
    with pytest.raises(ValueError):
        Dispatch.of(GlobalModel("demo", 4, 4, msg.params, selected=(), nonce=NONCE))


def test_encoder_refuses_what_devices_would_refuse():
    for bad in (
        Dispatch("demo", 1, NONCE[:8], ("a",)),
        Dispatch("demo", 1, NONCE, ()),
        Dispatch("demo", 1, NONCE, ("a", "a")),
        Dispatch("demo", 1, NONCE, ("a/b",)),
    ):
        with pytest.raises(ValueError):
            encode_dispatch(bad)


def test_the_decoder_only_ever_raises_payload_rejected():
    rng = random.Random(19)
    good = encode_dispatch(Dispatch("demo", 9, NONCE, ("a", "b")), signer())
    samples: list[Any] = [b"", b"\xc1", pack({"v": 1}), pack({"v": True, "k": "d"}), None, 3]
    samples.append(b"\x00" * (MAX_DISPATCH_BYTES + 1))
    samples.append(pack({"v": 1, "k": "ds", "b": b"\x80", "sig": bytes(64)}))
    for _ in range(3000):
        raw = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        samples.append(bytes(raw[: rng.randint(0, len(raw))]))
    for raw in samples:
        for verifier in (None, signer().verifier):
            with contextlib.suppress(PayloadRejected):  # anything else escaping fails the test
                decode_dispatch(raw, verifier=verifier)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_dispatch_vectors.py --write")
    content = build()
    FILE.write_text(dump(content))
    DOC.write_text(render_doc(DOC.read_text(), content))
    print(f"wrote {FILE} and the dispatch hex blocks of {DOC}")


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=70),
    st.binary(max_size=20),
    st.lists(
        st.one_of(st.text(max_size=8), st.integers(-(2**63), 2**63), st.binary(max_size=3)),
        max_size=5,
    ),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(["v", "k", "job", "ver", "nc", "sel", "b", "sig", "x"]), _VALUES
    ),
    st.booleans(),
)
def test_any_map_decodes_to_a_valid_dispatch_or_a_rejection(obj, keyed):
    """Structured fuzz: every map of the schema's keys (and one more) with any values either
    decodes to a dispatch a device can use or is refused with a reason."""
    try:
        d = decode_dispatch(pack(obj), verifier=signer().verifier if keyed else None)
    except PayloadRejected:
        return
    assert not keyed  # nothing unsigned passes where a key is configured
    assert d.selected and len(set(d.selected)) == len(d.selected) and len(d.nonce) == 16
    assert 0 <= d.version <= 2**40
