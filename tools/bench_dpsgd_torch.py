"""Benchmark: one DP-SGD step vs one plain minibatch SGD step for LeNet-5 (torch backend).

DP-SGD needs each sample's gradient, an L2 clip per sample, a sum and Gaussian noise from the
production CSPRNG; the plain step needs one batch gradient. Per-sample gradients are timed with both
methods of the torch backend: "expand" (one batched backward + per-layer products, the default) and
"vmap" (torch.func vmap(grad)). Everything goes through the flat-vector Model API, as a device
would use it; all steps are measured in the same run and the ratio to the plain step is printed
(target: < 3x). A last line times the same step through edge_fl.privacy.dpsgd (the project's
mechanism: float64 clipping, hardened Gaussian sampler) with "expand" gradients. Never run in CI.

    .venv/bin/python tools/bench_dpsgd_torch.py [--batch 64] [--repeats 30] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from edge_fl.models.torch_models import LeNet5, configure_torch_threads
from edge_fl.privacy.rng import secure_generator, seeded_generator


def plain_step(model, params, X, y, lr):
    return params - lr * model.grad(params, X, y)


def dpsgd_step(model, params, X, y, lr, clip, sigma, rng):
    G = model.per_sample_grads(params, X, y)  # (n, n_params)
    norms = np.sqrt(np.einsum("ij,ij->i", G, G))  # one pass, no (n, n_params) temporary
    scale = np.minimum(1.0, clip / np.maximum(norms, 1e-12)).astype(np.float32)
    clipped_sum = scale @ G  # sum of clipped rows without modifying G
    noisy = clipped_sum + rng.normal(0.0, sigma * clip, G.shape[1]).astype(np.float32)
    return params - lr * noisy / np.float32(X.shape[0])


def interleaved(variants, repeats):
    """Time every variant once per round, round-robin, so background load hits all alike; each
    timed call follows an untimed one so that caches are warm for every variant, not only the
    one that ran last."""
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            fn()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = ap.parse_args()

    threads = configure_torch_threads(args.threads)
    models = {m: LeNet5(n_classes=62, per_sample=m) for m in ("expand", "vmap")}
    model = models["expand"]
    data_rng = seeded_generator(0)
    params = model.init_params(data_rng)
    X = data_rng.random((args.batch, model.n_features), dtype=np.float32)
    y = data_rng.integers(0, model.n_classes, args.batch)
    noise_rng = secure_generator()
    lr = np.float32(0.05)

    variants = {"plain SGD step": lambda: plain_step(model, params, X, y, lr)}
    for method, m in models.items():
        variants[f"DP-SGD step ({method})"] = lambda m=m: dpsgd_step(
            m, params, X, y, lr, 1.0, 1.0, noise_rng
        )
    # The same step with the project's mechanism (float64 clipping, hardened Gaussian sampler),
    # to show what the privacy layer adds on top of the per-sample gradients.
    try:
        from edge_fl.privacy.dpsgd import DpSgdConfig
    except ImportError as exc:
        print(f"(project DP-SGD mechanism not available: {exc})")
    else:
        cfg = DpSgdConfig(
            clip_norm=1.0, noise_multiplier=1.0, sampling_rate=0.01, learning_rate=0.05
        )

        def project_step():
            G = model.per_sample_grads(params, X, y)
            g, _ = cfg.noisy_gradient(G, 100 * args.batch, noise_rng)  # q |D| = batch
            return params - cfg.learning_rate * g

        variants["DP-SGD step (project)"] = project_step

    interleaved(variants, 3)  # warm-up: allocator, vmap tracing, thread pools
    times = interleaved(variants, args.repeats)
    print(
        f"LeNet-5 (62 classes, {model.n_params} params), batch {args.batch}, "
        f"torch threads {threads}, {args.repeats} interleaved rounds"
    )
    base_med = statistics.median(times["plain SGD step"])
    base_min = min(times["plain SGD step"])
    for name, ts in times.items():
        med, low = statistics.median(ts), min(ts)
        line = f"{name:22s}: median {med * 1e3:7.2f} ms   min {low * 1e3:7.2f} ms"
        if name != "plain SGD step":
            ratio = med / base_med
            verdict = "ok" if ratio < 3 else "MISSED"
            line += f"   ratio {ratio:.2f}x (min/min {low / base_min:.2f}x; target < 3x: {verdict})"
        print(line)


if __name__ == "__main__":
    main()
