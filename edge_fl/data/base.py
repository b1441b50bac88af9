"""A federated dataset: one pooled training set, a held-out test set and each device's share."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FederatedDataset:
    name: str
    X_train: np.ndarray  # float32, (n_train, n_features)
    y_train: np.ndarray  # int64, (n_train,)
    X_test: np.ndarray  # float32, (n_test, n_features)
    y_test: np.ndarray  # int64, (n_test,)
    n_classes: int
    device_indices: tuple[np.ndarray, ...]  # row indices into X_train, one array per device

    @property
    def n_features(self) -> int:
        return int(self.X_train.shape[1])

    @property
    def n_devices(self) -> int:
        return len(self.device_indices)

    def device_data(self, device: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self.device_indices[device]
        return self.X_train[idx], self.y_train[idx]
