"""Virtual time: is an async job's metrics sequence the same on a quiet and on a loaded machine?

    .venv/bin/python tools/bench_virtual_time.py                  # fedbuff-C and fedasync, seed 1
    .venv/bin/python tools/bench_virtual_time.py --modes fedbuff-C --budget 100   # quicker

bench_async's phone-fleet job (100 devices, digits, MLP(64), Dirichlet(0.3), phone-fleet profile,
20% dropout, 5 local epochs) under virtual time with ``--reproducible``: FedBuff with a concurrency
limit (``fedbuff-C``: C = 20, K = 10, dispatch timeout 4 simulated s) and FedAsync without one
(``fedasync``: every available device trains on every version), ``--budget`` updates to apply
(default 565, sync's count in BENCHMARKS.md section 16). Each mode runs twice, each run one
``edge-fl simulate`` subprocess: first as the machine is, then while ``--hogs`` processes
(``python3 -c 'while True: pass'``, started and killed here) keep the cores busy. It prints, per
mode, whether the two metrics sequences are identical in every field but the wall-clock ones
(:data:`WALL_FIELDS`), the first difference if not, and the wall time of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_async import EDGE_FL, ROOT, base_config, mode_rounds, run

from edge_fl.clocksync import first_difference

#: the only fields of a metrics record that may differ between identical virtual-time runs: they
#: measure the machine (seconds of real time), not the simulation
WALL_FIELDS = ("wall_time_s", "elapsed_s")

BENCH_ASYNC_DEFAULTS = SimpleNamespace(
    concurrency=20,
    c_budget_factor=1.0,
    deadline=4.0,
    buffer_size=10,
    fedbuff_lr=1.0,
    fedasync_lr=0.25,
    staleness="polynomial",
    staleness_a=0.5,
    staleness_b=4,
    max_staleness=100,
    sync_rounds=30,
    wide_clients=60,
)


def config(seed: int, mode: str, budget: int) -> dict[str, Any]:
    cfg = base_config(seed, None)  # virtual time
    cfg["reproducible"] = True
    done = {"sync": {"updates_applied": budget}}  # what the -C modes size their budget by
    cfg["rounds"].update(mode_rounds(BENCH_ASYNC_DEFAULTS, mode, budget, done))
    return cfg


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for p in hogs:
        p.kill()
    for p in hogs:
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["fedbuff-C", "fedasync"])
    ap.add_argument("--budget", type=int, default=565, help="updates to apply (fedasync: 2x)")
    ap.add_argument("--hogs", type=int, default=2, help="CPU-bound processes in the loaded run")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_virtual_time")
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args()
    if not EDGE_FL.exists():
        sys.exit(f"{EDGE_FL} not found: create the venv first (README)")
    print(f"load average before: {os.getloadavg()[0]:.2f} (2-minute runs see it)", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for phase in ("as-is", "loaded"):
        hogs = start_hogs(args.hogs) if phase == "loaded" else []
        try:
            for mode in args.modes:
                budget = args.budget * (2 if mode in ("fedbuff", "fedasync") else 1)
                cfg = config(args.seed, mode, budget)
                out = args.out / f"{mode}-seed{args.seed}-{phase}"
                t0 = time.perf_counter()
                res = run(cfg, out, args.timeout)
                wall = time.perf_counter() - t0
                results.setdefault(mode, {})[phase] = res
                recs = res["records"]
                vt = res["summary"].get("virtual_time", {})
                print(
                    f"{phase:7s} {mode:10s}: {len(recs)} records, final acc "
                    f"{recs[-1]['accuracy']:.4f}, sim {recs[-1]['sim_time_s']:.1f} s, "
                    f"wall {wall:.1f} s, grants {vt.get('grants')}, load "
                    f"{os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        finally:
            stop_hogs(hogs)
    print()
    all_same = True
    for mode, phases in results.items():
        a, b = phases["as-is"]["records"], phases["loaded"]["records"]
        diff = first_difference(a, b, WALL_FIELDS)
        all_same &= diff is None
        fields = sorted(set(a[0]) - set(WALL_FIELDS))
        verdict = "IDENTICAL" if diff is None else f"DIFFERENT: {diff}"
        print(f"{mode}: {len(a)} records x {len(fields)} fields (all but {WALL_FIELDS}): {verdict}")
    summary = {
        mode: {
            phase: {
                "wall_s": round(r["wall_s"], 1),
                "records": len(r["records"]),
                "final_accuracy": r["records"][-1]["accuracy"],
                "sim_time_s": r["records"][-1]["sim_time_s"],
            }
            for phase, r in phases.items()
        }
        for mode, phases in results.items()
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(summary, indent=1) + "\n")
    sys.exit(0 if all_same else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
