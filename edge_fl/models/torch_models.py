"""LeNet-5 and a small CNN on the PyTorch backend, behind the flat-vector `Model` interface.

The rest of the system sees numpy in, numpy out and one flat float32 parameter vector. Inside, the
vector is split into views shaped like the network's parameters and evaluated with
``torch.func.functional_call``. Per-sample gradients, an ``(n, n_params)`` matrix for DP-SGD, come
without a Python loop over samples, by one of two methods (``per_sample=``):
``"vmap"``: ``torch.func.vmap(grad(...))`` over the flat vector; works for any network.
``"expand"``: one batched backward pass to the layer outputs, then per-layer outer products /
correlations (Goodfellow 2015); about 2x faster for LeNet-5 at batch 64, which is what keeps a
DP-SGD step within 3x of a plain step; only for Linear and stride-1 Conv2d layers.
``"auto"`` (default) picks "expand" when the network allows it. Both are tested against a loop.

Flat layout: the network's parameters in ``named_parameters()`` order, each flattened in C order, in
PyTorch's native orientation (conv weight ``(out, in, kh, kw)``, linear weight ``(out, in)``), which
differs from the numpy models' ``(in, out)``. ``layout()`` lists the entries.

Threads: torch defaults to one thread per core, which in a simulation starves the aggregator, the
MQTT event loop and onnxruntime evaluation running in the same process, and oversubscribes the
machine when several agent processes run side by side. The first model built therefore sets torch
to ``EDGE_FL_TORCH_THREADS`` threads if that variable is set, else half the cores capped at 4, and
one inter-op thread (we never run independent torch ops concurrently); ``configure_torch_threads``
overrides.
"""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # keep the core usable without torch; say exactly what to install
    # ModuleNotFoundError (an ImportError) with name="torch" lets the model registry recognise it
    raise ModuleNotFoundError(
        "torch models need PyTorch: pip install torch==2.13.0", name="torch"
    ) from exc

import contextlib
import copy
import math
import os
import threading
from collections.abc import Callable

import numpy as np
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

__all__ = [
    "CNN",
    "PER_SAMPLE_METHODS",
    "LeNet",
    "LeNet5",
    "SmallCNN",
    "TorchModel",
    "configure_torch_threads",
    "image_size_for",
    "lenet5_param_count",
    "make_cnn",
    "make_lenet",
]

PER_SAMPLE_METHODS = ("auto", "expand", "vmap")

_threads_configured = False


