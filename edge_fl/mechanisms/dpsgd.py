"""DP-SGD inside the device (mechanism C): example-level (eps, delta), one example replaced by null.

Each round a device runs ``steps = round(epochs / q)`` DP-SGD steps (Poisson batches at rate q,
per-example L2 clipping, Gaussian noise, divided by the expected batch q|D|) from the broadcast
model and uploads the difference. q, the step count and the normaliser depend on the device's |D|,
which also travels in clear in the update (``n``): |D| is public, so neighbouring datasets replace
one example by a null example that contributes nothing (dp-accounting's REPLACE_SPECIAL; its
Poisson-sampled Gaussian accounting equals add/remove's). Under add/remove the changed |D| would
re-weight every other example: the release audit measured eps 2.39 against a claim of 1.35. sigma is ``privacy.noise_multiplier`` or calibrated per (q, steps) so that
L = ``privacy.max_uploads`` uploads together stay within ``privacy.epsilon``.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_fl.mechanisms.base import UPLOADS, Device, Guarantee, JobFacts, Mechanism, dense_update
from edge_fl.privacy.calibration import calibrated
from edge_fl.privacy.dpsgd import DpSgdConfig, calibrate_dpsgd_noise_multiplier
from edge_fl.protocol import GlobalModel, Update
from edge_fl.protocol.params import MAX_COUNT, int_param, number_param

if TYPE_CHECKING:
    from edge_fl.privacy.events import PrivacyEvent


class DpSgd(Mechanism):
    name = "dpsgd"
    guarantee = Guarantee(
        "example",
        "replace_special",
        "approximate",
        ("|D| (the device's sample count; it sets q, the steps and the normaliser)",),
    )
    public_schema = (
        number_param("clip", True, "L2 clip bound of each per-example gradient", 0),
        number_param(
            "z",
            False,
            "noise multiplier sigma; absent: calibrated per dataset size (Python only)",
            0,
        ),
        number_param("q", False, "Poisson sampling rate; absent: min(1, bs / dataset size)", 0, 1),
        int_param("L", False, UPLOADS + "; absent: no limit", 1, MAX_COUNT),
    )

    def __init__(self, cfg: Any, facts: JobFacts) -> None:
        super().__init__(cfg, facts)
        if cfg.noise_multiplier is None and not math.isfinite(cfg.epsilon or math.inf):
            raise ValueError(
                "privacy.mechanism = 'dpsgd' needs privacy.noise_multiplier or a finite "
                "privacy.epsilon (to calibrate it)"
            )
        self._by_size: dict[tuple[float, int], DpSgdConfig] = {}

    def rate(self, n_samples: int) -> float:
        return self.cfg.sample_rate or min(1.0, self.facts.batch_size / max(1, n_samples))

    def steps(self, n_samples: int) -> int:
        """Steps per round: ``epochs`` expected passes over the data at rate q."""
        return max(1, round(self.facts.local_epochs / self.rate(n_samples)))

    def params(self, n_samples: int) -> DpSgdConfig:
        """DP-SGD for a device of this size; sigma calibrated once per (q, steps) when needed."""
        key = (self.rate(n_samples), self.steps(n_samples))
        q, steps = key
        c = self.cfg
        args = (c.epsilon, c.delta, q, steps * self.facts.max_uploads, c.accountant)
        # asked every time (a table lookup after the first), so the job's calibration scope
        # records this size's row whenever it is asked for (edge_fl.privacy.calibration.scope)
        sigma = c.noise_multiplier or calibrated(
            "dpsgd", args, lambda: calibrate_dpsgd_noise_multiplier(*args)
        )
        if key not in self._by_size:
            self._by_size[key] = DpSgdConfig(self.cfg.clip, sigma, q, self.facts.local_lr)
        return self._by_size[key]

    def device_update(self, device: Device, msg: GlobalModel, exposure: int) -> Update:
        n = device.n_samples
        cfg = self.params(n)
        w = msg.params.astype(np.float64)
        model, X, y = device.model, device.X, device.y

        def grads(at: np.ndarray, idx: np.ndarray) -> np.ndarray:
            return model.per_sample_grads(at, X[idx], y[idx])

        for _ in range(self.steps(n)):
            w = cfg.step(w, functools.partial(grads, w), n, device.rng).params
        return dense_update(device, msg, w - msg.params, self.name)

    def release_events(self, n_samples: int, exposure: int) -> list[PrivacyEvent]:
        return [self.params(n_samples).privacy_event(self.steps(n_samples))]

    def max_exposures(self) -> int | None:
        """Calibrated for L uploads: a device stops after them (a given sigma has no cap)."""
        return None if self.cfg.noise_multiplier else self.facts.max_uploads

    def describe(self) -> dict[str, Any]:
        for n in sorted(set(self.facts.dataset_sizes)):
            self.params(n)  # calibrate every size the job has, so run.json lists them all
        per_size = [
            {
                "sampling_rate": q,
                "steps_per_round": steps,
                "noise_multiplier": c.noise_multiplier,
                "clip_l2": c.clip_norm,
            }
            for (q, steps), c in sorted(self._by_size.items())
        ]
        return {
            **super().describe(),
            "clip_l2": self.cfg.clip,
            "target_epsilon": self.cfg.epsilon,
            "max_uploads": self.max_exposures(),
            "steps_rule": "round(training.epochs / q), q = privacy.sample_rate or batch_size/|D|",
            "by_dataset_size": per_size,
        }

    def public_extra(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "clip": c.clip,
            "z": c.noise_multiplier,
            "q": c.sample_rate,
            "L": self.max_exposures(),
        }
