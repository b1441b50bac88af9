"""Uplink and downlink codecs end to end: accuracy after R rounds against bytes, vs f32.

    .venv/bin/python tools/bench_codecs.py [--rounds 20] [--seeds 1] [--reproducible] [--only q8,q4]
        [--model lenet --dataset femnist --data-dir DIR [--make-femnist WRITERS]]
        [--devices N --clients-per-round K] [--lr LR --epochs E] [--runs-dir DIR]

Every run is ``edge_fl.simulation.simulate`` (embedded Mosquitto, aggregator and fleet in this
process, real MQTT sockets; by default digits, MLP, 50 devices, 20 per round, the job's default
training), strictly one at a time (the machine is shared). ``--model lenet --dataset femnist
--data-dir DIR`` runs LeNet-5 on LEAF JSON files; ``--make-femnist W`` first writes W synthetic
FEMNIST-style writers there (noisy class templates, as the tests do: generated, not real FEMNIST).
``--runs-dir`` keeps each run's directory (metrics.jsonl, run.json) for ``edge-fl report``. Rows: dense f32 (the baseline, measured in the same
invocation), f16 (stochastic rounding), q8, q4, top-k with error feedback (k = 0.01 and 0.1),
rot1, the quantised global model (``+dl-q8``: ``compression.downlink: q8``) with f32, q8 and top-k
updates, and SignDS for comparison (its own wire format and training settings, from
tools/bench_signds_e2e.py: sign_k 0.1, lr 0.05 x 1 epoch; eps = 100 is a privacy mechanism, not
a pure codec). Payload bytes are the aggregator's ``bytes_up`` (MQTT application payloads it
received); wire bytes are the run's ``total_wire_up`` / ``total_wire_down`` (every MQTT packet of
every device in both directions, ``edge_fl.transport.wire``; no TLS, no TCP/IP estimate).

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
from pathlib import Path
from typing import Any

import numpy as np

from edge_fl.config import load_config
from edge_fl.data.femnist import write_leaf_dir
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
    # the global model broadcast quantised too (compression.downlink: q8)
    ("f32+dl-q8", {"compression.uplink": "f32", "compression.downlink": "q8"}),
    ("q8+dl-q8", {"compression.uplink": "q8", "compression.downlink": "q8"}),
    (
        "topk-0.1+EF+dl-q8",
        {
            "compression.uplink": "topk",
            "compression.topk_fraction": 0.1,
            "compression.downlink": "q8",
        },
    ),
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


def make_femnist(root: Path, writers: int, seed: int = 0) -> Path:
    """Synthetic FEMNIST-style LEAF files: each class a random 28x28 template plus heavy noise,
    10 of the 62 classes in use, per-writer class skew; hard enough that accuracy is not 1.0."""
    rng = np.random.default_rng(seed)
    templates = rng.random((62, 784)).astype(np.float32)

    def samples(n: int, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        y = rng.choice(classes, n)
        noise = 0.4 * rng.standard_normal((n, 784))
        return np.clip(templates[y] + noise, 0, 1).astype(np.float32), y

    train, test = {}, {}
    for i in range(writers):
        classes = rng.choice(10, 6, replace=False)  # each writer sees 6 of the 10 classes
        train[f"writer_{i}"] = samples(80, classes)
        test[f"writer_{i}"] = samples(20, classes)
    return write_leaf_dir(root, train, test, files_per_split=2)


def run(
    name: str,
    overrides: dict[str, Any],
    rounds: int,
    seed: int,
    reproducible: bool,
    common: dict[str, Any],
    out_dir: Path | None = None,
) -> dict:
    cfg = load_config(
        None,
        {
            **common,
            **overrides,
            "rounds.rounds": rounds,
            "seed": seed,
            "reproducible": reproducible,
        },
    )
    t0 = time.perf_counter()
    summary = simulate(cfg, out_dir)
    if summary.get("stopped"):  # SIGTERM/SIGINT end the run cleanly; stop the whole table too
        raise SystemExit(f"{name}: stopped by {summary['stopped']}")
    return {
        "row": name,
        "seed": seed,
        "accuracy": summary["final_accuracy"],
        "bytes_up": summary["total_bytes_up"],
        "wire_up": summary["total_wire_up"],
        "wire_down": summary["total_wire_down"],
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
    ap.add_argument("--model", default=COMMON["model.name"])
    ap.add_argument("--dataset", default=COMMON["data.dataset"])
    ap.add_argument("--data-dir", type=Path, help="LEAF JSON directory (femnist)")
    ap.add_argument("--make-femnist", type=int, metavar="WRITERS", help="generate into --data-dir")
    ap.add_argument("--devices", type=int, default=COMMON["data.devices"])
    ap.add_argument("--clients-per-round", type=int, default=COMMON["rounds.clients_per_round"])
    ap.add_argument("--lr", type=float, help="training.lr for the codec rows (default: the job's)")
    ap.add_argument("--epochs", type=int, help="training.epochs for the codec rows")
    ap.add_argument("--runs-dir", type=Path, help="keep run directories here (for edge-fl report)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    common = {
        **COMMON,
        "data.dataset": args.dataset,
        "model.name": args.model,
        "data.devices": args.devices,
        "rounds.clients_per_round": args.clients_per_round,
    }
    if args.lr is not None:
        common["training.lr"] = args.lr
    if args.epochs is not None:
        common["training.epochs"] = args.epochs
    if args.data_dir is not None:
        common["data.data_dir"] = str(args.data_dir)
    if args.make_femnist:
        if args.data_dir is None:
            ap.error("--make-femnist needs --data-dir")
        make_femnist(args.data_dir, args.make_femnist)
    wanted = {"f32", *filter(None, args.only.split(","))} if args.only else None
    rows = [(n, o) for n, o in ROWS if wanted is None or n in wanted]
    results: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        for name, overrides in rows:
            out = args.runs_dir / f"{name}-s{seed}" if args.runs_dir else None
            r = run(name, overrides, args.rounds, seed, args.reproducible, common, out)
            print(json.dumps(r), file=sys.stderr, flush=True)
            results.append(r)
    base = [r for r in results if r["row"] == "f32"]
    base_acc = statistics.mean(r["accuracy"] for r in base)
    base_per_update = statistics.mean(r["bytes_up"] / r["updates"] for r in base)
    base_wire = statistics.mean(r["wire_up"] + r["wire_down"] for r in base)
    rng = "seeded PCG64 (NOT secure)" if args.reproducible else "ChaCha20 CSPRNG"
    print(
        f"{args.dataset} {args.model}, {args.devices} devices, {args.clients_per_round} per round, "
        f"{args.rounds} rounds, {args.seeds} seed(s), {rng}"
    )
    print(
        "| codecs | accuracy | vs f32 | payload up (total) | payload / update | f32 / this "
        "(payload per update) | wire up | wire down | f32 / this (wire up+down) | rejected |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
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
        wup = statistics.mean(r["wire_up"] for r in rs)
        wdown = statistics.mean(r["wire_down"] for r in rs)
        print(
            f"| {name} | {acc:.3f}{spread} | {acc - base_acc:+.3f} | {total:,.0f} | {per:,.0f} "
            f"| {base_per_update / per:.1f}x | {wup:,.0f} | {wdown:,.0f} "
            f"| {base_wire / (wup + wdown):.2f}x | {sum(r['rejected'] for r in rs)} |"
        )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
