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
from dataclasses import dataclass
from importlib import metadata
from itertools import pairwise
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from .base import Model
from .onnx_layout import is_torch_model, onnx_weights

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


def cache_dir() -> Path | None:
    """Where templates are kept (None: nowhere, e.g. a user without a home directory)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    try:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # no HOME and no passwd entry (an arbitrary-UID container)
        return None
    return Path(base) / "edge-fl"


def _key(model: Model) -> str | None:
    """What a template depends on: the model's shape, the onnx release that serialized it and
    the source of the graphs and their weights' layout (onnx_export.py, onnx_layout.py, this
    module), so an edited graph is never served stale."""
    try:
        onnx_version = metadata.version("onnx")
        here = Path(__file__).parent
        source = b"".join(
            (here / name).read_bytes()
            for name in ("onnx_export.py", "onnx_layout.py", "onnx_template.py")
        )
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
