"""Fleet connects alone: N device sessions (each with its own last will and retained status)
against a private embedded Mosquitto, then a quiet spell with every session open, then a clean
leave. Prints wall and CPU seconds (user + system) of this process and of the broker for each
phase, so a shared, loaded machine can still compare two trees (``PYTHONPATH=<tree>``).

    .venv/bin/python tools/bench_connect.py --devices 10000 --idle 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.transport.broker import EmbeddedBroker
from edge_fl.transport.url import parse_broker_url


def cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (all threads) or of ``pid``."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds with every session open")
    args = ap.parse_args()
    cfg = load_config(
        None, {"data.devices": args.devices, "data.dataset": "synthetic", "model.name": "logreg"}
    )
    job = build_job(cfg)
    result: dict[str, float | int] = {"devices": args.devices}
    with EmbeddedBroker(kind="mosquitto") as broker:
        fleet = job.fleet_runtime(parse_broker_url(broker.url))
        bpid = broker.pid

        async def run() -> None:
            phases = {}
            mark = (time.perf_counter(), cpu_s(), cpu_s(bpid))

            def phase(name: str) -> None:
                nonlocal mark
                now = (time.perf_counter(), cpu_s(), cpu_s(bpid))
                phases[name] = [round(b - a, 2) for a, b in zip(mark, now, strict=True)]
                mark = now

            await fleet.connect_all()
            phase("connect")
            await asyncio.sleep(args.idle)
            phase("idle")
            await fleet.disconnect_all()
            phase("leave")
            for name, (wall, own, brk) in phases.items():
                result[f"{name}_wall_s"] = wall
                result[f"{name}_cpu_s"] = own
                result[f"{name}_broker_cpu_s"] = brk

        asyncio.run(run())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
