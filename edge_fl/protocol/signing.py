"""Ed25519 signatures: devices trust only the aggregator.

The aggregator holds a private key (PEM, PKCS#8, unencrypted, file mode 0600, in its config dir);
every device knows the matching public key (32 raw bytes, written as 64 hex characters in a YAML
config or a job file, or as a PEM file). The codec (:mod:`edge_fl.protocol.codec`) signs every
global-model message, the ``done`` marker included, and a device given a :class:`Verifier` rejects
an unsigned or badly signed one.

Normative wire format of a signed global message
------------------------------------------------

A signed global message is a msgpack map of exactly four entries::

    {"v": 1, "k": "gs", "b": <bin: BODY>, "sig": <bin, 64 bytes: SIG>}

- ``BODY`` is the exact msgpack encoding of the unsigned global message (the map with
  ``"k": "g"`` that an unsigned sender publishes as the whole payload). It is carried as opaque
  bytes: the verifier checks the signature over these bytes *before* parsing them, and never
  re-encodes anything.
- ``SIG`` is the 64-byte Ed25519 signature (RFC 8032, pure Ed25519) of
  ``GLOBAL_CONTEXT || BODY`` where ``GLOBAL_CONTEXT = b"edge-fl/global/v1\\x00"`` (18 bytes). The
  context prefix separates these signatures from anything else the key might ever sign.
- Replay is not prevented by the signature itself: the body carries the job id, the run id
  (``run``: a replay from an earlier run of the same job id and key is refused,
  :mod:`edge_fl.device.trust`), the round, the version and the round's nonce, and devices apply
  :class:`edge_fl.protocol.window.GlobalWindow` (monotonic, bounded round/version).
- A :class:`Verifier` refuses a small-order or non-canonical public key (under the identity
  point every forged signature ``R = identity, S = 0`` verifies).

A decoder without a verifier still decodes a signed message (the signature is then ignored); a
decoder with a verifier rejects an unsigned message (``Reject.UNSIGNED``) and a signature that
does not verify (``Reject.BAD_SIGNATURE``).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from edge_fl.protocol.messages import GLOBAL_CONTEXT, SIGNATURE_BYTES

__all__ = [
    "GLOBAL_CONTEXT",
    "PRIVATE_SEED_BYTES",
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "Signer",
    "SigningKeyError",
    "Verifier",
    "generate_key_files",
    "load_signer",
    "load_verifier",
    "weak_key_reason",
]

PUBLIC_KEY_BYTES = 32
PRIVATE_SEED_BYTES = 32
PRIVATE_KEY_FILE = "aggregator_ed25519.pem"
PUBLIC_KEY_FILE = "aggregator_ed25519.pub"
_HEX_KEY = re.compile(r"^[0-9a-fA-F]{64}$")
_FIELD_P = 2**255 - 19
#: the y coordinates of the 8 points of order 1, 2, 4 and 8 (Ed25519's torsion subgroup): the
#: identity (y = 1), order 2 (y = -1), order 4 (y = 0) and order 8 (two values, each with both
#: signs of x). Under such a public key a signature that "verifies" proves nothing: with the
#: identity, the forged R = S*B passes any message (issue 24, item 10)
_SMALL_ORDER_Y = frozenset(
    {
        1,
        _FIELD_P - 1,
        0,
        int.from_bytes(
            bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05"),
            "little",
        ),
        int.from_bytes(
            bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a"),
            "little",
        ),
    }
)


class SigningKeyError(ValueError):
    """A key that cannot be used: wrong type, unreadable, or a private key others can read."""


def weak_key_reason(raw_public: bytes) -> str | None:
    """Why a 32-byte Ed25519 public key must not be trusted, or None: a small-order point (one of
    the 8 of order 1, 2, 4 or 8, in any encoding) or a non-canonical encoding (y >= p)."""
    y = int.from_bytes(raw_public, "little") & ((1 << 255) - 1)
    if y >= _FIELD_P:
        return "a non-canonical encoding (y >= 2^255 - 19)"
    if y in _SMALL_ORDER_Y:
        return "a small-order point (order 1, 2, 4 or 8; 01 followed by zeros is the identity)"
    return None


def _fingerprint(raw_public: bytes) -> str:
    return hashlib.sha256(raw_public).hexdigest()[:16]


class Verifier:
    """Checks Ed25519 signatures under one public key (the aggregator's)."""

    def __init__(self, public_key: Ed25519PublicKey) -> None:
        if not isinstance(public_key, Ed25519PublicKey):
            raise SigningKeyError(f"not an Ed25519 public key: {type(public_key).__name__}")
        raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        weak = weak_key_reason(raw)
        if weak is not None:
            raise SigningKeyError(
                f"refusing the public key {raw.hex()}: it is {weak}, under which forged "
                "signatures verify; give the aggregator's real key (`edge-fl keygen` makes one)"
            )
        self._key = public_key

    # -- construction
    @classmethod
    def from_bytes(cls, raw: bytes) -> Verifier:
        if not isinstance(raw, bytes | bytearray) or len(raw) != PUBLIC_KEY_BYTES:
            raise SigningKeyError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} raw bytes")
        return cls(Ed25519PublicKey.from_public_bytes(bytes(raw)))

    @classmethod
    def from_hex(cls, text: str) -> Verifier:
        text = text.strip() if isinstance(text, str) else text
        if not isinstance(text, str) or not _HEX_KEY.fullmatch(text):
            raise SigningKeyError(
                "an Ed25519 public key in hex is exactly 64 hex characters (32 bytes)"
            )
        return cls.from_bytes(bytes.fromhex(text))

    @classmethod
    def from_pem(cls, pem: bytes | str) -> Verifier:
        data = pem.encode() if isinstance(pem, str) else pem
        try:
            key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise SigningKeyError(f"not a PEM public key ({exc})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise SigningKeyError(f"the PEM key is {type(key).__name__}, not Ed25519")
        return cls(key)

    @classmethod
    def parse(cls, text: str | bytes) -> Verifier:
        """A public key given as 64 hex characters or as PEM text (what a config holds)."""
        if isinstance(text, bytes):
            try:
                text = text.decode("ascii")
            except UnicodeDecodeError:
                raise SigningKeyError("a public key is hex or PEM text (ASCII)") from None
        if not isinstance(text, str):
            raise SigningKeyError(f"a public key is hex or PEM text, not {type(text).__name__}")
        if "-----BEGIN" in text:
            return cls.from_pem(text)
        return cls.from_hex(text)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Verifier:
        """Read a public-key file holding hex or PEM."""
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise SigningKeyError(f"cannot read the public key {path}: {exc}") from None
        return cls.parse(data)

    # -- use
    def verify(self, data: bytes, signature: bytes) -> bool:
        """True iff ``signature`` is a valid Ed25519 signature of ``data``; never raises."""
        if not isinstance(signature, bytes | bytearray) or len(signature) != SIGNATURE_BYTES:
            return False
        if not isinstance(data, bytes | bytearray | memoryview):
            return False
        try:
            self._key.verify(bytes(signature), bytes(data))
        except (InvalidSignature, ValueError, TypeError):
            return False
        return True

    # -- export
    def raw(self) -> bytes:
        return self._key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def hex(self) -> str:
        """The 64-hex-character form for YAML configs and job files."""
        return self.raw().hex()

    def pem(self) -> bytes:
        return self._key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    @property
    def fingerprint(self) -> str:
        """First 16 hex characters of SHA-256 of the raw key: for logs and run.json."""
        return _fingerprint(self.raw())

    def save(self, path: str | os.PathLike[str], *, pem: bool = False) -> Path:
        """Write the public key (hex + newline by default, or PEM), mode 0644."""
        path = Path(path)
        data = self.pem() if pem else (self.hex() + "\n").encode()
        _write_atomic(path, data, 0o644, overwrite=True)
        return path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Verifier) and self.raw() == other.raw()

    def __hash__(self) -> int:
        return hash(self.raw())

    def __repr__(self) -> str:
        return f"Verifier(ed25519:{self.fingerprint})"


