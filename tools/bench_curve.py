"""The scaling curve: sessions online against connect time, round wall time, CPU per accepted
update, bytes per round and peak RSS of every process (BENCHMARKS.md, "Scaling curve").

Two layouts, each point a fresh run of an existing benchmark (so every figure has its command):

* one process (``edge-fl simulate``: aggregator and fleet on one event loop, the embedded
  Mosquitto beside it): ``tools/bench_scale.py --devices N --clients-per-round N/10``;
* three or more processes (an aggregator, ``--shards`` fleet processes, Mosquitto):
  ``tools/bench_population.py --no-population --online N --per-round N/10 --shards S``, which is
  how more sessions than one process's open-file limit (~20,000 here) are simulated;
* optionally the 1,000,000-device population of BENCHMARKS.md section 15
  (``tools/bench_population.py --no-baseline``, 10,000 online).

    .venv/bin/python tools/bench_curve.py --one 1000,5000,10000 --sharded 10000,19000 \\
        --population --json docs/bench/scaling.json
    .venv/bin/python tools/bench_curve.py --plot docs/bench/scaling.json --out docs/img/scaling.png

"Cores busy" is a process's CPU seconds over the wall seconds between two round records (rounds
after the first): 1.0 is one core saturated; the machine has 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def one_process(n: int, rounds: int, dataset: str) -> dict[str, Any]:
    out = Path(f"/tmp/bench-curve-{os.getpid()}-{n}")
    cmd = [
        PY,
        str(ROOT / "tools/bench_scale.py"),
        "--devices",
        str(n),
        "--clients-per-round",
        str(n // 10),
        "--rounds",
        str(rounds),
        "--dataset",
        dataset,
        "--out",
        str(out),
    ]
    res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    per_update = [c / (n // 10) * 1000 for c in res["cpu_s_per_round_after_first"]]
    return {
        "layout": "one process",
        "command": " ".join(["tools/bench_scale.py", *cmd[2:-2]]),
        "sessions": n,
        "per_round": n // 10,
        "rounds_closed": res["rounds_closed"],
        "received": res["received_per_round"],
        "accuracy": res["accuracy_per_round"][-1],
        "connect_s": res["sessions_connected_s"],
        "round_wall_s": _median(res["round_wall_s"][1:]),
        "round_wall_all_s": res["round_wall_s"],
        "cpu_ms_per_update": _median(per_update),
        "cpu_s_per_round": {
            "simulation": _median(res["cpu_s_per_round_simulation"]),
            "mosquitto": _median(
                [
                    a - b
                    for a, b in zip(
                        res["cpu_s_per_round_after_first"],
                        res["cpu_s_per_round_simulation"],
                        strict=True,
                    )
                ]
            ),
        },
        "cores_busy": {k: _median(v) for k, v in res["cores_busy_per_round"].items()},
        "bytes_up_per_round": _median(res["bytes_up_per_round"]),
        "wire_up_per_round": _median(res["wire_up_per_round"][1:]),
        "wire_down_per_round": _median(res["wire_down_per_round"][1:]),
        "bytes_down_modelled_per_round": _median(res["bytes_down_per_round"]),
        "peak_rss_mb": {
            "simulation": res["peak_rss_simulation_mb"],
            "mosquitto": res["peak_rss_broker_mb"],
        },
        "load_1min_at_end": res.get("load_1min_at_end"),
    }


def sharded(n: int, rounds: int, shards: int, population: int | None) -> dict[str, Any]:
    cmd = [
        PY,
        str(ROOT / "tools/bench_population.py"),
        "--online",
        str(n),
        "--per-round",
        str(n // 10),
        "--rounds",
        str(rounds),
        "--shards",
        str(shards),
    ]
    if population is None:
        cmd.append("--no-population")
    else:
        cmd += ["--population", str(population), "--no-baseline"]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    run = json.loads(text[: text.rindex("\n}") + 2])  # the run's JSON, before the table
    per_round = n // 10
    cpu = run["cpu_s_per_round"]
    total = [sum(v[i] for v in cpu.values()) for i in range(len(next(iter(cpu.values()), [])))]
    fleets = [f for f in run["fleets"] if f.get("event") == "connected"]
    return {
        "layout": f"{shards + 2} processes" + (" (population)" if population else ""),
        "command": " ".join(["tools/bench_population.py", *cmd[2:]]),
        "sessions": run["online_sessions"],
        "modelled_devices": run["devices_modelled"],
        "per_round": per_round,
        "rounds_closed": run["rounds_closed"],
        "received": run["received"],
        "failed": run["failed"],
        "connect_s": max((f["connect_s"] for f in fleets), default=None),
        "round_wall_s": _median(run["round_wall_s"][1:]),
        "round_wall_all_s": run["round_wall_s"],
        "cpu_ms_per_update": _median([t / per_round * 1000 for t in total]),
        "cpu_s_per_round": {k: _median(v) for k, v in cpu.items()},
        "cores_busy": {k: _median(v) for k, v in run["cores_busy_per_round"].items()},
        "bytes_up_per_round": _median(run["bytes_up"]),
        "bytes_down_modelled_per_round": _median(run["bytes_down"][1:]),
        "peak_rss_mb": run["peak_rss_mb"],
        "peak_rss_sum_mb": run["peak_rss_sum_mb"],
        "load_1min_before_after": run["load_1min_before_after"],
    }


def plot(points: list[dict[str, Any]], out: Path, note: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    styles = {"one process": "o-", "4 processes": "s--"}
    layouts = sorted({p["layout"] for p in points}, key=lambda s: (s.startswith("4"), s))

    def series(layout: str, key: Any) -> tuple[list[int], list[float]]:
        rows = [p for p in points if p["layout"] == layout and key(p) is not None]
        rows.sort(key=lambda p: p["sessions"])
        return [p["sessions"] for p in rows], [key(p) for p in rows]

    panels = [
        ("sessions connected (s, wall)", lambda p: p["connect_s"]),
        ("round wall time (s, median of rounds 2+)", lambda p: p["round_wall_s"]),
        ("CPU per accepted update (ms, all processes)", lambda p: p["cpu_ms_per_update"]),
        (
            "MB per round: uplink payload, modelled downlink / 100",
            None,
        ),
        ("peak RSS (MB), every process", None),
        ("cores busy during rounds (of 2)", None),
    ]
    for ax, (title, key) in zip(axes.flat, panels, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("sessions online")
        ax.set_xscale("log")
        ax.grid(alpha=0.3, which="both")
        for layout in layouts:
            style = styles.get(layout, "^:")
            if key is not None:
                x, y = series(layout, key)
                ax.plot(x, y, style, label=layout)
                continue
            if title.startswith("MB per round"):
                x, y = series(layout, lambda p: (p["bytes_up_per_round"] or 0) / 1e6)
                ax.plot(x, y, style, label=f"{layout}: up")
                x, y = series(layout, lambda p: (p["bytes_down_modelled_per_round"] or 0) / 1e8)
                ax.plot(x, y, style, alpha=0.5, label=f"{layout}: down/100")
            else:
                field = "peak_rss_mb" if title.startswith("peak") else "cores_busy"
                names = sorted({k for p in points if p["layout"] == layout for k in p[field]})
                for name in names:
                    x, y = series(layout, lambda p, n=name, f=field: p[f].get(n))
                    ax.plot(x, y, style, label=f"{layout}: {name}")
                if field == "peak_rss_mb":
                    x, y = series(
                        layout,
                        lambda p: p.get("peak_rss_sum_mb") or sum(p["peak_rss_mb"].values()),
                    )
                    ax.plot(x, y, style, color="black", label=f"{layout}: sum")
        ax.legend(fontsize=7)
    fig.suptitle(
        "edge-fl on a 2-core machine: 1/10 of the sessions report per round (logreg, synthetic); "
        f"tools/bench_curve.py{note}",
        fontsize=11,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", default="", help="sessions for one-process points, comma-separated")
    ap.add_argument("--sharded", default="", help="sessions for multi-process points")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--population", action="store_true", help="add the 1,000,000-device run")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dataset", default="synthetic-iid")
    ap.add_argument("--json", help="write (and extend) the points here")
    ap.add_argument("--plot", help="plot the points of this JSON file")
    ap.add_argument("--out", default="docs/img/scaling.png")
    ap.add_argument("--note", default="", help="a line for the plot's title (the conditions)")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.out), args.note)
        return
    points: list[dict[str, Any]] = []
    if args.json and Path(args.json).exists():
        points = json.loads(Path(args.json).read_text())
    for n in [int(x) for x in args.one.split(",") if x]:
        points.append(one_process(n, args.rounds, args.dataset))
        print(json.dumps(points[-1]), flush=True)
    for n in [int(x) for x in args.sharded.split(",") if x]:
        points.append(sharded(n, args.rounds, args.shards, None))
        print(json.dumps(points[-1]), flush=True)
    if args.population:
        points.append(sharded(10_000, args.rounds, args.shards, 1_000_000))
        print(json.dumps(points[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(points, indent=1) + "\n")


if __name__ == "__main__":
    main()
