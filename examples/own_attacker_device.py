"""An attacker device for a robustness study, through the job's device factory.

``build_job(cfg, device_factory=f)`` builds every device with ``f(job, index)``; here device 0 is
honest except that it scales its update x100 and claims 10,000,000 samples (model poisoning).
Its updates go over MQTT through the aggregator's decoder, admission and robust aggregation like
any other. The same job runs with robust aggregation off and with the defaults (a norm bound
relative to recent updates, the sample count capped at what the device declared).

    python examples/own_attacker_device.py
"""

import dataclasses

import numpy as np

import edge_fl

SCALE, CLAIM = 100.0, 10_000_000


class Poisoned:
    """A device's mechanism with its update scaled and its sample count inflated."""

    def __init__(self, honest):
        self.honest = honest

    def __getattr__(self, name):  # everything else, e.g. the privacy events, is the honest one's
        return getattr(self.honest, name)

    def device_update(self, device, msg, exposure):
        update = self.honest.device_update(device, msg, exposure)
        delta = (update.delta.astype(np.float64) * SCALE).astype(np.float32)
        return dataclasses.replace(update, delta=delta, n_samples=CLAIM)


def one_attacker(job: edge_fl.Job, index: int) -> edge_fl.DeviceAgent:
    agent = job.default_agent(index)
    if index == 0:
        agent.mechanism = Poisoned(agent.mechanism)
    return agent


for robust in ("off", "auto"):
    cfg = edge_fl.load_config(
        None,
        {
            "job": f"attacked-{robust}",
            "seed": 1,
            "model.name": "logreg",
            "data.devices": 10,
            "rounds.rounds": 5,
            "rounds.clients_per_round": 10,  # the attacker takes part in every round
            "robust.norm_bound": robust,
        },
    )
    job = edge_fl.build_job(cfg, device_factory=one_attacker)
    result = edge_fl.run_simulation(job)
    clipped = sum(r.get("norm_clipped") or 0 for r in result.records)
    capped = sum(r.get("capped_samples") or 0 for r in result.records)
    print(
        f"robust.norm_bound={robust}: final accuracy {result.summary['final_accuracy']:.3f}, "
        f"clipped {clipped}, capped {capped}"
    )
