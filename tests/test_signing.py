"""Ed25519 keys and signed global messages: devices trust only the aggregator."""

from __future__ import annotations

import os
import stat

import msgpack
import numpy as np
import pytest

from edge_fl.protocol import (
    GLOBAL_CONTEXT,
    GlobalModel,
    PayloadRejected,
    Reject,
    decode_global,
    encode_global,
    global_body,
    new_nonce,
)
from edge_fl.protocol.signing import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Signer,
    SigningKeyError,
    Verifier,
    generate_key_files,
    load_signer,
    load_verifier,
)

D = 20
posix_only = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")


@pytest.fixture(scope="module")
def signer() -> Signer:
    return Signer.generate()


@pytest.fixture(scope="module")
def verifier(signer: Signer) -> Verifier:
    return signer.verifier


def model(**kw) -> GlobalModel:
    base = dict(
        job="job-1",
        version=3,
        round=4,
        params=np.linspace(-1, 1, D, dtype=np.float32),
        selected=("d1", "d2"),
        config_digest="0123456789ab",
        mechanism_state={"r_est": 1e-3, "reached": False, "reached_count": 0},
        nonce=b"\x07" * 16,
        issued_at=1234.5,
    )
    base.update(kw)
    return GlobalModel(**base)


def rejected(payload: bytes, **kw) -> PayloadRejected:
    with pytest.raises(PayloadRejected) as info:
        decode_global(payload, **kw)
    return info.value


# ---------------------------------------------------------------- keys and raw signatures


def test_sign_verify_round_trip(signer, verifier):
    sig = signer.sign(b"hello")
    assert len(sig) == SIGNATURE_BYTES
    assert verifier.verify(b"hello", sig)
    assert not verifier.verify(b"hellO", sig)
    assert not verifier.verify(b"hello", sig[:-1])  # wrong length: False, never an exception
    assert not verifier.verify(b"hello", b"")
    assert not verifier.verify(b"hello", "not bytes")  # type: ignore[arg-type]
    assert not Signer.generate().verifier.verify(b"hello", sig)


def test_public_key_forms(verifier):
    assert len(verifier.raw()) == PUBLIC_KEY_BYTES
    assert len(verifier.hex()) == 64
    assert Verifier.from_hex(verifier.hex()) == verifier
    assert Verifier.from_hex(verifier.hex().upper() + "\n") == verifier
    assert Verifier.from_pem(verifier.pem()) == verifier
    assert Verifier.parse(verifier.pem().decode()) == verifier
    assert load_verifier(verifier.hex()) == verifier
    assert len(verifier.fingerprint) == 16 and verifier.fingerprint in repr(verifier)
    for bad in ("", "00" * 31, "zz" * 32, "00" * 33):
        with pytest.raises(SigningKeyError):
            Verifier.from_hex(bad)
    with pytest.raises(SigningKeyError):
        Verifier.from_pem(b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")


def test_signer_repr_never_shows_the_key(signer):
    assert "PRIVATE" not in repr(signer) and signer.verifier.fingerprint in repr(signer)


@posix_only
def test_key_files_permissions_and_round_trip(tmp_path):
    private, public, signer = generate_key_files(tmp_path / "keys")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert b"PRIVATE KEY" in private.read_bytes()
    assert public.read_text().strip() == signer.verifier.hex()
    loaded = load_signer(private)
    assert loaded.verifier == signer.verifier
    assert load_verifier(public) == signer.verifier
    assert signer.verifier.verify(b"x", loaded.sign(b"x"))
    # never silently replaced
    with pytest.raises(FileExistsError):
        generate_key_files(tmp_path / "keys")
    assert load_signer(private).verifier == signer.verifier
    # PEM public key file
    pem_path = signer.verifier.save(tmp_path / "pub.pem", pem=True)
    assert load_verifier(pem_path) == signer.verifier


@posix_only
def test_private_key_mode_0600_despite_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        path = Signer.generate().save(tmp_path / "k.pem")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@posix_only
def test_readable_private_key_is_refused(tmp_path):
    path = Signer.generate().save(tmp_path / "k.pem")
    path.chmod(0o644)
    with pytest.raises(SigningKeyError, match="chmod 600"):
        load_signer(path)
    assert Signer.load(path, check_permissions=False) is not None


def test_bad_key_files(tmp_path):
    with pytest.raises(SigningKeyError, match="cannot read"):
        load_signer(tmp_path / "missing.pem")
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"not a key")
    junk.chmod(0o600)
    with pytest.raises(SigningKeyError):
        load_signer(junk)
    with pytest.raises(SigningKeyError):
        load_verifier(junk)
    # a public key where a private key is expected, and the reverse
    pub = Signer.generate().verifier.save(tmp_path / "pub.pem", pem=True)
    pub.chmod(0o600)
    with pytest.raises(SigningKeyError):
        load_signer(pub)
    priv = Signer.generate().save(tmp_path / "priv.pem")
    with pytest.raises(SigningKeyError):
        load_verifier(priv)


# ---------------------------------------------------------------- signed global messages


def test_signed_global_round_trip(signer, verifier):
    msg = model()
    payload = encode_global(msg, signer=signer)
    back = decode_global(payload, verifier=verifier, expected_dim=D)
    np.testing.assert_array_equal(back.params, msg.params)
    assert (back.job, back.version, back.round, back.nonce) == ("job-1", 3, 4, msg.nonce)
    assert back.selected == msg.selected and back.mechanism_state == msg.mechanism_state
    assert back.issued_at == 1234.5
    # without a verifier a signed message still decodes (old callers keep working)
    assert decode_global(payload).round == 4


