"""The baseline for whole-process time: a plain numpy FedAvg loop of the same job, no framework.

Same configuration (defaults or the overrides given), same data split over devices, same model,
same local training (edge_fl's `local_sgd`), the same number of devices per round and the same
weighted averaging; no broker, no MQTT sessions, no serialisation, no privacy, no journal, no
ONNX. It is what a researcher would write by hand, and what `edge-fl simulate` is compared with
(tools/bench_simulate.py --plain).

    .venv/bin/python tools/plain_fedavg.py                        # the default job
    .venv/bin/python tools/plain_fedavg.py rounds.rounds=5 data.devices=100
"""

from __future__ import annotations

import sys
import time

import numpy as np

import edge_fl
from edge_fl.models import evaluate
from edge_fl.models.training import LocalTraining, local_sgd


def overrides(argv: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in argv:
        key, _, value = item.partition("=")
        try:
            out[key] = int(value)
        except ValueError:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def main(argv: list[str]) -> None:
    t0 = time.perf_counter()
    cfg = edge_fl.load_config(None, overrides(argv))
    job = edge_fl.build_job(cfg)
    data, model = job.dataset, job.model
    t = cfg.training
    training = LocalTraining(t.epochs, t.batch_size, t.lr)
    n_devices = cfg.data.devices
    per_round = job.target
    rng = np.random.default_rng(cfg.seed)
    device_rngs = [np.random.default_rng([cfg.seed, i]) for i in range(n_devices)]
    shards = [data.device_data(i) for i in range(n_devices)]
    w = job.initial_params().astype(np.float32)
    t1 = time.perf_counter()
    acc = 0.0
    for _ in range(cfg.rounds.rounds):
        chosen = rng.choice(n_devices, size=per_round, replace=False)
        total = np.zeros_like(w, dtype=np.float64)
        weight = 0
        for i in chosen:
            X, y = shards[i]
            w_i = local_sgd(model, w, X, y, training, device_rngs[i])
            total += len(y) * (w_i - w)
            weight += len(y)
        w = (w + cfg.rounds.server_lr * total / max(weight, 1)).astype(np.float32)
        acc, _loss = evaluate(model, w, data.X_test, data.y_test)
    t2 = time.perf_counter()
    print(
        f"plain FedAvg: {cfg.rounds.rounds} rounds x {per_round} devices, accuracy {acc:.4f}; "
        f"setup {t1 - t0:.3f} s, rounds {t2 - t1:.3f} s"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
