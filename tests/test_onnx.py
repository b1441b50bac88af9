"""ONNX export of every model and onnxruntime inference agree with the in-memory models."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from edge_fl.models import MLP, LogisticRegression, evaluate
from edge_fl.models.onnx_export import ONNX_OPSET, export_onnx, onnx_bytes, onnx_model
from edge_fl.models.onnx_runtime import OnnxClassifier
from edge_fl.privacy.rng import seeded_generator

TOL = 1e-4


def _data(model, n, seed=0):
    rng = seeded_generator(seed)
    X = rng.random((n, model.n_features), dtype=np.float32)
    y = rng.integers(0, model.n_classes, n)
    return X, y


def _check_roundtrip(model, tmp_path, n=50):
    params = model.init_params(seeded_generator(1))
    # move away from the init so biases are non-zero and every block of the layout matters
    params = params + seeded_generator(2).normal(0, 0.05, params.size).astype(np.float32)
    path = export_onnx(model, params, tmp_path / "model.onnx")
    assert path.is_file()
    onnx.checker.check_model(str(path))
    clf = OnnxClassifier(path)
    assert clf.n_features == model.n_features and clf.n_classes == model.n_classes
    X, y = _data(model, n, seed=3)
    ref = model.logits(params, X)
    got = clf.logits(X)
    assert got.shape == ref.shape and got.dtype == np.float32
    diff = float(np.max(np.abs(got - ref)))
    assert diff < TOL, diff
    np.testing.assert_array_equal(clf.predict(X), np.argmax(ref, axis=1))
    acc, loss = clf.evaluate(X, y)
    ref_acc, ref_loss = evaluate(model, params, X, y)
    assert acc == pytest.approx(ref_acc) and loss == pytest.approx(ref_loss, abs=1e-4)
    # dynamic batch axis: one row and many rows both work; bytes give the same session
    np.testing.assert_allclose(clf.logits(X[:1]), ref[:1], atol=TOL)
    clf2 = OnnxClassifier(onnx_bytes(model, params), batch_size=7)
    np.testing.assert_allclose(clf2.logits(X), ref, atol=TOL)
    return diff


def test_logreg_roundtrip(tmp_path):
    _check_roundtrip(LogisticRegression(64, 10), tmp_path)


def test_mlp_roundtrip(tmp_path):
    _check_roundtrip(MLP(64, 10, hidden=32), tmp_path)


def test_numpy_graph_structure():
    m = onnx_model(MLP(6, 3, hidden=4), MLP(6, 3, hidden=4).init_params(seeded_generator(0)))
    assert [n.op_type for n in m.graph.node] == ["MatMul", "Add", "Relu", "MatMul", "Add"]
    assert [i.name for i in m.graph.input] == ["x"] and [o.name for o in m.graph.output] == [
        "logits"
    ]
    assert m.opset_import[0].version == ONNX_OPSET
    dims = m.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "N" and dims[1].dim_value == 6


@pytest.mark.torch
@pytest.mark.parametrize("name", ["lenet", "cnn"])
def test_torch_roundtrip(name, tmp_path):
    pytest.importorskip("torch")
    from edge_fl.models.torch_models import LeNet5, SmallCNN

    model = LeNet5(62) if name == "lenet" else SmallCNN(10, image_size=16, channels=(4, 8))
    _check_roundtrip(model, tmp_path, n=20)


def test_export_rejects_bad_input(tmp_path):
    m = LogisticRegression(4, 3)
    p = m.init_params(seeded_generator(0))
    with pytest.raises(ValueError, match=r"params must have shape \(15,\)"):
        export_onnx(m, p[:-1], tmp_path / "m.onnx")
    bad = p.copy()
    bad[0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        export_onnx(m, bad, tmp_path / "m.onnx")

    class Other:
        name, n_features, n_classes, n_params = "svm", 4, 3, 15

    with pytest.raises(ValueError, match="cannot export model 'svm'"):
        onnx_bytes(Other(), p)

    class WrongHidden:
        name, n_features, n_classes, hidden = "mlp", 4, 3, 5
        n_params = 4 * 4 + 4 + 4 * 3 + 3  # fits hidden=4, not the declared 5

    with pytest.raises(ValueError, match="do not fit the layout"):
        onnx_bytes(WrongHidden(), np.zeros(WrongHidden.n_params, np.float32))


def test_classifier_rejects_bad_input(tmp_path):
    m = LogisticRegression(4, 3)
    clf = OnnxClassifier(onnx_bytes(m, m.init_params(seeded_generator(0))))
    with pytest.raises(FileNotFoundError, match="ONNX model file not found"):
        OnnxClassifier(tmp_path / "missing.onnx")
    with pytest.raises(ValueError, match=r"X must have shape \(n, 4\)"):
        clf.logits(np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="y must have shape"):
        clf.evaluate(np.zeros((2, 4), np.float32), np.array([0]))
    with pytest.raises(ValueError, match="integer labels"):
        clf.evaluate(np.zeros((2, 4), np.float32), np.array([0, 3]))
    with pytest.raises(ValueError, match="empty"):
        clf.evaluate(np.zeros((0, 4), np.float32), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="intra_op_threads"):
        OnnxClassifier(b"", intra_op_threads=0)
    assert clf.logits(np.zeros((0, 4), np.float32)).shape == (0, 3)
