"""How accepted updates become the next global model. One strategy object per round (or batch).

Updates are folded in as they are accepted (running weighted sums in float64), so an accepted update
is never held only in a queue that a crash or a bad later payload could lose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edge_fl.protocol import DenseUpdate, Update


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
        if not isinstance(update, DenseUpdate):
            raise TypeError(f"FedAvg takes dense updates, got {type(update).__name__}")
        self._sum += weight * update.n_samples * update.delta.astype(np.float64)
        self._weight += weight * update.n_samples
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
