"""Laplace output perturbation of one full-batch local step (mechanism A, "DP-FL client").

Device: per-example gradients at the broadcast model, L1-clipped to C, one averaged step, then
Laplace noise of scale ``2 lr C / |D| / eps_r`` on every coordinate. One step only: more local
iterations void the sensitivity bound (docs/specs/privacy.md pitfall 7), so ``training.epochs``/``batch_size`` are unused.
The job budget ``privacy.epsilon`` is split over the L = ``privacy.max_uploads`` uploads a device
may make (uniform or geometric schedule); a device stops when its schedule is spent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import edge_fl.protocol.fields as F
from edge_fl.mechanisms.base import UPLOADS, Device, Guarantee, JobFacts, Mechanism, dense_update
from edge_fl.privacy.laplace import LaplaceConfig
from edge_fl.protocol import GlobalModel, Update
from edge_fl.protocol.params import MAX_COUNT, ParamSpec, int_param, number_param

if TYPE_CHECKING:
    from edge_fl.privacy.events import PrivacyEvent


DECAY = "geometric schedule decay (required when sched = geometric)"


class Laplace(Mechanism):
    name = "laplace"
    guarantee = Guarantee("example", "replace_one", "pure", ("|D| (the device's sample count)",))
    public_schema = (
        number_param("clip", True, "L1 clip bound C of each per-example gradient", 0),
        number_param("eps", True, "total epsilon, split over L uploads by the schedule", 0),
        int_param("L", True, UPLOADS, 1, MAX_COUNT),
        ParamSpec("sched", "choice", True, "budget schedule", choices=("uniform", "geometric")),
        number_param("decay", False, DECAY, 0, 1, hi_open=True),
    )

    @classmethod
    def check_public(cls, mp: Mapping[str, Any], n_params: int | None) -> None:
        if mp["sched"] == "geometric" and "decay" not in mp:
            raise F.missing("mp.decay", DECAY)

    def __init__(self, cfg: Any, facts: JobFacts) -> None:
        super().__init__(cfg, facts)
        if cfg.epsilon is None:
            raise ValueError("privacy.mechanism = 'laplace' needs privacy.epsilon (the job budget)")
        self.params = LaplaceConfig(
            cfg.clip,
            facts.local_lr,
            cfg.epsilon,
            facts.max_uploads,
            cfg.schedule,
            cfg.schedule_decay,
        )
        self.notes.append(
            "laplace: one full-batch local step per round (sensitivity 2*lr*C/|D| holds only for "
            "one step); training.epochs and batch_size are not used"
        )

    def device_update(self, device: Device, msg: GlobalModel, exposure: int) -> Update:
        grads = device.model.per_sample_grads(msg.params, device.X, device.y)
        release = self.params.release(msg.params, grads, exposure, device.rng)
        return dense_update(device, msg, release.params - msg.params, self.name)

    def release_events(self, n_samples: int, exposure: int) -> list[PrivacyEvent]:
        """Past the schedule (a device that lost its count, e.g. after a reboot, and released
        again) a release is charged at the schedule's largest epsilon: never raise, never less."""
        if exposure >= self.params.rounds:
            exposure = int(self.params.epsilon_schedule().argmax())
        return [self.params.privacy_event(exposure)]

    def max_exposures(self) -> int:
        return self.params.rounds  # the schedule splits the budget over L uploads

    def describe(self) -> dict[str, Any]:
        p = self.params
        return {
            **super().describe(),
            "epsilon_total": p.epsilon,
            "epsilon_per_round": [float(e) for e in p.epsilon_schedule()],
            "schedule": p.schedule,
            "clip_l1": p.clip_l1,
            "local_lr": p.learning_rate,
            "max_exposures": self.max_exposures(),
        }

    def public_extra(self) -> dict[str, Any]:
        p = self.params
        geometric = p.schedule == "geometric"
        return {
            "clip": p.clip_l1,
            "eps": p.epsilon,
            "L": p.rounds,
            "sched": p.schedule,
            "decay": p.decay if geometric else None,
        }
