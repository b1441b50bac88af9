"""Multinomial logistic (softmax) regression over a flat parameter vector.

Layout of the flat vector (fixed: the ONNX exporter and the wire format rely on it):
``[W (n_features x n_classes, C order), b (n_classes)]``, so ``logits = X @ W + b``.

Precision: parameters are float32. Arithmetic runs in float64 if ``params`` or ``X`` is float64 (the
gradient checks use that), otherwise in float32, which is stable here because the softmax goes
through a max-shifted log-sum-exp and the loss is accumulated in float64.
"""

from __future__ import annotations

import numpy as np

from edge_fl.models.base import Model
from edge_fl.models.training import LocalTraining


def _compute_dtype(params: np.ndarray, X: np.ndarray) -> np.dtype:
    return np.result_type(params.dtype, X.dtype, np.float32)


def check_batch(model: Model, params: np.ndarray, X: np.ndarray, y: np.ndarray | None) -> None:
    """Reject shape/label mistakes early: a wrong layout would otherwise train on garbage."""
    if params.shape != (model.n_params,):
        raise ValueError(
            f"params has shape {params.shape}; {model.name} expects ({model.n_params},)"
        )
    if X.ndim != 2 or X.shape[1] != model.n_features:
        raise ValueError(f"X has shape {X.shape}; {model.name} expects (n, {model.n_features})")
    if y is None:
        return
    if y.shape != (X.shape[0],):
        raise ValueError(f"y has shape {y.shape}; expected ({X.shape[0]},) to match X")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(
            f"y has dtype {y.dtype}; labels must be integers in [0, {model.n_classes})"
        )
    if y.size and (y.min() < 0 or y.max() >= model.n_classes):
        raise ValueError(
            f"y has labels in [{y.min()}, {y.max()}]; allowed domain is [0, {model.n_classes})"
        )


