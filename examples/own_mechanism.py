"""Your own privacy mechanism, defined outside edge_fl and run end to end with its accounting.

``local-laplace``: each device clips its local update (the model delta after local SGD) to L1
norm C and adds Laplace noise of scale 2C / eps to every coordinate. Any two clipped deltas of a
device differ by at most 2C in L1, so one upload is pure eps-DP per device (replace-one
neighbours), and the ledger composes the uploads each device made.

The mechanism is one class: its settings (``privacy.options``, checked by its own pydantic model
when the config is loaded: a misspelt or out-of-range option is a one-line config error), its
public parameters (the wire schema devices check in every global message), the device rule, the
privacy events of one upload and the guarantee. Registering it makes ``privacy.mechanism =
"local-laplace"`` valid everywhere a mechanism is looked up by name.

Run: ``python examples/own_mechanism.py`` (starts a private Mosquitto, or set ``broker.url``).
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from edge_fl import load_config, register_mechanism, run_simulation
from edge_fl.mechanisms.base import Guarantee, Mechanism, dense_update, local_update
from edge_fl.privacy.events import PrivacyEvent, pure_privacy_event
from edge_fl.privacy.noise import laplace_noise
from edge_fl.protocol.params import int_param, number_param


class LocalLaplaceOptions(BaseModel):
    """``privacy.options`` of local-laplace."""

    model_config = ConfigDict(extra="forbid")
    clip: float = Field(1.0, gt=0, description="L1 clip bound C of the delta")
    eps: float = Field(1.0, gt=0, description="epsilon of one upload")
    uploads: int | None = Field(None, ge=1, description="uploads per device; None: the job's L")


class LocalLaplace(Mechanism):
    """L1-clipped local delta plus Laplace noise: pure eps-DP per upload, per device."""

    name = "local-laplace"
    guarantee = Guarantee("device", "replace_one", "pure")
    public_schema = (
        number_param("clip", True, "L1 clip bound C of the delta", 0),
        number_param("eps", True, "epsilon of one upload", 0),
        int_param("L", True, "uploads a device may make", 1, 2**40),
    )

    options_model = LocalLaplaceOptions

    def __init__(self, cfg: Any, facts: Any) -> None:
        super().__init__(cfg, facts)  # sets self.options, a LocalLaplaceOptions
        self.clip, self.eps = self.options.clip, self.options.eps
        self.uploads = self.options.uploads or (facts.max_uploads if facts else 1)

    def device_update(self, device: Any, msg: Any, exposure: int) -> Any:
        delta = local_update(device, msg)
        norm = float(np.abs(delta).sum())
        if norm > self.clip:
            delta = delta * (self.clip / norm)
        noisy = delta + laplace_noise(device.rng, 2 * self.clip / self.eps, delta.shape)
        return dense_update(device, msg, noisy, self.name)

    def release_events(self, n_samples: int, exposure: int) -> list[PrivacyEvent]:
        return [pure_privacy_event(self.eps, self.name)]

    def max_exposures(self) -> int:
        return self.uploads

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "clip_l1": self.clip, "epsilon_per_upload": self.eps}

    def public_extra(self) -> dict[str, Any]:
        return {"clip": self.clip, "eps": self.eps, "L": self.uploads}


register_mechanism("local-laplace", LocalLaplace)


def main(out_dir: str | None = None, rounds: int = 3) -> dict[str, Any]:
    cfg = load_config(
        None,
        {
            "job": f"own-mechanism-{uuid.uuid4().hex[:6]}",
            "data.devices": 8,
            "rounds.rounds": rounds,
            "rounds.clients_per_round": 4,
            "rounds.min_updates": 2,
            "rounds.deadline_s": 10,
            "privacy.mechanism": "local-laplace",
            "privacy.options": {"clip": 0.5, "eps": 2.0, "uploads": rounds},
        },
    )
    return run_simulation(cfg, out_dir).summary


if __name__ == "__main__":
    summary = main()
    privacy = summary["privacy"]
    print(
        f"{summary['mechanism']}: {summary['total_received']} updates accepted, "
        f"epsilon {privacy['epsilon']:.3f} ({privacy['unit']} level, {privacy['accountant']})"
    )
