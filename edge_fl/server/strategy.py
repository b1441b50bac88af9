"""How accepted updates become the next global model. One strategy object per round (or batch).

Updates are folded in as they are accepted (running weighted sums in float64), so an accepted update
is never held only in a queue that a crash or a bad later payload could lose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edge_fl.protocol import DenseUpdate, SignDSUpdate, Update


class Strategy(Protocol):
    def add(self, update: Update, weight: float) -> None: ...

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """New global parameters and extra metrics for the round record."""
        ...

    @property
    def count(self) -> int: ...


@dataclass
class FedAvg:
    """Sample-count weighted mean of deltas, scaled by a server learning rate."""

    n_params: int
    server_lr: float = 1.0
    _sum: np.ndarray = field(init=False)
    _weight: float = field(default=0.0, init=False)
    _count: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._sum = np.zeros(self.n_params, dtype=np.float64)

    def add(self, update: Update, weight: float) -> None:
        """``weight`` scales an update's influence (staleness); it is NOT renormalised away, so
        FedAsync with one update applies ``server_lr * f(s) * delta``."""
        if not isinstance(update, DenseUpdate):
            raise TypeError(f"FedAvg takes dense updates, got {type(update).__name__}")
        self._sum += weight * update.n_samples * update.delta.astype(np.float64)
        self._weight += update.n_samples
        self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        if self._count == 0 or self._weight <= 0:
            return params.copy(), {}
        step = self.server_lr * self._sum / self._weight
        return (params.astype(np.float64) + step).astype(np.float32), {
            "update_norm": float(np.linalg.norm(step))
        }


@dataclass
class NbAflFedAvg(FedAvg):
    """FedAvg of the noisy uploads, then NbAFL's downlink noise on the model before broadcast."""

    nbafl: Any = None  # edge_fl.privacy.nbafl.NbAflConfig
    rng: Any = None

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        new, info = super().finish(params)
        if self._count and self.nbafl.sigma_downlink > 0:
            new = self.nbafl.perturb_broadcast(new, self.rng).astype(np.float32)
        return new, {**info, "sigma_downlink": self.nbafl.sigma_downlink}


@dataclass
class CentralGaussianSum:
    """DP-FedAvg, central: unweighted sum of clipped deltas + N(0, (zS)^2), / expected count.

    Noise is added every round, also to an empty sum: skipping it would reveal that nobody came.
    The denominator is fixed (expected participants): the realised count would leak.
    """

    n_params: int
    central: Any  # edge_fl.privacy.gaussian.CentralGaussianConfig
    rng: Any
    server_lr: float = 1.0
    _sum: np.ndarray = field(init=False)
    _count: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._sum = np.zeros(self.n_params, dtype=np.float64)

    def add(self, update: Update, weight: float) -> None:
        if not isinstance(update, DenseUpdate):
            raise TypeError(f"central Gaussian takes dense updates, got {type(update).__name__}")
        norm = float(np.linalg.norm(update.delta.astype(np.float64)))
        if norm > self.central.clip_norm * (1 + 1e-5):
            raise ValueError(f"update norm {norm:.4g} exceeds the clip bound")
        self._sum += update.delta
        self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        step = self.server_lr * self.central.noisy_mean(self._sum, self.rng)
        return (params.astype(np.float64) + step).astype(np.float32), {
            "noise_std": self.central.std,
            "update_norm": float(np.linalg.norm(step)),
        }


@dataclass
class SignDSAggregate:
    """Reconstruct SignDS votes (sample-weighted) and step by MagRR's 3 N r_est; update MagRR."""

    n_params: int
    state: Any  # edge_fl.privacy.magrr.MagRRState at the start of the round
    magrr: Any  # MagRRConfig
    global_lr: float
    expected_n: int
    _votes: np.ndarray = field(init=False)
    _weight: float = field(default=0.0, init=False)
    _bits: list[int] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._votes = np.zeros(self.n_params, dtype=np.float64)

    def add(self, update: Update, weight: float) -> None:
        if not isinstance(update, SignDSUpdate):
            raise TypeError(f"SignDS takes SignDS updates, got {type(update).__name__}")
        # indices were validated by the decoder: strictly ascending, unique, in range
        self._votes[update.indices] += update.sign * weight * update.n_samples
        self._weight += update.n_samples
        self._bits.append(update.magrr_bit)

    @property
    def count(self) -> int:
        return len(self._bits)

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        from edge_fl.privacy.magrr import magrr_step

        step = self.state.step(self.expected_n, self.magrr)
        new = params.copy()
        if self._weight > 0:
            new = (params.astype(np.float64) + step * self._votes / self._weight).astype(np.float32)
        self.state, info = magrr_step(
            self.state,
            np.asarray(self._bits, dtype=np.int64),
            self.expected_n,
            self.global_lr,
            self.magrr,
        )
        return new, {
            "signds_step": step,
            "magrr_action": info.action,
            "magrr_r_est": info.r_est,
            "magrr_reached": self.state.is_reached,
            "magrr_ones": info.ones,
        }
