"""Split a pooled training set across devices: IID, or label-skewed by a per-class Dirichlet.

Both return one sorted int64 index array per device; together they cover every row exactly once.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np


class TooManyDevicesError(ValueError):
    """More devices than training samples: a caller that knows the dataset's name says so."""

    def __init__(self, n_devices: int, n_samples: int) -> None:
        super().__init__(
            f"n_devices={n_devices} exceeds n_samples={n_samples}; every device needs a sample"
        )
        self.n_devices = n_devices
        self.n_samples = n_samples


def _check_devices(n_samples: int, n_devices: int) -> None:
    if not isinstance(n_devices, Integral) or n_devices < 1:
        raise ValueError(f"n_devices={n_devices!r}; must be an integer >= 1")
    if n_devices > n_samples:
        raise TooManyDevicesError(int(n_devices), int(n_samples))


def _split_by_owner(owner: np.ndarray, n_devices: int) -> tuple[np.ndarray, ...]:
    """Group row indices by device id; a stable sort keeps each device's indices ascending."""
    order = np.argsort(owner, kind="stable")
    cuts = np.cumsum(np.bincount(owner, minlength=n_devices))[:-1]
    return tuple(np.split(order.astype(np.int64, copy=False), cuts))


def partition_iid(
    n_samples: int, n_devices: int, rng: np.random.Generator
) -> tuple[np.ndarray, ...]:
    """Shuffle, then deal equal shares (sizes differ by at most one)."""
    if not isinstance(n_samples, Integral) or n_samples < 1:
        raise ValueError(f"n_samples={n_samples!r}; must be an integer >= 1")
    _check_devices(n_samples, n_devices)
    perm = rng.permutation(n_samples)
    return tuple(np.sort(part) for part in np.array_split(perm, n_devices))


def partition_dirichlet(
    labels: np.ndarray,
    n_devices: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 1,
) -> tuple[np.ndarray, ...]:
    """Label-skewed split: for each class, device shares ~ Dirichlet(alpha * 1).

    The standard scheme (Hsu et al. 2019; Yurochkin et al. 2019): each class's shuffled samples are
    cut at the cumulative Dirichlet proportions. Small ``alpha`` -> each class lands on few devices.

    ``min_size`` guarantee: the scheme is drawn once; then devices below ``min_size`` are topped up
    with samples moved from devices above ``min_size``, taken uniformly at random from the pooled
    surplus (so large devices give proportionally more, and no donor drops below ``min_size``).
    Unlike the usual redraw-until-OK loop this always terminates, also for tiny ``alpha`` with many
    devices; devices that met ``min_size`` keep the Dirichlet skew apart from the donated rows.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array; got {labels.dtype} {labels.shape}")
    if labels.size and labels.min() < 0:
        raise ValueError(f"labels must be >= 0; found {labels.min()}")
    n = int(labels.size)
    if n < 1:
        raise ValueError("labels is empty; need at least one sample")
    _check_devices(n, n_devices)
    if not (isinstance(alpha, Real) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha={alpha!r}; must be a finite number > 0")
    if not isinstance(min_size, Integral) or min_size < 0:
        raise ValueError(f"min_size={min_size!r}; must be an integer >= 0")
    if min_size * n_devices > n:
        raise ValueError(
            f"min_size={min_size} x n_devices={n_devices} = {min_size * n_devices} exceeds "
            f"n_samples={n}; lower min_size or n_devices"
        )

    owner = np.empty(n, dtype=np.int64)
    conc = np.full(n_devices, float(alpha))
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        p = rng.dirichlet(conc)
        # Cut points at the cumulative proportions; the last cut is exactly len(idx).
        cuts = np.minimum((np.cumsum(p) * idx.size).astype(np.int64), idx.size)
        cuts[-1] = idx.size
        counts = np.diff(cuts, prepend=0)
        owner[idx] = np.repeat(np.arange(n_devices), counts)

    _top_up(owner, n_devices, min_size, rng)
    return _split_by_owner(owner, n_devices)


def _top_up(owner: np.ndarray, n_devices: int, min_size: int, rng: np.random.Generator) -> None:
    """Move rows from the pooled surplus (above min_size) to devices below it, in place."""
    sizes = np.bincount(owner, minlength=n_devices)
    deficit = np.maximum(min_size - sizes, 0)
    need = int(deficit.sum())
    if need == 0:
        return
    surplus = np.maximum(sizes - min_size, 0)
    # Uniform choice of `need` surplus slots without replacement = multivariate hypergeometric.
    take = rng.multivariate_hypergeometric(surplus, need)
    order = np.argsort(owner, kind="stable")
    starts = np.concatenate(([0], np.cumsum(sizes)))
    moved = [
        rng.choice(order[starts[d] : starts[d + 1]], size=int(take[d]), replace=False)
        for d in np.flatnonzero(take)
    ]
    rows = np.concatenate(moved)
    rng.shuffle(rows)
    owner[rows] = np.repeat(np.arange(n_devices), deficit)
