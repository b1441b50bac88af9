"""``edge-fl comm-cost``: every codec's update size, measured by the real encoders, per mechanism."""

from __future__ import annotations

import json

from click.testing import CliRunner

from edge_fl.cli.comm_cmds import comm_cost
from edge_fl.codecs import build_codec


def run(*args: str) -> dict:
    result = CliRunner().invoke(comm_cost, [*args, "--samples", "2", "--seed", "1", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_codec_sizes_are_the_codecs_exact_sizes_plus_the_same_header() -> None:
    dim = 16_554  # the digits MLP
    data = run("--dim", str(dim), "--topk-fraction", "0.05")
    codecs = data["codecs"]
    assert list(codecs) == ["f32", "f16", "q8", "q4", "topk", "rot1"]
    assert codecs["f32"]["payload"] == data["updates"]["dense_f32"]
    assert codecs["f16"]["payload"] == data["updates"]["dense_f16"]
    header = {c["payload"] - c["codec_fields"] for c in codecs.values()}
    assert len(header) == 1  # the codec fields are all that differs
    assert codecs["topk"]["codec_fields"] == build_codec("topk", fraction=0.05).payload_bytes(dim)
    assert codecs["topk"]["fraction"] == 0.05
    assert all(c["wire"]["up"] > c["payload"] for c in codecs.values())  # headers, acks, status
    assert 3.8 < codecs["q8"]["vs_f32"] < 3.9 and 7.4 < codecs["q4"]["vs_f32"] < 7.6


def test_refused_combinations_have_no_size_and_a_reason() -> None:
    data = run("--dim", "1000")
    assert data["by_mechanism"]["signds"] == dict.fromkeys(data["codecs"])
    assert "own wire format" in data["refused"]["signds"]["q8"]
    central = data["by_mechanism"]["gaussian-central"]
    assert central["q8"] is None and central["f16"] is not None
    # a longer mechanism name in m: a few more bytes, nothing else
    assert central["f32"] - data["by_mechanism"]["none"]["f32"] == len("gaussian-central") - 4


def test_topk_fraction_out_of_domain_names_the_flag() -> None:
    result = CliRunner().invoke(comm_cost, ["--dim", "100", "--topk-fraction", "0.9"])
    assert result.exit_code != 0 and "--topk-fraction" in result.output
