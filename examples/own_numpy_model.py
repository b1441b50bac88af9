"""Your own numpy model in a federated job with DP-SGD: register it, name it in the config, run.

A model is any object with the five methods of ``edge_fl.Model`` over one flat float32 parameter
vector. This one is softmax regression on the pixels and their squares. It has no ONNX export,
so the aggregator evaluates it natively (a warning says so) and writes no model.onnx.

    python examples/own_numpy_model.py
"""

import numpy as np

import edge_fl


class QuadraticSoftmax:
    """Softmax regression over features [x, x^2]: parameters [W (2F x C), b (C)]."""

    name = "quadratic"

    def __init__(self, n_features: int, n_classes: int) -> None:
        self.n_features, self.n_classes = n_features, n_classes
        self.n_params = 2 * n_features * n_classes + n_classes

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(self.n_params, dtype=np.float32)

    def _features(self, X: np.ndarray) -> np.ndarray:
        return np.hstack([X, X * X])

    def logits(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        split = 2 * self.n_features * self.n_classes
        W = params[:split].reshape(2 * self.n_features, self.n_classes)
        return self._features(X) @ W + params[split:]

    def _dz(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """d(loss of each sample) / d(logits) = softmax - onehot."""
        z = self.logits(params, X)
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        return p

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        z = self.logits(params, X)
        z = z - z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return float(-logp[np.arange(len(y)), y].mean())

    def per_sample_grads(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        dz = self._dz(params, X, y)
        weights = np.einsum("nf,nc->nfc", self._features(X), dz).reshape(len(y), -1)
        return np.hstack([weights, dz]).astype(np.float32)

    def grad(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        return self.per_sample_grads(params, X, y).mean(axis=0)


edge_fl.register_model("quadratic", QuadraticSoftmax)

cfg = edge_fl.load_config(
    None,
    {
        "job": "own-numpy-model",
        "model.name": "quadratic",  # the name registered above
        "data.dataset": "digits",
        "data.devices": 10,
        "rounds.rounds": 5,
        "rounds.clients_per_round": 10,
        "training.lr": 0.3,
        "privacy.mechanism": "dpsgd",  # per-example gradients, clipped and noised on the device
        "privacy.noise_multiplier": 1.0,
    },
)
result = edge_fl.run_simulation(cfg)
summary = result.summary
print(f"model {summary['model']} ({summary['n_params']} parameters)")
print(f"final accuracy {summary['final_accuracy']:.3f} after {summary['rounds_closed']} rounds")
print(f"epsilon {summary['epsilon']:.3g} at delta {summary['privacy']['delta']:g}")
