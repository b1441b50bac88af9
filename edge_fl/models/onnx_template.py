"""The ONNX files of the packaged numpy models (logreg, mlp) without importing onnx.

Writing an ONNX graph needs the onnx package, whose import (protobuf's Python layer, ml_dtypes)
takes ~0.1 s of CPU under the GIL: every simulation paid it in the aggregator's process while
its devices connected and trained their first round. These models' graphs depend only on their
shapes, and an initializer's raw bytes have a fixed length, so the serialized model of any
parameters is one serialization with its weights' bytes put in place: byte for byte what
``onnx_export.onnx_bytes`` writes (tests/test_onnx_template.py). For each shape the two
serializations (the model, and the evaluation graph with its weights as inputs) are written
once with onnx and kept in the user's cache directory (``EDGE_FL_CACHE_DIR``, else
``$XDG_CACHE_HOME/edge-fl``, else ``~/.cache/edge-fl``); a cache that cannot be read or
written costs only the import, and an entry that does not check out is written again."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from itertools import pairwise
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from .base import Model

CACHE_ENV = "EDGE_FL_CACHE_DIR"
_MEMORY: dict[str, Template | None] = {}


@dataclass(frozen=True)
class Template:
    """One shape's ONNX model with its weights' byte spans, and its evaluation graph."""

    model: bytes
    with_weight_inputs: bytes
    spans: dict[str, tuple[int, int]]

    def model_bytes(self, weights: dict[str, np.ndarray]) -> bytes:
        """The model with these weights (``onnx_weights``), as onnx would serialize it."""
        if set(weights) != set(self.spans):
            raise ValueError(f"weights {sorted(weights)}, the graph has {sorted(self.spans)}")
        out = bytearray(self.model)
        for name, (start, length) in self.spans.items():
            raw = np.ascontiguousarray(weights[name], dtype="<f4").tobytes()
            if len(raw) != length:
                raise ValueError(f"weight {name} has {len(raw)} bytes, the graph {length}")
            out[start : start + length] = raw
        return bytes(out)


def template(model: Model) -> Template | None:
    """``model``'s template (None: not a packaged numpy model, or onnx is not installed)."""
    if getattr(model, "name", None) not in ("logreg", "mlp") or is_torch_model(model):
        return None
    key = _key(model)
    if key is None:
        return None
    if key not in _MEMORY:
        zeros = np.zeros(model.n_params, dtype=np.float32)
        sizes = {n: w.size * 4 for n, w in onnx_weights(model, zeros).items()}
        _MEMORY[key] = _load(key, sizes) or _build(model, key)
    return _MEMORY[key]


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


def cache_dir() -> Path | None:
    """Where templates are kept (None: nowhere, e.g. a user without a home directory)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    try:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # no HOME and no passwd entry (an arbitrary-UID container)
        return None
    return Path(base) / "edge-fl"


def is_torch_model(model: object) -> bool:
    """Whether ``model`` is one of edge_fl.models.torch_models (never imported for the check)."""
    mod = sys.modules.get("edge_fl.models.torch_models")  # not imported -> cannot be a torch model
    return mod is not None and isinstance(model, mod.TorchModel)


def _key(model: Model) -> str | None:
    """What a template depends on: the model's shape, the onnx release that serialized it and
    the source of the graphs and their weights' layout (onnx_export.py, this module), so an
    edited graph is never served stale."""
    try:
        onnx_version = metadata.version("onnx")
        here = Path(__file__).parent
        source = (here / "onnx_export.py").read_bytes() + (here / "onnx_template.py").read_bytes()
    except (metadata.PackageNotFoundError, OSError):
        return None
    shape = [model.name, int(model.n_features), int(model.n_classes), int(model.n_params)]
    text = json.dumps([shape, onnx_version, hashlib.sha256(source).hexdigest()])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _path(key: str) -> Path | None:
    base = cache_dir()
    return None if base is None else base / "onnx" / f"{key}.msgpack"


def _digest(model: bytes, inputs: bytes, spans: dict[str, tuple[int, int]]) -> str:
    """What an entry's integrity is checked with: both graphs and the span table."""
    table = json.dumps(sorted((n, list(s)) for n, s in spans.items())).encode()
    return hashlib.sha256(b"\0".join([model, inputs, table])).hexdigest()


def _load(key: str, sizes: dict[str, int]) -> Template | None:
    """The cached entry, if it checks out: its digest, and one span per weight (``sizes``: each
    weight's byte length), each inside the model and none overlapping another."""
    path = _path(key)
    if path is None:
        return None
    try:
        entry = msgpack.unpackb(path.read_bytes(), raw=False)
        model, inputs = bytes(entry["model"]), bytes(entry["with_weight_inputs"])
        spans = {str(n): (int(s), int(length)) for n, (s, length) in entry["spans"].items()}
        if entry["sha256"] != _digest(model, inputs, spans):
            return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException):
        return None
    if {n: length for n, (_, length) in spans.items()} != sizes:
        return None
    ordered = sorted(spans.values())
    if ordered[0][0] < 0 or ordered[-1][0] + ordered[-1][1] > len(model):
        return None
    if any(a + la > b for (a, la), (b, _) in pairwise(ordered)):
        return None
    return Template(model, inputs, spans)


def _build(model: Model, key: str) -> Template | None:
    """Serialize with onnx, find where each weight's bytes landed (distinct random values: each
    span is found once), and keep it for the next process."""
    from edge_fl.models.onnx_export import onnx_model, onnx_with_weight_inputs

    params = np.random.default_rng(0).uniform(1.0, 2.0, model.n_params).astype(np.float32)
    data = onnx_model(model, params).SerializeToString()
    spans: dict[str, tuple[int, int]] = {}
    for name, w in onnx_weights(model, params).items():
        raw = np.ascontiguousarray(w, dtype="<f4").tobytes()
        start = data.find(raw)
        if start < 0 or data.find(raw, start + 1) >= 0:
            return None  # not a layout that can be filled in: export with onnx every time
        spans[name] = (start, len(raw))
    inputs = onnx_with_weight_inputs(model)
    if inputs is None:
        return None
    made = Template(data, inputs, spans)
    _store(key, made)
    return made


def _store(key: str, made: Template) -> None:
    entry: dict[str, Any] = {
        "model": made.model,
        "with_weight_inputs": made.with_weight_inputs,
        "spans": {n: list(s) for n, s in made.spans.items()},
        "sha256": _digest(made.model, made.with_weight_inputs, made.spans),
    }
    path = _path(key)
    if path is None:
        return
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(msgpack.packb(entry, use_bin_type=True))
        os.replace(partial, path)  # whole or not at all; two processes write the same bytes
    except OSError:  # a read-only or full cache: the next process builds it again
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
