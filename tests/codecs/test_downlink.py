"""The quantised global model (``compression.downlink: q8``, global ``dt = "q8"``): bounds,
determinism, hostile messages, signatures, and a job that learns from it over real MQTT."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from edge_fl.config import load_config
from edge_fl.protocol import GlobalModel, PayloadRejected, Reject, decode_global, encode_global
from edge_fl.protocol.signing import Signer
from edge_fl.simulation import simulate

D = 1000  # four blocks, the last one short


def message(params: np.ndarray, dt: str = "q8") -> GlobalModel:
    return GlobalModel(
        job="j", version=1, round=1, params=params, mode="sync", selected=("d00001",),
        deadline_s=10.0, config_digest="", wire_dtype=dt, nonce=bytes(16),
    )  # fmt: skip


def weights(seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    return (g.standard_normal(D) * np.repeat([0.01, 1.0, 30.0, 0.2], 250)).astype(np.float32)


def test_q8_global_is_within_half_a_step_deterministic_and_a_quarter_of_f32():
    params = weights()
    payload = encode_global(message(params))
    got = decode_global(payload, expected_dim=D)
    assert got.wire_dtype == "q8" and got.params.dtype == np.float32
    body = msgpack.unpackb(payload)
    steps = np.frombuffer(body["qp"], "<f4").reshape(-1, 2)[:, 1].astype(np.float64)
    bound = np.repeat(steps, 256)[:D] / 2 * (1 + 1e-6) + 1e-7  # + float32 rounding of the result
    assert np.all(np.abs(got.params.astype(np.float64) - params) <= bound)
    assert encode_global(message(params)) == payload  # the same model, the same bytes
    f32 = encode_global(message(params, "f4"))
    assert len(payload) < len(f32) / 3.5


@pytest.mark.parametrize(
    ("change", "reason", "field"),
    [
        ({"qp": None}, Reject.MISSING_FIELD, "qp"),
        ({"qp": b"\0" * 8}, Reject.WRONG_SHAPE, "qp"),
        ({"qp": np.array([np.nan, 1.0] * 4, "<f4").tobytes()}, Reject.OUT_OF_RANGE, "qp"),
        ({"w": b""}, Reject.WRONG_SHAPE, "w"),
        ({"dt": "q4"}, Reject.BAD_DTYPE, "dt"),
    ],
)
def test_hostile_q8_globals_are_rejected_precisely(change, reason, field):
    body = msgpack.unpackb(encode_global(message(weights())))
    for key, value in change.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    with pytest.raises(PayloadRejected) as caught:
        decode_global(msgpack.packb(body, use_bin_type=True))
    assert caught.value.reason == reason and caught.value.field == field


def test_qp_on_a_float_global_is_an_unknown_field_and_the_dimension_is_checked():
    body = msgpack.unpackb(encode_global(message(weights(), "f4")))
    body["qp"] = b"\0" * 32
    with pytest.raises(PayloadRejected) as caught:
        decode_global(msgpack.packb(body, use_bin_type=True))
    assert caught.value.reason == Reject.UNKNOWN_FIELD
    with pytest.raises(PayloadRejected) as caught:
        decode_global(encode_global(message(weights())), expected_dim=D + 1)
    assert caught.value.reason == Reject.WRONG_SHAPE


def test_a_signed_q8_global_verifies_and_a_changed_level_does_not():
    signer = Signer.generate()
    payload = encode_global(message(weights()), signer=signer)
    assert decode_global(payload, verifier=signer.verifier).wire_dtype == "q8"
    envelope = msgpack.unpackb(payload)
    body = msgpack.unpackb(envelope["b"])
    levels = bytearray(body["w"])
    levels[7] ^= 1
    body["w"] = bytes(levels)
    envelope["b"] = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(PayloadRejected) as caught:
        decode_global(msgpack.packb(envelope, use_bin_type=True), verifier=signer.verifier)
    assert caught.value.reason == Reject.BAD_SIGNATURE


def test_a_job_with_a_q8_downlink_learns_and_its_devices_receive_a_quarter_of_the_bytes():
    def run(downlink: str) -> dict:
        cfg = load_config(
            None,
            {
                "data.devices": 10,
                "rounds.clients_per_round": 10,
                "rounds.rounds": 4,
                "model.name": "logreg",
                "seed": 1,
                "reproducible": True,
                "compression.downlink": downlink,
            },
        )
        return simulate(cfg)

    q8, f32 = run("q8"), run("f32")
    assert q8["total_rejected"] == 0 and q8["total_received"] == 40
    # 650 parameters: the message's header (selection, mechanism parameters) is a good part of it
    assert q8["total_bytes_down"] < f32["total_bytes_down"] / 2.5
    assert q8["total_bytes_up"] == f32["total_bytes_up"]  # devices still answer in f4
    assert q8["final_accuracy"] > 0.8 and abs(q8["final_accuracy"] - f32["final_accuracy"]) < 0.05
