"""Export any edge-fl model with its parameters to ONNX: input "x" [N, n_features], output "logits".

ONNX is the hand-off format: the server evaluates and devices infer with onnxruntime alone, so
neither needs the training backend. The numpy models (logreg, mlp) are written directly as
MatMul/Add/Relu graphs from the flat vector, so exporting them never needs torch. Torch models go
through ``torch.onnx.export`` with the TorchScript exporter (``dynamo=False``): in torch 2.13 it
still exists (deprecated) and needs nothing beyond torch, whereas the default dynamo exporter also
requires the ``onnxscript`` package. If a future torch drops the TorchScript path we fall back to
dynamo and say what to install. torch is imported only when a torch model is exported.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .base import Model
from .onnx_layout import flat_params as _flat
from .onnx_layout import is_torch_model as _is_torch_model
from .onnx_layout import onnx_weights

__all__ = [
    "ONNX_IR_VERSION",
    "ONNX_OPSET",
    "export_onnx",
    "onnx_bytes",
    "onnx_model",
    "onnx_weights",
    "onnx_with_weight_inputs",
]

# Opset 17 / IR 8 are understood by onnxruntime >= 1.13, i.e. by the older builds found on devices.
ONNX_OPSET = 17
ONNX_IR_VERSION = 8
INPUT_NAME = "x"
OUTPUT_NAME = "logits"


def export_onnx(model: Model, params: np.ndarray, path: str | os.PathLike[str]) -> Path:
    """Write ``model`` with ``params`` to ``path`` as ONNX; returns the path."""
    out = Path(path)
    out.write_bytes(onnx_bytes(model, params))
    return out


def onnx_bytes(model: Model, params: np.ndarray) -> bytes:
    """The serialized ONNX model, e.g. to ship over the wire or hand to ``OnnxClassifier``."""
    if _is_torch_model(model):
        return _torch_onnx_bytes(model, _flat(model, params))
    return onnx_model(model, params).SerializeToString()


def onnx_model(model: Model, params: np.ndarray) -> onnx.ModelProto:
    """The ONNX graph of a numpy model (logreg or mlp), checked by ``onnx.checker``."""
    m = _numpy_graph(model, onnx_weights(model, params))
    onnx.checker.check_model(m, full_check=True)
    return m


def onnx_with_weight_inputs(model: Model) -> bytes | None:
    """The graph :func:`onnx_model` exports, nodes unchanged, with its initializers also declared
    as graph inputs (overridable, ONNX IR >= 4): one onnxruntime session then evaluates every
    round's global model, fed :func:`onnx_weights`, instead of a session built per round.
    None for a model whose graph is not written here (torch: exported per model)."""
    if _is_torch_model(model) or getattr(model, "name", None) not in ("logreg", "mlp"):
        return None
    m = onnx_model(model, np.zeros(model.n_params, dtype=np.float32))
    g = m.graph
    for init in g.initializer:
        g.input.append(helper.make_tensor_value_info(init.name, init.data_type, init.dims))
    onnx.checker.check_model(m, full_check=True)
    return m.SerializeToString()


def _numpy_graph(model: Model, w: dict[str, np.ndarray]) -> onnx.ModelProto:
    name = getattr(model, "name", None)
    F, C = int(model.n_features), int(model.n_classes)
    inits = [_init(k, v) for k, v in w.items()]
    if name == "logreg":
        nodes = [
            helper.make_node("MatMul", [INPUT_NAME, "W"], ["xW"]),
            helper.make_node("Add", ["xW", "b"], [OUTPUT_NAME]),
        ]
    else:
        nodes = [
            helper.make_node("MatMul", [INPUT_NAME, "W1"], ["xW1"]),
            helper.make_node("Add", ["xW1", "b1"], ["z1"]),
            helper.make_node("Relu", ["z1"], ["h1"]),
            helper.make_node("MatMul", ["h1", "W2"], ["hW2"]),
            helper.make_node("Add", ["hW2", "b2"], [OUTPUT_NAME]),
        ]
    graph = helper.make_graph(
        nodes,
        f"edge_fl_{name}",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["N", F])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["N", C])],
        initializer=inits,
    )
    m = helper.make_model(
        graph,
        producer_name="edge-fl",
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
    )
    m.ir_version = ONNX_IR_VERSION
    return m


def _init(name: str, a: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(a, dtype=np.float32), name)


def _torch_onnx_bytes(model, params: np.ndarray) -> bytes:
    import torch

    fresh = model.module_with(params)  # a copy: the model's own module is never mutated
    example = torch.zeros((2, model.n_features), dtype=torch.float32)
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's notice
            torch.onnx.export(
                fresh,
                (example,),
                # torch types f as a path, but its TorchScript exporter documents and takes any
                # binary file object
                buf,  # type: ignore[arg-type]
                dynamo=False,
                dynamic_axes={INPUT_NAME: {0: "N"}, OUTPUT_NAME: {0: "N"}},
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                opset_version=ONNX_OPSET,
            )
    except TypeError:  # a torch without the TorchScript exporter: needs onnxscript
        try:
            import onnxscript  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "this torch has no TorchScript ONNX exporter; the dynamo exporter needs "
                "onnxscript: pip install onnxscript"
            ) from exc
        n = torch.export.Dim("N")
        program = torch.onnx.export(
            fresh,
            (example,),
            dynamo=True,
            dynamic_shapes=({0: n},),
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            opset_version=ONNX_OPSET,
        )
        if program is None:  # only without f and with dynamo=True, which is this call
            raise RuntimeError("torch.onnx.export(dynamo=True) returned no program") from None
        return program.model_proto.SerializeToString()
    proto = onnx.load_from_string(buf.getvalue())
    proto.producer_name = "edge-fl/" + proto.producer_name
    onnx.checker.check_model(proto)
    return proto.SerializeToString()
