"""numpy models: exact gradients, per-sample gradients, registry, evaluation, training sanity."""

from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest

from edge_fl.data.digits import load_digits_split
from edge_fl.models import (
    MLP,
    BackendUnavailableError,
    LogisticRegression,
    Model,
    evaluate,
    flatten,
    known_models,
    make_model,
    register_lazy_model,
    unflatten,
)
from edge_fl.privacy.rng import seeded_generator

D, C, H = 7, 4, 5


def _models() -> list[Model]:
    return [LogisticRegression(D, C), MLP(D, C, hidden=H)]


def _batch(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = seeded_generator(seed)
    return rng.standard_normal((n, D)), rng.integers(0, C, n)


def _random_params(model: Model, seed: int = 2) -> np.ndarray:
    # Non-zero everywhere (also logreg, whose init is zeros) so every gradient term is exercised.
    return seeded_generator(seed).normal(0, 0.7, model.n_params)


@pytest.fixture(scope="module")
def digits():
    return load_digits_split(0.2, seed=0)


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.name)
def test_grad_matches_central_finite_differences_float64(model):
    X, y = _batch(12)
    p = _random_params(model)
    g = model.grad(p, X, y)
    assert g.dtype == np.float64 and g.shape == (model.n_params,)
    eps = 1e-6
    fd = np.empty_like(p)
    for i in range(p.size):
        e = np.zeros_like(p)
        e[i] = eps
        fd[i] = (model.loss(p + e, X, y) - model.loss(p - e, X, y)) / (2 * eps)
    # Central differences in float64: truncation ~eps^2, rounding ~1e-16/eps = 1e-10.
    np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.name)
def test_per_sample_grads_rows_and_mean(model):
    X, y = _batch(9)
    p = _random_params(model)
    ps = model.per_sample_grads(p, X, y)
    assert ps.shape == (9, model.n_params)
    for i in range(9):
        np.testing.assert_allclose(ps[i], model.grad(p, X[i : i + 1], y[i : i + 1]), atol=1e-12)
    np.testing.assert_allclose(ps.mean(axis=0), model.grad(p, X, y), atol=1e-12)


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.name)
def test_float32_path_stays_float32_and_close_to_float64(model):
    X, y = _batch(16)
    p = _random_params(model)
    p32, X32 = p.astype(np.float32), X.astype(np.float32)
    g32 = model.grad(p32, X32, y)
    ps32 = model.per_sample_grads(p32, X32, y)
    assert g32.dtype == np.float32 and ps32.dtype == np.float32
    assert model.logits(p32, X32).dtype == np.float32
    g64 = model.grad(p32.astype(np.float64), X32.astype(np.float64), y)
    np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.name)
def test_loss_is_stable_for_huge_logits(model):
    X, y = _batch(5)
    p = _random_params(model) * 1e4
    assert np.isfinite(model.loss(p, X, y))
    assert np.all(np.isfinite(model.grad(p, X, y)))


@pytest.mark.parametrize("model", _models(), ids=lambda m: m.name)
def test_plain_gradient_steps_decrease_loss(model):
    X, _ = _batch(64)
    y = (X @ seeded_generator(9).standard_normal((D, C))).argmax(axis=1)  # learnable labels
    p = model.init_params(seeded_generator(3))
    losses = [model.loss(p, X, y)]
    for _ in range(20):
        p = p - np.float32(0.1) * model.grad(p, X, y)
        losses.append(model.loss(p, X, y))
    assert all(b < a for a, b in itertools.pairwise(losses))
    assert losses[-1] < 0.9 * losses[0]


def test_init_params():
    lr = LogisticRegression(D, C)
    p = lr.init_params(seeded_generator(0))
    assert p.dtype == np.float32 and p.shape == (D * C + C,) and not p.any()

    mlp = MLP(64, 10, hidden=64)
    assert mlp.n_params == 4810  # digits: 64*64 + 64 + 64*10 + 10
    a = mlp.init_params(seeded_generator(0))
    b = mlp.init_params(seeded_generator(0))
    c = mlp.init_params(seeded_generator(1))
    assert a.dtype == np.float32 and a.shape == (4810,)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    t = unflatten(mlp, a)
    assert not t["b1"].any() and not t["b2"].any()
    # Std estimates from n normals have relative sd 1/sqrt(2n): 1.1% for W1, 2.8% for W2; 5 sigma+.
    assert abs(t["W1"].std() / np.sqrt(2 / 64) - 1) < 0.06
    assert abs(t["W2"].std() / np.sqrt(2 / 74) - 1) < 0.15


