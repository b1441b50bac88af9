"""Distributed DP under secure aggregation against central DP, at the same epsilon and participation.

    .venv/bin/python tools/bench_secagg_utility.py [--epsilons 2,4,8] [--repeats 3] [--out DIR]

Issue 21's utility claim: with an aggregator nobody has to trust (SecAgg+ with the distributed
discrete Gaussian, ``distributed-gaussian``), digits learns within 0.03 of ``gaussian-central``
(the aggregator adds the noise and sees every clipped update). Both run the same job: digits, 50
IID devices, every device selected every round (participation 1, so neither claims amplification by
sampling), logreg, 20 rounds, clip 1, delta 1e-5, the production CSPRNG (repeats differ). The
distributed mechanism calibrates its noise for the survivors floor the job accepts
(``secure_aggregation.dropout`` 0.3: 35 of 50); when more deliver, the survivors beyond the floor
reveal their noise and the aggregator removes it, so the sum carries the central noise, not
sqrt(50/35) = 1.2x it (docs/specs/secagg.md section 12); the ``dropout`` column says which floor a
row used. Each run is
``edge_fl.simulation.simulate`` in this process (embedded Mosquitto, aggregator and fleet),
strictly one at a time. Prints one markdown table; never run in CI.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from edge_fl.config import load_config
from edge_fl.report import read_run
from edge_fl.simulation import simulate

JOB: dict[str, Any] = {
    "data.dataset": "digits",
    "data.devices": 50,
    "rounds.clients_per_round": 50,
    "rounds.rounds": 20,
    "rounds.deadline_s": 300.0,
    "model.name": "logreg",
    "training.lr": 0.3,
    "training.epochs": 5,
    "training.batch_size": 8,
    "privacy.clip": 1.0,
    "privacy.delta": 1e-5,
    "privacy.accountant": "rdp",
}
FLAGS = "--dataset digits --devices 50 --clients-per-round 50 --rounds 20 --model logreg"


def run(mechanism: str, epsilon: float, dropout: float | None, seed: int, out: Path) -> dict:
    overrides = {**JOB, "seed": seed, "privacy.mechanism": mechanism, "privacy.epsilon": epsilon}
    if dropout is not None:
        overrides["secure_aggregation.enabled"] = True
        overrides["secure_aggregation.dropout"] = dropout
    t0 = time.perf_counter()
    simulate(load_config(None, overrides), out)
    wall = time.perf_counter() - t0
    result = read_run(out)
    summary = result.summary or {}
    return {
        "accuracy": result.final_accuracy,
        "epsilon": result.reported_epsilon,
        "closed": summary.get("rounds_closed"),
        "up": summary.get("total_bytes_up"),
        "down": summary.get("total_bytes_down"),
        "wall": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epsilons", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dropouts", default="0.3", help="survivors floors of the secure rows")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here (default: temp)")
    args = ap.parse_args()
    base = args.out or Path(tempfile.mkdtemp(prefix="bench-secagg-"))
    rows: list[tuple[str, float, Any, list[dict]]] = []
    for eps in (float(e) for e in args.epsilons.split(",")):
        plans: list[tuple[str, float | None]] = [("gaussian-central", None)]
        plans += [("distributed-gaussian", float(d)) for d in args.dropouts.split(",")]
        results: dict[tuple[str, float | None], list[dict]] = {p: [] for p in plans}
        for seed in range(args.repeats):  # alternating: a slow minute hits both mechanisms
            for mech, dropout in plans:
                out = base / f"{mech}-eps{eps:g}-d{dropout}-s{seed}"
                results[(mech, dropout)].append(run(mech, eps, dropout, seed, out))
                r = results[(mech, dropout)][-1]
                print(f"# {mech} eps {eps:g} dropout {dropout} seed {seed}: {r}", flush=True)
        for (mech, dropout), rs in results.items():
            rows.append((mech, eps, dropout, rs))
    print(f"\nruns under {base}; common flags: {FLAGS}\n")
    print("| mechanism | target eps | survivors floor | accuracy mean (min-max) | vs central |"
          " reported eps (max) | rounds closed | MB up / run | MB down / run | s / run |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    central: dict[float, float] = {}
    for mech, eps, dropout, rs in rows:
        accs = [r["accuracy"] for r in rs]
        mean = statistics.mean(accs)
        if mech == "gaussian-central":
            central[eps] = mean
        floor = "-" if dropout is None else f"{round((1 - dropout) * 50)} of 50 ({dropout:g})"
        diff = "-" if mech == "gaussian-central" else f"{mean - central[eps]:+.3f}"
        print(
            f"| {mech} | {eps:g} | {floor} | {mean:.3f} ({min(accs):.3f}-{max(accs):.3f}) | "
            f"{diff} | {max(r['epsilon'] for r in rs):.3f} | "
            f"{min(r['closed'] for r in rs)}/{JOB['rounds.rounds']} | "
            f"{statistics.mean(r['up'] for r in rs) / 1e6:.2f} | "
            f"{statistics.mean(r['down'] for r in rs) / 1e6:.2f} | "
            f"{statistics.mean(r['wall'] for r in rs):.1f} |"
        )


if __name__ == "__main__":
    main()
