"""Fleet scale: a whole simulation with thousands of devices, each with its own MQTT session.

Reports connect time, per-round wall time, CPU seconds (user + system) of the simulation process
(aggregator + fleet) and of the broker at every round's record, and the PEAK resident memory of
both, sampled from /proc (VmHWM is the kernel's own high-water mark, so short peaks are not
missed). CPU per round is the difference between consecutive records (round 1's record also holds
start-up and connects), so it is what a loaded, shared machine cannot inflate the way it inflates
wall time.

    .venv/bin/python tools/bench_scale.py --devices 10000 --clients-per-round 1000 --rounds 5

``PYTHONPATH=<another tree>`` measures that tree's code with this script (before/after).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import threading
import time
from pathlib import Path

from edge_fl.config import load_config
from edge_fl.simulation import simulate
from edge_fl.transport import broker as broker_mod


def vm_hwm_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (all its threads) or of ``pid``."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broker_pid() -> int | None:
    return next((b.pid for b in list(broker_mod._LIVE) if b.pid), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--clients-per-round", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", default="sync")
    ap.add_argument("--dataset", default="synthetic", help="synthetic | synthetic-iid (learns)")
    ap.add_argument("--out", default="runs/scale")
    args = ap.parse_args()

    broker_peak = {"kb": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            for b in list(broker_mod._LIVE):
                if b.pid:
                    broker_peak["kb"] = max(broker_peak["kb"], vm_hwm_kb(b.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cfg = load_config(
        None,
        {
            "data.devices": args.devices,
            "data.dataset": args.dataset,
            "model.name": "logreg",
            "rounds.rounds": args.rounds,
            "rounds.clients_per_round": args.clients_per_round,
            "rounds.mode": args.mode,
            "rounds.deadline_s": 600,
            "rounds.wait_for_devices_s": 600,
        },
    )
    cpu_at_record: list[tuple[float, float]] = []  # (simulation, broker) at each record
    at_record: list[float] = []  # wall clock at each record
    connect_s: list[float] = []

    def on_record(record: dict, fleet: object) -> None:
        del record
        cpu_at_record.append((cpu_s(), cpu_s(broker_pid())))
        at_record.append(time.perf_counter())
        if not connect_s:
            connect_s.append(getattr(fleet, "connect_s", float("nan")))

    t0 = time.perf_counter()
    cpu0 = cpu_s()
    summary = simulate(cfg, args.out, fleet_hook=on_record, overwrite=True)
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    records = [json.loads(x) for x in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
    own_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    per_round = [
        round((b[0] - a[0]) + (b[1] - a[1]), 2) for a, b in itertools.pairwise(cpu_at_record)
    ]
    result = {
        "devices": args.devices,
        "clients_per_round": args.clients_per_round,
        "dataset": args.dataset,
        "rounds_closed": summary["rounds_closed"],
        "accuracy_per_round": [r["accuracy"] for r in records],
        "received_per_round": [r["received"] for r in records],
        "online_at_end": records[-1]["online"] if records else None,
        "sessions_connected_s": round(connect_s[0], 2) if connect_s else None,
        "fleet_connected_since_start_s": summary["timings"]["fleet_connected_s"],
        "first_round_s": summary["timings"]["first_round_s"],
        "round_wall_s": [round(r["wall_time_s"], 3) for r in records],
        "total_s": round(wall, 2),
        "cpu_s_at_first_record": round(cpu_at_record[0][0] - cpu0 + cpu_at_record[0][1], 2)
        if cpu_at_record
        else None,
        "cpu_s_per_round_after_first": per_round,
        "cpu_s_per_round_simulation": [
            round(b[0] - a[0], 2) for a, b in itertools.pairwise(cpu_at_record)
        ],
        "cpu_s_total_simulation": round(cpu_s() - cpu0, 2),
        "cores_busy_per_round": {
            "simulation": [
                round((b[0] - a[0]) / (tb - ta), 2)
                for (a, b), (ta, tb) in zip(
                    itertools.pairwise(cpu_at_record), itertools.pairwise(at_record), strict=True
                )
            ],
            "mosquitto": [
                round((b[1] - a[1]) / (tb - ta), 2)
                for (a, b), (ta, tb) in zip(
                    itertools.pairwise(cpu_at_record), itertools.pairwise(at_record), strict=True
                )
            ],
        },
        "peak_rss_simulation_mb": round(own_peak_mb, 1),
        "peak_rss_broker_mb": round(broker_peak["kb"] / 1024, 1),
        "bytes_up_per_round": [r["bytes_up"] for r in records],
        "bytes_down_per_round": [r["bytes_down"] for r in records],
        "wire_up_per_round": [r.get("wire_up") for r in records],
        "wire_down_per_round": [r.get("wire_down") for r in records],
        "load_1min_at_end": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