def test_layout_unflatten_flatten_roundtrip():
    for model, names in (
        (LogisticRegression(D, C), ["W", "b"]),
        (MLP(D, C, H), ["W1", "b1", "W2", "b2"]),
    ):
        layout = model.layout()
        assert [n for n, _ in layout] == names
        assert sum(int(np.prod(s)) for _, s in layout) == model.n_params
        p = np.arange(model.n_params, dtype=np.float32)
        t = unflatten(model, p)
        assert np.shares_memory(t[names[0]], p)
        assert np.array_equal(flatten(model, t), p)
    # C order: W[i, j] is at i * n_classes + j, then b; logits = X @ W + b.
    lr = LogisticRegression(D, C)
    p = _random_params(lr).astype(np.float32)
    X, _ = _batch(3)
    t = unflatten(lr, p)
    assert t["W"][2, 3] == p[2 * C + 3] and t["b"][1] == p[D * C + 1]
    np.testing.assert_allclose(lr.logits(p, X.astype(np.float32)), X @ t["W"] + t["b"], rtol=1e-5)
    mlp = MLP(D, C, H)
    p = _random_params(mlp)
    t = unflatten(mlp, p)
    ref = np.maximum(X @ t["W1"] + t["b1"], 0) @ t["W2"] + t["b2"]
    np.testing.assert_allclose(mlp.logits(p, X), ref, rtol=1e-12)
    with pytest.raises(ValueError, match="layout needs"):
        unflatten(mlp, p[:-1])
    with pytest.raises(ValueError, match="W1"):
        flatten(mlp, {"b1": np.zeros(H)})


def test_evaluate_exact_values():
    lr = LogisticRegression(D, C)
    X, y = _batch(50)
    # Zero params: all logits equal, argmax picks class 0, loss is log(C) for every sample.
    acc, loss = evaluate(lr, lr.init_params(seeded_generator(0)), X, y)
    assert acc == pytest.approx(np.mean(y == 0)) and loss == pytest.approx(np.log(C))
    # Batching does not change the result, and the mean loss equals model.loss.
    p = _random_params(lr)
    a1, l1 = evaluate(lr, p, X, y, batch_size=7)
    a2, l2 = evaluate(lr, p, X, y, batch_size=1000)
    assert a1 == a2 == np.mean(lr.logits(p, X).argmax(1) == y)
    assert l1 == pytest.approx(l2, rel=1e-12) and l1 == pytest.approx(lr.loss(p, X, y), rel=1e-12)
    with pytest.raises(ValueError, match="rows"):
        evaluate(lr, p, X[:0], y[:0])
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(lr, p, X, y, batch_size=0)
    with pytest.raises(ValueError, match="labels"):
        evaluate(lr, p, X, y + C)


@pytest.mark.parametrize(
    ("name", "lr", "steps", "target"), [("logreg", 1.0, 300, 0.90), ("mlp", 1.0, 300, 0.93)]
)
def test_full_batch_gd_on_digits_reaches_target_accuracy(digits, name, lr, steps, target):
    X_tr, y_tr, X_te, y_te = digits
    model = make_model(name, X_tr.shape[1], 10)
    p = model.init_params(seeded_generator(0))
    for _ in range(steps):
        p -= np.float32(lr) * model.grad(p, X_tr, y_tr)
    acc, loss = evaluate(model, p, X_te, y_te)
    print(f"{name}: test accuracy {acc:.4f}, loss {loss:.4f}")
    assert acc >= target


def test_registry_and_bad_names():
    assert {"logreg", "mlp", "lenet", "cnn"} <= set(known_models())
    m = make_model("mlp", 64, 10, hidden=32)
    assert isinstance(m, MLP) and isinstance(m, Model) and m.hidden == 32
    assert isinstance(make_model("logreg", 3, 2), LogisticRegression)
    with pytest.raises(ValueError, match=r"known models: \[.*'logreg'.*'mlp'"):
        make_model("resnet", 64, 10)


def test_lazy_entry_reports_missing_backend_module(monkeypatch):
    from edge_fl import models

    monkeypatch.setattr(models, "_REGISTRY", dict(models._REGISTRY))
    register_lazy_model("ghost", "edge_fl.models._no_such_module", "Ghost")
    with pytest.raises(BackendUnavailableError, match=r"ghost.*not available"):
        make_model("ghost", 4, 2)


def test_lazy_entry_reports_missing_torch(monkeypatch, tmp_path):
    from edge_fl import models

    (tmp_path / "fake_torch_backend.py").write_text("import torch\nNet = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    monkeypatch.setattr(models, "_REGISTRY", dict(models._REGISTRY))
    register_lazy_model("tnet", "fake_torch_backend", "Net")
    with pytest.raises(BackendUnavailableError, match=r"needs torch.*pip install torch==2\.13\.0"):
        make_model("tnet", 4, 2)


def test_lazy_entry_builds_model_on_demand(monkeypatch):
    from edge_fl import models

    monkeypatch.setattr(models, "_REGISTRY", dict(models._REGISTRY))
    register_lazy_model("lazy-mlp", "edge_fl.models.mlp", "MLP")
    assert make_model("lazy-mlp", 4, 3, hidden=2).n_params == 4 * 2 + 2 + 2 * 3 + 3


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="n_features"):
        LogisticRegression(0, 3)
    with pytest.raises(ValueError, match="n_classes"):
        MLP(4, 1)
    with pytest.raises(ValueError, match="hidden"):
        MLP(4, 3, hidden=0)
    for model in _models():
        X, y = _batch(4)
        p = _random_params(model)
        with pytest.raises(ValueError, match="params has shape"):
            model.grad(p[:-1], X, y)
        with pytest.raises(ValueError, match="X has shape"):
            model.loss(p, X[:, :-1], y)
        with pytest.raises(ValueError, match="y has shape"):
            model.per_sample_grads(p, X, y[:-1])
        with pytest.raises(ValueError, match=r"allowed domain is \[0, 4\)"):
            model.grad(p, X, np.array([0, 1, 2, 4]))
        with pytest.raises(ValueError, match="integers"):
            model.loss(p, X, y.astype(float))
