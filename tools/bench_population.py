"""A population of 1,000,000 modelled devices, of which only the online ones hold MQTT sessions.

One private Mosquitto (the embedded broker: its open-file limit raised to the hard limit), one
aggregator process and ``--shards`` fleet processes, each running ``edge-fl fleet --shard I/N``'s
code path (``build_job`` then ``Job.fleet_runtime`` over ``range(I, devices, N)``: with a
``population:`` section that builds agents for the online devices of the shard only). Reports
rounds closed, wall time per round, start-up time and the peak RSS of every process (VmHWM, the
kernel's high-water mark, sampled from /proc until the process exits) and the peak of their sum.

The baseline, measured in the same run: the same job without a population (``--online`` devices
in all, every one of them online, data materialised by ``make_synthetic``: what BENCHMARKS.md
section 3 measured in one process), in the same process layout. Ratios are population / baseline.

    .venv/bin/python tools/bench_population.py --population 1000000 --online 10000 \\
        --per-round 1000 --rounds 3 --shards 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat fields 14 and 15)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class Sampler(threading.Thread):
    """Peak RSS per named process (VmHWM), the peak of the sum of current RSS (VmRSS) and CPU
    seconds per process (the last reading before it exits: robust to other load on the box)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.pids: dict[str, int] = {}
        self.peak_kb: dict[str, int] = {}
        self.peak_total_kb = 0
        self.cpu_s: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.25):
            total = 0
            for name, pid in list(self.pids.items()):
                self.peak_kb[name] = max(self.peak_kb.get(name, 0), _status_kb(pid, "VmHWM"))
                total += _status_kb(pid, "VmRSS")
                self.cpu_s[name] = max(self.cpu_s.get(name, 0.0), _cpu_s(pid))
            self.peak_total_kb = max(self.peak_total_kb, total)


# ---------------------------------------------------------------------- roles (subprocesses)


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def role_aggregator(config: str, launched: float) -> None:
    """The aggregator: waits for the devices that report (the online ones), runs the rounds."""
    from edge_fl.config import load_config
    from edge_fl.job import build_job
    from edge_fl.server.service import AggregatorService
    from edge_fl.transport.url import parse_broker_url

    t0 = time.time()
    job = build_job(load_config(config))
    core = job.aggregator_core()
    _emit(event="built", role="aggregator", build_s=round(time.time() - t0, 3))

    def on_record(r: dict[str, Any]) -> None:
        now = time.time()
        if r["round"] == 1:  # the first round opened when every online device had reported
            _emit(event="startup", startup_s=round(now - r["wall_time_s"] - launched, 3))
        _emit(
            event="round",
            round=r["round"],
            status=r["status"],
            received=r["received"],
            selected=r["selected"],
            online=r["online"],
            wall_time_s=round(r["wall_time_s"], 3),
            bytes_up=r.get("bytes_up"),
            bytes_down=r.get("bytes_down"),
        )

    service = AggregatorService(
        core,
        parse_broker_url(job.cfg.broker.url),
        job.topics,
        wait_for_devices_s=job.cfg.rounds.wait_for_devices_s,
        expected_devices=job.expected_devices,  # the online devices, never the population
        on_record=on_record,
    )
    asyncio.run(service.run())
    _emit(event="done", devices_known=len(core.devices), total_s=round(time.time() - launched, 3))


def role_fleet(config: str, shard: str, launched: float) -> None:
    """What ``edge-fl fleet --config CONFIG --shard I/N`` runs."""
    from edge_fl.config import load_config
    from edge_fl.job import build_job
    from edge_fl.transport.url import parse_broker_url

    t0 = time.time()
    cfg = load_config(config)
    job = build_job(cfg)
    built = time.time()
    i, n = (int(x) for x in shard.split("/"))
    fleet = job.fleet_runtime(
        parse_broker_url(cfg.broker.url),
        range(i, cfg.data.devices, n),
        prefix=f"edgefl-{cfg.job}-s{i}of{n}",
    )
    made = time.time()

    async def run() -> None:
        task = asyncio.create_task(fleet.run())
        await fleet.connected.wait()
        _emit(
            event="connected",
            shard=shard,
            sessions=len(fleet.agents),
            build_job_s=round(built - t0, 3),
            build_agents_s=round(made - built, 3),
            connect_s=round(time.time() - made, 3),
            ready_since_launch_s=round(time.time() - launched, 3),
        )
        await task

    asyncio.run(run())
    drawn = sum(1 for a in fleet.agents.values() if getattr(a, "materialised", True))
    _emit(event="fleet_done", shard=shard, published=fleet.published, data_drawn=drawn)


