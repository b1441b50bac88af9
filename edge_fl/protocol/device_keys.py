"""Device signing keys for secure aggregation: who may advertise keys under which device id.

SecAgg+ keeps a device's update secret from an honest-but-curious aggregator and broker with
the broker's per-device ACL alone. Against a malicious operator, which could advertise X25519
keys of its own under an honest device's name and so learn the pairwise masks, each device signs
its advertised keys and its masked input with its own Ed25519 key (docs/specs/secagg.md,
section 3), and every party checks them against a **directory** of the devices' public keys
that the operator cannot change after provisioning: it is minted with the devices' credentials
(``edge-fl keygen DIR --devices N``) and installed on each device beside its own private key.

The directory file (``device-keys.json``, docs/protocol.md "Device signing keys"):
``{"v": 1, "keys": {"<device id>": "<64 hex: raw Ed25519 public key>", ...}}``.
A directory is complete by design: a device id that is not in it has no key, so its keys are
refused (:meth:`DeviceKeys.key_of` returns a verifier that accepts nothing).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from edge_fl.protocol.signing import Signer, SigningKeyError, Verifier

__all__ = ["DIRECTORY_FILE", "DeviceKeys", "mint_device_keys", "private_key_path"]

DIRECTORY_FILE = "device-keys.json"
PRIVATE_DIR = "devices"


class _NoKey:
    """The verifier of a device the directory does not hold: no signature verifies."""

    def verify(self, data: bytes, signature: bytes) -> bool:
        return False

    def hex(self) -> str:
        return ""  # equal to no real key's


NO_KEY = _NoKey()


@dataclass(frozen=True)
class DeviceKeys:
    """A device id -> its public signing key, from a directory every party holds."""

    keys: Mapping[str, Verifier]

    def key_of(self, device: str) -> Verifier | _NoKey:
        """The device's public key; a verifier that accepts nothing for an unknown device."""
        return self.keys.get(device, NO_KEY)

    def __contains__(self, device: object) -> bool:
        return device in self.keys

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeviceKeys:
        """Read a directory file; SigningKeyError with one line naming what is wrong."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise SigningKeyError(f"cannot read the device key directory {path}: {exc}") from None
        except ValueError as exc:
            raise SigningKeyError(f"device key directory {path} is not JSON: {exc}") from None
        if (
            not isinstance(data, dict)
            or data.get("v") != 1
            or not isinstance(data.get("keys"), dict)
        ):
            raise SigningKeyError(
                f'device key directory {path}: expected {{"v": 1, "keys": {{device: hex}}}}'
            )
        keys: dict[str, Verifier] = {}
        for device, text in data["keys"].items():
            try:
                keys[device] = Verifier.from_hex(text if isinstance(text, str) else "")
            except SigningKeyError as exc:
                raise SigningKeyError(f"device key directory {path}: {device}: {exc}") from None
        if not keys:
            raise SigningKeyError(f"device key directory {path} holds no device")
        return cls(keys)

    def dump(self) -> str:
        body = {d: self.keys[d].hex() for d in sorted(self.keys)}
        return json.dumps({"v": 1, "keys": body}, indent=1) + "\n"


def private_key_path(directory: str | os.PathLike[str], device: str) -> Path:
    """Where ``edge-fl keygen DIR --devices N`` puts ``device``'s private key."""
    return Path(directory) / PRIVATE_DIR / f"{device}.key"


def mint_device_keys(
    directory: str | os.PathLike[str], devices: Iterable[str], *, overwrite: bool = False
) -> Path:
    """A fresh key pair per device (``DIR/devices/<id>.key``, PEM, mode 0600) and the public
    directory (``DIR/device-keys.json``); returns the directory's path. Refuses to replace an
    existing key unless ``overwrite``."""
    directory = Path(directory)
    ids = list(devices)
    if not ids:
        raise SigningKeyError("no devices to mint keys for")
    target = directory / DIRECTORY_FILE
    if target.exists() and not overwrite:
        raise SigningKeyError(f"{target} exists; refusing to re-key its devices (--force)")
    if not overwrite:  # refused before any key is written: a retry is never half done
        taken = [private_key_path(directory, d) for d in ids]
        taken = [path for path in taken if path.exists()]
        if taken:
            raise SigningKeyError(f"{taken[0]} exists; refusing to re-key its device (--force)")
    verifiers: dict[str, Verifier] = {}
    for device in ids:
        signer = Signer.generate()
        try:
            signer.save(private_key_path(directory, device), overwrite=overwrite)
        except FileExistsError as exc:
            raise SigningKeyError(str(exc)) from None
        verifiers[device] = signer.verifier
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(DeviceKeys(verifiers).dump())
    os.replace(tmp, target)
    return target
