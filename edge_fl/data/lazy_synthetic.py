"""Synthetic(alpha, beta) drawn lazily, one device at a time, from a seed.

:func:`edge_fl.data.synthetic.make_synthetic` generates every device at once: 1,000,000 devices x
50 samples x 60 features would be 12 GB. A population of a million modelled devices only ever
trains the few thousand that are online, so here each device's parameters and samples come from
its own generator, ``SeedSequence([seed, 2, LAZY_TAG, index])``, drawn when (and only when) the
device's data is asked for; the population holds only the devices' sizes (an int32 array).

Same distribution as ``make_synthetic`` (tested statistic by statistic): device k draws
``u_k ~ N(0, alpha^2)``, ``B_k ~ N(0, beta^2)``, ``v_k ~ N(B_k, 1)``, ``W_k, b_k ~ N(u_k, 1)``,
``x ~ N(v_k, Sigma)`` with ``Sigma_jj = j^-1.2`` and ``y = argmax(x W_k + b_k)``; sizes are
``min_samples + lognormal`` with mean ``mean_samples``; the last ``floor(test_fraction * n_k)`` of
a device's samples are its test share. Two differences, both forced by laziness:

- standardisation uses the features' *population* moments, which are known in closed form
  (mean 0, variance ``beta^2 + 1 + Sigma_jj``), instead of the empirical moments of a training set
  nobody materialises; the map is affine, so the learning problem is the same;
- the pooled test set is the test shares of a seeded sample of ``test_devices`` devices, not of
  all of them (an unbiased sample of the same pooled distribution).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

import numpy as np

from edge_fl.data.synthetic import N_CLASSES, N_FEATURES

__all__ = ["LAZY_TAG", "LazyFederatedDataset", "LazySynthetic", "lazy_dataset"]

#: a word in every lazy device's seed, so lazy streams never collide with make_synthetic's
LAZY_TAG = 7
_SIZES, _TEST_SAMPLE = 1, 2


@dataclass(frozen=True)
class LazySynthetic:
    """The generator's parameters; every draw is a pure function of (seed, device index)."""

    seed: int = 0
    alpha: float = 1.0
    beta: float = 1.0
    mean_samples: float = 50.0
    min_samples: int = 10
    sigma: float = 1.0
    test_fraction: float = 0.2
    standardize: bool = True
    n_features: int = N_FEATURES
    n_classes: int = N_CLASSES

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "sigma"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}={v!r}; must be a finite number >= 0")
        if not isinstance(self.min_samples, Integral) or self.min_samples < 2:
            raise ValueError(f"min_samples={self.min_samples!r}; must be an integer >= 2")
        if not self.min_samples <= self.mean_samples < math.inf:
            raise ValueError(
                f"mean_samples={self.mean_samples!r}; must be finite and >= min_samples"
            )
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction={self.test_fraction!r}; must be in (0, 1)")

    # ------------------------------------------------------------------ sizes

    def sizes(self, n_devices: int) -> np.ndarray:
        """Every device's total sample count (train + test), int32: 4 bytes a device."""
        if n_devices < 1:
            raise ValueError(f"n_devices={n_devices!r}; must be >= 1")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 2, LAZY_TAG, 0, _SIZES]))
        mean, lo, s = float(self.mean_samples), int(self.min_samples), float(self.sigma)
        if mean == lo or s == 0:
            return np.full(n_devices, round(mean), dtype=np.int32)
        mu = math.log(mean - lo) - s**2 / 2  # E[lognormal] = mean - min
        out = rng.lognormal(mu, s, n_devices)
        np.rint(out, out=out)
        return (out + lo).clip(max=np.iinfo(np.int32).max).astype(np.int32)

    def n_test(self, size: int | np.ndarray) -> int | np.ndarray:
        """The test share of a device of ``size`` samples."""
        return np.floor(self.test_fraction * np.asarray(size)).astype(np.int64)

    # ------------------------------------------------------------------ one device

    def _scale(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        d = self.n_features
        sd = np.sqrt(np.arange(1, d + 1, dtype=np.float64) ** -1.2)
        var = self.beta**2 + 1.0 + sd**2  # Var x_j over the population: B_k + N(0,1) + Sigma_jj
        return sd.astype(np.float32), np.zeros(d, np.float32), np.sqrt(var).astype(np.float32)

    def device(self, index: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """All ``size`` samples of device ``index`` (float32 features, int64 labels)."""
        if index < 0 or size < 1:
            raise ValueError(f"device index={index!r}, size={size!r}; need index >= 0, size >= 1")
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 2, LAZY_TAG, 1, index]))
        d, c = self.n_features, self.n_classes
        u = rng.normal(0.0, self.alpha)
        B = rng.normal(0.0, self.beta)
        v = rng.standard_normal(d, dtype=np.float32) + np.float32(B)
        W = rng.standard_normal((d, c), dtype=np.float32) + np.float32(u)
        b = rng.standard_normal(c, dtype=np.float32) + np.float32(u)
        sd, mean, std = self._scale()
        X = rng.standard_normal((int(size), d), dtype=np.float32)
        X *= sd
        X += v
        y = (X @ W + b).argmax(axis=1).astype(np.int64)
        if self.standardize:
            X -= mean
            X /= std
        return X, y

    def split(self, index: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(X_train, y_train, X_test, y_test) of one device: its last samples are its test share."""
        X, y = self.device(index, size)
        cut = int(size) - int(self.n_test(size))
        return X[:cut], y[:cut], X[cut:], y[cut:]

    def test_set(
        self, sizes: np.ndarray, n_sample: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pooled test shares of a seeded sample of ``n_sample`` devices (and which ones)."""
        n = len(sizes)
        rng = np.random.default_rng(
            np.random.SeedSequence([self.seed, 2, LAZY_TAG, 0, _TEST_SAMPLE])
        )
        chosen = np.sort(rng.choice(n, size=min(n_sample, n), replace=False))
        parts = [self.split(int(i), int(sizes[i]))[2:] for i in chosen]
        X = np.concatenate([p[0] for p in parts]) if parts else np.empty((0, self.n_features))
        y = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int64)
        if len(y) == 0:
            raise ValueError(
                f"the {len(chosen)} sampled devices hold no test samples; raise test_fraction, "
                "min_samples or the number of test devices"
            )
        return X.astype(np.float32, copy=False), y, chosen


