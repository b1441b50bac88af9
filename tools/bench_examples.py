"""Run every `edge-fl simulate --mechanism ...` example of README.md and report what it learns.

The commands are read from the README's fenced bash blocks, so the table in BENCHMARKS.md is about
exactly what users copy. Each runs ``--repeat`` times (production CSPRNG noise, so runs differ);
``--out`` is redirected to a temporary directory.

    .venv/bin/python tools/bench_examples.py --repeat 3
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_examples(readme: Path) -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.S)
    out = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():  # a command's continued lines
            line = line.split("#", 1)[0].strip()
            if line.startswith("edge-fl simulate --mechanism") and "--track" not in line:
                out.append(shlex.split(line))
    return out


def run(argv: list[str], out_dir: Path) -> dict:
    args = list(argv[1:])
    if "--out" in args:
        i = args.index("--out")
        del args[i : i + 2]
    cmd = [str(ROOT / ".venv/bin/edge-fl"), *args, "--out", str(out_dir), "--no-progress"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    summary = json.loads((out_dir / "summary.json").read_text())
    return {
        "accuracy": summary["final_accuracy"],
        "epsilon": summary["epsilon"],
        "accountant": summary["accountant"],
        "stopped": summary.get("stopped_devices", 0),
        "wall_s": wall,
        "stderr_lines": len([x for x in done.stderr.splitlines() if x.strip()]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    opts = ap.parse_args()
    examples = readme_examples(ROOT / "README.md")
    if not examples:
        sys.exit("no `edge-fl simulate --mechanism` example found in README.md")
    print(
        "| command | accuracy (mean, min-max) | epsilon (accountant) | devices stopped | wall s | stderr lines |"
    )
    print("|---|---|---|---|---|---|")
    for argv in examples:
        runs = []
        for _ in range(opts.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(run(argv, Path(tmp)))
        acc = [r["accuracy"] for r in runs]
        eps = statistics.mean(r["epsilon"] for r in runs)
        print(
            f"| `{' '.join(argv)}` | {statistics.mean(acc):.3f} ({min(acc):.3f}-{max(acc):.3f}) "
            f"| {eps:.4g} ({runs[-1]['accountant']}) | {max(r['stopped'] for r in runs)} "
            f"| {statistics.median(r['wall_s'] for r in runs):.1f} "
            f"| {max(r['stderr_lines'] for r in runs)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
