"""Public keys a device must refuse: the 8 small-order Ed25519 points (issue 24, item 10).

Under the identity point (``01`` + 31 zero bytes) the signature ``R = identity, S = 0`` verifies
for every message, so anyone's forged globals and job documents would pass; the other small-order
points are as weak (a forger guesses the 1-in-8 outcome). ``Verifier`` refuses them in every form
a key is given in (raw bytes, hex, PEM, a file), with one line.
"""

from __future__ import annotations

import subprocess

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from processes import EDGE_FL

from edge_fl.protocol.signing import Signer, SigningKeyError, Verifier, load_verifier

P = 2**255 - 19
D = (-121665 * pow(121666, P - 2, P)) % P

#: the canonical encodings of the 8 points of order 1, 2, 4 and 8
SMALL_ORDER = (
    "0100000000000000000000000000000000000000000000000000000000000000",  # identity
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",  # order 2
    "0000000000000000000000000000000000000000000000000000000000000000",  # order 4
    "0000000000000000000000000000000000000000000000000000000000000080",  # order 4
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",  # order 8
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",  # order 8
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",  # order 8
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",  # order 8
)


def _decode(raw: bytes) -> tuple[int, int]:
    """RFC 8032 point decoding (5.1.3), enough to check an order independently of the code."""
    n = int.from_bytes(raw, "little")
    y, sign = n & ((1 << 255) - 1), n >> 255
    x2 = (y * y - 1) * pow(D * y * y + 1, P - 2, P) % P
    x = pow(x2, (P + 3) // 8, P)
    if (x * x - x2) % P:
        x = x * pow(2, (P - 1) // 4, P) % P
    assert (x * x - x2) % P == 0, "not on the curve"
    if x % 2 != sign:
        x = P - x
    return x % P, y


def _add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    (x1, y1), (x2, y2) = a, b
    t = D * x1 * x2 * y1 * y2 % P
    return (x1 * y2 + x2 * y1) * pow(1 + t, P - 2, P) % P, (y1 * y2 + x1 * x2) * pow(
        1 - t, P - 2, P
    ) % P


def _order(point: tuple[int, int]) -> int | None:
    acc = (0, 1)
    for k in range(1, 9):
        acc = _add(acc, point)
        if acc == (0, 1):
            return k
    return None


def test_the_list_is_the_eight_small_order_points():
    points = {_decode(bytes.fromhex(h)) for h in SMALL_ORDER}
    assert len(points) == 8
    assert sorted(_order(p) for p in points) == [1, 2, 4, 4, 8, 8, 8, 8]


def test_the_identity_key_accepts_a_forgery_when_nothing_refuses_it():
    """Why it matters: the library alone verifies R = identity, S = 0 for any message."""
    key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(SMALL_ORDER[0]))
    forged = bytes.fromhex(SMALL_ORDER[0]) + bytes(32)
    key.verify(forged, b"edge-fl/global/v1\x00 any body at all")  # does not raise


@pytest.mark.parametrize("hexkey", SMALL_ORDER)
def test_every_small_order_key_is_refused_in_every_form(hexkey, tmp_path):
    raw = bytes.fromhex(hexkey)
    for make in (
        lambda: Verifier.from_bytes(raw),
        lambda: Verifier.from_hex(hexkey),
        lambda: load_verifier(hexkey),
        lambda: Verifier(Ed25519PublicKey.from_public_bytes(raw)),
    ):
        with pytest.raises(SigningKeyError, match="small-order point") as info:
            make()
        assert "\n" not in str(info.value)
    pem = Ed25519PublicKey.from_public_bytes(raw).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    path = tmp_path / "k.pem"
    path.write_bytes(pem)
    with pytest.raises(SigningKeyError, match="small-order point"):
        load_verifier(path)


def test_other_encodings_of_small_order_points_are_refused():
    identity_with_sign = "01" + "00" * 30 + "80"  # x = 0 with the sign bit set
    y_is_p_plus_1 = "ee" + "ff" * 30 + "7f"  # 2^255 - 18 = p + 1: the identity, non-canonical
    for hexkey in (identity_with_sign, y_is_p_plus_1):
        with pytest.raises(SigningKeyError):
            Verifier.from_hex(hexkey)


def test_real_keys_still_load():
    for _ in range(20):
        verifier = Signer.generate().verifier
        assert Verifier.from_hex(verifier.hex()) == verifier
        assert Verifier.from_pem(verifier.pem()) == verifier


def test_the_device_command_says_one_line(tmp_path):
    proc = subprocess.run(
        [
            EDGE_FL,
            "device",
            "--broker",
            "mqtt://127.0.0.1:9",
            "--id",
            "d00001",
            "--public-key",
            SMALL_ORDER[0],
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and "small-order point" in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr
