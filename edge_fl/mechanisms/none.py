"""No privacy: plain local SGD on the device, sample-weighted FedAvg on the server.

Under ``secure_aggregation`` it is the plain secure sum (:class:`~edge_fl.mechanisms.secure.
SecureSum`): each device L2-clips its update to ``privacy.clip``, puts it on the grid of step
clip / Q and rounds each coordinate stochastically (unbiased) to an integer in [-Q, Q]; the
aggregator learns only the sum and returns the unweighted mean. That hides each update from the
aggregator and the broker; it is not differential privacy (the sum itself is released exactly),
so it charges no privacy and claims no guarantee.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_fl.mechanisms.base import Device, Mechanism, local_update
from edge_fl.mechanisms.secure import SecureJob, SecureLayout
from edge_fl.secagg.calibration import MAX_BITS, min_bits

if TYPE_CHECKING:
    from edge_fl.privacy.events import PrivacyEvent
    from edge_fl.protocol.messages import GlobalModel

#: the default grid: 2^8 levels per clip. Stochastic rounding adds at most step^2 / 4 of variance
#: per coordinate, unbiased, so one device's rounding error has L2 norm at most
#: clip * sqrt(d) / 512 and the mean's shrinks by sqrt(n) more (d = 4,810, n = 50: 2% of clip, below
#: the spread of local SGD itself), while the sum of 100 devices' values fits 16 bits (1,000: 19),
#: half of plain float32 on the wire (docs/specs/secagg.md section 5 calibrates with it).
DEFAULT_LEVELS = 2**8


def grid_levels(clip: float, step: float | None) -> int:
    """Q = ceil(clip / step) (default :data:`DEFAULT_LEVELS`): the grid's levels per clip."""
    if step is None:
        return DEFAULT_LEVELS
    if not (math.isfinite(step) and step > 0):
        raise ValueError(f"secure_aggregation.step must be > 0, got {step!r}")
    return max(1, math.ceil(clip / step))


def clip_l2(x: np.ndarray, bound: float) -> np.ndarray:
    norm = float(np.linalg.norm(x))
    return x * (bound / norm) if norm > bound else x


def stochastic_round(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each coordinate to floor(x) + 1 with probability its fractional part: E[out] = x."""
    floor = np.floor(x)
    return (floor + (rng.random(x.size) < x - floor)).astype(np.int64)


class NoPrivacy(Mechanism):
    name = "none"

    # --- the plain secure sum (SecureSum); none of it runs without secure aggregation --------
    def _clip(self) -> float:
        return float(self.cfg.clip) if self.cfg is not None else 1.0

    def secure_layout(self, job: SecureJob) -> SecureLayout:
        """Q = ceil(clip / step) levels per clip; the grid's step is then clip / Q (at most the
        step asked), so the layout alone tells devices and the aggregator the step. Room for
        ``job.selected`` signed values in [-Q, Q]."""
        clip = self._clip()
        q = grid_levels(clip, job.step)
        bits = min_bits(job.selected, clip, clip / q)
        if bits > MAX_BITS:
            raise ValueError(
                f"the plain secure sum of {job.selected} values in [-{q}, {q}] needs {bits} > "
                f"{MAX_BITS} bits: raise secure_aggregation.step"
            )
        return SecureLayout(length=job.n_params, max_int=q, bits=bits, modular=False)

    def secure_encode(
        self, device: Device, msg: GlobalModel, layout: SecureLayout, round_seed: bytes
    ) -> np.ndarray:
        """Train, clip to L2 ``privacy.clip``, scale by Q / clip, round stochastically (the
        device's CSPRNG) into [-Q, Q]."""
        delta = local_update(device, msg)
        if delta.size != layout.length:
            raise ValueError(f"the model has {delta.size} parameters, the layout {layout.length}")
        q = layout.max_int
        scaled = np.clip(clip_l2(delta, self._clip()) * (q / self._clip()), -q, q)
        return stochastic_round(scaled, device.rng)

    def secure_decode(
        self, total: np.ndarray, contributors: int, layout: SecureLayout, round_seed: bytes
    ) -> np.ndarray:
        """The unweighted mean of the contributors' clipped updates (the sum times the step,
        over the count): a weight per device would be one more summed coordinate."""
        total = np.asarray(total)
        if total.shape != (layout.length,):
            raise ValueError(f"a secure sum of {layout.length} values, got shape {total.shape}")
        if contributors < 1:
            raise ValueError(f"a secure sum needs at least 1 contributor, got {contributors}")
        step = self._clip() / layout.max_int
        return (total.astype(np.float64) * (step / contributors)).astype(np.float32)

    def secure_events(self, job: SecureJob) -> list[PrivacyEvent]:
        """None: the sum hides each update from the aggregator, but it is released exactly."""
        return []

    def secure_describe(self, job: SecureJob) -> dict[str, Any]:
        """The plain secure sum's layout and grid, for ``edge-fl privacy plan``."""
        layout = self.secure_layout(job)
        return {
            "secure_sum": "plain (no differential privacy: the sum is released exactly)",
            "clip_l2": self._clip(),
            "step": self._clip() / layout.max_int,
            "levels_per_clip": layout.max_int,
        }
