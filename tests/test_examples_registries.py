"""A mechanism and a codec defined outside the package (examples/own_mechanism.py, own_codec.py):
registered through the public registries, found by name everywhere, and run end to end with
accounting over a private Mosquitto."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from edge_fl.mechanisms import accepted_tags, check_combination, mechanism_class, mechanism_names
from edge_fl.protocol import PayloadRejected, UpdateLimits, decode_update, encode_update
from edge_fl.protocol.codecs import build_codec, codec_for_tag, codec_names
from edge_fl.protocol.messages import DenseUpdate
from edge_fl.protocol.params import check_mechanism_params

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> ModuleType:
    """The example module, loaded once per session (it registers its class when imported)."""
    key = f"edge_fl_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def test_an_own_mechanism_is_found_by_name_and_its_schema_checks_global_messages() -> None:
    own = example("own_mechanism")
    assert "local-laplace" in mechanism_names()
    assert mechanism_class("local-laplace") is own.LocalLaplace
    mp = {"m": "local-laplace", "lr": 0.1, "ep": 1, "bs": 8, "clip": 0.5, "eps": 2.0, "L": 3}
    assert check_mechanism_params(mp) == mp
    with pytest.raises(PayloadRejected, match="missing_field") as missing:
        check_mechanism_params({k: v for k, v in mp.items() if k != "eps"})
    assert missing.value.field == "mp.eps"
    with pytest.raises(PayloadRejected, match="out_of_range"):
        check_mechanism_params({**mp, "clip": -1.0})
    assert check_combination("local-laplace", "q8") is None  # a local release: any codec


def test_an_own_codec_is_found_by_name_and_tag_and_decodes_strictly() -> None:
    own = example("own_codec")
    assert "i8" in codec_names() and isinstance(codec_for_tag("i8"), own.Int8)
    codec = build_codec("i8")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(300)
    fields, _ = codec.encode(x, rng)
    out = codec.decode(fields, 300)
    assert np.max(np.abs(out - x)) <= fields["s"] / 2 + 1e-6
    # the aggregator's decoder finds it by its tag; a job limited to f4/f2 refuses it
    update = DenseUpdate("d1", 1, 1, 5, np.zeros(300, np.float32), mechanism="gaussian")
    payload = encode_update(update, coded=("i8", fields))
    assert (
        len(payload) - len(encode_update(update, coded=("i8", {}))) == codec.payload_bytes(300) - 6
    )  # the codec's fields, "dt" excluded (it is in both)
    decoded = decode_update(payload, UpdateLimits(300, mechanism="gaussian", max_abs=None))
    np.testing.assert_array_equal(decoded.delta, out)
    with pytest.raises(PayloadRejected, match="bad_dtype"):
        decode_update(payload, UpdateLimits(300, codecs=frozenset({"f4", "f2"})))
    with pytest.raises(PayloadRejected, match="wrong_shape"):
        codec.decode({**fields, "x": fields["x"][:-1]}, 300)
    with pytest.raises(PayloadRejected, match="bad_type"):
        codec.decode({**fields, "s": "big"}, 300)
    # soundness is the mechanism's call, made when the job is assembled
    assert "i8" in accepted_tags("gaussian") and "i8" not in accepted_tags("gaussian-central")


@pytest.mark.broker
def test_an_own_mechanism_runs_a_job_with_its_accounting(tmp_path: Path) -> None:
    summary = example("own_mechanism").main(str(tmp_path), rounds=3)
    assert summary["mechanism"] == "local-laplace" and summary["rounds_closed"] == 3
    assert summary["total_received"] > 0 and summary["total_rejected"] == 0
    privacy = summary["privacy"]
    assert privacy["unit"] == "device" and privacy["guarantee"].startswith("pure eps-DP")
    # pure eps = 2 per upload, composed over the worst device's uploads (basic composition)
    assert privacy["epsilon_by_accountant"]["basic"] == pytest.approx(2.0 * privacy["events"])
    assert 1 <= privacy["events"] <= 3
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["epsilon"] == pytest.approx(privacy["epsilon"])


@pytest.mark.broker
def test_an_own_codec_carries_a_job_s_updates(tmp_path: Path) -> None:
    summary = example("own_codec").main(str(tmp_path), rounds=3)
    assert summary["rounds_closed"] == 3 and summary["total_rejected"] == 0
    received = summary["total_received"]
    assert received > 0
    per_update = summary["total_bytes_up"] / received
    n_params = summary["n_params"]
    assert per_update < build_codec("f32").payload_bytes(n_params) / 3.5
    assert per_update >= build_codec("i8").payload_bytes(n_params)
    assert summary["privacy"]["epsilon"] > 0