class Signer:
    """Holds the aggregator's Ed25519 private key and signs with it."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise SigningKeyError(f"not an Ed25519 private key: {type(private_key).__name__}")
        self._key = private_key

    @classmethod
    def generate(cls) -> Signer:
        """A fresh key pair (the OS CSPRNG)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Signer:
        """The key pair of a 32-byte RFC 8032 private seed. For test vectors and hardware-held
        seeds; a production key comes from :meth:`generate` (never a guessable seed)."""
        if not isinstance(seed, bytes | bytearray) or len(seed) != PRIVATE_SEED_BYTES:
            raise SigningKeyError(f"an Ed25519 private seed is {PRIVATE_SEED_BYTES} raw bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    @classmethod
    def from_pem(cls, pem: bytes | str) -> Signer:
        data = pem.encode() if isinstance(pem, str) else pem
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise SigningKeyError(f"not an unencrypted PEM private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SigningKeyError(f"the PEM key is {type(key).__name__}, not Ed25519")
        return cls(key)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, check_permissions: bool = True) -> Signer:
        """Read a PEM private key; refuse one that group or others may read (like ssh does)."""
        path = Path(path)
        try:
            st = path.stat()
            data = path.read_bytes()
        except OSError as exc:
            raise SigningKeyError(f"cannot read the private key {path}: {exc}") from None
        if check_permissions and os.name == "posix" and st.st_mode & 0o077:
            raise SigningKeyError(
                f"private key {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or others "
                f"can access it; run `chmod 600 {path}`"
            )
        return cls.from_pem(data)

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``data``."""
        return self._key.sign(bytes(data))

    @property
    def verifier(self) -> Verifier:
        return Verifier(self._key.public_key())

    def pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the private key as PEM with mode 0600 (created so; never world-readable)."""
        path = Path(path)
        _write_atomic(path, self.pem(), 0o600, overwrite=overwrite)
        return path

    def __repr__(self) -> str:  # never print key material
        return f"Signer(ed25519:{self.verifier.fingerprint})"


def _write_atomic(path: Path, data: bytes, mode: int, *, overwrite: bool) -> None:
    """Write via a temporary file created with ``mode`` in the same directory, then rename."""
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; refusing to overwrite a key")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, mode)  # the umask may have removed bits; never added any
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def generate_key_files(
    directory: str | os.PathLike[str],
    *,
    private_name: str = PRIVATE_KEY_FILE,
    public_name: str = PUBLIC_KEY_FILE,
    overwrite: bool = False,
) -> tuple[Path, Path, Signer]:
    """Create a key pair in ``directory``: the private key (PEM, 0600) and the public key (hex).

    Returns (private path, public path, signer); ``signer.verifier.hex()`` is what devices need.
    """
    directory = Path(directory)
    signer = Signer.generate()
    private = signer.save(directory / private_name, overwrite=overwrite)
    public = signer.verifier.save(directory / public_name)
    return private, public, signer


def load_signer(path: str | os.PathLike[str]) -> Signer:
    return Signer.load(path)


def load_verifier(key: str | bytes | os.PathLike[str]) -> Verifier:
    """A verifier from 64 hex characters, PEM text, or the path of a file holding either."""
    if isinstance(key, str) and (_HEX_KEY.fullmatch(key.strip()) or "-----BEGIN" in key):
        return Verifier.parse(key)
    if isinstance(key, bytes):
        return Verifier.parse(key)
    return Verifier.load(key)
