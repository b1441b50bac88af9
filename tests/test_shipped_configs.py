"""Every example config the project ships validates, and the Pi's config agrees with the README's
job (the digest devices compare with every global model)."""

from __future__ import annotations

import re
from pathlib import Path

from edge_fl.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def readme_job_yaml(tmp_path: Path) -> Path:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```yaml\n(# job\.yaml\n.*?)```", text, flags=re.S)
    assert block, "README.md has no job.yaml block"
    path = tmp_path / "job.yaml"
    path.write_text(block.group(1))
    return path


def test_the_pi_device_config_validates_and_matches_the_readme_job(tmp_path):
    device = load_config(ROOT / "devices/raspberry-pi/device.yaml")
    job = load_config(readme_job_yaml(tmp_path))
    assert device.device.id and device.device.index is not None
    assert device.digest() == job.digest()


def test_every_shipped_yaml_config_validates():
    configs = [p for p in ROOT.glob("devices/**/*.yaml")]
    assert configs
    for path in configs:
        load_config(path)
