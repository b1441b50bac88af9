"""A mechanism and a codec defined outside the package (examples/own_mechanism.py, own_codec.py):
registered through the public registries, found by name everywhere, and run end to end with
accounting over a private Mosquitto.

Each example runs in its own interpreter, as a user's script would: a registration lasts for the
process, and this test session's other tests see only the built-in mechanisms and codecs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

OWN_MECHANISM_CHECKS = """
from edge_fl.mechanisms import check_combination, mechanism_class, mechanism_names
from edge_fl.protocol import PayloadRejected
from edge_fl.protocol.params import check_mechanism_params

assert "local-laplace" in mechanism_names()
assert mechanism_class("local-laplace") is example["LocalLaplace"]
mp = {"m": "local-laplace", "lr": 0.1, "ep": 1, "bs": 8, "clip": 0.5, "eps": 2.0, "L": 3}
assert check_mechanism_params(mp) == mp
try:
    check_mechanism_params({k: v for k, v in mp.items() if k != "eps"})
    raise AssertionError("an mp without eps was accepted")
except PayloadRejected as exc:
    assert exc.reason == "missing_field" and exc.field == "mp.eps", exc
try:
    check_mechanism_params({**mp, "clip": -1.0})
    raise AssertionError("a negative clip was accepted")
except PayloadRejected as exc:
    assert exc.reason == "out_of_range" and exc.field == "mp.clip", exc
assert check_combination("local-laplace", "q8") is None  # a local release: any codec
# its options model checks privacy.options when the config is loaded, and fills the defaults in
from edge_fl.config import ConfigError, load_config

cfg = load_config(None, {"privacy.mechanism": "local-laplace", "privacy.options": {"eps": 2.0}})
assert cfg.privacy.options == {"clip": 1.0, "eps": 2.0, "uploads": None}, cfg.privacy.options
for bad, why in (({"eps": -1}, "options.eps = -1"), ({"epz": 1}, "options.epz = 1")):
    try:
        load_config(None, {"privacy.mechanism": "local-laplace", "privacy.options": bad})
        raise AssertionError(f"options {bad} were accepted")
    except ConfigError as exc:
        assert why in str(exc) and len(str(exc).splitlines()) == 1, str(exc)
# a registered cross-field check that raises something else still rejects, never crashes
from edge_fl.protocol.params import MechanismSchema, register_schema

def broken(mp, n_params):
    raise ValueError("a bug in the check")

register_schema(MechanismSchema("broken-check", check=broken))
try:
    check_mechanism_params({"m": "broken-check", "lr": 0.1, "ep": 1, "bs": 8})
    raise AssertionError("a failing check accepted the map")
except PayloadRejected as exc:
    assert exc.reason == "out_of_range" and exc.field == "mp", exc
    assert "a bug in the check" in exc.detail, exc
result = {"checked": True}
"""

OWN_CODEC_CHECKS = """
import numpy as np

from edge_fl.mechanisms import accepted_tags
from edge_fl.protocol import PayloadRejected, UpdateLimits, decode_update, encode_update
from edge_fl.protocol.codecs import build_codec, codec_for_tag, codec_names
from edge_fl.protocol.messages import DenseUpdate

assert "i8" in codec_names() and isinstance(codec_for_tag("i8"), example["Int8"])
codec = build_codec("i8")
rng = np.random.default_rng(0)
x = rng.standard_normal(300)
fields, _ = codec.encode(x, rng)
out = codec.decode(fields, 300)
assert np.max(np.abs(out - x)) <= fields["s"] / 2 + 1e-6
# the aggregator's decoder finds it by its tag; a job limited to f4/f2 refuses it
update = DenseUpdate("d1", 1, 1, 5, np.zeros(300, np.float32), mechanism="gaussian")
payload = encode_update(update, coded=("i8", fields))
decoded = decode_update(payload, UpdateLimits(300, mechanism="gaussian", max_abs=None))
assert np.array_equal(decoded.delta, out)
for limits, bad, reason in (
    (UpdateLimits(300, codecs=frozenset({"f4", "f2"})), {}, "bad_dtype"),
    (UpdateLimits(300), {"x": fields["x"][:-1]}, "wrong_shape"),
    (UpdateLimits(300), {"s": "big"}, "bad_type"),
):
    try:
        decode_update(encode_update(update, coded=("i8", {**fields, **bad})), limits)
        raise AssertionError(f"{bad} was accepted")
    except PayloadRejected as exc:
        assert exc.reason == reason, (reason, exc)
# soundness is the mechanism's call, made when the job is assembled
assert "i8" in accepted_tags("gaussian") and "i8" not in accepted_tags("gaussian-central")
result = {"checked": True, "payload_bytes": codec.payload_bytes(4810)}
"""


PRELUDE = "import json, runpy, sys\nexample = runpy.run_path(sys.argv[1])\n"
EPILOGUE = """
if len(sys.argv) > 2:
    result["summary"] = example["main"](sys.argv[2], rounds=3)
print("RESULT " + json.dumps(result))
"""


def run_example(name: str, script: str, out_dir: Path | None = None) -> dict[str, Any]:
    """Load examples/<name>.py in a fresh interpreter (registering its class), run ``script``
    (which sets ``result``) and, with ``out_dir``, the example's job; return both as JSON."""
    args = [str(EXAMPLES / f"{name}.py")] + ([str(out_dir)] if out_dir is not None else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + script + EPILOGUE, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_an_own_mechanism_is_found_by_name_and_its_schema_checks_global_messages() -> None:
    assert run_example("own_mechanism", OWN_MECHANISM_CHECKS)["checked"]


def test_an_own_codec_is_found_by_name_and_tag_and_decodes_strictly() -> None:
    assert run_example("own_codec", OWN_CODEC_CHECKS)["checked"]


@pytest.mark.broker
def test_an_own_mechanism_runs_a_job_with_its_accounting(tmp_path: Path) -> None:
    summary = run_example("own_mechanism", "result = {}", tmp_path)["summary"]
    assert summary["mechanism"] == "local-laplace" and summary["rounds_closed"] == 3
    assert summary["total_received"] > 0 and summary["total_rejected"] == 0
    privacy = summary["privacy"]
    assert privacy["unit"] == "device" and privacy["guarantee"].startswith("pure eps-DP")
    assert privacy["mechanisms"] == ["local-laplace"]
    # pure eps = 2 per upload, composed over the worst device's uploads (basic composition)
    assert 1 <= privacy["events"] <= 3
    assert privacy["epsilon_by_accountant"]["basic"] == pytest.approx(2.0 * privacy["events"])
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["epsilon"] == pytest.approx(privacy["epsilon"])
    assert json.loads((tmp_path / "summary.json").read_text())["privacy"] == privacy


@pytest.mark.broker
def test_an_own_codec_carries_a_job_s_updates(tmp_path: Path) -> None:
    result = run_example("own_codec", OWN_CODEC_CHECKS, tmp_path)
    summary = result["summary"]
    assert summary["rounds_closed"] == 3 and summary["total_rejected"] == 0
    assert summary["total_received"] > 0 and summary["n_params"] == 4810
    per_update = summary["total_bytes_up"] / summary["total_received"]
    f32_bytes = 4 * summary["n_params"]
    assert result["payload_bytes"] <= per_update < f32_bytes / 3.5  # about 4x smaller than f32
    assert summary["privacy"]["epsilon"] > 0
