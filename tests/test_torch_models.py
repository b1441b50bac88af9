"""The torch backend behind the flat-vector Model protocol: gradients, sizes, training."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edge_fl.models import make_model  # noqa: E402
from edge_fl.models.base import Model  # noqa: E402
from edge_fl.models.torch_models import (  # noqa: E402
    LeNet5,
    SmallCNN,
    configure_torch_threads,
    image_size_for,
    lenet5_param_count,
)
from edge_fl.privacy.rng import seeded_generator  # noqa: E402

pytestmark = pytest.mark.torch


def _batch(model, n, seed=0):
    rng = seeded_generator(seed)
    X = rng.random((n, model.n_features), dtype=np.float32)
    y = rng.integers(0, model.n_classes, n)
    return X, y


@pytest.fixture(scope="module")
def lenet():
    return LeNet5(n_classes=62)


@pytest.fixture(scope="module")
def cnn():
    return SmallCNN(n_classes=10, image_size=12, channels=(4, 8), hidden=16)


def test_lenet5_parameter_count_for_femnist(lenet):
    # 6(25+1) + 16(150+1) + 120(400+1) + 84(120+1) + 62(84+1), as documented
    assert lenet.n_params == 66126
    assert lenet5_param_count(62, 1, 28) == 66126
    assert sum(p.numel() for p in lenet.net.parameters()) == 66126
    assert [s for _, s in lenet.layout()][:2] == [(6, 1, 5, 5), (6,)]
    assert dict(lenet.layout())["fc1.weight"] == (120, 16 * 5 * 5)


def test_lenet5_parameter_formula_other_shapes():
    for k, c, h in [(10, 1, 28), (10, 3, 32), (47, 1, 28), (2, 1, 12)]:
        assert LeNet5(k, c, h).n_params == lenet5_param_count(k, c, h)
    # RGB 32x32 (CIFAR-like): feature map 16 x 6 x 6 before fc1 with padding 2
    assert lenet5_param_count(10, 3, 32) == 6 * 76 + 16 * 151 + 120 * (16 * 36 + 1) + 84 * 121 + 850


def test_models_satisfy_protocol_and_registry(lenet, cnn):
    assert isinstance(lenet, Model) and isinstance(cnn, Model)
    m = make_model("lenet", 784, 62)
    assert isinstance(m, LeNet5) and m.n_params == 66126 and m.name == "lenet"
    c = make_model("cnn", 144, 10, channels=(4, 8), hidden=16)
    assert isinstance(c, SmallCNN) and c.name == "cnn" and c.n_params == cnn.n_params


@pytest.mark.parametrize("method", ["expand", "vmap"])
@pytest.mark.parametrize("which", ["lenet", "cnn"])
def test_per_sample_grads_match_a_loop(which, method, lenet, cnn):
    model = lenet if which == "lenet" else cnn
    assert model.per_sample == "expand"  # the default where the network allows it
    if method == "vmap":  # torch.func.vmap(grad(...)), the generic path
        model = (
            LeNet5(n_classes=62, per_sample="vmap")
            if which == "lenet"
            else SmallCNN(10, image_size=12, channels=(4, 8), hidden=16, per_sample="vmap")
        )
    params = model.init_params(seeded_generator(1))
    X, y = _batch(model, 6, seed=2)
    G = model.per_sample_grads(params, X, y)
    assert G.shape == (6, model.n_params) and G.dtype == np.float32
    loop = np.stack([model.grad(params, X[i : i + 1], y[i : i + 1]) for i in range(6)])
    np.testing.assert_allclose(G, loop, rtol=1e-4, atol=1e-6)
    # the mean of per-sample gradients is the batch gradient
    np.testing.assert_allclose(G.mean(axis=0), model.grad(params, X, y), rtol=1e-4, atol=1e-6)
    # samples differ, so rows must too (guards against broadcasting one gradient)
    assert not np.allclose(G[0], G[1])


@pytest.mark.parametrize("method", ["expand", "vmap"])
def test_per_sample_grads_chunking_is_transparent(cnn, method):
    chunked = SmallCNN(
        10, image_size=12, channels=(4, 8), hidden=16, chunk_size=2, per_sample=method
    )
    params = cnn.init_params(seeded_generator(3))
    X, y = _batch(cnn, 5, seed=4)
    np.testing.assert_allclose(
        chunked.per_sample_grads(params, X, y), cnn.per_sample_grads(params, X, y), atol=1e-6
    )
    empty = chunked.per_sample_grads(params, X[:0], y[:0])
    assert empty.shape == (0, cnn.n_params)


def test_per_sample_method_selection():
    class Odd(torch.nn.Module):  # a strided conv: not covered by the expansion trick
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 2, 3, stride=2)
            self.fc = torch.nn.Linear(2 * 3 * 3, 3)

        def forward(self, x):
            return self.fc(torch.flatten(self.conv(x.reshape(-1, 1, 8, 8)), 1))

    from edge_fl.models.torch_models import TorchModel

    odd = TorchModel(Odd(), 64, 3, chunk_size=None)
    assert odd.per_sample == "vmap"
    params = odd.init_params(seeded_generator(12))
    X, y = _batch(odd, 4)
    loop = np.stack([odd.grad(params, X[i : i + 1], y[i : i + 1]) for i in range(4)])
    np.testing.assert_allclose(odd.per_sample_grads(params, X, y), loop, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="per_sample='expand' needs"):
        TorchModel(Odd(), 64, 3, chunk_size=None, per_sample="expand")
    with pytest.raises(ValueError, match="per_sample='fast'"):
        LeNet5(per_sample="fast")


def test_gradient_matches_finite_differences(cnn):
    params = cnn.init_params(seeded_generator(5)).astype(np.float64)
    X, y = _batch(cnn, 4, seed=6)
    g = cnn.grad(params, X, y)
    rng = seeded_generator(7)
    for i in rng.choice(cnn.n_params, 5, replace=False):
        e = np.zeros_like(params)
        e[i] = 1e-2
        fd = (cnn.loss(params + e, X, y) - cnn.loss(params - e, X, y)) / 2e-2
        assert abs(fd - g[i]) < 2e-3 + 2e-2 * abs(g[i])


def test_sgd_steps_reduce_loss(lenet):
    params = lenet.init_params(seeded_generator(8))
    X, y = _batch(lenet, 32, seed=9)
    start = lenet.loss(params, X, y)
    for _ in range(8):
        params = params - np.float32(0.1) * lenet.grad(params, X, y)
    assert params.dtype == np.float32
    assert lenet.loss(params, X, y) < 0.8 * start


def test_logits_and_init_are_deterministic(cnn):
    a = cnn.init_params(seeded_generator(10))
    b = cnn.init_params(seeded_generator(10))
    assert a.dtype == np.float32 and a.shape == (cnn.n_params,)
    np.testing.assert_array_equal(a, b)
    X, _ = _batch(cnn, 3)
    z = cnn.logits(a, X)
    assert z.shape == (3, 10) and z.dtype == np.float32
    np.testing.assert_array_equal(z, cnn.logits(a, X))
    # caller's array is not modified by the model
    np.testing.assert_array_equal(a, b)


def test_bad_inputs_are_rejected(cnn):
    params = cnn.init_params(seeded_generator(11))
    X, y = _batch(cnn, 3)
    with pytest.raises(ValueError, match="params must have shape"):
        cnn.logits(params[:-1], X)
    with pytest.raises(ValueError, match=r"X must have shape \(n, 144\)"):
        cnn.logits(params, X[:, :-1])
    with pytest.raises(ValueError, match="y labels must lie in"):
        cnn.loss(params, X, np.array([0, 1, 10]))
    with pytest.raises(ValueError, match="y must have shape"):
        cnn.grad(params, X, y[:2])
    with pytest.raises(ValueError, match="integer class labels"):
        cnn.per_sample_grads(params, X, y.astype(np.float32))
    with pytest.raises(ValueError, match="image_size must be >= 12"):
        LeNet5(10, 1, 8)
    with pytest.raises(ValueError, match="n_classes must be"):
        LeNet5(1)
    with pytest.raises(ValueError, match="chunk_size"):
        SmallCNN(chunk_size=0)
    with pytest.raises(ValueError, match="square image"):
        image_size_for(785)
    with pytest.raises(ValueError, match="multiple of in_channels"):
        image_size_for(784, 3)
    assert image_size_for(3 * 32 * 32, 3) == 32


def test_thread_configuration(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert configure_torch_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("EDGE_FL_TORCH_THREADS", "2")
        assert configure_torch_threads() == 2 and torch.get_num_threads() == 2
        monkeypatch.setenv("EDGE_FL_TORCH_THREADS", "many")
        with pytest.raises(ValueError, match="EDGE_FL_TORCH_THREADS"):
            configure_torch_threads()
        with pytest.raises(ValueError, match="n_threads must be >= 1"):
            configure_torch_threads(0)
    finally:
        torch.set_num_threads(before)
