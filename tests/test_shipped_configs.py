"""Every example config the project ships is valid for what reads it: the README's job.yaml for
the aggregator, the Pi's device.yaml for `edge-fl device` (which takes only a device's own
settings: the job comes from the aggregator's job document)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from edge_fl.cli.device_cmd import _local_settings
from edge_fl.config import load_config
from edge_fl.identity import device_index

ROOT = Path(__file__).resolve().parent.parent


def readme_job_yaml(tmp_path: Path) -> Path:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```yaml\n(# job\.yaml\n.*?)```", text, flags=re.S)
    assert block, "README.md has no job.yaml block"
    path = tmp_path / "job.yaml"
    path.write_text(block.group(1))
    return path


def test_the_readme_job_validates(tmp_path):
    assert load_config(readme_job_yaml(tmp_path)).job == "digits-demo"


def test_the_pi_device_config_is_a_device_config():
    path = ROOT / "devices/raspberry-pi/device.yaml"
    s = _local_settings(str(path))
    assert s["url"].startswith("mqtts://") and "?ca=/etc/edge-fl/ca.crt" in s["url"]
    user = s["url"].split("://", 1)[1].split(":", 1)[0]
    assert s["id"] == user == "d00001" and device_index(s["id"]) == 1  # id = MQTT username
    assert s["public_key"]  # a device should verify what it is sent
    raw = yaml.safe_load(path.read_text())
    assert set(raw) <= {"broker", "device", "security", "data", "job"}
