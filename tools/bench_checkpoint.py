"""What a round's commit costs as the job goes on: ``save_checkpoint`` timed call by call.

Two ways (BENCHMARKS.md section 1, "A known cost that grows with the job"):

* ``engine``: a sync engine alone (6 devices, 3 answers a round, no broker, no fleet), a
  checkpoint after every round into a temporary directory; little else runs, so the CPU figure
  is the commit's own;
* ``simulate ARGS...``: ``edge-fl simulate ARGS...`` with ``save_checkpoint`` wrapped, e.g.
  ``simulate --rounds 500 --model logreg --out DIR``; then the records' gaps are in DIR.

Each prints the medians of the first and last 50 commits: wall time and the calling thread's CPU
time (``time.thread_time``, less sensitive to other processes' load than the wall clock), the
sums over the job, and the checkpoint's files at the end. Works on any tree (``PYTHONPATH``):
before the ledger file there is no ``checkpoint-ledger-*.jsonl``.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_checkpoint.py engine --rounds 2000
    PYTHONPATH=$PWD .venv/bin/python tools/bench_checkpoint.py simulate --rounds 500 \\
        --model logreg --out /tmp/ckpt500
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import edge_fl.server.checkpoint as checkpoint

TIMES: list[tuple[float, float]] = []
_save = checkpoint.save_checkpoint


def timed_save(core: Any, directory: Any, **kwargs: Any) -> None:
    w0, c0 = time.perf_counter(), time.thread_time()
    _save(core, directory, **kwargs)
    TIMES.append((time.perf_counter() - w0, time.thread_time() - c0))


def engine(rounds: int, directory: Path) -> None:
    import numpy as np

    from edge_fl.privacy.rng import seeded_generator
    from edge_fl.protocol import DenseUpdate, Status, UpdateLimits, encode_status, encode_update
    from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings

    d = 5
    settings = AggregatorSettings(
        job="j", rounds=rounds + 1, target=3, min_updates=2, deadline_s=10.0, mode="sync"
    )
    core = AggregatorCore(settings, np.zeros(d, np.float32), UpdateLimits(d), seeded_generator(3))
    for i in range(6):
        core.on_status(f"d{i}", encode_status(Status(f"d{i}", True, 100)))
    delta = np.full(d, 0.01, np.float32)
    for _ in range(rounds):
        msg = core.open_round(0.0)
        assert msg is not None and msg.selected is not None
        for device in msg.selected[:3]:
            update = DenseUpdate(device, msg.round, msg.version, 40, delta,
                                 nonce=core.nonce_of(msg.round))  # fmt: skip
            core.on_update(device, encode_update(update))
        core.close_round(1.0, 0.1)
        timed_save(core, directory)


def report(directory: Path | None) -> None:
    if not TIMES:
        print("no checkpoint written")
        return
    wall = [w * 1e3 for w, _ in TIMES]
    cpu = [c * 1e3 for _, c in TIMES]
    med = statistics.median
    print(
        f"{len(TIMES)} commits; save_checkpoint, medians of the first / last 50: "
        f"wall {med(wall[:50]):.2f} / {med(wall[-50:]):.2f} ms, "
        f"CPU {med(cpu[:50]):.2f} / {med(cpu[-50:]):.2f} ms; "
        f"whole job: wall {sum(wall) / 1e3:.2f} s, CPU {sum(cpu) / 1e3:.2f} s"
    )
    if directory is not None and (directory / "checkpoint.json").exists():
        ledger = sum(p.stat().st_size for p in directory.glob("checkpoint-ledger-*.jsonl"))
        state = (directory / "checkpoint.json").stat().st_size
        print(f"checkpoint.json {state / 1e3:.1f} KB, ledger file {ledger / 1e3:.1f} KB")


def main(argv: list[str]) -> None:
    if argv[:1] == ["engine"]:
        rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2000
        with tempfile.TemporaryDirectory() as tmp:
            engine(rounds, Path(tmp))
            report(Path(tmp))
    elif argv[:1] == ["simulate"]:
        checkpoint.save_checkpoint = timed_save  # the service imports it at each commit
        from edge_fl.cli import main as cli

        out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
        try:
            cli(argv, standalone_mode=False)
        finally:
            report(out)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
