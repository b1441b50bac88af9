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


# ------------------------------------------------------------ the red team's findings, fixed


def secure_job(tmp_path, keys: bool = True, devices: int = 4):
    from edge_fl.job import build_job

    overrides: dict = {
        "data.devices": devices, "rounds.clients_per_round": devices, "rounds.rounds": 2,
        "secure_aggregation.enabled": True, "reproducible": True,
    }  # fmt: skip
    if keys:
        path = mint_device_keys(tmp_path / "keys", [f"d{i:05d}" for i in range(devices)])
        overrides["security.device_keys"] = str(path)
    return build_job(load_config(None, overrides))


def test_a_secure_jobs_device_refuses_a_round_without_secure_parameters(tmp_path):
    """A downgrade: a (signed) global message of a secure job without ``sa``. The device's
    trust refuses it (``not_secure``), and the agent never makes a plain update of it."""
    from edge_fl.protocol import GlobalModel, encode_global

    job = secure_job(tmp_path, keys=False)
    agent = job.agents()[0]
    msg = GlobalModel(job.cfg.job, 0, 1, job.initial_params(), selected=(agent.device_id,),
                      nonce=bytes(16), config_digest=job.cfg.digest())  # fmt: skip
    trust = job.trust()
    assert trust.receive(encode_global(msg), job.topics, job.model.n_params) is None
    assert trust.rejected["not_secure"] == 1
    assert agent.on_global(msg) is None and agent.state.updates_sent == 0
    assert agent.state.last_release is None


def test_a_lowered_threshold_or_another_graph_is_refused_before_keys(tmp_path):
    job = secure_job(tmp_path, keys=False)
    sec = job.secure_device
    plan = job.secure_plan
    k, t = plan.for_roster(4)
    sa = plan.wire(4)
    assert sec.mismatch(sa, 4) is None
    assert "graph" in sec.mismatch({**sa, "t": 1}, 4)  # one share would reveal a secret
    assert "graph" in sec.mismatch({**sa, "k": k, "t": t - 1}, 4)
    assert "survivors" in sec.mismatch({**sa, "ms": sa["ms"] - 1}, 4)


def test_with_a_directory_only_its_devices_are_selectable_and_forged_masked_inputs_uncharged(
    tmp_path,
):
    from edge_fl.protocol import Status, encode_status

    job = secure_job(tmp_path)
    core = job.aggregator_core()
    for device in ("d00000", "d00001", "d00002", "d00003", "mallory"):
        core.on_status(device, encode_status(Status(device, True, 10)))
    assert "mallory" not in core.devices and core.foreign_seen == 1
    assert core.open_round(0.0) is not None
    core.open_secure(0.0)
    forged = b"\x85\xa1v\x01\xa1k\xa2mx\xa1r\x01\xa2nc\xc4\x10" + bytes(16) + b"\xa1y\xc4\x00"
    assert not core.charge_secure("d00001", 1, forged)
    assert core.releases == []