def test_wire_format_is_the_documented_envelope(signer, verifier):
    msg = model()
    envelope = msgpack.unpackb(encode_global(msg, signer=signer), raw=False)
    assert set(envelope) == {"v", "k", "b", "sig"}
    assert envelope["v"] == 1 and envelope["k"] == "gs"
    assert envelope["b"] == global_body(msg) == encode_global(msg)  # the exact unsigned bytes
    assert len(envelope["sig"]) == 64
    assert verifier.verify(GLOBAL_CONTEXT + envelope["b"], envelope["sig"])
    assert not verifier.verify(envelope["b"], envelope["sig"])  # the context is part of it


def test_done_marker_is_signed(signer, verifier):
    payload = encode_global(model(done=True), signer=signer)
    assert decode_global(payload, verifier=verifier).done
    unsigned = encode_global(model(done=True))
    assert rejected(unsigned, verifier=verifier).reason is Reject.UNSIGNED


def test_unsigned_rejected_when_a_verifier_is_given(verifier):
    err = rejected(encode_global(model()), verifier=verifier)
    assert err.reason is Reject.UNSIGNED


def test_wrong_key_rejected(signer):
    payload = encode_global(model(), signer=signer)
    err = rejected(payload, verifier=Signer.generate().verifier)
    assert err.reason is Reject.BAD_SIGNATURE


def test_tampering_with_any_byte_is_rejected(signer, verifier):
    payload = encode_global(model(params=np.arange(4, dtype=np.float32)), signer=signer)
    for i in range(len(payload)):
        for flip in (0x01, 0x80):
            tampered = bytearray(payload)
            tampered[i] ^= flip
            with pytest.raises(PayloadRejected):
                decode_global(bytes(tampered), verifier=verifier)
    for cut in range(len(payload)):
        with pytest.raises(PayloadRejected):
            decode_global(payload[:cut], verifier=verifier)
    with pytest.raises(PayloadRejected):
        decode_global(payload + b"\x00", verifier=verifier)


def _envelope(body: bytes, sig: bytes, **extra) -> bytes:
    return msgpack.packb({"v": 1, "k": "gs", "b": body, "sig": sig, **extra}, use_bin_type=True)


def test_re_wrapped_bodies_are_rejected(signer, verifier):
    body = global_body(model())
    good = signer.sign(GLOBAL_CONTEXT + body)
    assert decode_global(_envelope(body, good), verifier=verifier).round == 4
    # a changed round under the old signature
    forged = global_body(model(round=2**40, version=2**40))
    assert rejected(_envelope(forged, good), verifier=verifier).reason is Reject.BAD_SIGNATURE
    # a signature over the body without the context
    bare = signer.sign(body)
    assert rejected(_envelope(body, bare), verifier=verifier).reason is Reject.BAD_SIGNATURE
    # wrong signature length, extra envelope fields, a signed envelope inside an envelope
    assert rejected(_envelope(body, good[:63]), verifier=verifier).reason is Reject.BAD_SIGNATURE
    assert rejected(_envelope(body, good, x=1), verifier=verifier).reason is Reject.UNKNOWN_FIELD
    nested = encode_global(model(), signer=signer)
    inner_sig = signer.sign(GLOBAL_CONTEXT + nested)
    assert rejected(_envelope(nested, inner_sig), verifier=verifier).reason is Reject.WRONG_KIND
    # a signed body that is not a global model at all
    status = msgpack.packb({"v": 1, "k": "st", "dev": "d1", "on": True})
    sig = signer.sign(GLOBAL_CONTEXT + status)
    assert rejected(_envelope(status, sig), verifier=verifier).reason is Reject.WRONG_KIND


def test_a_raising_verifier_counts_as_bad_signature(signer):
    class Broken:
        def verify(self, data: bytes, signature: bytes) -> bool:
            raise RuntimeError("hardware token unplugged")

    payload = encode_global(model(), signer=signer)
    assert rejected(payload, verifier=Broken()).reason is Reject.BAD_SIGNATURE


def test_expected_dim_on_signed_messages(signer, verifier):
    payload = encode_global(model(), signer=signer)
    err = rejected(payload, verifier=verifier, expected_dim=D + 1)
    assert err.reason is Reject.WRONG_SHAPE and f"{D} values" in err.detail


def test_new_nonce_is_random_and_sized():
    a, b = new_nonce(), new_nonce()
    assert len(a) == len(b) == 16 and a != b


def test_rfc8032_test_vector_1():
    """Plain RFC 8032 Ed25519 (section 7.1, TEST 1): what a non-Python device must implement."""
    seed = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
    signer = Signer.from_seed(seed)
    assert signer.verifier.hex() == (
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
    )
    assert signer.sign(b"").hex() == (
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39"
        "701cf9b46bd25bf5f0595bbe24655141438e7a100b"
    )
    with pytest.raises(SigningKeyError):
        Signer.from_seed(seed[:31])


def test_signature_covers_context_and_exact_body(signer, verifier):
    payload = encode_global(model(), signer=signer)
    envelope = msgpack.unpackb(payload, raw=False)
    assert verifier.verify(GLOBAL_CONTEXT + envelope["b"], envelope["sig"])
    assert GLOBAL_CONTEXT.hex() == "656467652d666c2f676c6f62616c2f763100"