def configure_torch_threads(n_threads: int | None = None) -> int:
    """Set torch's intra-op thread count (see the module docstring for why); returns the count."""
    global _threads_configured
    if n_threads is None:
        env = os.environ.get("EDGE_FL_TORCH_THREADS")
        if env is not None:
            try:
                n_threads = int(env)
            except ValueError:
                raise ValueError(
                    f"EDGE_FL_TORCH_THREADS must be a positive integer, got {env!r}"
                ) from None
        else:
            n_threads = max(1, min(4, (os.cpu_count() or 1) // 2))
    if n_threads < 1:
        raise ValueError(f"n_threads must be >= 1, got {n_threads}")
    torch.set_num_threads(n_threads)
    if not _threads_configured:
        # only allowed before torch's first parallel work; harmless to skip afterwards
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
    _threads_configured = True
    return n_threads


def _ensure_threads() -> None:
    if not _threads_configured:
        configure_torch_threads()


def _pooled(size: int, kernel: int, padding: int) -> int:
    """Spatial size after a stride-1 conv (kernel, padding) then a 2x2/2 max-pool."""
    return (size + 2 * padding - kernel + 1) // 2


def lenet5_param_count(n_classes: int = 62, in_channels: int = 1, image_size: int = 28) -> int:
    """Closed form of LeNet5's parameter count (see the class docstring)."""
    s = _pooled(_pooled(image_size, 5, 2), 5, 0)
    return (
        6 * (25 * in_channels + 1)  # conv1
        + 16 * (25 * 6 + 1)  # conv2
        + 120 * (16 * s * s + 1)  # fc1
        + 84 * (120 + 1)  # fc2
        + n_classes * (84 + 1)  # fc3
    )


class TorchModel:
    """Shared machinery: flat vector <-> parameter views, numpy <-> tensors, loss and gradients."""

    name: str
    n_features: int
    n_classes: int
    n_params: int

    def __init__(
        self,
        net: nn.Module,
        n_features: int,
        n_classes: int,
        chunk_size: int | None,
        per_sample: str = "auto",
    ):
        _ensure_threads()
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
        if per_sample not in PER_SAMPLE_METHODS:
            raise ValueError(f"per_sample={per_sample!r}; allowed: {PER_SAMPLE_METHODS}")
        self.net = net.eval()  # no dropout/batch-norm, but make it explicit
        for p in self.net.parameters():
            p.requires_grad_(False)
        self.n_features = n_features
        self.n_classes = n_classes
        self._names = [n for n, _ in net.named_parameters()]
        self._shapes = [tuple(p.shape) for _, p in net.named_parameters()]
        self._sizes = [math.prod(s) for s in self._shapes]
        self.n_params = int(sum(self._sizes))
        self.chunk_size = chunk_size  # rows per per-sample-gradient pass: bounds peak memory
        self._per_sample_vmap: Callable[..., torch.Tensor] = vmap(
            grad(self._sample_loss), in_dims=(None, 0, 0), chunk_size=chunk_size
        )
        self._batch_grad: Callable[..., torch.Tensor] = grad(self._batch_loss)
        self._layers = _expandable_layers(net, self._names)
        if per_sample == "auto":
            per_sample = "vmap" if self._layers is None else "expand"
        elif per_sample == "expand" and self._layers is None:
            raise ValueError(
                "per_sample='expand' needs a network of Linear and stride-1 Conv2d layers only"
            )
        self.per_sample = per_sample
        # functional_call swaps the module's parameters in place and the expansion trick hooks
        # its layers, so calls on one instance are serialised (one instance per thread for
        # parallelism)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n_features={self.n_features}, n_classes={self.n_classes}, "
            f"n_params={self.n_params})"
        )

    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of each block of the flat vector, in order."""
        return list(zip(self._names, self._shapes, strict=True))

    # -- flat vector <-> named tensors ------------------------------------------------------------

    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = torch.split(flat, self._sizes)
        return {n: p.view(s) for n, p, s in zip(self._names, parts, self._shapes, strict=True)}

    def _forward(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.net, self._unflatten(flat), (x,))

    def _batch_loss(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self._forward(flat, x), y)

    def _sample_loss(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self._forward(flat, x.unsqueeze(0)), y.unsqueeze(0))

    def module_with(self, params: np.ndarray) -> nn.Module:
        """An independent copy of the network holding ``params`` (for the ONNX exporter)."""
        flat = self._params(params)
        with self._lock:
            module = copy.deepcopy(self.net)
        module.load_state_dict({n: t.clone() for n, t in self._unflatten(flat).items()})
        return module.eval()

    # -- validation / conversion -------------------------------------------------------------------

    def _params(self, params: np.ndarray) -> torch.Tensor:
        p = np.asarray(params)
        if p.shape != (self.n_params,):
            raise ValueError(f"params must have shape ({self.n_params},), got {p.shape}")
        return torch.from_numpy(np.array(p, dtype=np.float32))  # copy: callers keep their array

    def _X(self, X: np.ndarray) -> torch.Tensor:
        a = np.asarray(X)
        if a.ndim != 2 or a.shape[1] != self.n_features:
            raise ValueError(f"X must have shape (n, {self.n_features}), got {a.shape}")
        return torch.from_numpy(np.array(a, dtype=np.float32))

    def _y(self, y: np.ndarray, n: int) -> torch.Tensor:
        a = np.asarray(y)
        if a.shape != (n,):
            raise ValueError(f"y must have shape ({n},) to match X, got {a.shape}")
        if a.dtype.kind not in "iu":
            raise ValueError(f"y must hold integer class labels, got dtype {a.dtype}")
        if n and (a.min() < 0 or a.max() >= self.n_classes):
            raise ValueError(
                f"y labels must lie in [0, {self.n_classes}), got range [{a.min()}, {a.max()}]"
            )
        return torch.from_numpy(a.astype(np.int64))

    # -- the Model protocol ------------------------------------------------------------------------

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        """He-uniform weights for layers feeding a ReLU, 1/sqrt(fan_in) for the output layer, zero
        biases; drawn from the injected generator so runs are reproducible when it is seeded."""
        out = np.empty(self.n_params, dtype=np.float32)
        offset = 0
        last_weight = max(i for i, n in enumerate(self._names) if n.endswith("weight"))
        for i, (name, shape, size) in enumerate(
            zip(self._names, self._shapes, self._sizes, strict=True)
        ):
            if name.endswith("bias"):
                out[offset : offset + size] = 0.0
            else:
                fan_in = math.prod(shape[1:])
                bound = math.sqrt(1.0 / fan_in) if i == last_weight else math.sqrt(6.0 / fan_in)
                out[offset : offset + size] = rng.uniform(-bound, bound, size)
            offset += size
        return out

    def logits(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        flat, x = self._params(params), self._X(X)
        with self._lock, torch.inference_mode():
            return self._forward(flat, x).numpy()

    def loss(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> float:
        flat, x = self._params(params), self._X(X)
        yt = self._y(y, x.shape[0])
        with self._lock, torch.inference_mode():
            return float(self._batch_loss(flat, x, yt))

    def grad(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        flat, x = self._params(params), self._X(X)
        yt = self._y(y, x.shape[0])
        with self._lock:
            return self._batch_grad(flat, x, yt).numpy()

    def per_sample_grads(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        flat, x = self._params(params), self._X(X)
        yt = self._y(y, x.shape[0])
        if x.shape[0] == 0:
            return np.zeros((0, self.n_params), dtype=np.float32)
        with self._lock:
            if self.per_sample == "vmap":
                return self._per_sample_vmap(flat, x, yt).numpy()
            out = torch.empty((x.shape[0], self.n_params), dtype=torch.float32)
            step = self.chunk_size or x.shape[0]
            for i in range(0, x.shape[0], step):
                sl = slice(i, i + step)
                self._per_sample_expand(flat, x[sl], yt[sl], out[sl])
            return out.numpy()

    def _per_sample_expand(
        self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Per-sample gradients from one batched backward pass (Goodfellow 2015's trick).

        A layer's weight gradient for sample i only needs the layer's input a_i and the gradient
        of sample i's loss with respect to the layer's output g_i: outer(g_i, a_i) for a linear
        layer, the correlation of a_i with g_i for a convolution. So one backward pass to the
        layer outputs of the summed loss, then one small product per layer, yields every row;
        about half the time of vmap(grad) for LeNet-5 at batch 64 (tools/bench_dpsgd_torch.py).
        """
        layers = self._layers
        assert layers is not None
        seen: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor):
            if module in seen:
                raise RuntimeError(f"layer {module} ran twice; use per_sample='vmap'")
            seen[module] = (inputs[0].detach(), output)

        handles = [layer.register_forward_hook(record) for layer in layers]
        try:
            with torch.enable_grad():
                x = x.detach().requires_grad_()  # makes the layer outputs part of the graph
                loss = F.cross_entropy(self._forward(flat, x), y, reduction="sum")
                grads = torch.autograd.grad(loss, [seen[layer][1] for layer in layers])
        finally:
            for h in handles:
                h.remove()

        n = x.shape[0]
        offset = 0
        for layer, g in zip(layers, grads, strict=True):
            a = seen[layer][0]
            w_shape = tuple(layer.weight.shape)
            w_out = out[:, offset : offset + layer.weight.numel()].unflatten(1, w_shape)
            offset += layer.weight.numel()
            b_out = out[:, offset : offset + w_shape[0]]
            offset += w_shape[0]
            if isinstance(layer, nn.Linear):
                torch.mul(g.unsqueeze(2), a.unsqueeze(1), out=w_out)
                b_out.copy_(g)
            else:
                # correlation of each sample's input with its own output gradient, as one conv
                # with the batch as groups: (C, n, H, W) * (n*O, 1, Ho, Wo) -> (C, n*O, kh, kw)
                padding = layer.padding
                assert not isinstance(padding, str)  # _expandable_layers admits no 'same'/'valid'
                ph, pw = padding
                a = F.pad(a, (pw, pw, ph, ph)) if ph or pw else a
                o = w_shape[0]
                kern = g.reshape(n * o, 1, g.shape[2], g.shape[3])
                corr = F.conv2d(a.transpose(0, 1), kern, groups=n)
                w_out.copy_(corr.reshape(w_shape[1], n, o, *w_shape[2:]).permute(1, 2, 0, 3, 4))
                b_out.copy_(g.sum(dim=(2, 3)))


