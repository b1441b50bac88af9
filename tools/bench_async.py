"""Async (FedBuff, FedAsync) against sync rounds with deadlines, in SIMULATED time, on digits.

    .venv/bin/python tools/bench_async.py                     # the documented run (3 seeds, ~15 min)
    .venv/bin/python tools/bench_async.py --seeds 1 --no-doc  # one seed, outputs under --out only
    .venv/bin/python tools/bench_async.py --reuse             # re-analyse finished runs

The claim under test: "async reaches at least the accuracy of sync mode with deadlines, in less
simulated time". Every run is one ``edge-fl simulate`` subprocess (embedded Mosquitto, one run at
a time) on the same job: 100 devices, digits, MLP(64), Dirichlet(0.3) labels, the phone-fleet
profile (~10x compute spread, slow uplinks, night-time availability; ~79 of 100 devices available),
20% per-round dropout, 5 local epochs. Per seed, in this order:

* ``sync``: 20 devices per round, 30% over-selection (26 asked, the round closes at 20 updates), a
  deadline of 4 simulated s (~p95 of a device's modelled download + training + upload here), half
  the target to close, one extension, ``--sync-rounds`` rounds. It sets the target (its final
  accuracy), the update budget U (the updates it applied) and the time budget T (its simulated
  time).
* ``sync-wide``: the same with 60 devices per round (78 asked): sync using about as many devices at
  once as async does (asynchrony vs mere parallelism). 2U updates.
* ``fedbuff``: K = 10, staleness weight (1 + s)^-0.5, server_lr 1, max_staleness 100. 2U updates.
* ``fedasync``: (1 + s)^-0.5, server_lr 0.25, max_staleness 100, one update per application. 2U.
  ``fedbuff`` and ``fedasync`` run without a concurrency limit (``concurrency: 0``): every available
  device trains on every version, as before the limit existed.
* ``fedbuff-C``, ``fedasync-C``: the same with a concurrency limit of ``--concurrency`` devices
  (default 20, sync's round target; sync asks 26 with its over-selection), a dispatch timeout of
  sync's deadline, and U updates to apply (sync's count, not 2U): does asynchrony reach sync's
  accuracy sooner with no more device work?
* ``fedbuff-T``, ``fedasync-T``: the same, for about T simulated seconds (applications = the rate
  of the 2U run x T x 1.05): fairness by simulated time rather than by device work.

Device work = updates devices computed: the aggregator's ``device_updates`` (every update that
reached it, one per (device, version or round), admitted or not: late, stale, refused included)
plus the fleet's ``dropouts`` (devices that trained and then dropped out before uploading), both
cumulative per record; the table gives it when sync's final accuracy was first reached and at the
end.

Async settings were tuned on seed 0 (not reported as a result; docs/bench/async.md lists the
sweep). Simulated time (``sim_time_s``) is counted from the first model broadcast (the fleet's
connection phase is subtracted). The fleet clock counts real CPU time as well as modelled sleeps,
so real overhead / ``--time-scale`` leaks into simulated time; at the default scale of 1 this was
checked against a scale of 2 (docs/bench/async.md). Never run in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
EDGE_FL = ROOT / ".venv" / "bin" / "edge-fl"


def base_config(seed: int, time_scale: float | None) -> dict[str, Any]:
    """The job; ``time_scale`` None: virtual time (``fleet.clock: virtual``), else scaled wall
    time."""
    fleet: dict[str, Any] = {"profile": "phone-fleet", "dropout": 0.2}
    if time_scale is None:
        fleet["clock"] = "virtual"
    else:
        fleet |= {"clock": "wall", "time_scale": time_scale}
    return {
        "job": f"bench-async-{seed}",
        "seed": seed,
        "data": {"dataset": "digits", "devices": 100, "partition": "dirichlet", "alpha": 0.3},
        "model": {"name": "mlp", "hidden": 64},
        "training": {"epochs": 5, "batch_size": 8, "lr": 0.3},
        "fleet": fleet,
        "rounds": {"wait_for_devices_s": 120.0},
    }


def mode_rounds(
    args: argparse.Namespace, mode: str, budget: int | None, done: dict[str, Any]
) -> dict[str, Any]:
    """The ``rounds`` section of one mode; ``budget`` = updates to apply; ``done``: this seed's
    finished runs (a ``-T`` mode runs as many applications as its base mode made per simulated
    second, times sync's simulated time, plus 5%)."""
    if mode.endswith("-C"):
        rounds = mode_rounds(args, mode[:-2], budget, done)
        rounds["concurrency"] = args.concurrency
        rounds["dispatch_timeout_s"] = args.deadline  # sync's deadline: ~p95 of a device's time
        assert budget is not None
        c_budget = math.ceil(args.c_budget_factor * done["sync"]["updates_applied"])
        k = 1 if mode.startswith("fedasync") else args.buffer_size
        rounds["rounds"] = math.ceil(c_budget / k)
        return rounds
    if mode.endswith("-T"):
        base, sync = done[mode[:-2]], done["sync"]
        rate = base["applications"] / base["sim_time_final_s"]
        rounds = mode_rounds(args, mode[:-2], budget, done)
        rounds["rounds"] = math.ceil(1.05 * rate * sync["sim_time_final_s"])
        return rounds
    sync = {
        "mode": "sync",
        "deadline_s": args.deadline,
        "over_selection": 1.3,
        "on_short_round": "extend",
    }
    if mode == "sync":
        return {**sync, "rounds": args.sync_rounds, "clients_per_round": 20, "min_updates": 10}
    assert budget is not None
    if mode == "sync-wide":
        k = args.wide_clients
        return {**sync, "rounds": math.ceil(budget / k), "clients_per_round": k}
    staleness = {
        "staleness": args.staleness,
        "staleness_a": args.staleness_a,
        "staleness_b": args.staleness_b,
        "max_staleness": args.max_staleness,
        "deadline_s": 30.0,  # an async window that gets nothing for 30 s is skipped
        "concurrency": 0,  # no limit (the -C modes set one)
    }
    if mode == "fedbuff":
        return {
            **staleness,
            "mode": "fedbuff",
            "buffer_size": args.buffer_size,
            "server_lr": args.fedbuff_lr,
            "rounds": math.ceil(budget / args.buffer_size),
        }
    if mode == "fedasync":
        return {**staleness, "mode": "fedasync", "server_lr": args.fedasync_lr, "rounds": budget}
    raise ValueError(f"mode = {mode!r}: use sync, sync-wide, fedbuff, fedasync (or fedbuff-T, ...)")


def run(cfg: dict[str, Any], out: Path, timeout_s: float, reuse: bool = False) -> dict[str, Any]:
    """One ``edge-fl simulate`` subprocess; returns its records, summary and wall time.

    With ``reuse``, a finished run of the same config in ``out`` is read instead of re-run."""
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.yaml"
    text = yaml.safe_dump(cfg, sort_keys=False)
    cmd = [str(EDGE_FL), "simulate", "--config", str(cfg_path), "--out", str(out)]
    done = out / "wall.json"
    if reuse and done.exists() and cfg_path.exists() and cfg_path.read_text() == text:
        wall = json.loads(done.read_text())["wall_s"]
    else:
        cfg_path.write_text(text)
        done.unlink(missing_ok=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        done.write_text(json.dumps({"wall_s": wall}) + "\n")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    shown = " ".join(_rel(Path(c)) if c.startswith("/") else c for c in cmd)  # from the repo root
    return {"records": records, "summary": summary, "wall_s": wall, "command": shown}


def analyse(result: dict[str, Any], time_scale: float | None) -> dict[str, Any]:
    recs = result["records"]
    # simulated time from the first broadcast: round 1 opened wall_time_s (real) before its
    # record; under virtual time it opened at simulated time 0
    offset = (
        0.0 if time_scale is None else recs[0]["sim_time_s"] - recs[0]["wall_time_s"] / time_scale
    )
    closed = [r for r in recs if r["status"] == "closed"]
    curve, applied = [], 0  # (simulated s, accuracy, updates applied so far) per record
    work = []  # device work so far per record: updates that reached the aggregator + dropouts
    for r in recs:
        applied += r["received"] if r["status"] == "closed" else 0
        curve.append((r["sim_time_s"] - offset, r["accuracy"], applied))
        work.append(r.get("device_updates", 0) + (r.get("dropouts") or 0))
    hist: dict[int, int] = {}
    for r in closed:
        for s, n in (r.get("staleness_hist") or {}).items():
            hist[int(s)] = hist.get(int(s), 0) + n
    n_stale = sum(hist.values())
    s = result["summary"]
    after = (s.get("after_last_round") or {}).get("device_updates")
    return {
        "curve": curve,
        "work": work,
        "device_work": max(work[-1], (after or 0) + (recs[-1].get("dropouts") or 0)),
        "device_updates": recs[-1].get("device_updates"),
        "final_accuracy": recs[-1]["accuracy"],
        "best_accuracy": max(a for _, a, _ in curve),
        "sim_time_final_s": curve[-1][0],
        "connect_offset_sim_s": offset,
        "windows": len(recs),
        "applications": len(closed),
        "updates_applied": sum(r["received"] for r in closed),
        "uploads_published": s.get("fleet_published"),
        "late_lost": s.get("total_late"),
        "rejected": s.get("total_rejected"),
        "rejected_by_reason": _sum_reasons(recs),
        "rejected_stale": _sum_reasons(recs).get("stale", 0),
        "dropouts": recs[-1].get("dropouts"),
        "staleness_mean": (sum(k * n for k, n in hist.items()) / n_stale) if n_stale else None,
        "staleness_max": max(hist) if hist else None,
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
        "bytes_up": s.get("total_bytes_up"),
        "bytes_down": s.get("total_bytes_down"),
        "wall_s": result["wall_s"],
        "command": result["command"],
    }


def _sum_reasons(recs: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in recs:
        for k, v in r.get("rejected_by_reason", {}).items():
            out[k] = out.get(k, 0) + v
    return out


Curve = list[tuple[float, float, int]]


def first_reach(curve: Curve, target: float) -> tuple[float, int] | tuple[None, None]:
    """Simulated time and updates applied when the accuracy first reached ``target``."""
    return next(((t, u) for t, a, u in curve if a is not None and a >= target), (None, None))


def work_at_reach(res: dict[str, Any], target: float) -> int | None:
    """Device work done when the accuracy first reached ``target``."""
    for (_, a, _), w in zip(res["curve"], res["work"], strict=True):
        if a is not None and a >= target:
            return w
    return None


def accuracy_at(curve: Curve, t_end: float | None = None, updates: int | None = None):
    """The accuracy of the last record by simulated time ``t_end`` or by ``updates`` applied."""
    before = [
        a
        for t, a, u in curve
        if (t_end is None or t <= t_end) and (updates is None or u <= updates)
    ]
    return before[-1] if before else None


# ------------------------------------------------------------------ outputs


def _fmt_t(t: float | None) -> str:
    return "not reached" if t is None else f"{t:.1f}"


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def for_json(results: dict[str, Any], max_points: int = 300) -> dict[str, Any]:
    """Results with each curve thinned to about ``max_points`` records (first and last kept)."""
    out = json.loads(json.dumps(results))
    for per_mode in out["seeds"].values():
        for r in per_mode.values():
            curve = r["curve"]
            step = max(1, math.ceil(len(curve) / max_points))
            kept = curve[::step] + ([curve[-1]] if (len(curve) - 1) % step else [])
            r["curve"] = [[round(t, 3), a if a is None else round(a, 4), u] for t, a, u in kept]
            work = r.pop("work", [])
            r["work"] = work[::step] + ([work[-1]] if work and (len(work) - 1) % step else [])
            r["curve_thinned_every"] = step
    return out


def work_table(results: dict[str, Any], modes: list[str]) -> str:
    """Per seed and mode: accuracy, simulated time and device work, against sync's."""
    lines = [
        "| seed | mode | final acc | sim s to sync's final acc (speed-up) | device work then"
        " (x sync's) | device work in all (x sync's) | updates applied | mean staleness |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seed, per_mode in results["seeds"].items():
        sync = per_mode.get("sync")
        for mode in modes:
            r = per_mode.get(mode)
            if r is None:
                continue
            t, w = r["time_to_sync_final_s"], r["work_to_sync_final"]
            st, sw = (sync["time_to_sync_final_s"], sync["work_to_sync_final"]) if sync else (0, 0)
            reach = _fmt_t(t) + (f" ({st / t:.1f}x)" if t and st else "")
            then = "-" if w is None else f"{w}" + (f" ({w / sw:.2f}x)" if sw else "")
            total = f"{r['device_work']}" + (f" ({r['device_work'] / sync['device_work']:.2f}x)"
                                             if sync else "")  # fmt: skip
            lines.append(
                f"| {seed} | {mode} | {r['final_accuracy']:.3f} | {reach} | {then} | {total} | "
                f"{r['updates_applied']} | {_fmt(r['staleness_mean'], '.2f')} |"
            )
    return "\n".join(lines)


def work_summary(results: dict[str, Any], modes: list[str]) -> str:
    """Over seeds: how often each mode reached sync's final accuracy sooner with no more work."""
    lines = [
        "| mode | seeds | final acc (mean) | reached sync's final acc | of those: sooner and with"
        " <= sync's work | speed-up (median) | work then, x sync's (median) | work in all, x"
        " sync's (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        pairs = [(pm["sync"], pm[mode]) for pm in results["seeds"].values() if mode in pm]
        if not pairs:
            continue
        hit = [(s, r) for s, r in pairs if r["time_to_sync_final_s"] is not None]
        good = [
            (s, r)
            for s, r in hit
            if r["time_to_sync_final_s"] <= s["time_to_sync_final_s"]
            and r["work_to_sync_final"] <= s["work_to_sync_final"]
        ]
        speed = [s["time_to_sync_final_s"] / max(r["time_to_sync_final_s"], 1e-9) for s, r in hit]
        work = [r["work_to_sync_final"] / s["work_to_sync_final"] for s, r in hit]
        lines.append(
            f"| {mode} | {len(pairs)} | "
            f"{statistics.mean(r['final_accuracy'] for _, r in pairs):.3f} | "
            f"{len(hit)}/{len(pairs)} | {len(good)}/{len(hit)} | "
            f"{_fmt(statistics.median(speed) if speed else None, '.1f')}x | "
            f"{_fmt(statistics.median(work) if work else None, '.2f')} | "
            f"{statistics.mean(r['device_work'] / s['device_work'] for s, r in pairs):.2f} |"
        )
    return "\n".join(lines)


def table(results: dict[str, Any], modes: list[str]) -> str:
    """Per seed and mode: the numbers behind the claim."""
    lines = [
        "| seed | mode | updates applied | final acc | sim s to final | sim s (updates) to reach"
        " sync's final acc | acc at sync's end time | acc after sync's no. of updates | uploads"
        " | late, discarded | rejected stale | mean (max) staleness | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seed, per_mode in results["seeds"].items():
        for mode in modes:
            r = per_mode.get(mode)
            if r is None:
                continue
            stale = (
                "-"
                if r["staleness_mean"] is None
                else f"{r['staleness_mean']:.1f} ({r['staleness_max']})"
            )
            reach = _fmt_t(r["time_to_sync_final_s"])
            if r["updates_to_sync_final"] is not None:
                reach += f" ({r['updates_to_sync_final']})"
            lines.append(
                f"| {seed} | {mode} | {r['updates_applied']} | {r['final_accuracy']:.3f} | "
                f"{r['sim_time_final_s']:.1f} | {reach} | {_fmt(r['acc_at_sync_end'], '.3f')} | "
                f"{_fmt(r['acc_at_sync_updates'], '.3f')} | {r['uploads_published']} | "
                f"{r['late_lost']} | {r['rejected_stale']} | {stale} | {r['wall_s']:.0f} |"
            )
    return "\n".join(lines)


def aggregate(results: dict[str, Any], modes: list[str]) -> str:
    """Over seeds: means, and in how many seeds sync's final accuracy was reached."""
    lines = [
        "| mode | seeds | final acc (mean, min-max) | sim s to final (mean) | reached sync's final"
        " acc | sim s to reach it (median of those) | updates applied (mean) | mean staleness"
        " | wall s (mean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        rs = [pm[mode] for pm in results["seeds"].values() if mode in pm]
        if not rs:
            continue
        acc = [r["final_accuracy"] for r in rs]
        reached = [r["time_to_sync_final_s"] for r in rs if r["time_to_sync_final_s"] is not None]
        stale = [r["staleness_mean"] for r in rs if r["staleness_mean"] is not None]
        lines.append(
            f"| {mode} | {len(rs)} | {statistics.mean(acc):.3f} ({min(acc):.3f}-{max(acc):.3f}) | "
            f"{statistics.mean(r['sim_time_final_s'] for r in rs):.1f} | "
            f"{len(reached)}/{len(rs)} | "
            f"{_fmt(statistics.median(reached) if reached else None, '.1f')} | "
            f"{statistics.mean(r['updates_applied'] for r in rs):.0f} | "
            f"{_fmt(statistics.mean(stale) if stale else None, '.1f')} | "
            f"{statistics.mean(r['wall_s'] for r in rs):.0f} |"
        )
    return "\n".join(lines)


def ratios(results: dict[str, Any], modes: list[str]) -> str:
    """Against sync of the same seed: simulated-time speed-up and update cost to sync's target."""
    lines = []
    for seed, per_mode in results["seeds"].items():
        sync = per_mode.get("sync")
        if sync is None or sync["time_to_sync_final_s"] is None:
            continue
        for mode in modes:
            r = per_mode.get(mode)
            if mode == "sync" or r is None:
                continue
            if r["time_to_sync_final_s"] is None:
                lines.append(
                    f"seed {seed} {mode}: did not reach sync's {sync['final_accuracy']:.3f}"
                )
                continue
            speed = sync["time_to_sync_final_s"] / max(r["time_to_sync_final_s"], 1e-9)
            cost = r["updates_to_sync_final"] / sync["updates_to_sync_final"]
            lines.append(
                f"seed {seed} {mode}: reached sync's {sync['final_accuracy']:.3f} {speed:.1f}x "
                f"faster in simulated time, with {cost:.1f}x sync's updates"
            )
    return "\n".join(lines)


def plot(results: dict[str, Any], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "sync": "C0",
        "sync-wide": "C2",
        "fedbuff": "C1",
        "fedasync": "C3",
        "fedbuff-C": "C4",
        "fedasync-C": "C5",
    }
    # a -T run extends its equal-updates run in simulated time: plot the longer one
    shown = [m for m in modes if f"{m}-T" not in modes]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (seed, per_mode) in enumerate(results["seeds"].items()):
        for mode in shown:
            r = per_mode.get(mode)
            if r is None:
                continue
            t, a = zip(*[(t, a) for t, a, _ in r["curve"] if t > 0 and a is not None], strict=True)
            ax.plot(
                t,
                a,
                color=colors.get(mode.removesuffix("-T"), "k"),
                alpha=1.0 if i == 0 else 0.3,
                lw=1.3 if i == 0 else 0.8,
                label=mode if i == 0 else None,
            )
        sync = per_mode.get("sync")
        if sync is not None and i == 0:
            ax.axhline(
                sync["final_accuracy"], color="C0", ls=":", lw=1, label=f"sync final (seed {seed})"
            )
    ax.set_xscale("log")
    ax.set_xlabel("simulated time since the first broadcast (s, log scale)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, which="both")
    ax.set_title(
        "digits MLP, 100 phones (phone-fleet), Dirichlet 0.3, 20% dropout\n"
        f"seed {next(iter(results['seeds']))} bold, other seeds faint"
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["sync", "fedbuff-C", "fedasync-C", "fedbuff", "fedasync"],
        help="sync first; X-C = mode X with --concurrency; X-T = mode X for as long (simulated) "
        "as sync ran (also: sync-wide, fedbuff-T, fedasync-T)",
    )
    ap.add_argument("--concurrency", type=int, default=20, help="C of the -C modes")
    ap.add_argument(
        "--c-budget-factor",
        type=float,
        default=1.0,
        help="the -C modes apply this many times sync's updates",
    )
    ap.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="real s per simulated s (scaled wall time); default: virtual time",
    )
    ap.add_argument(
        "--reproducible", action="store_true", help="seeded randomness (identical reruns)"
    )
    ap.add_argument("--sync-rounds", type=int, default=30)
    ap.add_argument("--deadline", type=float, default=4.0, help="sync deadline, simulated s")
    ap.add_argument("--wide-clients", type=int, default=60, help="sync-wide: devices per round")
    ap.add_argument("--buffer-size", type=int, default=10, help="FedBuff K")
    ap.add_argument("--fedbuff-lr", type=float, default=1.0, help="FedBuff server_lr")
    ap.add_argument("--fedasync-lr", type=float, default=0.25, help="FedAsync server_lr")
    ap.add_argument("--staleness", default="polynomial", help="constant | polynomial | hinge")
    ap.add_argument("--staleness-a", type=float, default=0.5)
    ap.add_argument("--staleness-b", type=int, default=4)
    ap.add_argument("--max-staleness", type=int, default=100)
    ap.add_argument("--budget", type=int, help="updates to apply in the other modes")
    ap.add_argument(
        "--budget-factor",
        type=float,
        default=2.0,
        help="without --budget: the other modes apply this many times sync's updates",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_async")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "async.json")
    ap.add_argument(
        "--plot", type=Path, default=ROOT / "docs" / "bench" / "async_accuracy_vs_simtime.png"
    )
    ap.add_argument("--no-doc", action="store_true", help="write only under --out")
    ap.add_argument("--reuse", action="store_true", help="read finished runs of the same config")
    ap.add_argument("--timeout", type=float, default=3600.0, help="real s per run")
    args = ap.parse_args()
    if "sync" not in args.modes and args.budget is None:
        ap.error("without the sync baseline, give --budget (updates to apply)")
    if not EDGE_FL.exists():
        sys.exit(f"{EDGE_FL} not found: create the venv first (README)")

    settings = {k: _rel(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results: dict[str, Any] = {"settings": settings, "seeds": {}}
    json_path = args.out / "async.json" if args.no_doc else args.json
    for seed in args.seeds:
        per_mode: dict[str, Any] = {}
        results["seeds"][str(seed)] = per_mode
        budget = args.budget
        for mode in args.modes:
            cfg = base_config(seed, args.time_scale)
            if args.reproducible:
                cfg["reproducible"] = True
            cfg["rounds"].update(mode_rounds(args, mode, budget, per_mode))
            print(f"seed {seed} {mode}: {cfg['rounds']}", flush=True)
            result = run(cfg, args.out / f"{mode}-seed{seed}", args.timeout, args.reuse)
            res = analyse(result, args.time_scale)
            res["config"] = cfg
            per_mode[mode] = res
            if mode == "sync" and args.budget is None:
                budget = math.ceil(args.budget_factor * res["updates_applied"])
            print(
                f"  final acc {res['final_accuracy']:.3f} at {res['sim_time_final_s']:.1f} sim s; "
                f"{res['applications']} applications, {res['updates_applied']} updates, "
                f"{res['late_lost']} lost as late, staleness {res['staleness_mean']}, "
                f"wall {res['wall_s']:.0f} s",
                flush=True,
            )
        sync = per_mode.get("sync")
        for res in per_mode.values():
            for key in ("time_to_sync_final_s", "updates_to_sync_final"):
                res[key] = None
            res["acc_at_sync_end"] = res["acc_at_sync_updates"] = None
            res["work_to_sync_final"] = None
            if sync is None:
                continue
            target, end = sync["final_accuracy"], sync["sim_time_final_s"]
            res["time_to_sync_final_s"], res["updates_to_sync_final"] = first_reach(
                res["curve"], target
            )
            res["acc_at_sync_end"] = accuracy_at(res["curve"], t_end=end)
            res["acc_at_sync_updates"] = accuracy_at(res["curve"], updates=sync["updates_applied"])
            res["work_to_sync_final"] = work_at_reach(res, target)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(for_json(results), indent=1) + "\n")  # after every seed
    print()
    print(work_table(results, args.modes))
    print()
    print(work_summary(results, args.modes))
    print()
    print(table(results, args.modes))
    print()
    print(aggregate(results, args.modes))
    print()
    print(ratios(results, args.modes))
    plot(
        results,
        args.modes,
        args.out / "async_accuracy_vs_simtime.png" if args.no_doc else args.plot,
    )
    print(f"\nresults: {json_path}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
