"""Your own small torch network in a federated job with DP-SGD (needs torch).

``edge_fl.TorchModule`` makes an ``nn.Module`` an edge-fl model: per-example gradients come from
torch.func, and the aggregator evaluates the global model, and writes model.onnx, through ONNX.
The network takes flat rows (here 8x8 digits, 64 pixels) and returns logits.

    python examples/own_torch_model.py [OUT_DIR]
"""

import sys

import torch
from torch import nn

import edge_fl

torch.manual_seed(0)  # the job starts from the network's own initial weights


def tiny_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),  # flat pixels in, as every edge-fl model takes them
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 10),
    )


edge_fl.register_model(
    "tiny-cnn",
    lambda n_features, n_classes: edge_fl.TorchModule(
        tiny_cnn(), n_features, n_classes, name="tiny-cnn"
    ),
)

cfg = edge_fl.load_config(
    None,
    {
        "job": "own-torch-model",
        "model.name": "tiny-cnn",
        "data.dataset": "digits",
        "data.devices": 10,
        "rounds.rounds": 4,
        "rounds.clients_per_round": 10,
        "training.epochs": 2,
        "training.lr": 0.1,
        "privacy.mechanism": "dpsgd",
        "privacy.noise_multiplier": 1.0,
    },
)
out_dir = sys.argv[1] if len(sys.argv) > 1 else None  # model.onnx, metrics, summary
result = edge_fl.run_simulation(cfg, out_dir)
summary = result.summary
print(f"model {summary['model']} ({summary['n_params']} parameters)")
print(f"final accuracy {summary['final_accuracy']:.3f} after {summary['rounds_closed']} rounds")
print(f"epsilon {summary['epsilon']:.3g} at delta {summary['privacy']['delta']:g}")
