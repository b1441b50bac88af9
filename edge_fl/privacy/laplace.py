"""Mechanism A: Laplace output perturbation of one local full-batch step ("DP-FL client").

The client clips each per-sample gradient in L1 to C, takes ONE averaged step
``w_c = w_s - eta * mean(g_i)`` and uploads ``w_c + Lap(Delta / eps_r)`` per coordinate, with
``Delta = 2 eta C / |D|`` (replace-one neighbours, L1). One step only: more local iterations void
the sensitivity bound (docs/specs/privacy.md pitfall 7). The job budget eps is split over the T rounds a device may take
part in (basic composition: the sum of the per-round eps is exactly eps); the ledger additionally
reports the tighter PLD/RDP composition of the same Laplace events, labelled as such.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np

from edge_fl.privacy import _checks, _dp
from edge_fl.privacy.clipping import clip_rows_l1
from edge_fl.privacy.noise import laplace_noise

if TYPE_CHECKING:
    from dp_accounting import dp_event

    from edge_fl.privacy.events import PrivacyEvent

__all__ = ["LaplaceConfig", "LaplaceRelease"]

Schedule = Literal["uniform", "geometric"]


class LaplaceRelease(NamedTuple):
    """What a device uploads, and the numbers its ledger entry and metrics need."""

    params: np.ndarray
    epsilon_round: float
    scale: float
    sensitivity: float
    fraction_clipped: float


@dataclass(frozen=True)
class LaplaceConfig:
    """Laplace output perturbation; ``rounds`` = T exposures the budget ``epsilon`` covers.

    ``schedule="geometric"`` spends ``eps (1-r) r^k / (1-r^T)`` in round k (more early, as
    training gains most there); ``decay`` is r in (0, 1).
    """

    clip_l1: float
    learning_rate: float
    epsilon: float
    rounds: int
    schedule: Schedule = "uniform"
    decay: float = 0.9

    unit = "example"

    @property
    def neighboring_relation(self):  # dp-accounting's enum, imported only to account
        return _dp.relation("REPLACE_ONE")

    def __post_init__(self) -> None:
        _checks.positive("clip_l1", self.clip_l1)
        _checks.positive("learning_rate", self.learning_rate)
        _checks.positive("epsilon", self.epsilon)
        _checks.integer("rounds", self.rounds)
        if self.schedule not in ("uniform", "geometric"):
            raise ValueError(f"schedule must be 'uniform' or 'geometric', got {self.schedule!r}")
        if not 0 < _checks.real("decay", self.decay, "in (0, 1)") < 1:
            raise ValueError(f"decay must be in (0, 1), got {self.decay!r}")

    # --- budget ----------------------------------------------------------------------------
    def epsilon_schedule(self) -> np.ndarray:
        """Per-round eps for rounds 0..T-1; sums to ``epsilon`` (to float rounding)."""
        t = self.rounds
        if self.schedule == "uniform":
            return np.full(t, self.epsilon / t)
        r = float(self.decay)
        w = r ** np.arange(t, dtype=np.float64)
        return self.epsilon * w / math.fsum(w)

    def epsilon_round(self, round_index: int) -> float:
        """eps spent in the device's ``round_index``-th exposure (0-based, < rounds)."""
        _checks.integer("round_index", round_index, minimum=0)
        if not 0 <= round_index < self.rounds:
            raise ValueError(
                f"round_index must be in [0, {self.rounds}) (the budget is split over "
                f"rounds={self.rounds}), got {round_index}"
            )
        if self.schedule == "uniform":
            return self.epsilon / self.rounds
        return float(self.epsilon_schedule()[round_index])

    # --- mechanism -------------------------------------------------------------------------
    def sensitivity(self, dataset_size: int) -> float:
        """L1 sensitivity of the one-step output under replace-one: 2 eta C / |D|."""
        n = _checks.integer("dataset_size", dataset_size)
        return 2.0 * self.learning_rate * self.clip_l1 / n

    def scale(self, dataset_size: int, round_index: int) -> float:
        return self.sensitivity(dataset_size) / self.epsilon_round(round_index)

    def local_step(
        self, params: np.ndarray, per_sample_grads: np.ndarray
    ) -> tuple[np.ndarray, float]:
        """One full-batch step on L1-clipped per-sample gradients (rows = the whole dataset)."""
        w = np.asarray(params, dtype=np.float64)
        g = np.asarray(per_sample_grads)
        if w.ndim != 1 or g.ndim != 2 or g.shape[1] != w.shape[0] or g.shape[0] < 1:
            raise ValueError(
                f"per_sample_grads must have shape (|D| >= 1, {w.shape[0]}) for params of shape "
                f"{w.shape}, got {g.shape}"
            )
        clipped = clip_rows_l1(g, self.clip_l1)
        return w - self.learning_rate * clipped.values.mean(axis=0), clipped.fraction_clipped

    def perturb(
        self, stepped: np.ndarray, dataset_size: int, round_index: int, rng: np.random.Generator
    ) -> np.ndarray:
        """Add Lap(Delta / eps_r) to every coordinate of the locally stepped parameters."""
        w = np.asarray(stepped, dtype=np.float64)
        return w + laplace_noise(rng, self.scale(dataset_size, round_index), w.shape)

    def release(
        self,
        params: np.ndarray,
        per_sample_grads: np.ndarray,
        round_index: int,
        rng: np.random.Generator,
    ) -> LaplaceRelease:
        """The whole client step: clip, one step, perturb. ``round_index``: device's exposure."""
        n = int(np.shape(per_sample_grads)[0])
        stepped, frac = self.local_step(params, per_sample_grads)
        eps_r = self.epsilon_round(round_index)
        return LaplaceRelease(
            self.perturb(stepped, n, round_index, rng),
            eps_r,
            self.scale(n, round_index),
            self.sensitivity(n),
            frac,
        )

    # --- accounting ------------------------------------------------------------------------
    def dp_event(self, round_index: int) -> dp_event.LaplaceDpEvent:
        """One release: Laplace with scale / L1 sensitivity = 1 / eps_r (eps_r pure DP)."""
        return _dp.events().LaplaceDpEvent(noise_multiplier=1.0 / self.epsilon_round(round_index))

    def privacy_event(self, round_index: int) -> PrivacyEvent:
        from edge_fl.privacy.events import PrivacyEvent

        return PrivacyEvent(
            self.dp_event(round_index), self.neighboring_relation, "example", "laplace"
        )
