"""Empirical DP audits through the REAL local training and update rule of each mechanism.

Two neighbouring device datasets (a worst-case canary), the mechanism's own ``device_update`` run
``--runs`` times on each with fresh randomness, a test statistic fixed on separate calibration
runs, and a Clopper-Pearson lower bound on epsilon (confidence 1 - 1e-3), printed beside the
claimed epsilon; then the same with half the noise, claiming the original epsilon (the audit must
catch it). Settings as in tests/test_release_audit.py: logreg 2x2, m = 10, lr = 1, C = 0.5.

    .venv/bin/python tools/bench_release_audit.py --runs 10000
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from edge_fl.config import load_config
from edge_fl.mechanisms import build_mechanism
from edge_fl.models import make_model
from edge_fl.privacy.rng import seeded_generator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the audit harness
from release_audit import (
    NullSlotModel,
    audit_release,
    noise_scaled,
    release_facts,
    replace_one_canary,
    replace_special_canary,
)

MODEL = make_model("logreg", 2, 2)
M, C = 10, 0.5


def privacy(**settings):
    return load_config(None, {f"privacy.{k}": v for k, v in settings.items()}).privacy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=20240601)
    opts = ap.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)
    cases = [
        ("nbafl", privacy(mechanism="nbafl", epsilon=2.5, delta=1e-5, clip=C), {}, "replace"),
        ("laplace", privacy(mechanism="laplace", epsilon=1.0, clip=C), {}, "replace"),
        (
            "dpsgd (q = 8/11, 1 step)",
            privacy(mechanism="dpsgd", noise_multiplier=1.0, clip=C),
            {"batch_size": 8},
            "special",
        ),
    ]
    print("| mechanism | noise | claimed eps (at delta) | empirical lower bound | verdict | s |")
    print("|---|---|---|---|---|---|")
    for i, (name, cfg, facts, relation) in enumerate(cases):
        claim = build_mechanism(cfg, release_facts(MODEL, M, lr=1.0, **facts))
        for label, run_cfg in (("as configured", cfg), ("half", noise_scaled(cfg, 0.5))):
            mech = build_mechanism(run_cfg, release_facts(MODEL, M, lr=1.0, **facts))
            rng = seeded_generator(opts.seed, i, 0)
            if relation == "replace":
                nb, model = replace_one_canary(MODEL, M, rng), MODEL
            else:
                nb, model = replace_special_canary(MODEL, M, rng, x=10.0), NullSlotModel(MODEL)
            t0 = time.perf_counter()
            res = audit_release(
                mech, model, nb, opts.runs, seeded_generator(opts.seed, i, 1), claim=claim
            )
            verdict = "within the claim" if res.ok else "**claim broken: caught**"
            print(
                f"| {name} | {label} | {res.claimed_epsilon:.3f} (delta {res.delta:g}) "
                f"| {res.epsilon_lower_bound:.3f} | {verdict} | {time.perf_counter() - t0:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
