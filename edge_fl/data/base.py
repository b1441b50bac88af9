"""A federated dataset: one pooled training set, a held-out test set and each device's share."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge_fl.data.partition import partition_dirichlet, partition_iid


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
        """Device ``device``'s rows. A contiguous share (Synthetic's) comes as read-only views
        of the pooled arrays, not a copy: 10,000 devices' copies were ~92 MB of a fleet's RSS."""
        idx = self.device_indices[device]
        if (
            len(idx)
            and int(idx[-1]) - int(idx[0]) + 1 == len(idx)
            and bool((np.diff(idx) == 1).all())
        ):
            rows = slice(int(idx[0]), int(idx[-1]) + 1)
            X, y = self.X_train[rows], self.y_train[rows]
            X.flags.writeable = False
            y.flags.writeable = False
            return X, y
        return self.X_train[idx], self.y_train[idx]

    def fingerprint(self) -> str:
        """SHA-256 of what the devices train on and the aggregator tests on: every array (shape,
        dtype, bytes) and every device's share. Two loads of the same files agree wherever the
        files are kept; other files, or another split, disagree (the config digest's data_dir)."""
        h = hashlib.sha256()
        arrays = (self.X_train, self.y_train, self.X_test, self.y_test, *self.device_indices)
        for a in arrays:
            c = np.ascontiguousarray(a)
            h.update(f"{c.dtype.str}{c.shape};".encode())
            h.update(c.data)
        return "sha256:" + h.hexdigest()

    @classmethod
    def from_arrays(
        cls,
        x_train: np.ndarray,
        y_train: np.ndarray,
        x_test: np.ndarray,
        y_test: np.ndarray,
        *,
        devices: int,
        partition: str | Sequence[np.ndarray] = "iid",
        alpha: float = 0.5,
        seed: int = 0,
        min_size: int = 1,
        n_classes: int | None = None,
        name: str = "arrays",
    ) -> FederatedDataset:
        """Your own arrays split over ``devices`` devices.

        Rows are flattened to feature vectors (an image becomes its pixels) as float32; labels
        must be integers in [0, n_classes) (default: the largest label + 1). ``partition``:
        "iid" (equal shuffled shares), "dirichlet" (label skew with concentration ``alpha``,
        every device at least ``min_size`` rows) or your own split, one array of training-row
        indices per device. The split is seeded by ``seed``: it decides the experiment, not
        privacy."""
        X, y = _rows(x_train, y_train, "train")
        X_test, y_test = _rows(x_test, y_test, "test")
        if X_test.shape[1] != X.shape[1]:
            raise ValueError(
                f"x_test has {X_test.shape[1]} features per row, x_train {X.shape[1]}; they must agree"
            )
        top = int(max(y.max(), y_test.max())) + 1
        n_classes = top if n_classes is None else int(n_classes)
        if n_classes < max(top, 2):
            raise ValueError(f"n_classes = {n_classes}: labels go up to {top - 1} (need >= 2)")
        rng = np.random.default_rng([seed, 0xDA7A])
        if isinstance(partition, str):
            if partition == "iid":
                parts = partition_iid(len(y), devices, rng)
            elif partition == "dirichlet":
                parts = partition_dirichlet(y, devices, alpha, rng, min_size=min_size)
            else:
                raise ValueError(
                    f"partition = {partition!r}: 'iid', 'dirichlet' or one index array per device"
                )
        else:
            parts = _own_split(partition, devices, len(y))
        return cls(name, X, y, X_test, y_test, n_classes, parts)


def _rows(x: np.ndarray, y: np.ndarray, which: str) -> tuple[np.ndarray, np.ndarray]:
    X = np.asarray(x)
    labels = np.asarray(y)
    if X.ndim < 2 or X.shape[0] == 0:
        raise ValueError(f"x_{which} has shape {X.shape}: need (rows, features...) with rows >= 1")
    if labels.shape != (X.shape[0],):
        raise ValueError(
            f"y_{which} has shape {labels.shape}; expected ({X.shape[0]},) as x_{which}"
        )
    if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0:
        raise ValueError(f"y_{which} must hold integer class labels >= 0, got {labels.dtype}")
    X = np.ascontiguousarray(X.reshape(X.shape[0], -1), dtype=np.float32)
    if not np.all(np.isfinite(X)):
        raise ValueError(f"x_{which} holds NaN or inf")
    return X, labels.astype(np.int64)


def _own_split(parts: Sequence[np.ndarray], devices: int, n_rows: int) -> tuple[np.ndarray, ...]:
    split = tuple(np.sort(np.asarray(p, dtype=np.int64).ravel()) for p in parts)
    if len(split) != devices:
        raise ValueError(f"partition gives {len(split)} index arrays for devices = {devices}")
    for i, p in enumerate(split):
        if p.size == 0:
            raise ValueError(f"partition: device {i} has no rows")
        if p[0] < 0 or p[-1] >= n_rows:
            raise ValueError(f"partition: device {i} has indices outside [0, {n_rows})")
    return split
