"""Uplink codecs end to end: accuracy after R rounds against total payload bytes up, vs f32.

    .venv/bin/python tools/bench_codecs.py [--rounds 20] [--seeds 1] [--reproducible] [--only q8,q4]

Every run is ``edge_fl.simulation.simulate`` (embedded Mosquitto, aggregator and fleet in this
process, real MQTT sockets; digits, MLP, 50 devices, 20 per round, the job's default training),
strictly one at a time (the machine is shared). Rows: dense f32 (the baseline, measured in the same
invocation), f16 (stochastic rounding), q8, q4, top-k with error feedback (k = 0.01 and 0.1),
rot1, and SignDS for comparison (its own wire format and training settings, from
tools/bench_signds_e2e.py: sign_k 0.1, lr 0.05 x 1 epoch; eps = 100 is a privacy mechanism, not
a pure codec). Bytes are the aggregator's ``bytes_up`` (MQTT application payloads it received);
wire-level bytes (MQTT headers, acks, TLS, TCP/IP) are not measured here.

Randomness: the production ChaCha20 CSPRNG unless ``--reproducible`` (seeded, NOT secure). The data
split and the initial model come from ``seed``. Never run in CI.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any

from edge_fl.config import load_config
from edge_fl.simulation import simulate

COMMON: dict[str, Any] = {
    "data.dataset": "digits",
    "model.name": "mlp",
    "data.devices": 50,
    "rounds.clients_per_round": 20,
    "rounds.deadline_s": 120.0,
}
ROWS: list[tuple[str, dict[str, Any]]] = [
    ("f32", {"compression.uplink": "f32"}),
    ("f16", {"compression.uplink": "f16"}),
    ("q8", {"compression.uplink": "q8"}),
    ("q4", {"compression.uplink": "q4"}),
    ("topk-0.1+EF", {"compression.uplink": "topk", "compression.topk_fraction": 0.1}),
    ("topk-0.01+EF", {"compression.uplink": "topk", "compression.topk_fraction": 0.01}),
    ("rot1", {"compression.uplink": "rot1"}),
    (
        "signds",
        {
            "privacy.mechanism": "signds",
            "privacy.signds.sign_k": 0.1,
            "training.lr": 0.05,
            "training.epochs": 1,
        },
    ),
]


def run(name: str, overrides: dict[str, Any], rounds: int, seed: int, reproducible: bool) -> dict:
    cfg = load_config(
        None,
        {
            **COMMON,
            **overrides,
            "rounds.rounds": rounds,
            "seed": seed,
            "reproducible": reproducible,
        },
    )
    t0 = time.perf_counter()
    summary = simulate(cfg)
    return {
        "row": name,
        "seed": seed,
        "accuracy": summary["final_accuracy"],
        "bytes_up": summary["total_bytes_up"],
        "updates": summary["total_received"],
        "rejected": summary["total_rejected"],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--reproducible", action="store_true", help="seeded noise, NOT secure")
    ap.add_argument("--only", default="", help="comma-separated rows (f32 always runs)")
    ap.add_argument("--json", dest="json_out", help="write the raw results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    wanted = {"f32", *filter(None, args.only.split(","))} if args.only else None
    rows = [(n, o) for n, o in ROWS if wanted is None or n in wanted]
    results: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        for name, overrides in rows:
            r = run(name, overrides, args.rounds, seed, args.reproducible)
            print(json.dumps(r), file=sys.stderr, flush=True)
            results.append(r)
    base = [r for r in results if r["row"] == "f32"]
    base_acc = statistics.mean(r["accuracy"] for r in base)
    base_per_update = statistics.mean(r["bytes_up"] / r["updates"] for r in base)
    rng = "seeded PCG64 (NOT secure)" if args.reproducible else "ChaCha20 CSPRNG"
    print(
        f"digits MLP, 50 devices, 20 per round, {args.rounds} rounds, {args.seeds} seed(s), {rng}"
    )
    print(
        "| uplink | accuracy | vs f32 | bytes up (total) | bytes / update | f32 / this "
        "(bytes per update) | rejected |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, _ in rows:
        rs = [r for r in results if r["row"] == name]
        acc = statistics.mean(r["accuracy"] for r in rs)
        spread = (
            f" ({min(r['accuracy'] for r in rs):.3f}-{max(r['accuracy'] for r in rs):.3f})"
            if len(rs) > 1
            else ""
        )
        total = statistics.mean(r["bytes_up"] for r in rs)
        per = statistics.mean(r["bytes_up"] / r["updates"] for r in rs)
        print(
            f"| {name} | {acc:.3f}{spread} | {acc - base_acc:+.3f} | {total:,.0f} | {per:,.0f} "
            f"| {base_per_update / per:.1f}x | {sum(r['rejected'] for r in rs)} |"
        )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
