"""The numpy models' ONNX files from a cached template (edge_fl.models.onnx_template): byte for
byte what onnx writes, written again when the cache is damaged, working without a writable
cache, and a simulation of a shape seen before never imports onnx."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import edge_fl
from edge_fl.job import build_job
from edge_fl.models import make_model, onnx_exporter
from edge_fl.models import onnx_template as ot
from edge_fl.models.onnx_export import onnx_model, onnx_with_weight_inputs
from edge_fl.models.onnx_layout import onnx_weights

MODELS = [("logreg", {}), ("mlp", {"hidden": 16}), ("mlp", {"hidden": 3})]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(ot.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(ot, "_MEMORY", {})
    return tmp_path / "cache"


@pytest.mark.parametrize(("name", "options"), MODELS)
def test_a_filled_in_template_is_byte_for_byte_what_onnx_writes(cache, name, options):
    model = make_model(name, 12, 5, **options)
    made = ot.template(model)
    assert made is not None
    assert made.with_weight_inputs == onnx_with_weight_inputs(model)
    ot._MEMORY.clear()  # the next process: read from the cache directory
    loaded = ot.template(model)
    assert loaded == made and len(list((cache / "onnx").iterdir())) == 1
    export = onnx_exporter(model)
    assert export is not None
    rng = np.random.default_rng(7)
    for params in (rng.standard_normal(model.n_params), np.zeros(model.n_params)):
        params = params.astype(np.float32)
        want = onnx_model(model, params).SerializeToString()
        assert loaded.model_bytes(onnx_weights(model, params)) == want
        assert export(params) == want


def test_a_damaged_entry_is_written_again_and_never_served(cache):
    model = make_model("mlp", 12, 5, hidden=8)
    ot.template(model)
    (entry,) = (cache / "onnx").iterdir()
    good = entry.read_bytes()
    params = np.random.default_rng(1).standard_normal(model.n_params).astype(np.float32)
    want = onnx_model(model, params).SerializeToString()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    for damaged in (good[:100], bytes(flipped), b"not msgpack", b""):
        entry.write_bytes(damaged)
        ot._MEMORY.clear()
        made = ot.template(model)
        assert made is not None and made.model_bytes(onnx_weights(model, params)) == want
        assert entry.read_bytes() == good


def test_a_consistent_but_wrong_span_table_is_never_served(cache):
    """An entry whose digest matches but whose spans do not fit the model's weights (one
    missing, renamed, overlapping, out of the file) is rebuilt: the biases of the template's
    own random parameters are never shipped."""
    import msgpack

    model = make_model("mlp", 12, 5, hidden=8)
    good = ot.template(model)
    assert good is not None
    (entry,) = (cache / "onnx").iterdir()
    (w1, b1, w2, b2) = (good.spans[n] for n in ("W1", "b1", "W2", "b2"))
    params = np.random.default_rng(2).standard_normal(model.n_params).astype(np.float32)
    want = onnx_model(model, params).SerializeToString()
    for spans in (
        {"W1": w1, "b1": b1, "W2": w2},  # b2 missing
        {"W1": w1, "b1": b1, "W2": w2, "Z": b2},  # renamed
        {"W1": w1, "b1": (w1[0], b1[1]), "W2": w2, "b2": b2},  # overlapping
        {"W1": w1, "b1": b1, "W2": w2, "b2": (len(good.model) - 4, b2[1])},  # past the end
    ):
        forged = {
            "model": good.model,
            "with_weight_inputs": good.with_weight_inputs,
            "spans": {n: list(s) for n, s in spans.items()},
            "sha256": ot._digest(good.model, good.with_weight_inputs, spans),
        }
        entry.write_bytes(msgpack.packb(forged, use_bin_type=True))
        ot._MEMORY.clear()
        made = ot.template(model)
        assert made is not None and made.model_bytes(onnx_weights(model, params)) == want
        assert made.spans == good.spans


def test_no_home_directory_costs_only_the_import(monkeypatch):
    """HOME and XDG_CACHE_HOME unset and no passwd entry (an arbitrary-UID container): no
    cache, the export still works."""
    for name in (ot.CACHE_ENV, "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ot, "_MEMORY", {})

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    exports_what_onnx_writes(make_model("logreg", 12, 5))


def test_an_unwritable_cache_costs_only_the_import(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(ot.CACHE_ENV, str(blocker))
    monkeypatch.setattr(ot, "_MEMORY", {})
    exports_what_onnx_writes(make_model("logreg", 12, 5))


def exports_what_onnx_writes(model) -> None:
    params = np.ones(model.n_params, dtype=np.float32)
    made = ot.template(model)
    assert made is not None
    assert made.model_bytes(onnx_weights(model, params)) == (
        onnx_model(model, params).SerializeToString()
    )


def test_weights_of_another_shape_are_refused(cache):
    made = ot.template(make_model("logreg", 12, 5))
    assert made is not None
    with pytest.raises(ValueError, match="bytes"):
        made.model_bytes(onnx_weights(make_model("logreg", 12, 4), np.zeros(52)))


def test_a_simulation_of_a_shape_seen_before_never_imports_onnx(tmp_path):
    """The second simulation of the same job (another process, the same cache) evaluates every
    round through onnxruntime and writes model.onnx without importing onnx; its model.onnx is
    what onnx writes for its final parameters."""
    env = {**os.environ, ot.CACHE_ENV: str(tmp_path / "cache")}
    script = (
        "import json, sys, edge_fl\n"
        "cfg = edge_fl.load_config(None, {'model.name': 'mlp', 'data.devices': 6,"
        " 'rounds.rounds': 2, 'rounds.clients_per_round': 6, 'fleet.processes': 1})\n"
        "r = edge_fl.run_simulation(cfg, sys.argv[1])\n"
        "r.params.astype('float32').tofile(sys.argv[1] + '/params.f32')\n"
        "print(json.dumps({'onnx': 'onnx' in sys.modules,"
        " 'accuracy': r.records[-1]['accuracy']}))\n"
    )
    seen = []
    for run in ("first", "second"):
        done = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / run)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        seen.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert seen[0]["onnx"] and not seen[1]["onnx"], seen
    assert seen[1]["accuracy"] > 0.2  # evaluated through onnxruntime all the same
    out = Path(tmp_path / "second")
    params = np.fromfile(out / "params.f32", dtype=np.float32)
    job = build_job(edge_fl.load_config(None, {"model.name": "mlp", "data.devices": 6}))
    assert (out / "model.onnx").read_bytes() == onnx_model(job.model, params).SerializeToString()