#: the layers whose per-sample gradients the expansion trick computes
ExpandableLayer = nn.Linear | nn.Conv2d


def _expandable_layers(net: nn.Module, names: list[str]) -> list[ExpandableLayer] | None:
    """The layers in parameter order if per-sample gradients can use the expansion trick, else None
    (any other parametrised layer, shared layers, or an order that differs from the flat layout)."""
    layers: list[ExpandableLayer] = []
    expected: list[str] = []
    for prefix, module in net.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if not own:
            continue
        ok_conv = (
            isinstance(module, nn.Conv2d)
            and module.groups == 1
            and module.stride == (1, 1)
            and module.dilation == (1, 1)
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )
        if not (isinstance(module, nn.Linear) or ok_conv) or own != ["weight", "bias"]:
            return None
        assert isinstance(module, ExpandableLayer)  # ok_conv implies a Conv2d
        layers.append(module)
        expected += [f"{prefix}.weight", f"{prefix}.bias"]
    return layers if expected == names else None


class _LeNet5Net(nn.Module):
    def __init__(self, n_classes: int, in_channels: int, image_size: int):
        super().__init__()
        self.shape = (in_channels, image_size, image_size)
        s = _pooled(_pooled(image_size, 5, 2), 5, 0)
        self.conv1 = nn.Conv2d(in_channels, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * s * s, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, *self.shape)  # flat rows in, as everywhere else in edge-fl
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class LeNet5(TorchModel):
    """LeNet-5 (LeCun et al. 1998) with ReLU and max-pooling, the FEMNIST baseline in LEAF-style FL.

    conv 5x5 -> 6 (padding 2) -> ReLU -> maxpool 2 -> conv 5x5 -> 16 (no padding) -> ReLU ->
    maxpool 2 -> fc 120 -> ReLU -> fc 84 -> ReLU -> fc n_classes.
    Padding 2 on the first convolution makes a 28x28 image behave like the original 32x32 input,
    so the feature map before fc1 is 16 x 5 x 5 exactly as in the classic network.

    Parameter count, with c = in_channels, K = n_classes and s = ((H + 4 - 4) // 2 - 4) // 2 the
    spatial size before fc1 (s = 5 for H = 28):
        6(25c + 1) + 16(25*6 + 1) + 120(16 s^2 + 1) + 84(120 + 1) + K(84 + 1)
    For K = 62, c = 1, H = 28: 156 + 2416 + 48120 + 10164 + 5270 = 66126.
    """

    name = "lenet"

    def __init__(
        self,
        n_classes: int = 62,
        in_channels: int = 1,
        image_size: int = 28,
        *,
        chunk_size: int | None = 256,
        per_sample: str = "auto",
    ):
        _check_positive(n_classes=n_classes, in_channels=in_channels)
        if n_classes < 2:
            raise ValueError(f"n_classes must be >= 2, got {n_classes}")
        if _pooled(_pooled(image_size, 5, 2), 5, 0) < 1:
            raise ValueError(f"image_size must be >= 12 for LeNet5, got {image_size}")
        self.in_channels = in_channels
        self.image_size = image_size
        net = _LeNet5Net(n_classes, in_channels, image_size)
        n_features = in_channels * image_size * image_size
        super().__init__(net, n_features, n_classes, chunk_size, per_sample)


