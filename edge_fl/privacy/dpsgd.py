"""Mechanism C: DP-SGD inside the device (example-level DP; Abadi et al., CCS 2016).

Each step: Poisson-sample a batch (every example independently with prob q, from the CSPRNG),
clip each per-sample gradient in L2 to C, sum, add N(0, sigma^2 C^2) with the hardened sampler,
divide by the EXPECTED batch size q |D| (the realised size would leak, docs/specs/privacy.md pitfall 4), step.
Accounting per step: ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`` under REPLACE_SPECIAL:
one example replaced by a null example (|D| stays what it is, and public: q and the normaliser q|D|
depend on it; under add/remove they would change with the neighbour and leak, measured by
``tests/test_release_audit.py``); ``steps`` steps compose as ``SelfComposedDpEvent(..., steps)``, counting every local step
of every round. Poisson sampling, not shuffled fixed batches, is what the accounting assumes
(docs/specs/privacy.md pitfall 8); an empty sample still gets the noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np

from edge_fl.privacy import _checks, _dp
from edge_fl.privacy.clipping import clip_rows_l2
from edge_fl.privacy.noise import gaussian_noise, poisson_mask

if TYPE_CHECKING:
    from dp_accounting import dp_event

    from edge_fl.privacy.events import PrivacyEvent

__all__ = ["DpSgdConfig", "DpSgdStep", "calibrate_dpsgd_noise_multiplier", "dpsgd_epsilon"]


class DpSgdStep(NamedTuple):
    params: np.ndarray
    batch_size: int  # realised; a metric for the device only, never part of the update
    fraction_clipped: float


@dataclass(frozen=True)
class DpSgdConfig:
    """DP-SGD hyper-parameters: clip C, noise multiplier sigma, Poisson rate q, learning rate."""

    clip_norm: float
    noise_multiplier: float
    sampling_rate: float
    learning_rate: float = 0.1
    secure_draws: int = 2

    # |D| is public (it sets q and the normaliser q|D|, and travels in updates): neighbours replace
    # one example by a null one that contributes no gradient; dp-accounting's Poisson-sampled
    # Gaussian has the same RDP curve and PLD under this relation as under add/remove.
    unit = "example"

    @property
    def neighboring_relation(self):  # dp-accounting's enum, imported only to account
        return _dp.relation("REPLACE_SPECIAL")

    def __post_init__(self) -> None:
        _checks.positive("clip_norm", self.clip_norm)
        _checks.positive("noise_multiplier", self.noise_multiplier)
        _checks.probability("sampling_rate", self.sampling_rate)
        _checks.positive("learning_rate", self.learning_rate)
        _checks.integer("secure_draws", self.secure_draws)

    def sample_batch(self, rng: np.random.Generator, dataset_size: int) -> np.ndarray:
        """Indices of a Poisson(q) sample of ``range(dataset_size)``."""
        n = _checks.integer("dataset_size", dataset_size)
        return np.flatnonzero(poisson_mask(rng, n, self.sampling_rate))

    def expected_batch_size(self, dataset_size: int) -> float:
        return self.sampling_rate * _checks.integer("dataset_size", dataset_size)

    def noisy_gradient(
        self, per_sample_grads: np.ndarray, dataset_size: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, float]:
        """(sum of clipped rows + N(0, sigma^2 C^2)) / (q |D|).

        Rows are the sampled batch, possibly none: the noise is added regardless.
        """
        clipped = clip_rows_l2(per_sample_grads, self.clip_norm)
        total = clipped.values.sum(axis=0)
        total += gaussian_noise(
            rng, self.noise_multiplier * self.clip_norm, total.shape, n=self.secure_draws
        )
        return total / self.expected_batch_size(dataset_size), clipped.fraction_clipped

    def step(
        self,
        params: np.ndarray,
        grads_fn: Callable[[np.ndarray], np.ndarray],
        dataset_size: int,
        rng: np.random.Generator,
    ) -> DpSgdStep:
        """One DP-SGD step. ``grads_fn(indices) -> (len(indices), n_params)`` per-sample grads,
        e.g. ``lambda idx: model.per_sample_grads(w, X[idx], y[idx])``."""
        w = np.asarray(params, dtype=np.float64)
        idx = self.sample_batch(rng, dataset_size)
        grads = np.asarray(grads_fn(idx)) if idx.size else np.zeros((0, w.shape[0]))
        if grads.shape != (idx.size, w.shape[0]):
            raise ValueError(
                f"grads_fn must return shape ({idx.size}, {w.shape[0]}), got {grads.shape}"
            )
        g, frac = self.noisy_gradient(grads, dataset_size, rng)
        return DpSgdStep(w - self.learning_rate * g, int(idx.size), frac)

    def dp_event(self, steps: int = 1) -> dp_event.DpEvent:
        """``steps`` DP-SGD steps: SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)."""
        _checks.integer("steps", steps)
        return _dpsgd_event(self.noise_multiplier, self.sampling_rate, steps)

    def privacy_event(self, steps: int = 1) -> PrivacyEvent:
        from edge_fl.privacy.events import PrivacyEvent

        return PrivacyEvent(self.dp_event(steps), self.neighboring_relation, "example", "dpsgd")


def _dpsgd_event(sigma: float, q: float, steps: int) -> dp_event.DpEvent:
    e = _dp.events()
    g = e.GaussianDpEvent(sigma)
    one = e.PoissonSampledDpEvent(q, g) if q < 1 else g
    return e.SelfComposedDpEvent(one, steps)


def dpsgd_epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    delta: float,
    accountant: Literal["rdp", "pld"] = "rdp",
) -> float:
    """Epsilon after ``steps`` DP-SGD steps (RDP orders of Opacus / the spec, or PLD)."""
    cfg = DpSgdConfig(1.0, noise_multiplier, sampling_rate)
    if accountant not in ("rdp", "pld"):
        raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")
    from edge_fl.privacy.accountants import RDP_ORDERS, compose_epsilon

    return compose_epsilon([cfg.privacy_event(steps)], delta, accountant, orders=RDP_ORDERS).epsilon


def calibrate_dpsgd_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: Literal["rdp", "pld"] = "rdp",
) -> float:
    """Smallest sigma reaching at most ``target_epsilon`` after ``steps`` steps at rate q."""
    q = _checks.probability("sampling_rate", sampling_rate)
    n = _checks.integer("steps", steps)
    from edge_fl.privacy.accountants import calibrate_noise_multiplier

    return calibrate_noise_multiplier(
        lambda s: _dpsgd_event(s, q, n), target_epsilon, delta, accountant
    )
