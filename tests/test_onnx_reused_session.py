"""The aggregator's evaluation reuses one onnxruntime session fed each round's weights: it must
give exactly what a fresh session over the exported model (the file devices run) gives."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from edge_fl.models import make_model
from edge_fl.models.onnx_export import (
    onnx_bytes,
    onnx_weights,
    onnx_with_weight_inputs,
)
from edge_fl.models.onnx_runtime import OnnxClassifier


@pytest.mark.parametrize(("name", "options"), [("mlp", {"hidden": 16}), ("logreg", {})])
def test_reused_session_matches_the_exported_model(name, options):
    model = make_model(name, 12, 4, **options)
    rng = np.random.default_rng(3)
    X = rng.normal(size=(300, 12)).astype(np.float32)
    y = rng.integers(0, 4, size=300)
    graph = onnx_with_weight_inputs(model)
    assert graph is not None
    reused = OnnxClassifier(graph)
    for _ in range(3):  # one session, several models: no weight of an earlier round survives
        w = rng.normal(size=model.n_params).astype(np.float32)
        reused.set_weights(onnx_weights(model, w))
        fresh = OnnxClassifier(onnx_bytes(model, w))
        np.testing.assert_array_equal(reused.logits(X), fresh.logits(X))
        assert reused.evaluate(X, y) == fresh.evaluate(X, y)


def test_weights_must_name_every_initializer_with_its_shape():
    model = make_model("logreg", 5, 3)
    clf = OnnxClassifier(onnx_with_weight_inputs(model))
    w = onnx_weights(model, np.zeros(model.n_params, dtype=np.float32))
    with pytest.raises(ValueError, match="initializers"):
        clf.set_weights({"W": w["W"]})
    with pytest.raises(ValueError, match="shape"):
        clf.set_weights({"W": w["W"][:2], "b": w["b"]})


def test_non_finite_weights_are_refused_as_the_export_refuses_them():
    model = make_model("logreg", 5, 3)
    with pytest.raises(ValueError, match="finite"):
        onnx_weights(model, np.full(model.n_params, np.nan, dtype=np.float32))


def test_a_jobs_session_is_built_once_whichever_thread_asks_first():
    """``simulate`` builds the evaluation session on its preload thread while the event loop
    may already ask for it: both get the same session, built once."""
    import threading

    from edge_fl.config import load_config
    from edge_fl.job import build_job

    job = build_job(load_config(None, {"data.devices": 10, "model.name": "logreg"}))
    got: list[object] = []
    threads = [
        threading.Thread(target=lambda: got.append(job.evaluation_session())) for _ in range(2)
    ]
    for t in threads:
        t.start()
    got.append(job.evaluation_session())
    for t in threads:
        t.join()
    assert len(got) == 3 and got[0] is not None and all(s is got[0] for s in got)