# ---------------------------------------------------------------------- the driver


def one_run(args: argparse.Namespace, population: bool, work: Path) -> dict[str, Any]:
    from edge_fl.transport.broker import EmbeddedBroker

    label = "population" if population else "baseline"
    devices = args.population if population else args.online
    job = f"bench-{label}-{os.getpid()}"
    sampler = Sampler()
    sampler.start()
    load_before = os.getloadavg()[0]
    with EmbeddedBroker(kind="mosquitto", connection_messages=False) as broker:
        sampler.pids["mosquitto"] = broker.pid
        cfg: dict[str, Any] = {
            "job": job,
            "seed": args.seed,
            "broker": {"url": broker.url},
            "data": {"dataset": "synthetic", "devices": devices},
            "model": {"name": "logreg", "evaluate_with": "native"},
            "rounds": {
                "rounds": args.rounds,
                "clients_per_round": args.per_round,
                "deadline_s": 600,
                "wait_for_devices_s": 600,
            },
            # wall clock: virtual time runs one fleet process in lock-step with its aggregator
            # (several are refused); the phone-fleet profile alone would make it virtual
            "fleet": {"profile": "phone-fleet", "start_hour": 8, "dropout": 0.0, "clock": "wall"},
        }
        if population:
            cfg["population"] = {"online": args.online}
        path = work / f"{label}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        launched = time.time()
        me = [sys.executable, __file__, "--launched", str(launched), "--config", str(path)]
        procs = {"aggregator": subprocess.Popen([*me, "--role", "aggregator"], **_pipes())}
        for i in range(args.shards):
            name = f"fleet {i}/{args.shards}"
            shard = ["--role", "fleet", "--shard", f"{i}/{args.shards}"]
            procs[name] = subprocess.Popen([*me, *shard], **_pipes())
        for name, p in procs.items():
            sampler.pids[name] = p.pid
        events: dict[str, list[dict[str, Any]]] = {}
        readers = [
            threading.Thread(
                target=_read, args=(p, events.setdefault(n, []), sampler.pids), daemon=True
            )
            for n, p in procs.items()
        ]
        for r in readers:
            r.start()
        failed = []
        for name, p in procs.items():
            try:
                rc = p.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = "timeout"
            if rc != 0:
                failed.append(f"{name}: exit {rc}")
        for r in readers:
            r.join(timeout=5)
        time.sleep(0.3)
    sampler.stop.set()
    sampler.join()
    agg = events["aggregator"]
    rounds = [e for e in agg if e.get("event") == "round"]
    fleets = [e for n, ev in events.items() if n != "aggregator" for e in ev]
    return {
        "run": label,
        "devices_modelled": devices,
        "online_sessions": sum(e["sessions"] for e in fleets if e.get("event") == "connected"),
        "failed": failed,
        "rounds_closed": sum(1 for e in rounds if e["status"] == "closed"),
        "received": [e["received"] for e in rounds],
        "round_wall_s": [e["wall_time_s"] for e in rounds],
        "startup_s": next((e["startup_s"] for e in agg if e.get("event") == "startup"), None),
        "aggregator_build_s": next((e["build_s"] for e in agg if e.get("event") == "built"), None),
        "aggregator_devices_known": next(
            (e["devices_known"] for e in agg if e.get("event") == "done"), None
        ),
        "total_s": next((e["total_s"] for e in agg if e.get("event") == "done"), None),
        "fleets": [e for e in fleets if e.get("event") in ("connected", "fleet_done")],
        "peak_rss_mb": {k: round(v / 1024, 1) for k, v in sampler.peak_kb.items()},
        "peak_rss_sum_mb": round(sampler.peak_total_kb / 1024, 1),
        "cpu_s": {k: round(v, 1) for k, v in sampler.cpu_s.items()},
        **per_round_cpu(rounds),
        "bytes_up": [e.get("bytes_up") for e in rounds],
        "bytes_down": [e.get("bytes_down") for e in rounds],
        "load_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def _pipes() -> dict[str, Any]:
    return {"stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL, "text": True, "cwd": ROOT}


def _read(proc: subprocess.Popen, out: list[dict[str, Any]], pids: dict[str, int]) -> None:
    """Events of one role; a round's record also takes every process's CPU seconds and the
    time as it arrives, so CPU per round and per process can be told apart."""
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "round":
            event["at"] = time.time()
            event["cpu_at"] = {name: _cpu_s(pid) for name, pid in list(pids.items())}
        out.append(event)


def per_round_cpu(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """CPU seconds per round and per process between consecutive records (round 1's record
    also holds start-up), and the cores each process kept busy then (CPU s / wall s)."""
    cpu: dict[str, list[float]] = {}
    busy: dict[str, list[float]] = {}
    for a, b in itertools.pairwise(rounds):
        wall = b["at"] - a["at"]
        for name, value in b["cpu_at"].items():
            used = value - a["cpu_at"].get(name, 0.0)
            cpu.setdefault(name, []).append(round(used, 2))
            busy.setdefault(name, []).append(round(used / wall, 2) if wall > 0 else 0.0)
    return {"cpu_s_per_round": cpu, "cores_busy_per_round": busy}


def table(runs: list[dict[str, Any]]) -> str:
    base = next((r for r in runs if r["run"] == "baseline"), None)
    lines = [
        "| run | modelled devices | sessions | rounds closed | round wall s | start-up s | "
        "peak RSS per process MB | peak RSS sum MB | CPU s per process | load before/after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        procs = ", ".join(f"{k} {v:g}" for k, v in r["peak_rss_mb"].items())
        lines.append(
            f"| {r['run']} | {r['devices_modelled']:,} | {r['online_sessions']:,} | "
            f"{r['rounds_closed']} ({'/'.join(map(str, r['received']))} updates) | "
            f"{', '.join(f'{w:.2f}' for w in r['round_wall_s'])} | {r['startup_s']} | {procs} | "
            f"{r['peak_rss_sum_mb']:g} | {', '.join(f'{v:g}' for v in r['cpu_s'].values())} | "
            f"{'/'.join(map(str, r['load_1min_before_after']))} |"
        )
    pop = next((r for r in runs if r["run"] == "population"), None)
    if base and pop and base["peak_rss_sum_mb"] and base["round_wall_s"]:
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        lines.append("")
        lines.append(
            "population / baseline: peak RSS sum "
            f"{pop['peak_rss_sum_mb'] / base['peak_rss_sum_mb']:.2f}x, "
            f"mean round wall {mean(pop['round_wall_s']) / mean(base['round_wall_s']):.2f}x, "
            f"start-up {pop['startup_s'] / base['startup_s']:.2f}x, "
            f"CPU s of all processes {sum(pop['cpu_s'].values()) / sum(base['cpu_s'].values()):.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--population", type=int, default=1_000_000)
    ap.add_argument("--online", type=int, default=10_000)
    ap.add_argument("--per-round", type=int, default=1_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shards", type=int, default=2, help="fleet processes (<= ~15,000 each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--no-population", action="store_true", help="the baseline alone")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--role", choices=["aggregator", "fleet"], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--shard", help=argparse.SUPPRESS)
    ap.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "aggregator":
        return role_aggregator(args.config, args.launched)
    if args.role == "fleet":
        return role_fleet(args.config, args.shard, args.launched)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-population-") as tmp:
        if not args.no_baseline:
            runs.append(one_run(args, population=False, work=Path(tmp)))
            print(json.dumps(runs[-1], indent=2), flush=True)
        if not args.no_population:
            runs.append(one_run(args, population=True, work=Path(tmp)))
            print(json.dumps(runs[-1], indent=2), flush=True)
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
