"""Model registry, evaluation and flat-vector layout helpers.

Backends register a factory ``(n_features, n_classes, **options) -> Model`` under a name. numpy
models are registered eagerly; torch models are *lazy* entries, so importing this package never
imports torch and a missing torch only fails when such a model is actually requested.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import numpy as np

from edge_fl.models.base import Model
from edge_fl.models.logreg import LogisticRegression, log_softmax
from edge_fl.models.mlp import MLP

__all__ = [
    "MLP",
    "BackendUnavailableError",
    "LogisticRegression",
    "Model",
    "evaluate",
    "flatten",
    "known_models",
    "make_model",
    "onnx_exporter",
    "register_lazy_model",
    "register_model",
    "unflatten",
]

ModelFactory = Callable[..., Model]

TORCH_INSTALL_HINT = "pip install torch==2.13.0"


class BackendUnavailableError(ImportError):
    """A registered model whose backend (e.g. torch) cannot be imported here."""


_REGISTRY: dict[str, ModelFactory] = {}


def register_model(name: str, factory: ModelFactory) -> None:
    """Register (or replace) the factory for ``name``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"model name={name!r}; must be a non-empty string")
    _REGISTRY[name] = factory


def register_lazy_model(name: str, module: str, attr: str, *, requires: str = "torch") -> None:
    """Register ``module.attr`` as the factory for ``name``, imported only on first use.

    If ``requires`` (a top-level package) cannot be imported, the call fails with a
    :class:`BackendUnavailableError` that says what to install.
    """

    def factory(n_features: int, n_classes: int, **options) -> Model:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").split(".")[0]
            if missing == requires:
                hint = f" ({TORCH_INSTALL_HINT})" if requires == "torch" else ""
                raise BackendUnavailableError(
                    f"model {name!r} needs {requires}, which is not installed{hint}"
                ) from exc
            if exc.name == module:
                raise BackendUnavailableError(
                    f"model {name!r} lives in {module}, which is not available in this build"
                ) from exc
            raise
        return getattr(mod, attr)(n_features, n_classes, **options)

    factory.__qualname__ = f"lazy[{module}.{attr}]"
    register_model(name, factory)


register_model("logreg", LogisticRegression)
register_model("mlp", MLP)
# Torch backend hook: edge_fl/models/torch_models.py must define LeNet and CNN with the signature
# (n_features, n_classes, **options) -> Model.
register_lazy_model("lenet", "edge_fl.models.torch_models", "LeNet")
register_lazy_model("cnn", "edge_fl.models.torch_models", "CNN")


def known_models() -> list[str]:
    return sorted(_REGISTRY)


def onnx_exporter(model: Model) -> Callable[[np.ndarray], bytes] | None:
    """How to write ``model`` as ONNX (``params -> bytes``), or None when it cannot be.

    A model of one's own exports itself with an ``onnx_bytes(params)`` method (the torch wrapper,
    ``edge_fl.models.torch_module``, has one); the packaged models go through
    ``edge_fl.models.onnx_export``. onnx is imported only when the export runs, and for the numpy
    models only the first time a shape is exported on this machine (``onnx_template``)."""
    own = getattr(model, "onnx_bytes", None)
    if callable(own):
        return own
    torch_models = sys.modules.get("edge_fl.models.torch_models")  # not imported: no torch model
    packaged: tuple[type, ...] = (LogisticRegression, MLP)
    if torch_models is not None:
        packaged += (torch_models.TorchModel,)
    if not isinstance(model, packaged):
        return None

    def export(params: np.ndarray) -> bytes:
        from edge_fl.models.onnx_layout import onnx_weights
        from edge_fl.models.onnx_template import template

        made = template(model)  # the numpy models: without importing onnx (onnx_template)
        if made is not None:
            return made.model_bytes(onnx_weights(model, params))
        from edge_fl.models.onnx_export import onnx_bytes

        return onnx_bytes(model, params)

    return export


def make_model(name: str, n_features: int, n_classes: int, **options) -> Model:
    """Build the model registered as ``name``; options go to its constructor (e.g. ``hidden``)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"model={name!r} is unknown; known models: {known_models()}") from None
    return factory(n_features, n_classes, **options)


def unflatten(model: Model, params: np.ndarray) -> dict[str, np.ndarray]:
    """Named views (no copies) into ``params`` following ``model.layout()``."""
    shapes = model.layout()  # type: ignore[attr-defined]
    sizes = [int(np.prod(s)) for _, s in shapes]
    if params.shape != (sum(sizes),):
        raise ValueError(f"params has shape {params.shape}; layout needs ({sum(sizes)},)")
    out: dict[str, np.ndarray] = {}
    start = 0
    for (name, shape), size in zip(shapes, sizes, strict=True):
        out[name] = params[start : start + size].reshape(shape)
        start += size
    return out


def flatten(model: Model, tensors: dict[str, np.ndarray]) -> np.ndarray:
    """Inverse of :func:`unflatten`: the flat float32 vector in layout order."""
    layout = model.layout()  # type: ignore[attr-defined]
    parts = []
    for name, shape in layout:
        if name not in tensors:
            raise ValueError(f"tensor {name!r} missing; layout needs {[n for n, _ in layout]}")
        t = np.asarray(tensors[name])
        if t.shape != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {t.shape}; layout needs {tuple(shape)}")
        parts.append(t.astype(np.float32, copy=False).ravel())
    return np.concatenate(parts)


def evaluate(
    model: Model, params: np.ndarray, X: np.ndarray, y: np.ndarray, *, batch_size: int = 1024
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over ``X, y``, in batches so memory stays O(batch_size)."""
    if X.shape[0] == 0 or X.shape[0] != y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows and y {y.shape[0]}; need equal and >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}; must be >= 1")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= model.n_classes:
        raise ValueError(f"y must hold integer labels in [0, {model.n_classes})")
    correct = 0
    loss_sum = 0.0
    for start in range(0, X.shape[0], batch_size):
        xb, yb = X[start : start + batch_size], y[start : start + batch_size]
        z = np.asarray(model.logits(params, xb))
        rows = np.arange(z.shape[0])
        correct += int(np.count_nonzero(z.argmax(axis=1) == yb))
        loss_sum -= float(np.sum(log_softmax(z)[rows, yb], dtype=np.float64))
    n = X.shape[0]
    return correct / n, loss_sum / n
