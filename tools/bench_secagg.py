"""SecAgg+ cost per round: bytes up and down per device against plain f32, and CPU per round.

Runs whole rounds of the pure core in one process (edge_fl.secagg.driver: every byte a device
would publish or receive through the broker is counted), with the job's calibration
(edge_fl.secagg.calibrate) for each n, and a share of the selection vanishing before its masked
input (the aggregator then rebuilds those devices' keys and removes their pairwise masks: the
expensive path). Plain f32 is the project's own encoding: a dense f4 update up, the f4 global
model down. The model download is counted on both sides (a SecAgg+ device receives it too).

    PYTHONPATH=. python tools/bench_secagg.py                 # n = 100, 1000; d = 4810, 61706
    PYTHONPATH=. python tools/bench_secagg.py --n 100 --dim 4810 --dropout 0.1

CPU: ``time.process_time`` of each side's calls; "device" is the mean and the max over devices,
"aggregator" the whole round (one core, this machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from edge_fl.protocol import DenseUpdate, GlobalModel, encode_global, encode_update
from edge_fl.secagg import RoundParams, Summed, calibrate
from edge_fl.secagg.driver import run_round


def plain_bytes(dim: int, n: int) -> tuple[int, int]:
    """(up, down) of one device in a plain f32 round: its update and the global model."""
    sel = tuple(f"d{i:05d}" for i in range(n))
    model = GlobalModel(
        "job1", 3, 3, np.zeros(dim, np.float32), selected=sel, deadline_s=30.0, nonce=os.urandom(16)
    )
    update = DenseUpdate("d00000", 3, 3, 40, np.zeros(dim, np.float32), nonce=os.urandom(16))
    return len(encode_update(update)), len(encode_global(model))


def bench(
    n: int, dim: int, clip: float, step: float, dropout: float, rng: np.random.Generator
) -> dict:
    cal = calibrate(n, clip, step)
    roster = tuple(f"d{i:05d}" for i in range(n))
    p = RoundParams(
        "job1", 3, os.urandom(16), roster, cal.neighbours, cal.threshold, cal.bits, dim, cal.max_int
    )
    xs = {d: rng.integers(-cal.max_int, cal.max_int + 1, dim) for d in roster}
    vanish = {d: "mask" for d in rng.permutation(roster)[: int(dropout * n)]}
    trace = run_round(p, xs, vanish, clock=time.process_time)
    assert isinstance(trace.outcome, Summed), trace.outcome
    assert np.array_equal(trace.outcome.total, sum(xs[d] for d in trace.outcome.contributors))
    full = [d for d in roster if d not in vanish]  # devices that went through every phase
    up_plain, model = plain_bytes(dim, n)
    up = statistics.mean(trace.up[d] for d in full)
    down = statistics.mean(trace.down[d] for d in full) + model
    cpu = [trace.cpu_device[d] for d in full]
    return {
        "n": n,
        "d": dim,
        "k": cal.neighbours,
        "t": cal.threshold,
        "b": cal.bits,
        "up": up,
        "down": down,
        "up_x": up / up_plain,
        "down_x": down / model,
        "total_x": (up + down) / (up_plain + model),
        "dev_ms": 1e3 * statistics.mean(cpu),
        "dev_max_ms": 1e3 * max(cpu),
        "agg_s": trace.cpu_aggregator,
        "dropped": len(vanish),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--dim", type=int, nargs="+", default=[4810, 61706])
    ap.add_argument("--clip", type=float, default=1.0, help="max |coordinate| after clipping")
    ap.add_argument(
        "--step", type=float, nargs="+", default=[2**-8, 2**-16], help="quantisation steps"
    )
    ap.add_argument("--dropout", type=float, default=0.1, help="share vanishing before masking")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(
        f"clip {args.clip:g}; {args.dropout:.0%} of the selection vanish before their masked "
        "input; bytes per surviving device per round, the f4 model download included"
    )
    head = ("Q", "n", "d", "k", "t", "b", "up B", "down B", "up x", "down x", "total x",
            "device ms", "device max ms", "aggregator s")  # fmt: skip
    print(" | ".join(head))
    for step in args.step:
        for n in args.n:
            for dim in args.dim:
                r = bench(n, dim, args.clip, step, args.dropout, rng)
                print(
                    f"{int(np.ceil(args.clip / step))} | "
                    f"{r['n']} | {r['d']} | {r['k']} | {r['t']} | {r['b']} | {r['up']:,.0f} | "
                    f"{r['down']:,.0f} | {r['up_x']:.3f} | {r['down_x']:.3f} | {r['total_x']:.3f} | "
                    f"{r['dev_ms']:.1f} | {r['dev_max_ms']:.1f} | {r['agg_s']:.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
