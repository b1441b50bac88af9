"""Empirical DP audit of distributed-gaussian through its real encode, secure sum and decode.

One secure round. Each contributing device runs the production device-side encode
(``ddg.device_encode``: clip, rotation, scaling, conditional rounding, the exact discrete Gaussian
noise share; ``DistributedGaussian.secure_encode`` is local training followed by exactly this call)
on its update, with the mechanism's own calibration for the job. The integers are summed as the
aggregator's secure sum is: in Z_2^b (``primitives.to_ring`` / ``from_ring``, the ring and lift
SecAgg+ uses; ``--secagg-trials`` trials per input and row instead run a whole in-memory SecAgg+
round, ``secagg.driver.run_round(modular=True)``, and check its sum equals the modular sum bit for
bit). The aggregator's ``secure_decode`` gives the noisy mean.

Neighbours (the mechanism's relation, zero-out): the canary device's update is ``clip`` along one
rotated axis (``ddg.unrotate(clip e_0)`` under the round's public rotation seed, fresh each round)
in D1 and zero in D0; its noise share is there in both. Every other device's update is zero.
Statistic: the decoded sum's projection on the canary's direction in grid units, rounded to an
integer (it is the summed integer coordinate 0). Event: statistic > t, t fixed on separate
calibration runs (the candidate whose calibration rates, extrapolated to ``--runs`` runs, give the
largest bound, as tests/release_audit.py does). Clopper-Pearson lower bound on epsilon at
delta' = 1e-3, confidence 1 - 1e-3 (``edge_fl.privacy.audit.eps_lower_bound``), compared with the
claim: the epsilon the project's ledger charges for one round of this calibration
(``secure_events`` in a ``PrivacyLedger``, its tightest bound at delta').

Rows: as configured; "half noise" (the real mechanism built with ``privacy.noise_multiplier`` half
the configured calibration's, claiming the configured epsilon: a quarter of the variance);
"undeclared colluders" (calibrated for 8 honest shares, collude = 0, but 6 of the 8 contributors
pool their encoded vectors with the aggregator, which subtracts them from the secure sum mod 2^b:
2 honest shares, a quarter of the noise variance the claim counts on); "noise beyond the floor
removed" (all 6 selected deliver to a job whose floor is 4: two survivors reveal their noise and
the aggregator subtracts it, as ``AggregatorSession`` does, choosing them by SHA-256(nonce || id);
the sum keeps 4 shares, what the claim counts on: the canary's own noise may be among those
removed).

    PYTHONPATH=. nice -n 19 .venv/bin/python tools/bench_ddg_audit.py --runs 10000 --jobs 2

Results and what they do not show: docs/bench/ddg-audit.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing import get_context

import numpy as np

from edge_fl.config import load_config
from edge_fl.mechanisms import build_mechanism
from edge_fl.mechanisms.base import JobFacts
from edge_fl.mechanisms.distributed_gaussian import NAME, DistributedGaussian
from edge_fl.mechanisms.secure import SecureJob, SecureLayout
from edge_fl.privacy.audit import eps_lower_bound
from edge_fl.privacy.ledger import PrivacyLedger
from edge_fl.privacy.rng import seeded_generator
from edge_fl.secagg import RoundParams, Summed, ddg
from edge_fl.secagg.driver import run_round
from edge_fl.secagg.primitives import from_ring, ring_mask, to_ring

DIM = 8  # logreg with 3 features and 2 classes: D' = 8, no padding, so e_0 rotates back exactly
CLIP = 1.0
EPSILON, DELTA, ROUNDS = 3.0, 1e-5, 1  # the job's target: one round at (3, 1e-5)
AUDIT_DELTA = 1e-3  # tails at 1e-5 need far more than 1e5 runs (docs/specs/privacy.md 5.2)
ALPHA = 1e-3


@dataclass(frozen=True)
class Row:
    """One audited configuration: the job the noise is calibrated for, ``noise_multiplier``
    (None: the configured epsilon), how many devices contribute and how many of them collude."""

    label: str
    job: SecureJob
    contributors: int
    colluders: int = 0
    noise_multiplier: float | None = None
    noise_floor: int = 0  # > 0: the noise of the contributors beyond it is removed

    @property
    def honest(self) -> int:
        """The honest noise shares left in the sum."""
        kept = min(self.contributors, self.noise_floor) if self.noise_floor else self.contributors
        return kept - self.colluders


def facts(n_params: int = DIM) -> JobFacts:
    return JobFacts(
        rounds=ROUNDS,
        n_devices=100,
        expected_participants=10.0,
        n_params=n_params,
        local_lr=1.0,
        local_epochs=1,
        batch_size=16,
        min_dataset_size=10,
        max_uploads=ROUNDS,
    )


def mechanism(
    job: SecureJob, noise_multiplier: float | None = None, epsilon: float = EPSILON
) -> tuple[DistributedGaussian, SecureLayout]:
    """The production mechanism for ``job`` (privacy.epsilon, or privacy.noise_multiplier)."""
    settings: dict = {"privacy.mechanism": NAME, "privacy.clip": CLIP, "privacy.delta": DELTA}
    if noise_multiplier is None:
        settings["privacy.epsilon"] = epsilon
    else:
        settings["privacy.noise_multiplier"] = noise_multiplier
    mech = build_mechanism(load_config(None, settings).privacy, facts(job.n_params))
    assert isinstance(mech, DistributedGaussian)
    return mech, mech.secure_layout(job)


def claimed_epsilon(job: SecureJob, delta: float = AUDIT_DELTA) -> float:
    """What the ledger charges a device for one secure round of the configured calibration: its
    tightest bound at ``delta`` (the events are the mechanism's own ``secure_events``)."""
    mech, _ = mechanism(job)
    ledger = PrivacyLedger()
    for ev in mech.secure_events(job):
        ledger.add(ev, device="canary", round=1)
    return float(ledger.best(delta, "canary")[0].epsilon)


def rows() -> list[Row]:
    small = SecureJob(DIM, 6, 4)  # 6 selected, floor 4: the round the claim covers with 2 dropped
    half_z = mechanism(small)[0].calibration(small).noise_multiplier / 2
    return [
        Row("as configured", small, 4),
        Row("half noise", small, 4, noise_multiplier=half_z),
        Row("undeclared colluders (6 of 8)", SecureJob(DIM, 10, 8), 8, colluders=6),
        Row("noise beyond the floor removed (6 deliver)", small, 6, noise_floor=4),
    ]


# ------------------------------------------------------------------------------ the rounds


@lru_cache(maxsize=8)
def _built(row: Row) -> tuple[DistributedGaussian, SecureLayout]:
    return mechanism(row.job, row.noise_multiplier)


def canary(p: ddg.DdgParams, seed: bytes) -> np.ndarray:
    """The update of norm ``clip`` whose rotation under ``seed`` is ``clip/gamma`` on axis 0."""
    if p.dim != p.padded:
        raise ValueError("the canary needs a dimension that is a power of two")
    axis = np.zeros(p.padded)
    axis[0] = p.clip
    return ddg.unrotate(axis, seed, p.dim)


def name(i: int) -> str:
    return f"d{i:03d}"


def removed(nonce: bytes, n: int, floor: int) -> list[int]:
    """The devices whose noise the aggregator removes: beyond the floor, in SHA-256 order."""
    order = sorted(range(n), key=lambda i: hashlib.sha256(nonce + name(i).encode()).digest())
    return order[: max(0, n - floor)] if floor else []


def secagg_sum(
    layout: SecureLayout,
    ints: list[np.ndarray],
    rng: np.random.Generator,
    nonce: bytes,
    noise: list[np.ndarray] | None = None,
    floor: int = 0,
) -> np.ndarray:
    """The sum through a whole SecAgg+ round in memory (every device stays; with ``floor``, the
    survivors beyond it reveal their ``noise`` and the session removes it)."""
    inputs = {name(i): v for i, v in enumerate(ints)}
    roster = tuple(sorted(inputs))
    k = len(roster) - 1  # a complete graph, threshold a majority of the neighbours
    # max_int 0: a modular layout's values are unbounded, as the server's plan sets it
    # (edge_fl/server/secure.py); SecAgg+'s "sum beyond what the inputs can reach" check is off
    rp = RoundParams("audit", 1, nonce, roster, k, k // 2 + 1, layout.bits, layout.length, 0,
                     min_survivors=floor or 2, noise_floor=floor)  # fmt: skip
    revealed = {name(i): z for i, z in enumerate(noise)} if noise is not None else None
    trace = run_round(rp, inputs, randbytes=lambda d: rng.bytes, modular=True, noise=revealed)
    if not isinstance(trace.outcome, Summed):
        raise RuntimeError(f"the SecAgg+ round failed: {trace.outcome}")
    return np.asarray(trace.outcome.total)


def statistic(row: Row, with_canary: bool, rng: np.random.Generator, secagg: bool) -> int:
    """One secure round; the decoded sum on the canary's direction, in grid units."""
    mech, layout = _built(row)
    p = mech.calibration(row.job).params
    seed = rng.bytes(32)  # the round's public rotation seed
    zero = np.zeros(p.dim)
    update = canary(p, seed) if with_canary else zero
    # device 0 is the canary; devices 1 .. colluders are the colluders (if any)
    parts = [ddg.device_parts(update if i == 0 else zero, p, seed, rng.bytes)
             for i in range(row.contributors)]  # fmt: skip
    ints = [r + z for r, z in parts]
    nonce = rng.bytes(16)  # the round's nonce: it orders whose noise is removed
    mask = ring_mask(layout.bits)
    ring = np.zeros(layout.length, dtype=np.uint64)
    for v in ints:
        ring = (ring + to_ring(v, layout.bits)) & mask
    for i in removed(nonce, row.contributors, row.noise_floor):
        ring = (ring - to_ring(parts[i][1], layout.bits)) & mask
    total = from_ring(ring, layout.bits)
    if secagg:
        noise = [z for _, z in parts] if row.noise_floor else None
        via = secagg_sum(layout, ints, rng, nonce, noise, row.noise_floor)
        if not np.array_equal(via, total):
            raise AssertionError("the SecAgg+ sum differs from the modular sum")
        total = via
    if row.colluders:  # what the colluders pool: their own encoded vectors, subtracted mod 2^b
        for v in ints[1 : 1 + row.colluders]:
            ring = (ring - to_ring(v, layout.bits)) & mask
        total = from_ring(ring, layout.bits)
    mean = mech.secure_decode(total, row.contributors, layout, seed)
    u = canary(p, seed) / p.clip
    return round(float(np.dot(mean.astype(np.float64), u)) * row.contributors / p.gamma)


def draw(task: tuple[Row, bool, int, tuple[int, ...], int]) -> tuple[np.ndarray, float]:
    """``n`` rounds of one input (a worker's chunk); the statistics and the CPU seconds."""
    row, with_canary, n, stream, secagg = task
    logging.getLogger("absl").setLevel(logging.ERROR)
    rng = seeded_generator(*stream)
    t0 = time.process_time()
    out = np.array([statistic(row, with_canary, rng, i < secagg) for i in range(n)], dtype=np.int64)
    return out, time.process_time() - t0


# ------------------------------------------------------------------------------ the test


def choose_threshold(s0: np.ndarray, s1: np.ndarray, n: int, alpha: float = ALPHA) -> int:
    """The integer t whose calibration rates of {statistic > t}, extrapolated to ``n`` runs per
    input, give the largest lower bound (the median of D1's calibration when none is positive)."""
    lo, hi = int(np.percentile(s0, 50)), int(np.max(s1))
    best, best_t = 0.0, int(np.median(s1))
    s0s, s1s = np.sort(s0), np.sort(s1)
    for t in range(lo, hi + 1):
        r0 = (s0.size - np.searchsorted(s0s, t, side="right")) / s0.size
        r1 = (s1.size - np.searchsorted(s1s, t, side="right")) / s1.size
        bound = eps_lower_bound(round(r0 * n), round(r1 * n), n, AUDIT_DELTA, alpha)
        if bound > best:
            best, best_t = bound, t
    return best_t


def lower_bound(s0: np.ndarray, s1: np.ndarray, t: int, alpha: float = ALPHA) -> dict:
    n = int(s0.size)
    k0, k1 = int(np.count_nonzero(s0 > t)), int(np.count_nonzero(s1 > t))
    return {"n": n, "threshold": t, "k0": k0, "k1": k1, "alpha": alpha,
            "epsilon_lower_bound": eps_lower_bound(k0, k1, n, AUDIT_DELTA, alpha)}  # fmt: skip


def chunks(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def sample(pool, row: Row, n: int, stream: tuple[int, ...], jobs: int, secagg: int):
    """``n`` rounds per input, split over ``jobs`` workers; (s0, s1, cpu seconds)."""
    out, cpu = [], 0.0
    for which in (0, 1):
        parts = [c for c in chunks(n, jobs) if c]
        tasks = [(row, bool(which), c, (*stream, which, j), secagg if j == 0 else 0)
                 for j, c in enumerate(parts)]  # fmt: skip
        got = pool.map(draw, tasks) if pool is not None else [draw(t) for t in tasks]
        out.append(np.concatenate([g[0] for g in got]))
        cpu += sum(g[1] for g in got)
    return out[0], out[1], cpu


# ------------------------------------------------------------------------------ exact rates


@lru_cache(maxsize=16)
def discrete_gaussian_pmf(
    sigma2: float, shares: int, reach: float = 14.0
) -> tuple[int, np.ndarray]:
    """The pmf of a sum of ``shares`` independent N_Z(0, sigma2) draws: (lowest value, pmf)."""
    k = math.ceil(reach * math.sqrt(sigma2)) + 1
    x = np.arange(-k, k + 1, dtype=np.float64)
    one = np.exp(-(x**2) / (2 * sigma2))
    one /= one.sum()
    pmf = one
    for _ in range(shares - 1):
        pmf = np.convolve(pmf, one)
    return -k * shares, pmf


def exact_rates(p: ddg.DdgParams, shares: int, t: int) -> tuple[float, float]:
    """P(statistic > t) without and with the canary, from the mechanism's parameters: the sum of
    ``shares`` discrete Gaussians, plus (D1) clip/gamma stochastically rounded (both roundings are
    within the L2 bound, so conditional rounding accepts the first)."""
    low, pmf = discrete_gaussian_pmf(float(p.sigma2), shares)
    sf = np.concatenate([np.cumsum(pmf[::-1])[::-1], [0.0]])  # sf[i] = P(S >= low + i)

    def above(v: int) -> float:  # P(S > v)
        i = v + 1 - low
        return float(sf[min(max(i, 0), sf.size - 1)])

    x = p.clip / p.gamma
    f = math.floor(x)
    frac = x - f
    return above(t), (1 - frac) * above(t - f) + frac * above(t - f - 1)


def pass_probability(n: int, p0: float, p1: float, claim: float, alpha: float = ALPHA) -> float:
    """P(eps_lb <= claim) with k0 ~ Bin(n, p0), k1 ~ Bin(n, p1), exactly (beyond 9 standard
    deviations of either count is left out: < 1e-18)."""
    from scipy import stats

    def support(q: float) -> np.ndarray:
        sd = math.sqrt(n * q * (1 - q))
        return np.arange(max(0, int(n * q - 9 * sd) - 1), min(n, int(n * q + 9 * sd) + 2) + 1)

    k0s, k1s = support(p0), support(p1)
    w1 = stats.binom.pmf(k1s, n, p1)
    total = 0.0
    for k0 in k0s:
        w0 = float(stats.binom.pmf(k0, n, p0))
        if w0 < 1e-18:
            continue
        # eps_lb is non-decreasing in k1 (both of its ratios grow as the miss bound shrinks):
        # bisect the largest k1 that still passes
        lo, hi = int(k1s[0]) - 1, int(k1s[-1])
        if eps_lower_bound(int(k0), hi, n, AUDIT_DELTA, alpha) <= claim:
            lo = hi
        else:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if eps_lower_bound(int(k0), mid, n, AUDIT_DELTA, alpha) <= claim:
                    lo = mid
                else:
                    hi = mid
        total += w0 * float(w1[k1s <= lo].sum())
    return total


# ------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10_000, help="audit rounds per input and row")
    ap.add_argument("--calibration-runs", type=int, default=2000)
    ap.add_argument("--secagg-trials", type=int, default=100,
                    help="rounds per input and row summed by a whole SecAgg+ round")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--seed", type=int, default=20261128)
    ap.add_argument("--json", help="write the rows here")
    opts = ap.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)
    results = []
    ctx = get_context("fork")
    pool = ctx.Pool(opts.jobs) if opts.jobs > 1 else None
    print("| row | noise shares (claimed / in the sum) | claimed eps (delta 1e-3) "
          "| lower bound | verdict | runs per input | secagg rounds | s (wall) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    try:
        for i, row in enumerate(rows()):
            t0 = time.perf_counter()
            claim = claimed_epsilon(row.job)
            mech, layout = _built(row)
            p = mech.calibration(row.job).params
            c0, c1, cpu_c = sample(
                pool, row, opts.calibration_runs, (opts.seed, i, 0), opts.jobs, 0
            )
            t = choose_threshold(c0, c1, opts.runs)
            s0, s1, cpu_a = sample(pool, row, opts.runs, (opts.seed, i, 1), opts.jobs,
                                   opts.secagg_trials)  # fmt: skip
            res = lower_bound(s0, s1, t)
            wall = time.perf_counter() - t0
            r0, r1 = exact_rates(p, row.honest, t)
            ok = res["epsilon_lower_bound"] <= claim
            res.update(row=row.label, claimed_epsilon=claim, passed=ok, seconds=wall,
                       cpu_seconds=cpu_c + cpu_a, sigma2=float(p.sigma2), gamma=p.gamma,
                       n_min=p.n_min, honest_shares=row.honest, ring_bits=layout.bits,
                       exact_rates=[r0, r1], secagg_trials=min(opts.secagg_trials, opts.runs),
                       claimed_epsilon_job_delta=claimed_epsilon(row.job, DELTA),
                       noise_multiplier=math.sqrt(p.n_min * float(p.sigma2)) / p.l2)  # fmt: skip
            results.append(res)
            verdict = "within the claim" if ok else "**claim broken: caught**"
            print(f"| {row.label} | {p.n_min} / {row.honest} | {claim:.3f} "
                  f"| {res['epsilon_lower_bound']:.3f} | {verdict} | {opts.runs} "
                  f"| {2 * res['secagg_trials']} | {wall:.0f} |", flush=True)  # fmt: skip
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(results, fh, indent=1)
    for r in results:
        print(json.dumps({k: r[k] for k in ("row", "threshold", "k0", "k1", "exact_rates",
                                            "sigma2", "cpu_seconds")}), file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