def log_softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax via the max-shift, so large logits never overflow exp."""
    shifted = z - z.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def softmax_minus_onehot(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """d(per-sample CE)/d(logits) = softmax(z) - onehot(y), computed in place on a fresh array."""
    p = np.exp(log_softmax(z))
    p[np.arange(z.shape[0]), y] -= 1
    return p


def mean_cross_entropy(z: np.ndarray, y: np.ndarray) -> float:
    logp = log_softmax(z)
    return float(-np.mean(logp[np.arange(z.shape[0]), y], dtype=np.float64))


def _validate_sizes(n_features: int, n_classes: int) -> None:
    if int(n_features) != n_features or n_features < 1:
        raise ValueError(f"n_features={n_features!r}; must be an integer >= 1")
    if int(n_classes) != n_classes or n_classes < 2:
        raise ValueError(f"n_classes={n_classes!r}; must be an integer >= 2")


class LogisticRegression:
    """Softmax regression; convex, so it is the reference model for privacy and protocol tests."""

    name = "logreg"

    def __init__(self, n_features: int, n_classes: int) -> None:
        _validate_sizes(n_features, n_classes)
        self.n_features = int(n_features)
        self.n_classes = int(n_classes)
        self._n_w = self.n_features * self.n_classes
        self.n_params = self._n_w + self.n_classes

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """Name and shape of each tensor, in flat-vector order."""
        return [("W", (self.n_features, self.n_classes)), ("b", (self.n_classes,))]

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        """All zeros: the loss is convex, so a symmetric start costs nothing and every party starts
        from the same point regardless of its generator. ``rng`` is accepted for the protocol."""
        del rng
        return np.zeros(self.n_params, dtype=np.float32)

    def _unpack(self, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        W = params[: self._n_w].reshape(self.n_features, self.n_classes)
        return W, params[self._n_w :]

    def logits(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        check_batch(self, params, X, None)
        dt = _compute_dtype(params, X)
        W, b = self._unpack(params.astype(dt, copy=False))
        return X.astype(dt, copy=False) @ W + b

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        check_batch(self, params, X, y)
        return mean_cross_entropy(self.logits(params, X), y)

    def grad(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        check_batch(self, params, X, y)
        dt = _compute_dtype(params, X)
        Xc = X.astype(dt, copy=False)
        dz = softmax_minus_onehot(self.logits(params, X), y)
        dz /= X.shape[0]
        out = np.empty(self.n_params, dtype=dt)
        out[: self._n_w] = (Xc.T @ dz).ravel()
        out[self._n_w :] = dz.sum(axis=0)
        return out

    def sgd(
        self,
        params: np.ndarray,
        X: np.ndarray,
        y: np.ndarray,
        training: LocalTraining,
        rng: np.random.Generator,
    ) -> np.ndarray:
        """:func:`edge_fl.models.training.local_sgd` for this model, bit for bit: the same numpy
        operations on the same arrays, with the shape checks, dtype choice and parameter views made
        once for the device's data instead of twice per minibatch (those were over half of a small
        device's training time: docs/bench/profile-10k.md)."""
        w = params.astype(np.float32, copy=True)
        check_batch(self, w, X, y)
        dt = _compute_dtype(w, X)
        Xc = X.astype(dt, copy=False)
        wc = w.astype(dt, copy=False)  # w itself when dt is float32: the views follow its updates
        W, b = self._unpack(wc)
        n_w = self._n_w
        lr = np.float32(training.lr)
        n = len(y)
        size = training.batch_size
        rows = np.arange(min(n, size))
        maximum, add, exp, log = np.maximum.reduce, np.add.reduce, np.exp, np.log
        subtract, multiply = np.subtract, np.multiply
        for _ in range(training.epochs):
            order = rng.permutation(n)
            if wc is w:
                # the epoch's rows gathered once (each batch a contiguous slice holding the rows
                # Xc[batch] would copy), and every step's temporaries written in place: the same
                # operations on the same values, fewer calls and allocations per minibatch
                Xo, yo = Xc[order], y[order]
                for start in range(0, n, size):
                    Xb = Xo[start : start + size]
                    m = Xb.shape[0]
                    z = Xb @ W
                    z += b
                    subtract(z, maximum(z, axis=1, keepdims=True), out=z)  # shifted
                    dz = exp(z)
                    subtract(z, log(add(dz, axis=1, keepdims=True)), out=z)
                    exp(z, out=dz)
                    dz[rows[:m], yo[start : start + size]] -= 1
                    dz /= m
                    g = Xb.T @ dz
                    W -= multiply(lr, g, out=g)
                    b -= lr * add(dz, axis=0)
                continue
            for start in range(0, n, size):
                batch = order[start : start + size]
                Xb = Xc[batch]
                W, b = self._unpack(w.astype(dt))  # float64 data: cast anew each step, as grad
                # softmax_minus_onehot(Xb @ W + b, y[batch]) / batch, its very operations (the
                # ufuncs' reductions that ndarray.max and .sum call)
                z = Xb @ W + b
                shifted = z - maximum(z, axis=1, keepdims=True)
                dz = exp(shifted - log(add(exp(shifted), axis=1, keepdims=True)))
                dz[rows[: len(batch)], y[batch]] -= 1
                dz /= Xb.shape[0]
                g = np.empty(self.n_params, dtype=dt)
                g[:n_w] = (Xb.T @ dz).ravel()
                g[n_w:] = add(dz, axis=0)
                w -= lr * g.astype(np.float32, copy=False)
        return w

    def per_sample_grads(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Row i is grad of sample i's loss: [outer(x_i, dz_i).ravel(), dz_i].

        Memory: n * n_params * itemsize bytes for the result (plus n * n_classes scratch), e.g.
        64 features, 10 classes -> 650 params -> 2.6 kB per sample in float32.
        """
        check_batch(self, params, X, y)
        dt = _compute_dtype(params, X)
        n = X.shape[0]
        dz = softmax_minus_onehot(self.logits(params, X), y)
        out = np.empty((n, self.n_params), dtype=dt)
        w_view = out[:, : self._n_w].reshape(n, self.n_features, self.n_classes)
        np.einsum("nd,nc->ndc", X.astype(dt, copy=False), dz, out=w_view)
        out[:, self._n_w :] = dz
        return out
