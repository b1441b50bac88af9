"""Benchmark SignDS planning and client selection against numpy baselines measured in the same run.

    .venv/bin/python tools/bench_signds.py [--repeat 7]

For each d: ``plan()`` with an empty cache (the exact h search), ``select()`` on a float32 update
with the production ChaCha20 generator, and as baselines ``np.argpartition`` (the O(d) core of the
selection) and a full ``np.argsort`` (what a sort-based top-k would cost). Prints medians and
ratios. Never run in CI.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from edge_fl.privacy.rng import secure_generator
from edge_fl.privacy.signds import SignDSParams, plan, plan_from_counts, select
from edge_fl.protocol.indices import decode_indices, encode_indices


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    rng = secure_generator()
    data_rng = np.random.default_rng(0)

    print("plan() with an empty cache (exact h search), baseline: np.argpartition on d floats")
    for d in (66_404, 1_000_000, 10_000_000):
        u = data_rng.standard_normal(d).astype(np.float32)
        base = _median_time(lambda u=u, d=d: np.argpartition(u, d // 2), args.repeat)
        for k, eps in ((0.01, 100.0), (0.25, 100.0), (0.01, 1.0)):
            params = SignDSParams(k=k, eps=eps)

            def fresh(params=params, d=d):
                plan_from_counts.cache_clear()
                return plan(params, d)

            t = _median_time(fresh, args.repeat)
            p = fresh()
            print(
                f"  d={d:>10,} k={k:<5} eps={eps:<5} K={p.topk:>9,} h={p.h:>3} "
                f"(exact {p.h_uncapped:>3}) nu_th={p.nu_th:>3}: {_fmt(t)}  "
                f"argpartition {_fmt(base)}  ratio {t / base:6.3f}"
            )

    print("\nselect() (k=0.01, eps=100, ChaCha20), baselines: np.argpartition, np.argsort")
    for d in (66_404, 1_000_000, 10_000_000):
        u = data_rng.standard_normal(d).astype(np.float32)
        p = plan(SignDSParams(k=0.01, eps=100.0), d)
        t_sel = _median_time(lambda u=u, p=p: select(u, p, rng), args.repeat)
        t_part = _median_time(lambda u=u, p=p, d=d: np.argpartition(u, d - p.topk), args.repeat)
        t_sort = _median_time(lambda u=u: np.argsort(u), max(3, args.repeat // 2))
        print(
            f"  d={d:>10,} h={p.h}: select {_fmt(t_sel)}  argpartition {_fmt(t_part)}  "
            f"argsort {_fmt(t_sort)}  select/argpartition {t_sel / t_part:5.2f}  "
            f"select/argsort {t_sel / t_sort:5.3f}"
        )

    print("\nindex coding (uniform random sets, 2000 draws)")
    for d, h in ((66_404, 43), (1_000_000, 100)):
        sets = [np.sort(data_rng.choice(d, h, replace=False)) for _ in range(2000)]
        t0 = time.perf_counter()
        coded = [encode_indices(s, d) for s in sets]
        t_enc = (time.perf_counter() - t0) / len(sets)
        t0 = time.perf_counter()
        for tag, blob in coded:
            decode_indices(tag, blob, d, h, 100)
        t_dec = (time.perf_counter() - t0) / len(sets)
        sizes = np.array([len(b) for _, b in coded])
        tags = [t for t, _ in coded]
        bp = (h * max(1, (d - 1).bit_length()) + 7) // 8
        print(
            f"  d={d:>10,} h={h:>3}: bit-packed {bp} B, chosen mean {sizes.mean():.1f} B "
            f"(min {sizes.min()}, max {sizes.max()}; dv chosen {tags.count('dv')}/{len(tags)}); "
            f"encode {t_enc * 1e6:.1f} us, decode {t_dec * 1e6:.1f} us"
        )


if __name__ == "__main__":
    main()
