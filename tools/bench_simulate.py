"""Whole-process time of `edge-fl simulate` (what a user waits for, run after run) and its parts.

Each repetition runs the real command in a fresh interpreter; baselines measured in the same run,
alternating with it: `python -c pass` (interpreter start), `python -c "import numpy"` and
tools/plain_fedavg.py (a plain numpy FedAvg loop of the same job: same data split, model, local
training and averaging, no framework), run as it is and with numpy's BLAS on one thread. The breakdown comes from the run's own summary.json
(build, broker ready, fleet connected, first round, all rounds).

    .venv/bin/python tools/bench_simulate.py --repeats 5            # the README's first job
    .venv/bin/python tools/bench_simulate.py --repeats 5 --args ""  # the default job
    .venv/bin/python tools/bench_simulate.py --args "" --guard tools/bench_simulate_baseline.json
    .venv/bin/python tools/bench_simulate.py --args "--epochs 20"  # 4x the training per round

The regression guard compares the per-round cost, as a ratio to the plain loop's per-round cost
measured in the same run (so the machine's speed cancels), with the recorded baseline and exits 1
when it grew by more than 20%; `--record` writes the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable
EDGE_FL = str(Path(PY).with_name("edge-fl"))
PLAIN = str(Path(__file__).with_name("plain_fedavg.py"))
GUARD_TOLERANCE = 1.20
#: the plain loop again with numpy's BLAS on one thread: on small matrices OpenBLAS's threads
#: bring nothing, and when the other core is busy they can make the loop jumpy (2026-11-28, six
#: alternating pairs on 2 cores: 0.67-1.18 s with its default threads, 0.66-0.73 s with one), so
#: the ratio is also given against the faster of the two
PLAIN_ONE_THREAD = "plain loop, one BLAS thread"
ONE_THREAD = {
    **os.environ,
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def plain_args(simulate_args: str) -> list[str]:
    """The plain loop's overrides for the simulate flags this benchmark passes."""
    names = {
        "--devices": "data.devices",
        "--rounds": "rounds.rounds",
        "--clients-per-round": "rounds.clients_per_round",
        "--dataset": "data.dataset",
        "--model": "model.name",
        "--epochs": "training.epochs",
    }
    words = simulate_args.split()
    out = []
    for flag, value in zip(words[::2], words[1::2], strict=False):
        if flag not in names:
            raise SystemExit(f"bench_simulate: the plain loop has no equivalent of {flag}")
        out.append(f"{names[flag]}={value}")
    return out


def children_cpu() -> float:
    """User + system CPU seconds of every waited-for child so far (their own children too: the
    embedded Mosquitto is counted with the simulate process that started it)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(cmd: list[str], cpu: list[float] | None = None) -> float:
    t, c = time.perf_counter(), children_cpu()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if cpu is not None:
        cpu.append(children_cpu() - c)
    return time.perf_counter() - t


def compile_package() -> None:
    """Byte-compile the edge_fl the runs import, as pip does when it installs a wheel: an
    editable install, or a shell with PYTHONDONTWRITEBYTECODE set (as on the development
    machines), otherwise compiles its ~110 modules from source in every run (about 0.5 s of CPU
    measured under cProfile), a cost no user pays after the first run."""
    import compileall

    import edge_fl

    compileall.compile_dir(str(Path(edge_fl.__file__).parent), quiet=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--args",
        default="--devices 50 --rounds 20 --clients-per-round 20 --dataset digits --model mlp",
    )
    ap.add_argument("--guard", help="baseline JSON: exit 1 if per-round cost grew > 20%%")
    ap.add_argument("--record", action="store_true", help="write --guard's baseline from this run")
    args = ap.parse_args()
    compile_package()
    rows: dict[str, list[float]] = {"python -c pass": [], "python -c 'import numpy'": []}
    rows["plain numpy FedAvg loop (whole process)"] = []
    rows[PLAIN_ONE_THREAD] = []
    rows["edge-fl simulate (whole process)"] = []
    plain_rounds: list[float] = []
    cpu: dict[str, list[float]] = {"plain": [], "simulate": []}
    parts: dict[str, list[float]] = {}
    per_round: list[float] = []
    for _ in range(args.repeats):
        rows["python -c pass"].append(timed([PY, "-c", "pass"]))
        rows["python -c 'import numpy'"].append(timed([PY, "-c", "import numpy"]))
        t, c = time.perf_counter(), children_cpu()
        plain = subprocess.run(
            [PY, PLAIN, *plain_args(args.args)], check=True, capture_output=True, text=True
        )
        rows["plain numpy FedAvg loop (whole process)"].append(time.perf_counter() - t)
        cpu["plain"].append(children_cpu() - c)
        plain_rounds.append(float(plain.stdout.rsplit("rounds ", 1)[1].split()[0]))
        t = time.perf_counter()
        subprocess.run(
            [PY, PLAIN, *plain_args(args.args)], check=True, capture_output=True, env=ONE_THREAD
        )
        rows[PLAIN_ONE_THREAD].append(time.perf_counter() - t)
        with tempfile.TemporaryDirectory() as out:
            cmd = [EDGE_FL, "simulate", *args.args.split(), "--out", out, "--no-progress"]
            rows["edge-fl simulate (whole process)"].append(timed(cmd, cpu["simulate"]))
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
    whole = statistics.median(rows["edge-fl simulate (whole process)"])
    plain_whole = statistics.median(rows["plain numpy FedAvg loop (whole process)"])
    n_rounds = len(per_round) / args.repeats
    plain_round = statistics.median(plain_rounds) / n_rounds
    ratio_round = statistics.median(per_round) / plain_round
    one_thread = statistics.median(rows[PLAIN_ONE_THREAD])
    print(
        f"  whole process against the plain loop: x{whole / plain_whole:.2f} "
        f"(x{whole / one_thread:.2f} against its one-BLAS-thread run; the stricter: "
        f"x{whole / min(plain_whole, one_thread):.2f})"
    )
    cpu_sim, cpu_plain = statistics.median(cpu["simulate"]), statistics.median(cpu["plain"])
    print(
        f"  CPU (user+sys, all processes): simulate {cpu_sim:.2f} s, plain {cpu_plain:.2f} s, "
        f"x{cpu_sim / cpu_plain:.2f}"
    )
    print(
        f"  per round against the plain loop: x{ratio_round:.2f} "
        f"({plain_round * 1000:.1f} ms per plain round)"
    )
    if args.guard:
        guard = Path(args.guard)
        if args.record:
            guard.write_text(
                json.dumps({"args": args.args, "per_round_vs_plain": ratio_round}) + "\n"
            )
            print(f"  baseline recorded in {guard}")
            return
        base_ratio = json.loads(guard.read_text())["per_round_vs_plain"]
        grew = ratio_round / base_ratio
        verdict = "REGRESSION" if grew > GUARD_TOLERANCE else "ok"
        print(f"  guard: per-round cost x{grew:.2f} of the recorded baseline: {verdict}")
        if grew > GUARD_TOLERANCE:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
