"""Local training on a device's own data: plain minibatch SGD over a flat parameter vector."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_fl.models.base import Model


@dataclass(frozen=True)
class LocalTraining:
    epochs: int = 1
    batch_size: int = 16
    lr: float = 0.1


def local_sgd(
    model: Model,
    params: np.ndarray,
    X: np.ndarray,
    y: np.ndarray,
    training: LocalTraining,
    rng: np.random.Generator,
) -> np.ndarray:
    """Shuffled minibatch SGD for ``training.epochs``; returns new parameters (input untouched).

    A model with its own ``sgd`` (the same steps, checked once instead of per minibatch:
    :meth:`edge_fl.models.logreg.LogisticRegression.sgd`) runs it; the result is bit-identical."""
    sgd = getattr(model, "sgd", None)
    if sgd is not None:
        return sgd(params, X, y, training, rng)
    w = params.astype(np.float32, copy=True)
    n = len(y)
    for _ in range(training.epochs):
        order = rng.permutation(n)
        for start in range(0, n, training.batch_size):
            batch = order[start : start + training.batch_size]
            g = model.grad(w, X[batch], y[batch])
            if np.shape(g) != w.shape:  # a scalar or a broadcastable shape would pass silently
                raise ValueError(
                    f"{type(model).__name__}.grad returned shape {np.shape(g)}, not the "
                    f"parameters' {w.shape}"
                )
            w -= np.float32(training.lr) * np.asarray(g).astype(np.float32)
    return w