@dataclass
class LazyFederatedDataset:
    """What a job needs of a dataset, for a population whose rows are never all materialised:
    sizes as an array, the pooled test set, and one device's training share on demand."""

    generator: LazySynthetic
    n_devices: int
    test_devices: int = 200
    name: str = "synthetic"
    sizes: np.ndarray = field(init=False, repr=False)  # total samples per device, int32
    train_sizes: np.ndarray = field(init=False, repr=False)  # training samples per device, int32
    X_test: np.ndarray = field(init=False, repr=False)
    y_test: np.ndarray = field(init=False, repr=False)
    test_sample: np.ndarray = field(init=False, repr=False)  # the devices the test set came from
    generated: int = 0  # devices whose data was drawn (the population never draws the rest)

    def __post_init__(self) -> None:
        self.sizes = self.generator.sizes(self.n_devices)
        self.train_sizes = (self.sizes - self.generator.n_test(self.sizes)).astype(np.int32)
        self.train_sizes.flags.writeable = False
        self.X_test, self.y_test, self.test_sample = self.generator.test_set(
            self.sizes, self.test_devices
        )
        self.generated = len(self.test_sample)

    @property
    def n_classes(self) -> int:
        return self.generator.n_classes

    @property
    def n_features(self) -> int:
        return self.generator.n_features

    @property
    def n_train(self) -> int:
        return int(self.train_sizes.sum(dtype=np.int64))

    def device_data(self, device: int) -> tuple[np.ndarray, np.ndarray]:
        """Device ``device``'s training share, drawn now from its seed."""
        if not 0 <= device < self.n_devices:
            raise IndexError(f"device {device} is outside the population of {self.n_devices}")
        self.generated += 1
        X, y, _, _ = self.generator.split(int(device), int(self.sizes[device]))
        return X, y


def lazy_dataset(cfg: Any) -> LazyFederatedDataset:
    """The lazily drawn dataset of a job config with a ``population`` section: synthetic only
    (a real dataset's rows exist and are read, not drawn), with the job's seed and mean size."""
    d, pop = cfg.data, cfg.population
    if d.dataset != "synthetic":
        raise ValueError(
            f"a population draws its data lazily, which only data.dataset = 'synthetic' can; "
            f"got {d.dataset!r}"
        )
    if d.partition not in (None, "natural", "iid"):
        raise ValueError(f"data.partition = {d.partition!r}: synthetic is naturally partitioned")
    if pop.online > d.devices:
        raise ValueError(f"online = {pop.online} exceeds the population data.devices = {d.devices}")
    target = cfg.rounds.target(d.devices)
    if target > pop.online:
        raise ValueError(
            f"rounds.clients_per_round selects {target} devices a round but only {pop.online} "
            "are online"
        )
    generator = LazySynthetic(seed=int(cfg.seed), mean_samples=float(d.samples_per_device))
    return LazyFederatedDataset(generator, int(d.devices), test_devices=int(pop.test_devices))
