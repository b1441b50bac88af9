"""The model interface every backend (numpy, torch) implements.

A model is stateless: parameters travel as one flat float32 vector, which is what the wire protocol,
the privacy mechanisms and the aggregator operate on. Backends differ only in how they compute.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Model(Protocol):
    """A classifier over a flat parameter vector."""

    name: str
    n_features: int  # flattened input size
    n_classes: int
    n_params: int

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        """Initial parameters, float32, shape (n_params,)."""
        ...

    def logits(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Class scores, shape (n, n_classes)."""
        ...

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        """Mean cross-entropy over the batch."""
        ...

    def grad(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Gradient of the mean loss, shape (n_params,)."""
        ...

    def per_sample_grads(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Gradient of each sample's loss, shape (n, n_params); needed by DP-SGD and Laplace."""
        ...
