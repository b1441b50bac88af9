"""An uplink codec end to end: simulate (embedded broker, real MQTT) with compressed updates."""

from __future__ import annotations

from typing import Any

import pytest

from edge_fl.config import load_config
from edge_fl.protocol.codecs import build_codec
from edge_fl.simulation import simulate


@pytest.mark.parametrize(
    ("uplink", "options"), [("q4", {}), ("topk", {"compression.topk_fraction": 0.1})]
)
def test_a_compressed_job_learns_and_sends_the_codecs_bytes(
    uplink: str, options: dict[str, Any]
) -> None:
    cfg = load_config(
        None,
        {
            "data.devices": 10,
            "rounds.clients_per_round": 10,
            "rounds.rounds": 3,
            "model.name": "logreg",
            "seed": 1,
            "reproducible": True,
            "compression.uplink": uplink,
            **options,
        },
    )
    summary = simulate(cfg)
    assert summary["total_rejected"] == 0 and summary["total_received"] == 30
    n_params = summary["n_params"]
    codec = cfg.compression.build()
    per_update = summary["total_bytes_up"] / summary["total_received"]
    # the update header (v, k, r, bv, n, nc, m) is about 40 bytes; the rest is the codec's
    assert codec.payload_bytes(n_params) < per_update < codec.payload_bytes(n_params) + 60
    assert per_update < build_codec("f32").payload_bytes(n_params) / 3
    assert summary["final_accuracy"] > 0.8
