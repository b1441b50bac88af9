"""Fleet scale: a whole simulation with thousands of devices, each with its own MQTT session.

Reports connect time, per-round wall time and the PEAK resident memory of the simulation process
(aggregator + fleet) and of the broker process, sampled from /proc (VmHWM is the kernel's own
high-water mark, so short peaks are not missed).

    .venv/bin/python tools/bench_scale.py --devices 10000 --clients-per-round 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--clients-per-round", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", default="sync")
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
            "data.dataset": "synthetic",
            "model.name": "logreg",
            "rounds.rounds": args.rounds,
            "rounds.clients_per_round": args.clients_per_round,
            "rounds.mode": args.mode,
            "rounds.deadline_s": 600,
            "rounds.wait_for_devices_s": 600,
        },
    )
    t0 = time.perf_counter()
    summary = simulate(cfg, args.out)
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    records = [json.loads(x) for x in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
    own_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {
        "devices": args.devices,
        "clients_per_round": args.clients_per_round,
        "rounds_closed": summary["rounds_closed"],
        "received_per_round": [r["received"] for r in records],
        "online_at_end": records[-1]["online"] if records else None,
        "connect_all_s": summary["timings"]["fleet_connected_s"],
        "first_round_s": summary["timings"]["first_round_s"],
        "round_wall_s": [round(r["wall_time_s"], 3) for r in records],
        "total_s": round(wall, 2),
        "peak_rss_simulation_mb": round(own_peak_mb, 1),
        "peak_rss_broker_mb": round(broker_peak["kb"] / 1024, 1),
        "bytes_down_per_round": [r["bytes_down"] for r in records],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
