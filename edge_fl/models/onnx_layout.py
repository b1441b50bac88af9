"""Where a numpy model's parameters sit in its ONNX graph: the named float32 initializers of
the graphs ``onnx_export`` writes, without importing onnx (``onnx_template`` fills them in)."""

from __future__ import annotations

import sys

import numpy as np

from .base import Model


def onnx_weights(model: Model, params: np.ndarray) -> dict[str, np.ndarray]:
    """A numpy model's parameters as the named float32 tensors of its ONNX graph (the
    initializers ``onnx_export.onnx_model`` writes, in the same layout)."""
    p = flat_params(model, params)
    name = getattr(model, "name", None)
    F, C = int(model.n_features), int(model.n_classes)
    if name == "logreg":
        expected = F * C + C
        if p.size != expected:
            raise ValueError(f"logreg params must have {expected} entries, got {p.size}")
        return {"W": p[: F * C].reshape(F, C), "b": p[F * C :]}
    if name == "mlp":
        H = mlp_hidden(model, p.size)
        o = np.cumsum([0, F * H, H, H * C, C])
        return {
            "W1": p[o[0] : o[1]].reshape(F, H),
            "b1": p[o[1] : o[2]],
            "W2": p[o[2] : o[3]].reshape(H, C),
            "b2": p[o[3] : o[4]],
        }
    raise ValueError(
        f"cannot export model {name!r} ({type(model).__name__}) to ONNX: supported are the "
        "numpy models 'logreg' and 'mlp' and the torch models in edge_fl.models.torch_models"
    )


def flat_params(model: Model, params: np.ndarray) -> np.ndarray:
    """``params`` as the contiguous float32 vector an export writes (finite, the right size)."""
    p = np.asarray(params)
    if p.shape != (model.n_params,):
        raise ValueError(f"params must have shape ({model.n_params},), got {p.shape}")
    if not np.all(np.isfinite(p)):
        raise ValueError("params must be finite to export (found NaN or inf)")
    return np.ascontiguousarray(p, dtype=np.float32)


def mlp_hidden(model: Model, n_params: int) -> int:
    """Hidden width from n_params = H(F + C + 1) + C; cross-checked with ``model.hidden``."""
    F, C = int(model.n_features), int(model.n_classes)
    H, rem = divmod(n_params - C, F + C + 1)
    declared = getattr(model, "hidden", H)
    if rem or H < 1 or declared != H:
        raise ValueError(
            f"mlp params ({n_params}) do not fit the layout [W1 F*H, b1 H, W2 H*C, b2 C] with "
            f"F={F}, C={C}, hidden={declared}"
        )
    return H


def is_torch_model(model: object) -> bool:
    """Whether ``model`` is one of edge_fl.models.torch_models (never imported for the check)."""
    mod = sys.modules.get("edge_fl.models.torch_models")  # not imported -> cannot be a torch model
    return mod is not None and isinstance(model, mod.TorchModel)
