"""Central DP-FedAvg (mechanism B, central): devices clip, the aggregator adds the noise.

Devices L2-clip their update to S; the aggregator sums the clipped updates, adds N(0, (zS)^2) and
divides by the EXPECTED number of participants (the realised count would leak). Noise is added
every round, also to an empty one: skipping it would reveal that nobody came. Device level,
add/remove one device. Amplification by sampling (q = expected participants / population) is
claimed only with ``privacy.poisson_selection``: devices then flip secret coins from their CSPRNG,
the global message carries q instead of a selection list, and participation counts stay out of
everything devices can read (docs/specs/privacy.md pitfall 8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_fl.mechanisms.base import (
    Device,
    Guarantee,
    JobFacts,
    Mechanism,
    dense_update,
    local_update,
    partial_fields,
)
from edge_fl.mechanisms.exact_sum import ExactSum
from edge_fl.privacy.calibration import calibrated
from edge_fl.privacy.gaussian import CentralGaussianConfig, calibrate_central_noise_multiplier
from edge_fl.protocol import DenseUpdate, GlobalModel, PayloadRejected, Reject, Update
from edge_fl.protocol.params import number_param

if TYPE_CHECKING:
    from edge_fl.privacy.events import PrivacyEvent

#: A delta clipped to S on the device may exceed S after float16 rounding (up to ~5e-4 relative):
#: within this slack the aggregator projects it back onto the S-ball (the sum's sensitivity is S
#: either way); beyond it the update is refused as norm_exceeded.
ROUNDING_SLACK = 1e-3


class CentralGaussian(Mechanism):
    name = "gaussian-central"
    acts_on_empty_round = True
    guarantee = Guarantee(
        "device", "add_or_remove_one", "approximate", ("the expected participants per round",)
    )
    public_schema = (
        number_param("clip", True, "L2 clip bound S of the delta (the device only clips)", 0),
        number_param("z", False, "noise multiplier of the aggregator's noise (informational)", 0),
    )

    def __init__(self, cfg: Any, facts: JobFacts) -> None:
        super().__init__(cfg, facts)
        if facts.mode != "sync":
            raise ValueError(
                f"privacy.mechanism = 'gaussian-central' needs rounds.mode = 'sync' (its noise "
                f"and fixed denominator are per round), got {facts.mode!r}"
            )
        q = min(1.0, facts.expected_participants / facts.n_devices)
        if cfg.noise_multiplier is None and cfg.epsilon is None:
            raise ValueError(
                "privacy.mechanism = 'gaussian-central' needs privacy.noise_multiplier or "
                "privacy.epsilon"
            )
        args = (cfg.epsilon, cfg.delta, q if cfg.poisson_selection else 1.0, facts.rounds)
        z = cfg.noise_multiplier or calibrated(
            "gaussian-central",
            (*args, cfg.accountant),
            lambda: calibrate_central_noise_multiplier(*args, cfg.accountant),
        )
        self.params = CentralGaussianConfig(
            cfg.clip,
            z,
            facts.expected_participants,
            facts.n_devices,
            poisson_selection=cfg.poisson_selection,
        )
        if not cfg.poisson_selection:
            self.notes.append(
                "gaussian-central: no amplification by sampling claimed (selection is not secret "
                "Poisson sampling); set privacy.poisson_selection to select by Poisson sampling"
            )

    def device_update(self, device: Device, msg: GlobalModel, exposure: int) -> Update:
        """Only clipping on the device; the aggregator adds the noise to the sum."""
        clipped = self.params.clip_update(local_update(device, msg))
        return dense_update(device, msg, clipped.values, self.name)

    def new_strategy(self, state: Any, server_lr: float, rng: np.random.Generator) -> Any:
        return CentralGaussianSum(self.facts.n_params, self.params, rng, server_lr)

    def selection_rate(self) -> float | None:
        return self.params.sampling_rate if self.cfg.poisson_selection else None

    def round_events(self) -> list[PrivacyEvent]:
        return [self.params.privacy_event(1)]

    def describe(self) -> dict[str, Any]:
        p = self.params
        return {
            **super().describe(),
            "clip_l2": p.clip_norm,
            "noise_multiplier": p.noise_multiplier,
            "noise_std": p.std,
            "expected_participants": p.expected_participants,
            "population": p.population,
            "poisson_selection": p.poisson_selection,
            "sampling_rate": p.sampling_rate if p.poisson_selection else 1.0,
            "rounds": self.facts.rounds,
        }

    def public_extra(self) -> dict[str, Any]:
        return {"clip": self.params.clip_norm, "z": self.params.noise_multiplier}


@dataclass
class CentralGaussianSum:
    """Unweighted sum of clipped deltas + N(0, (zS)^2), divided by the expected count."""

    n_params: int
    central: CentralGaussianConfig
    rng: np.random.Generator
    server_lr: float = 1.0
    _sum: ExactSum = field(init=False)
    _count: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._sum = ExactSum(self.n_params)

    def add(self, update: Update, weight: float) -> None:
        self._sum.add(self._clipped(update))
        self._count += 1

    def remove(self, update: Update, weight: float) -> None:
        self._sum.add(-self._clipped(update))  # the same projection, subtracted: exact
        self._count -= 1

    def _clipped(self, update: Update) -> np.ndarray:
        if not isinstance(update, DenseUpdate):
            raise TypeError(f"central Gaussian takes dense updates, got {type(update).__name__}")
        delta = update.delta.astype(np.float64)
        norm, bound = float(np.linalg.norm(delta)), self.central.clip_norm
        if norm > bound * (1 + ROUNDING_SLACK):
            raise PayloadRejected(
                Reject.NORM_EXCEEDED,
                f"delta L2 norm {norm:.4g} exceeds the clip bound S = {bound:g}",
            )
        if norm > bound:  # float16/float32 rounding of a clipped delta: project onto the S-ball
            delta *= bound / norm
        return delta

    def partial(self) -> dict[str, Any]:
        return {"s": self._sum.to_bytes(), "w": 0, "c": self._count}

    def merge(self, data: dict[str, Any]) -> None:
        total, _, count = partial_fields(data, self.n_params)
        self._sum.merge(total)
        self._count += count

    @property
    def count(self) -> int:
        return self._count

    @property
    def state(self) -> None:
        return None

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        step = self.server_lr * self.central.noisy_mean(self._sum.value(), self.rng)
        return (params.astype(np.float64) + step).astype(np.float32), {
            "noise_std": self.central.std,
            "update_norm": float(np.linalg.norm(step)),
        }
