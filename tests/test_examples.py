"""Every file in examples/ runs as a user would run it (its own process, its own embedded
Mosquitto on a free port) and prints what it promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edge_fl.transport.broker import find_mosquitto

pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def run_example(name: str, *args: str) -> str:
    if find_mosquitto() is None:
        pytest.skip("no mosquitto binary: the examples start an embedded Mosquitto")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text}"
    return float(found.group(1))


def test_own_numpy_model():
    out = run_example("own_numpy_model.py")
    assert "model quadratic (1290 parameters)" in out
    assert number(r"final accuracy ([\d.]+) after 5 rounds", out) > 0.6
    assert 0 < number(r"epsilon ([\d.e+-]+) at delta", out) < 100  # DP-SGD was accounted


def test_own_dataset_from_arrays():
    out = run_example("own_dataset_from_arrays.py")
    assert "dataset blobs on 8 devices" in out
    assert number(r"final accuracy ([\d.]+)", out) > 0.9


def test_own_torch_model(tmp_path):
    pytest.importorskip("torch")
    out = run_example("own_torch_model.py", str(tmp_path))
    assert "model tiny-cnn (2610 parameters)" in out
    assert number(r"final accuracy ([\d.]+) after 4 rounds", out) > 0.3
    assert 0 < number(r"epsilon ([\d.e+-]+) at delta", out) < 100
    onnx = pytest.importorskip("onnxruntime")
    session = onnx.InferenceSession(str(tmp_path / "model.onnx"))
    assert session.get_outputs()[0].shape[-1] == 10


def test_own_attacker_device():
    out = run_example("own_attacker_device.py")
    off = re.search(r"norm_bound=off: final accuracy ([\d.]+), clipped (\d+), capped (\d+)", out)
    auto = re.search(r"norm_bound=auto: final accuracy ([\d.]+), clipped (\d+), capped (\d+)", out)
    assert off and auto, out
    # the attacker's claim is capped at its declared count in every round, with or without
    # robust aggregation; only the norm bound clips its scaled update, and that saves the model
    assert int(off.group(3)) == 5 and int(auto.group(3)) == 5
    assert int(off.group(2)) == 0 and int(auto.group(2)) >= 4
    assert float(auto.group(1)) > 0.8
    assert float(auto.group(1)) > float(off.group(1)) + 0.3
