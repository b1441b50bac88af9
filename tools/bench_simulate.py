"""Whole-process time of `edge-fl simulate` (what a user waits for, run after run) and its parts.

Each repetition runs the real command in a fresh interpreter; baselines measured in the same run:
`python -c pass` (interpreter start) and `python -c "import numpy"`. The breakdown comes from the
run's own summary.json (build, broker ready, fleet connected, first round, all rounds).

    .venv/bin/python tools/bench_simulate.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable
EDGE_FL = str(Path(PY).with_name("edge-fl"))


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--args",
        default="--devices 50 --rounds 20 --clients-per-round 20 --dataset digits --model mlp",
    )
    args = ap.parse_args()
    rows: dict[str, list[float]] = {"python -c pass": [], "python -c 'import numpy'": []}
    rows["edge-fl simulate (whole process)"] = []
    parts: dict[str, list[float]] = {}
    per_round: list[float] = []
    for _ in range(args.repeats):
        rows["python -c pass"].append(timed([PY, "-c", "pass"]))
        rows["python -c 'import numpy'"].append(timed([PY, "-c", "import numpy"]))
        with tempfile.TemporaryDirectory() as out:
            cmd = [EDGE_FL, "simulate", *args.args.split(), "--out", out, "--no-progress"]
            rows["edge-fl simulate (whole process)"].append(timed(cmd))
            summary = json.loads((Path(out) / "summary.json").read_text())
            for key, value in summary["timings"].items():
                parts.setdefault(key, []).append(value)
            recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
            per_round.extend(r["wall_time_s"] for r in recs)
    base = statistics.median(rows["python -c pass"])
    print(f"command: edge-fl simulate {args.args}   ({args.repeats} repeats, medians)")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"  {name:<36}{med:8.3f} s   x{med / base:6.1f} of interpreter start")
    print("  inside the run (summary.json timings, seconds since start of simulate()):")
    for key, values in parts.items():
        print(f"    {key:<24}{statistics.median(values):8.3f}")
    print(
        f"  per-round wall time: median {statistics.median(per_round) * 1000:.1f} ms, "
        f"p90 {sorted(per_round)[int(0.9 * len(per_round))] * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
