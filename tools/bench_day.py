"""A simulated day of a phone fleet under virtual time: how much wall time, and where it goes.

    .venv/bin/python tools/bench_day.py                          # 1,000 devices, 24 h, rounds every 600 s
    .venv/bin/python tools/bench_day.py --period 0 --hours 3     # back to back (no round period)
    .venv/bin/python tools/bench_day.py --hogs 2                 # again beside 2 CPU hogs: same records?

The job (issue 20's "a simulated 24 hours of a 1,000-device phone fleet with availability
windows"): ``--devices`` phones (phone-fleet profile: four tiers over four US time zones, three
available in night-time charging windows with on/off interruptions, one in short random bursts), Synthetic IID data, ``--model``, ``--epochs`` local epochs,
sync rounds of 20 devices with 30% over-selection and a 120 s deadline, opened every
``--period`` simulated seconds (``rounds.period_s``), from 00:00 UTC for ``--hours`` simulated
hours (``fleet.sim_hours``), ``--reproducible``. One ``edge-fl simulate`` subprocess per run; it prints
the wall time, the simulated time reached, rounds, the clock's grants (one broker round trip
each), the fleet's training time (``virtual_time.train_wall_s``) as a share of the wall time, the
CPU of the simulation process and its children, and the peak RSS. With ``--hogs N`` the same job
runs a second time while N ``python3 -c 'while True: pass'`` processes keep the cores busy, and
the two metrics sequences are compared in every field but the wall-clock ones.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
EDGE_FL = [str(ROOT / ".venv" / "bin" / "edge-fl")]
WALL_FIELDS = ("wall_time_s", "elapsed_s")


def job(args: argparse.Namespace) -> dict[str, Any]:
    rounds: dict[str, Any] = {
        "rounds": 1_000_000,  # the simulated day ends the job, not a round count
        "clients_per_round": 20,
        "over_selection": 1.3,
        "deadline_s": 120.0,
        "wait_for_devices_s": 600.0,
    }
    if args.period > 0:
        rounds["period_s"] = args.period
    return {
        "job": f"bench-day-{args.seed}",
        "seed": args.seed,
        "reproducible": True,
        "data": {"dataset": "synthetic-iid", "devices": args.devices},
        "model": {"name": args.model},
        "training": {"epochs": args.epochs},
        "rounds": rounds,
        "fleet": {
            "profile": "phone-fleet",
            "clock": "virtual",
            "start_hour": 0.0,
            "sim_hours": args.hours,
        },
    }


def run(config: dict[str, Any], out: Path) -> dict[str, Any]:
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*EDGE_FL, "simulate", "--config", str(path), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"edge-fl simulate exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    vt = summary.get("virtual_time", {})
    return {
        "wall_s": wall,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "peak_rss_mb": after.ru_maxrss / 1024,  # the largest child's, over this process's life
        "sim_hours": vt.get("sim_end_s", 0.0) / 3600,
        "rounds": len(records),
        "skipped": sum(1 for r in records if r.get("skipped")),
        "updates": sum(r.get("received", 0) for r in records),
        "grants": vt.get("grants", 0),
        "train_wall_s": vt.get("train_wall_s", 0.0),
        "accuracy": records[-1].get("accuracy") if records else None,
        "stopped": summary.get("stopped"),
        "records": records,
    }


def show(label: str, r: dict[str, Any]) -> None:
    train = r["train_wall_s"]
    print(
        f"{label}: {r['sim_hours']:.2f} simulated h in {r['wall_s']:.1f} s wall "
        f"({r['sim_hours'] * 3600 / r['wall_s']:.0f}x), {r['rounds']} rounds "
        f"({r['skipped']} skipped), {r['updates']} updates, {r['grants']} grants "
        f"({1000 * r['wall_s'] / max(1, r['grants']):.1f} ms wall per grant), training "
        f"{train:.1f} s = {100 * train / r['wall_s']:.0f}% of the wall time, CPU {r['cpu_s']:.1f} s, "
        f"peak RSS {r['peak_rss_mb']:.0f} MB, final accuracy {r['accuracy']}, stopped: "
        f"{r['stopped']}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--period", type=float, default=600.0, help="rounds.period_s; 0: none")
    p.add_argument("--model", default="logreg")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hogs", type=int, default=0, help="then again beside N CPU hogs")
    p.add_argument("--json", type=Path, help="write the figures (without records) here")
    args = p.parse_args()
    cfg = job(args)
    print(f"job: {json.dumps(cfg)}")
    with tempfile.TemporaryDirectory() as tmp:
        first = run(cfg, Path(tmp) / "quiet")
        show("as the machine is", first)
        results = {"as-is": first}
        if args.hogs:
            hogs = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.hogs)
            ]
            try:
                second = run(cfg, Path(tmp) / "loaded")
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
            show(f"beside {args.hogs} CPU hogs", second)
            results["hogs"] = second
            from edge_fl.clocksync import first_difference

            diff = first_difference(first["records"], second["records"], WALL_FIELDS)
            print(
                "metrics sequences: identical in every field but "
                f"{', '.join(WALL_FIELDS)} ({len(first['records'])} records)"
                if diff is None
                else f"metrics sequences DIFFER: {diff}"
            )
    if args.json:
        slim = {k: {f: v for f, v in r.items() if f != "records"} for k, r in results.items()}
        args.json.write_text(json.dumps({"command": sys.argv, "job": cfg, **slim}, indent=1))


if __name__ == "__main__":
    main()
