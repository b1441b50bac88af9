"""``edge-fl comm-cost``: every codec's update size, measured by the real encoders, per mechanism."""

from __future__ import annotations

import json

from click.testing import CliRunner

from edge_fl.cli.comm_cmds import comm_cost, round_wire, session_wire
from edge_fl.protocol import Topics
from edge_fl.protocol.codecs import build_codec
from edge_fl.transport.wire import mqtt_packet_bytes


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


def test_wire_model_takes_the_global_model_at_qos_0() -> None:
    """Devices subscribe to the global model at QoS 0 (docs/protocol.md): the model's PUBLISH
    has no packet id and the device sends no PUBACK for it; the update goes up at QoS 1."""
    topics = Topics("edgefl")
    update = mqtt_packet_bytes("publish", topic=topics.update("d00000"), payload=1000, qos=1)
    model = mqtt_packet_bytes("publish", topic=topics.global_model, payload=5000, qos=0)
    puback = mqtt_packet_bytes("puback")
    got = round_wire(1000, 5000)
    assert (got["up"], got["down"]) == (update, model + puback)
    idle = round_wire(1000, 5000, uploads=False)  # online, not selected: only the model
    assert (idle["up"], idle["down"]) == (0, model)
    # the end-of-job model: its PUBLISH down (payload + header, no packet id), no PUBACK up
    small, big = session_wire(final_global=100), session_wire(final_global=1000)
    assert big["up"] == small["up"] and big["down"] - small["down"] == 900 + 1  # varint: 2 B


def test_without_dim_it_prices_the_default_jobs_model() -> None:
    """README: `edge-fl comm-cost --downlink q8` runs as written (no --dim: the default job's
    model, the one `edge-fl simulate` trains without options)."""
    import edge_fl

    n_params = edge_fl.build_job(edge_fl.load_config(None, {})).model.n_params
    result = CliRunner().invoke(comm_cost, ["--downlink", "q8", "--samples", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["dim"] == n_params
    table = CliRunner().invoke(comm_cost, ["--downlink", "q8", "--samples", "2"])
    assert table.exit_code == 0, table.output
    assert f"d = {n_params:,}: the default job's model" in table.output
