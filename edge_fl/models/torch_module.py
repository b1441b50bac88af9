"""Your own small torch ``nn.Module`` as an edge-fl :class:`~edge_fl.models.base.Model`.

The wrapper keeps a private copy of the module and evaluates it on one flat float32 parameter
vector (``torch.func.functional_call``), as the packaged LeNet and CNN do: per-example gradients
for DP-SGD and Laplace come from ``torch.func`` (or the faster per-layer expansion when the
network is only Linear and stride-1 Conv2d layers), and the aggregator evaluates, and writes
model.onnx, through the ONNX export (``torch.onnx``, TorchScript path).

What the module must be: a classifier taking flat rows ``(n, n_features)`` (reshape inside
``forward``, e.g. ``nn.Unflatten``, for images) and returning logits ``(n, n_classes)``; trained by
its parameters only (buffers such as batch-norm statistics are not federated, and a module
holding any is refused); no dropout (the wrapper runs it in eval mode; refused too). Importing this module imports torch.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from edge_fl.models.torch_models import TorchModel

__all__ = ["TorchModule"]

INITS = ("module", "he")


class TorchModule(TorchModel):
    """``module`` behind the flat-vector Model interface.

    ``n_classes``: default, the width of the module's output on one zero row. ``init``:
    "module" starts every job from the module's own parameters as you built them (seed torch
    for reproducibility), "he" draws He-uniform weights and zero biases from the job's seeded
    generator (needs parameters named ``*.weight`` / ``*.bias``). ``per_sample``: "auto",
    "expand" or "vmap" (see ``edge_fl.models.torch_models``); ``chunk_size`` bounds the memory of a
    per-example gradient pass."""

    def __init__(
        self,
        module: nn.Module,
        n_features: int,
        n_classes: int | None = None,
        *,
        name: str = "torch-module",
        init: str = "module",
        per_sample: str = "auto",
        chunk_size: int | None = 256,
    ) -> None:
        if init not in INITS:
            raise ValueError(f"init = {init!r}; one of {INITS}")
        if int(n_features) != n_features or n_features < 1:
            raise ValueError(f"n_features = {n_features!r}; must be an integer >= 1")
        net = copy.deepcopy(module)  # the caller's module is never changed
        if not any(True for _ in net.parameters()):
            raise ValueError(f"{type(module).__name__} has no parameters to train")
        _refuse_unfederated(net)
        width = _output_width(net, int(n_features))
        n_classes = width if n_classes is None else int(n_classes)
        if n_classes != width or n_classes < 2:
            raise ValueError(
                f"{type(module).__name__} returns {width} logits per row; n_classes = {n_classes} "
                "(need them equal and >= 2)"
            )
        self.name = name
        self.init = init
        super().__init__(net, int(n_features), n_classes, chunk_size, per_sample)
        self._initial = np.concatenate(
            [p.detach().cpu().numpy().astype(np.float32).ravel() for p in net.parameters()]
        )

    def init_params(self, rng: np.random.Generator) -> np.ndarray:
        if self.init == "module":
            return self._initial.copy()
        return super().init_params(rng)


#: layers that behave differently in training (the wrapper evaluates the module in eval mode, so
#: they would silently do nothing)
DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
           nn.FeatureAlphaDropout)  # fmt: skip


def _refuse_unfederated(net: nn.Module) -> None:
    """ValueError, at construction, for what the flat parameter vector cannot carry: buffers
    (batch-norm running statistics were accepted, then the round's ONNX export failed on the
    missing keys) and dropout (accepted, then silently off)."""
    buffers = [name for name, _ in net.named_buffers()]
    if buffers:
        raise ValueError(
            f"{type(net).__name__} has buffers ({', '.join(buffers[:3])}"
            f"{', ...' if len(buffers) > 3 else ''}), which are not federated: only parameters "
            "are; use a layer without running statistics (nn.LayerNorm, nn.GroupNorm)"
        )
    dropouts = [name for name, m in net.named_modules() if isinstance(m, DROPOUT)]
    if dropouts:
        raise ValueError(
            f"{type(net).__name__} has dropout ({', '.join(dropouts[:3])}): the module is run "
            "in eval mode, where it would do nothing; remove it"
        )


def _output_width(net: nn.Module, n_features: int) -> int:
    try:
        with torch.inference_mode():
            out = net.eval()(torch.zeros((1, n_features), dtype=torch.float32))
    except RuntimeError as exc:  # a first layer of another width: torch's own words, one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{type(net).__name__} cannot take a (1, {n_features}) row of n_features = "
            f"{n_features}: {reason}"
        ) from None
    if out.ndim != 2 or out.shape[0] != 1:
        raise ValueError(
            f"{type(net).__name__} maps a (1, {n_features}) row to shape {tuple(out.shape)}; "
            "a classifier returns (n, n_classes) logits"
        )
    return int(out.shape[1])
