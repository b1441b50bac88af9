"""The core works without torch: a fresh interpreter in which ``import torch`` fails.

torch is optional (`pip install torch==2.13.0`); a Pi or a server without it must still train numpy
models, export and run ONNX, load datasets, and get a clear message when asking for a torch model.
The check runs in a subprocess because torch may already be imported in the test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import sys

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, BlockTorch())
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker failed: torch imported")

    import numpy as np

    from edge_fl.models import make_model
    from edge_fl.models.onnx_export import onnx_bytes
    from edge_fl.models.onnx_runtime import OnnxClassifier
    import edge_fl.data.femnist, edge_fl.data.mnist  # noqa: E401, F401

    rng = np.random.default_rng(0)
    model = make_model("mlp", 16, 3, hidden=8)
    params = model.init_params(rng)
    X = rng.random((40, 16), dtype=np.float32)
    y = rng.integers(0, 3, 40)
    before = model.loss(params, X, y)
    for _ in range(5):
        params = params - np.float32(0.5) * model.grad(params, X, y)
    after = model.loss(params, X, y)
    assert after < before, (before, after)
    assert model.per_sample_grads(params, X, y).shape == (40, model.n_params)

    clf = OnnxClassifier(onnx_bytes(model, params))
    diff = float(np.max(np.abs(clf.logits(X) - model.logits(params, X))))
    assert diff < 1e-4, diff

    for name in ("lenet", "cnn"):
        try:
            make_model(name, 784, 62)
        except ImportError as exc:
            assert "pip install torch==2.13.0" in str(exc), str(exc)
        else:
            raise AssertionError(f"make_model({name!r}) worked without torch")
    try:
        import edge_fl.models.torch_models  # noqa: F401
    except ImportError as exc:
        assert str(exc) == "torch models need PyTorch: pip install torch==2.13.0", str(exc)
    else:
        raise AssertionError("edge_fl.models.torch_models imported without torch")

    assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
    print("NO-TORCH-OK", before, after, diff)
    """
)


def test_core_runs_without_torch():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NO-TORCH-OK" in proc.stdout
