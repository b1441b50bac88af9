"""The base install (`pip install edge-fl`, no extra) in a fresh venv: it holds none of the server
extra's packages, and its `edge-fl device` takes part in a real job. Slow: it installs packages."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from processes import keygen, run_job

pytestmark = [pytest.mark.slow, pytest.mark.broker]

REPO = Path(__file__).resolve().parents[1]
EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))
SERVER_ONLY = ("dp_accounting", "scipy", "onnx", "onnxruntime", "sklearn", "matplotlib", "amqtt")


def site_packages_mb(venv: Path) -> float:
    site = next(venv.glob("lib/python3*/site-packages"))
    return sum(f.stat().st_size for f in site.rglob("*") if f.is_file()) / 1e6


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("base") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    done = subprocess.run(
        [str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check", str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return venv


def test_the_base_install_is_the_device_agent_only(base_venv):
    python = str(base_venv / "bin/python")
    for module in SERVER_ONLY:
        found = subprocess.run([python, "-c", f"import {module}"], capture_output=True)
        assert found.returncode != 0, f"{module} is installed by the base package"
    print(f"base install: {site_packages_mb(base_venv):.1f} MB in site-packages")


def test_the_base_install_shows_its_help_and_names_the_extra_a_server_command_needs(base_venv):
    edge_fl = str(base_venv / "bin/edge-fl")
    done = subprocess.run([edge_fl, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for command in ("aggregator", "audit", "device", "privacy", "report", "simulate"):
        assert f"\n  {command} " in done.stdout, done.stdout
    device = subprocess.run([edge_fl, "device", "--help"], capture_output=True, text=True)
    assert device.returncode == 0, device.stderr
    audit = subprocess.run([edge_fl, "audit", "--help"], capture_output=True, text=True)
    assert audit.returncode == 2 and "Traceback" not in audit.stderr, audit.stderr
    assert "needs rich, part of the server extra" in audit.stderr, audit.stderr


def test_a_base_install_device_runs_a_signed_signds_job(base_venv, mosquitto, tmp_path):
    job = f"base-{uuid.uuid4().hex[:6]}"
    private, public = keygen(tmp_path / "keys")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        f"job: {job}\nsecurity: {{signing_key: {private}}}\n"
        "privacy: {mechanism: signds, signds: {sign_k: 0.1, sign_eps: 100}}\n"
        "model: {name: logreg}\ndata: {devices: 2}\ntraining: {epochs: 1, lr: 0.05}\n"
        "rounds: {rounds: 3, clients_per_round: 2, deadline_s: 30}\n"
    )
    device = [str(base_venv / "bin/edge-fl"), "device", "--broker", mosquitto.url]
    done = run_job(
        [EDGE_FL, "aggregator", "--config", str(cfg), "--broker", mosquitto.url],
        [[*device, "--id", f"d0000{i}", "--public-key", public] for i in (0, 1)],
        timeout=180,
        device_timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert all("3 updates sent" in e for e in done.device_errs), done.device_errs
    assert [
        line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("round")
    ] == [f"round {i} closed" for i in (1, 2, 3)]
