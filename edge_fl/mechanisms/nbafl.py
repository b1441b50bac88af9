"""NbAFL, noise before model aggregation (Wei et al., IEEE TIFS 2020; mechanism D).

Device: ONE full-batch step from the broadcast model on per-example gradients clipped in L2 to
C / lr, the parameters projected onto the L2 ball of radius C, plus N(0, sigma_U^2) with
sigma_U = 2 c C L / (m eps). That local training is what makes the paper's uplink sensitivity
2C/m true (``edge_fl.privacy.nbafl``); ``training.epochs``/``batch_size`` are not used. A device
uploads at most L = ``privacy.max_uploads`` times. Server: sample-weighted FedAvg of the uploads,
then N(0, sigma_D^2) with the paper's sigma_D = 2 c C sqrt(T^2 - L^2 N) / (m N eps) when
T > L sqrt(N) (partial participation: L < T). The ledger records each upload's Gaussian event
(multiplier c L / eps against sensitivity 2C/m); the downlink noise protects the broadcast against
other devices and is post-processing for the aggregator, so it costs nothing in the ledger.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_fl.mechanisms.base import (
    UPLOADS,
    Device,
    FedAvg,
    Guarantee,
    JobFacts,
    Mechanism,
    dense_update,
)
from edge_fl.privacy.nbafl import NbAflCalibrationWarning, NbAflConfig
from edge_fl.privacy.noise import gaussian_noise
from edge_fl.protocol import GlobalModel, Update
from edge_fl.protocol.params import MAX_COUNT, int_param, number_param

if TYPE_CHECKING:
    from edge_fl.privacy.events import PrivacyEvent


class NbAfl(Mechanism):
    name = "nbafl"
    guarantee = Guarantee(
        "example", "replace_one", "approximate", ("m = the smallest device dataset size",)
    )
    public_schema = (
        number_param(
            "clip", True, "L2 clip bound C (gradients clipped to C/lr, parameters to C)", 0
        ),
        number_param("sigma", True, "uplink noise standard deviation sigma_U", 0),
        int_param("L", True, UPLOADS, 1, MAX_COUNT),
        int_param(
            "mmin",
            True,
            "m: the smallest dataset size the noise is calibrated for; a device "
            "with fewer examples must not upload",
            1,
            10_000_000,
        ),
    )

    def __init__(self, cfg: Any, facts: JobFacts) -> None:
        super().__init__(cfg, facts)
        if cfg.epsilon is None:
            raise ValueError("privacy.mechanism = 'nbafl' needs privacy.epsilon (the job budget)")
        with warnings.catch_warnings():  # said once, by warnings(), and kept in run.json
            warnings.simplefilter("ignore", NbAflCalibrationWarning)
            self.params = NbAflConfig(
                cfg.clip,
                cfg.epsilon,
                cfg.delta,
                facts.rounds,
                facts.max_uploads,
                facts.n_devices,
                facts.min_dataset_size,
            )
        self.notes.append(
            "nbafl: one full-batch local step per round on per-example gradients clipped to C/lr "
            "(the sensitivity 2C/m holds only for that); training.epochs and batch_size are unused"
        )

    def device_update(self, device: Device, msg: GlobalModel, exposure: int) -> Update:
        grads = device.model.per_sample_grads(msg.params, device.X, device.y)
        stepped, _ = self.params.local_step(msg.params, grads, self.facts.local_lr)
        upload, _ = self.params.privatize_upload(stepped, device.rng)
        return dense_update(device, msg, upload - msg.params, self.name)

    def new_strategy(self, state: Any, server_lr: float, rng: np.random.Generator) -> Any:
        return NbAflFedAvg(self.facts.n_params, server_lr, nbafl=self.params, rng=rng)

    def release_events(self, n_samples: int, exposure: int) -> list[PrivacyEvent]:
        return [self.params.privacy_event()]

    def max_exposures(self) -> int:
        return self.params.exposures

    def describe(self) -> dict[str, Any]:
        p = self.params
        return {
            **super().describe(),
            "clip_l2": p.clip_norm,
            "epsilon_target": p.epsilon,
            "c": p.c,
            "rounds_T": p.rounds,
            "uploads_L": p.exposures,
            "devices_N": p.num_clients,
            "min_dataset_size_m": p.min_dataset_size,
            "sigma_uplink": p.sigma_uplink,
            "sigma_downlink": p.sigma_downlink,
            "noise_multiplier_per_upload": p.sigma_uplink / p.uplink_sensitivity,
        }

    def warnings(self) -> list[str]:
        if self.params.epsilon >= 1:
            return [
                f"nbafl: epsilon {self.params.epsilon} >= 1, where c = sqrt(2 ln(1.25/delta)) is "
                "not proven; the ledger's accountant gives the actual guarantee"
            ]
        return []

    def public_extra(self) -> dict[str, Any]:
        p = self.params
        return {
            "clip": p.clip_norm,
            "sigma": p.sigma_uplink,
            "L": p.exposures,
            "mmin": p.min_dataset_size,
        }


@dataclass
class NbAflFedAvg(FedAvg):
    """FedAvg of the noisy uploads, then the downlink noise on the model before broadcast."""

    nbafl: NbAflConfig | None = None
    rng: np.random.Generator | None = None

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        assert self.nbafl is not None and self.rng is not None
        new, info = super().finish(params)
        sigma = self.nbafl.sigma_downlink
        if self.count and sigma > 0:
            noise = gaussian_noise(self.rng, sigma, new.shape, n=self.nbafl.secure_draws)
            new = (new.astype(np.float64) + noise).astype(np.float32)
        return new, {**info, "sigma_downlink": sigma}
