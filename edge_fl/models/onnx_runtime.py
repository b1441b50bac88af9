"""Inference and evaluation of an exported model with onnxruntime only (no torch, no training code).

The aggregator evaluates the global model on the held-out set and devices predict from the same
``model.onnx``. The session is pinned to the CPU provider with a small thread count so evaluation
does not compete with the MQTT event loop and aggregation for cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

__all__ = ["OnnxClassifier"]


class OnnxClassifier:
    """A classifier over an ONNX graph with one float input [N, n_features] and logits [N, C]."""

    def __init__(
        self,
        path_or_bytes: str | os.PathLike[str] | bytes,
        *,
        intra_op_threads: int = 1,
        batch_size: int = 4096,
    ):
        if intra_op_threads < 1:
            raise ValueError(f"intra_op_threads must be >= 1, got {intra_op_threads}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3  # errors only; warnings about unused initializers are noise
        if isinstance(path_or_bytes, bytes | bytearray):
            source: str | bytes = bytes(path_or_bytes)
        else:
            path = Path(path_or_bytes)
            if not path.is_file():
                raise FileNotFoundError(f"ONNX model file not found: {path}")
            source = str(path)
        self._session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
        inputs, outputs = self._session.get_inputs(), self._session.get_outputs()
        if len(inputs) != 1 or len(outputs) < 1:
            raise ValueError(
                f"expected an ONNX graph with one input and a logits output, got "
                f"{len(inputs)} inputs and {len(outputs)} outputs"
            )
        self._input = inputs[0].name
        self._output = outputs[0].name
        shape = inputs[0].shape
        if len(shape) != 2:
            raise ValueError(f"expected a 2-D model input [N, n_features], got shape {shape}")
        self.n_features: int | None = shape[1] if isinstance(shape[1], int) else None
        out_shape = outputs[0].shape
        self.n_classes: int | None = (
            out_shape[-1] if out_shape and isinstance(out_shape[-1], int) else None
        )
        self.batch_size = batch_size
        self._overridable = {
            i.name: tuple(i.shape) for i in self._session.get_overridable_initializers()
        }
        self._weights: dict[str, np.ndarray] = {}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Feed these tensors for the graph's overridable initializers on every later run: the
        same session evaluates another model's parameters (``onnx_with_weight_inputs``)."""
        missing = set(self._overridable) - set(weights)
        unknown = set(weights) - set(self._overridable)
        if missing or unknown:
            raise ValueError(
                f"weights must name the graph's initializers {sorted(self._overridable)}, "
                f"got {sorted(weights)}"
            )
        feeds = {}
        for name, value in weights.items():
            a = np.ascontiguousarray(value, dtype=np.float32)
            if a.shape != self._overridable[name]:
                raise ValueError(f"weight {name} must have shape {self._overridable[name]}")
            feeds[name] = a
        self._weights = feeds

    def logits(self, X: np.ndarray) -> np.ndarray:
        """Class scores, float32 (n, n_classes); evaluated in batches to bound memory."""
        x = np.asarray(X)
        if x.ndim != 2 or (self.n_features is not None and x.shape[1] != self.n_features):
            want = self.n_features if self.n_features is not None else "n_features"
            raise ValueError(f"X must have shape (n, {want}), got {x.shape}")
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape[0] == 0:
            return np.zeros((0, self.n_classes or 0), dtype=np.float32)
        parts = [
            self._session.run(
                [self._output], {self._input: x[i : i + self.batch_size], **self._weights}
            )[0]
            for i in range(0, x.shape[0], self.batch_size)
        ]
        return np.concatenate(parts).astype(np.float32, copy=False)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predicted class per row, int64."""
        return np.argmax(self.logits(X), axis=1).astype(np.int64)

    def evaluate(self, X: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(accuracy, mean cross-entropy) on a labelled set."""
        z = self.logits(X).astype(np.float64)
        labels = np.asarray(y)
        if labels.shape != (z.shape[0],):
            raise ValueError(f"y must have shape ({z.shape[0]},) to match X, got {labels.shape}")
        if z.shape[0] == 0:
            raise ValueError("cannot evaluate on an empty set (X has 0 rows)")
        if labels.dtype.kind not in "iu" or labels.min() < 0 or labels.max() >= z.shape[1]:
            raise ValueError(f"y must hold integer labels in [0, {z.shape[1]})")
        labels = labels.astype(np.int64)
        m = z.max(axis=1, keepdims=True)
        logsumexp = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
        loss = float(np.mean(logsumexp - z[np.arange(z.shape[0]), labels]))
        accuracy = float(np.mean(np.argmax(z, axis=1) == labels))
        return accuracy, loss
