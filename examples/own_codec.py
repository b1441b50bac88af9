"""Your own uplink codec, defined outside edge_fl and run end to end.

``i8``: every value of a device's (already privatised) update as a signed 8-bit level of one
scale ``s = max |x| / 127``, rounded to nearest: about 4x smaller than float32, deterministic,
biased by at most s / 2 per value. A codec is a pure map between a float vector and a few msgpack
fields; its decoder trusts nothing (every field's presence, type, exact length and domain, and
every failure a PayloadRejected naming the key), because the aggregator runs it on bytes any
device sent. Registering it makes ``compression.uplink = "i8"`` valid, devices encode with it and
the aggregator decodes updates tagged ``dt = "i8"``.

Run: ``python examples/own_codec.py`` (starts a private Mosquitto, or set ``broker.url``).
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

import edge_fl.protocol.fields as F
from edge_fl import load_config, register_codec, run_simulation
from edge_fl.protocol.codecs.base import Codec, CodecState, bin_size, check_vector

LEVELS = 127


class Int8(Codec):
    name = "i8"
    dt = "i8"
    keys = frozenset({"x", "s"})

    def encode(
        self, x: np.ndarray, rng: np.random.Generator, state: CodecState | None = None
    ) -> tuple[dict[str, Any], CodecState | None]:
        vec = check_vector(x)
        scale = float(np.abs(vec).max()) / LEVELS if vec.size else 0.0
        levels = np.rint(vec / scale) if scale > 0 else np.zeros(vec.size)
        return {"x": levels.astype("<i1").tobytes(), "s": scale}, None

    def decode(self, fields: dict[str, Any], dim: int) -> np.ndarray:
        scale = F.number(F.get(fields, "s", float, "scale", "float"), "s", "scale", 0.0, 1e30)
        blob = self.blob(fields, "x", "levels", dim, f"{dim} int8 levels")
        levels = np.frombuffer(blob, "<i1").astype(np.float64)
        if np.any(levels < -LEVELS):
            raise F.out_of_range(
                "x", "levels", int(levels.min()), f"levels in [-{LEVELS}, {LEVELS}]"
            )
        return self.finite((levels * scale).astype(np.float32), "x", "decoded update")

    def payload_bytes(self, dim: int) -> int:
        # "dt": "i8" (3 + 3), "x": bin (2 + bin), "s": float64 (2 + 9)
        return 6 + 2 + bin_size(dim) + 2 + 9


register_codec(Int8)


def main(out_dir: str | None = None, rounds: int = 3) -> dict[str, Any]:
    cfg = load_config(
        None,
        {
            "job": f"own-codec-{uuid.uuid4().hex[:6]}",
            "data.devices": 8,
            "rounds.rounds": rounds,
            "rounds.clients_per_round": 4,
            "rounds.min_updates": 2,
            "rounds.deadline_s": 10,
            "privacy.mechanism": "gaussian",
            "privacy.noise_multiplier": 2.0,
            "compression.uplink": "i8",
        },
    )
    return run_simulation(cfg, out_dir).summary


if __name__ == "__main__":
    summary = main()
    per_update = summary["total_bytes_up"] / max(1, summary["total_received"])
    print(
        f"i8: {summary['total_received']} updates accepted, {per_update:.0f} bytes each for "
        f"{summary['n_params']} parameters, epsilon {summary['privacy']['epsilon']:.3f}"
    )
