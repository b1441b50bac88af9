"""The devices' signing-key directory (``edge_fl.protocol.device_keys``) and its minting by
``edge-fl keygen DIR --devices N``: what every party checks SecAgg+ adverts against."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from edge_fl.config import ConfigError, load_config
from edge_fl.protocol.device_keys import DeviceKeys, mint_device_keys, private_key_path
from edge_fl.protocol.signing import Signer, SigningKeyError


def test_minted_keys_sign_what_the_directory_verifies(tmp_path):
    path = mint_device_keys(tmp_path, ["d00000", "d00001"])
    keys = DeviceKeys.load(path)
    for device in ("d00000", "d00001"):
        key = private_key_path(tmp_path, device)
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        signature = Signer.load(key).sign(b"advert")
        assert keys.key_of(device).verify(b"advert", signature)
        other = "d00001" if device == "d00000" else "d00000"
        assert not keys.key_of(other).verify(b"advert", signature)
    # a device the directory does not hold has no key: nothing it signs verifies
    assert "d00002" not in keys
    assert not keys.key_of("d00002").verify(b"advert", Signer.generate().sign(b"advert"))


def test_minting_again_is_refused_unless_forced(tmp_path):
    first = mint_device_keys(tmp_path, ["d00000"]).read_text()
    with pytest.raises(SigningKeyError, match="refusing to re-key"):
        mint_device_keys(tmp_path, ["d00000"])
    assert (tmp_path / "device-keys.json").read_text() == first
    mint_device_keys(tmp_path, ["d00000"], overwrite=True)
    assert (tmp_path / "device-keys.json").read_text() != first


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "is not JSON"),
        ('{"v": 2, "keys": {}}', 'expected {"v": 1'),
        ('{"v": 1, "keys": {}}', "holds no device"),
        ('{"v": 1, "keys": {"d00000": "zz"}}', "d00000: an Ed25519 public key in hex"),
    ],
)
def test_a_bad_directory_is_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "device-keys.json"
    path.write_text(content)
    with pytest.raises(SigningKeyError, match=message) as info:
        DeviceKeys.load(path)
    assert "\n" not in str(info.value)


def test_device_keys_need_secure_aggregation():
    with pytest.raises(ConfigError, match=r"security\.device_keys signs SecAgg"):
        load_config(None, {"security.device_keys": "keys/device-keys.json"})


def test_keygen_mints_device_keys_and_refuses_to_overwrite(tmp_path):
    edge_fl = str(Path(sys.executable).parent / "edge-fl")
    cmd = [edge_fl, "keygen", str(tmp_path), "--devices", "3", "--start", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "device-keys.json" in out.stdout
    listed = json.loads((tmp_path / "device-keys.json").read_text())["keys"]
    assert sorted(listed) == ["d00004", "d00005", "d00006"]
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 2
    assert again.stderr.strip().count("\n") == 0 and "refusing to re-key" in again.stderr
