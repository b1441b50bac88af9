"""scikit-learn's bundled 8x8 digits (1797 images, 10 classes): the no-download default dataset."""

from __future__ import annotations

import numpy as np

from edge_fl.data.base import FederatedDataset
from edge_fl.data.partition import partition_dirichlet, partition_iid

N_CLASSES = 10


def _check_fraction(test_fraction: float) -> None:
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction={test_fraction!r}; must be in (0, 1)")


def stratified_split(
    y: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(train_idx, test_idx), each class contributing round(test_fraction * n_c) test rows, so the
    test set mirrors the class balance regardless of the seed."""
    _check_fraction(test_fraction)
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = round(test_fraction * idx.size)
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _read_digits() -> np.ndarray:
    """The 1797 x 65 table (last column = label), bundled in ``edge_fl/data/files`` (UCI data,
    CC BY 4.0): a device with the base install has no scikit-learn, and importing sklearn would
    cost ~0.6 s, a quarter of a whole 20-round simulation."""
    from importlib.resources import files

    with files("edge_fl.data").joinpath("files/digits.csv.gz").open("rb") as raw:
        import gzip

        with gzip.open(raw) as text:
            return np.loadtxt(text, delimiter=",", dtype=np.float32)


def load_digits_split(
    test_fraction: float = 0.2, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X_train, y_train, X_test, y_test); pixels scaled from 0..16 to [0, 1] float32."""
    raw = _read_digits()
    X = (raw[:, :-1] / np.float32(16.0)).astype(np.float32)
    y = raw[:, -1].astype(np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
    tr, te = stratified_split(y, test_fraction, rng)
    return X[tr], y[tr], X[te], y[te]


def load_digits_federated(
    n_devices: int,
    *,
    partition: str | None = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    test_fraction: float = 0.2,
    min_size: int = 1,
) -> FederatedDataset:
    """Digits with the training split spread over ``n_devices`` ("iid" or "dirichlet"(alpha))."""
    X_tr, y_tr, X_te, y_te = load_digits_split(test_fraction, seed)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 1]))
    partition = partition or "iid"
    if partition == "iid":
        parts = partition_iid(y_tr.size, n_devices, rng)
    elif partition == "dirichlet":
        parts = partition_dirichlet(y_tr, n_devices, alpha, rng, min_size=min_size)
    else:
        raise ValueError(f"partition={partition!r} for digits; allowed: 'iid', 'dirichlet'")
    return FederatedDataset(
        name="digits",
        X_train=X_tr,
        y_train=y_tr,
        X_test=X_te,
        y_test=y_te,
        n_classes=N_CLASSES,
        device_indices=parts,
    )
