"""Local DP-FedAvg (mechanism B): clip the local update in L2 to S, add N(0, (zS)^2) on the device.

Any two updates of a device are neighbours (local DP, device level, replace-one: sensitivity 2S,
hence the event's multiplier z/2). ``z`` is ``privacy.noise_multiplier`` or calibrated so that
L = ``privacy.max_uploads`` uploads stay within ``privacy.epsilon``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edge_fl.mechanisms.base import (
    N_IN_THE_CLEAR,
    UPLOADS,
    Device,
    Guarantee,
    JobFacts,
    Mechanism,
    dense_update,
    local_update,
)
from edge_fl.privacy.calibration import calibrated
from edge_fl.privacy.gaussian import LocalGaussianConfig, calibrate_local_noise_multiplier
from edge_fl.protocol import GlobalModel, Update
from edge_fl.protocol.params import MAX_COUNT, int_param, number_param

if TYPE_CHECKING:
    from edge_fl.privacy.events import PrivacyEvent


class LocalGaussian(Mechanism):
    name = "gaussian"
    guarantee = Guarantee("device", "replace_one", "approximate", (N_IN_THE_CLEAR,))
    public_schema = (
        number_param("clip", True, "L2 clip bound S of the delta", 0),
        number_param(
            "z", True, "noise multiplier z: the device adds N(0, (z S)^2) per coordinate", 0
        ),
        int_param("L", False, UPLOADS + "; absent: no limit", 1, MAX_COUNT),
    )

    def __init__(self, cfg: Any, facts: JobFacts) -> None:
        super().__init__(cfg, facts)
        z = cfg.noise_multiplier or _calibrated(cfg, facts.max_uploads)
        self.params = LocalGaussianConfig(cfg.clip, z)
        # calibrated for L uploads: a device stops after them (a given multiplier has no cap)
        self._cap = None if cfg.noise_multiplier else facts.max_uploads

    def device_update(self, device: Device, msg: GlobalModel, exposure: int) -> Update:
        noisy = self.params.privatize_update(local_update(device, msg), device.rng)
        return dense_update(device, msg, noisy.update, self.name)

    def release_events(self, n_samples: int, exposure: int) -> list[PrivacyEvent]:
        return [self.params.privacy_event()]

    def max_exposures(self) -> int | None:
        return self._cap

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "clip_l2": self.params.clip_norm,
            "noise_multiplier": self.params.noise_multiplier,
            "target_epsilon": self.cfg.epsilon,
            "max_uploads": self._cap,
        }

    def public_extra(self) -> dict[str, Any]:
        return {"clip": self.params.clip_norm, "z": self.params.noise_multiplier, "L": self._cap}


def _calibrated(cfg: Any, rounds: int) -> float:
    if cfg.epsilon is None:
        raise ValueError(
            "privacy.mechanism = 'gaussian' needs privacy.noise_multiplier or privacy.epsilon"
        )
    args = (cfg.epsilon, cfg.delta, rounds)
    return calibrated("gaussian", args, lambda: calibrate_local_noise_multiplier(*args))
