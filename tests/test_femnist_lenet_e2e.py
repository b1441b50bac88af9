"""LeNet-5 on (generated) FEMNIST end to end over Mosquitto, with every privacy mechanism."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

pytest.importorskip("torch")

from edge_fl.config import load_config
from edge_fl.data.femnist import write_leaf_dir
from edge_fl.models.onnx_runtime import OnnxClassifier
from edge_fl.simulation import simulate

pytestmark = [pytest.mark.broker, pytest.mark.torch]

WRITERS = 6


@pytest.fixture(scope="module")
def femnist_dir(tmp_path_factory):
    """Six writers in LEAF JSON; each writer's digits are a noisy class template (learnable)."""
    rng = np.random.default_rng(0)
    templates = rng.random((62, 784)).astype(np.float32)

    def samples(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, 5, n)  # five classes in use, out of 62
        X = np.clip(templates[y] + 0.2 * rng.standard_normal((n, 784)), 0, 1).astype(np.float32)
        return X, y

    root = tmp_path_factory.mktemp("femnist")
    train = {f"writer_{i}": samples(24) for i in range(WRITERS)}
    test = {f"writer_{i}": samples(8) for i in range(WRITERS)}
    return write_leaf_dir(root, train, test, files_per_split=2)


MECHANISMS = {
    "none": {},
    "laplace": {"privacy.epsilon": 50.0},
    "gaussian": {"privacy.epsilon": 50.0},
    "gaussian-central": {"privacy.epsilon": 50.0},
    "dpsgd": {"privacy.epsilon": 50.0},
    "nbafl": {"privacy.epsilon": 50.0, "privacy.clip": 20.0},
    "signds": {"privacy.signds.sign_k": 0.05},
}


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_lenet_femnist_every_mechanism(mechanism, femnist_dir, tmp_path):
    cfg = load_config(
        None,
        {
            "job": f"fem-{uuid.uuid4().hex[:6]}",
            "data.dataset": "femnist",
            "data.data_dir": str(femnist_dir),
            "data.devices": WRITERS,
            "model.name": "lenet",
            "rounds.rounds": 2,
            "rounds.clients_per_round": 4,
            "rounds.min_updates": 2,
            "training.epochs": 1,
            "training.lr": 0.05,
            "privacy.mechanism": mechanism,
            **MECHANISMS[mechanism],
        },
    )
    summary = simulate(cfg, tmp_path)
    assert summary["rounds_closed"] == 2, summary
    assert summary["n_params"] == 66_126  # LeNet-5, 62 classes, 1 channel
    assert summary["total_received"] >= 4
    if mechanism == "none":
        assert summary["privacy"] is None
    else:
        assert summary["privacy"]["epsilon"] > 0
    # the exported global model is what the aggregator evaluated, through onnxruntime
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["model"]["name"] == "lenet"
    clf = OnnxClassifier(tmp_path / "model.onnx")
    assert clf.n_classes == 62