class _SmallCNNNet(nn.Module):
    def __init__(
        self,
        n_classes: int,
        in_channels: int,
        image_size: int,
        channels: tuple[int, int],
        hidden: int,
    ):
        super().__init__()
        self.shape = (in_channels, image_size, image_size)
        s = _pooled(_pooled(image_size, 3, 1), 3, 1)
        self.conv1 = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 3, padding=1)
        self.fc1 = nn.Linear(channels[1] * s * s, hidden)
        self.fc2 = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, *self.shape)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


class SmallCNN(TorchModel):
    """A cheap CNN for phones and Pis: two 3x3 'same' convolutions with 2x2 max-pooling, one hidden
    dense layer. With the defaults (28x28x1, channels (8, 16), hidden 32, 10 classes) it has
    80 + 1168 + 25120 + 330 = 26698 parameters, about 40% of LeNet5's."""

    name = "cnn"

    def __init__(
        self,
        n_classes: int = 10,
        in_channels: int = 1,
        image_size: int = 28,
        channels: tuple[int, int] = (8, 16),
        hidden: int = 32,
        *,
        chunk_size: int | None = 256,
        per_sample: str = "auto",
    ):
        given = tuple(int(c) for c in channels)
        if len(given) != 2:
            raise ValueError(f"channels must be a pair of ints, got {given!r}")
        channels = (given[0], given[1])
        _check_positive(
            n_classes=n_classes,
            in_channels=in_channels,
            channels0=channels[0],
            channels1=channels[1],
            hidden=hidden,
        )
        if n_classes < 2:
            raise ValueError(f"n_classes must be >= 2, got {n_classes}")
        if image_size < 4:
            raise ValueError(f"image_size must be >= 4 for SmallCNN, got {image_size}")
        self.in_channels = in_channels
        self.image_size = image_size
        self.channels = channels
        self.hidden = hidden
        net = _SmallCNNNet(n_classes, in_channels, image_size, channels, hidden)
        n_features = in_channels * image_size * image_size
        super().__init__(net, n_features, n_classes, chunk_size, per_sample)


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def image_size_for(n_features: int, in_channels: int = 1) -> int:
    """Side of the square image behind a flat feature count, for registry constructors."""
    if in_channels < 1 or n_features % in_channels:
        raise ValueError(f"n_features={n_features} is not a multiple of in_channels={in_channels}")
    side = math.isqrt(n_features // in_channels)
    if side * side * in_channels != n_features:
        raise ValueError(
            f"n_features={n_features} is not in_channels x H x H for a square image "
            f"(in_channels={in_channels})"
        )
    return side


def make_lenet(n_features: int, n_classes: int, *, in_channels: int = 1, **options) -> LeNet5:
    """Registry constructor: LeNet5 for square images of ``n_features`` pixels per channel."""
    return LeNet5(n_classes, in_channels, image_size_for(n_features, in_channels), **options)


def make_cnn(n_features: int, n_classes: int, *, in_channels: int = 1, **options) -> SmallCNN:
    """Registry constructor: SmallCNN for square images of ``n_features`` pixels per channel."""
    return SmallCNN(n_classes, in_channels, image_size_for(n_features, in_channels), **options)


# Entry points named by the model registry (edge_fl/models/__init__.py):
# (n_features, n_classes, **options) -> Model.
LeNet = make_lenet
CNN = make_cnn
