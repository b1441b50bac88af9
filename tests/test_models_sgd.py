"""LogisticRegression.sgd (the checked-once fast path of local_sgd) gives the same parameters,
bit for bit, as minibatch SGD over ``model.grad``: the fleet's training must not change with it."""

from __future__ import annotations

import numpy as np
import pytest

from edge_fl.models.logreg import LogisticRegression
from edge_fl.models.training import LocalTraining, local_sgd


def reference_sgd(model, params, X, y, training, rng):
    """The generic loop of ``local_sgd``, written out: one checked ``model.grad`` per step."""
    w = params.astype(np.float32, copy=True)
    for _ in range(training.epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y), training.batch_size):
            batch = order[start : start + training.batch_size]
            w -= np.float32(training.lr) * model.grad(w, X[batch], y[batch]).astype(np.float32)
    return w


@pytest.mark.parametrize("x_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 37])
def test_the_fast_path_is_bit_identical(x_dtype, n):
    data = np.random.default_rng(n)
    model = LogisticRegression(12, 5)
    X = data.normal(size=(n, 12)).astype(x_dtype) * 3
    y = data.integers(0, 5, size=n)
    params = data.normal(size=model.n_params).astype(np.float32)
    training = LocalTraining(epochs=3, batch_size=8, lr=0.3)
    fast = local_sgd(model, params, X, y, training, np.random.default_rng(7))
    slow = reference_sgd(model, params, X, y, training, np.random.default_rng(7))
    assert fast.dtype == slow.dtype == np.float32
    assert fast.tobytes() == slow.tobytes()
    assert not np.array_equal(fast, params)  # it trained


def test_the_fast_path_checks_the_data_once():
    model = LogisticRegression(4, 3)
    training = LocalTraining()
    params = np.zeros(model.n_params, np.float32)
    with pytest.raises(ValueError, match="labels"):
        local_sgd(
            model,
            params,
            np.ones((4, 4)),
            np.array([0, 1, 2, 3]),
            training,
            np.random.default_rng(0),
        )
    with pytest.raises(ValueError, match="X has shape"):
        local_sgd(
            model, params, np.ones((4, 5)), np.zeros(4, int), training, np.random.default_rng(0)
        )
