"""One-hidden-layer ReLU perceptron over a flat parameter vector.

Layout of the flat vector (fixed: the ONNX exporter and the wire format rely on it):
``[W1 (n_features x hidden, C order), b1 (hidden),
W2 (hidden x n_classes, C order), b2 (n_classes)]``, so ``logits = relu(X @ W1 + b1) @ W2 + b2``.

Precision follows :mod:`edge_fl.models.logreg`: float64 if ``params`` or ``X`` is float64, else
float32.

Per-sample gradients are materialised as an ``(n, n_params)`` array: ``n * n_params * itemsize``
bytes. For digits (64 features, hidden 64, 10 classes: 4810 params) that is 19.2 kB per sample in
float32, so a DP-SGD lot of 256 costs about 4.9 MB and 10k samples about 192 MB; callers with large
lots should feed micro-batches and clip/sum as they go.
"""

from __future__ import annotations

import numpy as np

from edge_fl.models.logreg import (
    _compute_dtype,
    _validate_sizes,
    check_batch,
    mean_cross_entropy,
    softmax_minus_onehot,
)


class MLP:
    """The smallest non-convex model: exercises what SignDS and DP-SGD do off the convex path."""

    name = "mlp"

    def __init__(self, n_features: int, n_classes: int, hidden: int = 64) -> None:
        _validate_sizes(n_features, n_classes)
        if int(hidden) != hidden or hidden < 1:
            raise ValueError(f"hidden={hidden!r}; must be an integer >= 1")
        self.n_features = int(n_features)
        self.n_classes = int(n_classes)
        self.hidden = int(hidden)
        d, h, c = self.n_features, self.hidden, self.n_classes
        # Offsets of W1 | b1 | W2 | b2 in the flat vector.
        self._o = np.cumsum([0, d * h, h, h * c, c]).tolist()
        self.n_params = int(self._o[-1])

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """Name and shape of each tensor, in flat-vector order."""
        d, h, c = self.n_features, self.hidden, self.n_classes
        return [("W1", (d, h)), ("b1", (h,)), ("W2", (h, c)), ("b2", (c,))]

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        """He-normal W1 (ReLU keeps half the variance), Glorot-normal W2 (linear output), zero
        biases: activations and logits start at unit-order scale, so plain SGD works at once."""
        d, h, c = self.n_features, self.hidden, self.n_classes
        p = np.zeros(self.n_params, dtype=np.float32)
        o = self._o
        p[o[0] : o[1]] = rng.standard_normal(d * h, dtype=np.float32) * np.float32(np.sqrt(2.0 / d))
        p[o[2] : o[3]] = rng.standard_normal(h * c, dtype=np.float32) * np.float32(
            np.sqrt(2.0 / (h + c))
        )
        return p

    def _unpack(self, params: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        d, h, c = self.n_features, self.hidden, self.n_classes
        o = self._o
        return (
            params[o[0] : o[1]].reshape(d, h),
            params[o[1] : o[2]],
            params[o[2] : o[3]].reshape(h, c),
            params[o[3] : o[4]],
        )

    def _forward(self, params: np.ndarray, X: np.ndarray):
        dt = _compute_dtype(params, X)
        W1, b1, W2, b2 = self._unpack(params.astype(dt, copy=False))
        Xc = X.astype(dt, copy=False)
        hid = Xc @ W1
        hid += b1
        np.maximum(hid, 0, out=hid)
        return Xc, hid, W2, hid @ W2 + b2

    def logits(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        check_batch(self, params, X, None)
        return self._forward(params, X)[3]

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        check_batch(self, params, X, y)
        return mean_cross_entropy(self._forward(params, X)[3], y)

    def _backward_signals(self, params: np.ndarray, X: np.ndarray, y: np.ndarray):
        """Per-sample dLoss/dlogits and dLoss/dpre-activation (unscaled by 1/n)."""
        Xc, hid, W2, z = self._forward(params, X)
        dz = softmax_minus_onehot(z, y)
        dh = dz @ W2.T
        dh *= hid > 0  # ReLU gate; the subgradient at 0 is taken as 0
        return Xc, hid, dz, dh

    def grad(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        check_batch(self, params, X, y)
        Xc, hid, dz, dh = self._backward_signals(params, X, y)
        n = X.shape[0]
        o = self._o
        out = np.empty(self.n_params, dtype=dz.dtype)
        out[o[0] : o[1]] = (Xc.T @ dh).ravel()
        out[o[1] : o[2]] = dh.sum(axis=0)
        out[o[2] : o[3]] = (hid.T @ dz).ravel()
        out[o[3] : o[4]] = dz.sum(axis=0)
        out /= n
        return out

    def per_sample_grads(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Row i is grad of sample i's loss; outer products by einsum, written straight into the
        result so peak memory is the (n, n_params) output plus O(n * hidden) scratch."""
        check_batch(self, params, X, y)
        Xc, hid, dz, dh = self._backward_signals(params, X, y)
        n = X.shape[0]
        d, h, c = self.n_features, self.hidden, self.n_classes
        o = self._o
        out = np.empty((n, self.n_params), dtype=dz.dtype)
        np.einsum("nd,nh->ndh", Xc, dh, out=out[:, o[0] : o[1]].reshape(n, d, h))
        out[:, o[1] : o[2]] = dh
        np.einsum("nh,nc->nhc", hid, dz, out=out[:, o[2] : o[3]].reshape(n, h, c))
        out[:, o[3] : o[4]] = dz
        return out
