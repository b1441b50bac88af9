"""Model poisoning against robust aggregation: accuracy of the default digits job under attack.

    .venv/bin/python tools/bench_poisoning.py [--repeats 3] [--rounds 20] [--only attacked-default]

Each run is the real ``edge_fl.run_simulation`` (embedded Mosquitto, aggregator and the
50-device fleet in this process) on the default job: digits, MLP, 50 IID devices, 20 per round,
20 rounds. The attack (issue: "model poisoning"): in every round ONE selected device (the first of
the selection) uploads its honest delta scaled x100 and claims n = 10,000,000 samples; it is
built by the job's device factory (:func:`attackers`, the public hook of ``build_job``), so the
update goes over MQTT and through the aggregator's decoder, admission and strategy like any
other. Variant ``liar``: every
device also declares 10,000,000 samples in its retained status, which defeats the aggregator's cap
at the declared count; the default robust settings (``norm_bound: auto``) then cap the count at 3x
the median count of recent updates (``robust.py``): liar/default 0.143 -> 0.929 (3 runs each). Runs are sequential; noise and training use the production CSPRNG, so
repeats differ: the table gives the mean, min and max, and the cost against the clean job with
robust aggregation off, measured in the same invocation. Never run in CI (``tests/test_robust.py``
has a one-run version).

``--workers N``: the aggregator is ``edge-fl aggregator --workers N`` (sharded ingest, its workers
local processes) on an embedded Mosquitto, and the attacked fleet runs in this process. liar/default
with ``--workers 2``: 0.2145 (0.100-0.332) while workers folded without the sample cap, 0.9192
(0.916-0.922) with it (3 runs each, 20 rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edge_fl import DeviceAgent, Job, build_job, load_config, run_simulation
from edge_fl.protocol import Status, encode_status

SCALE = 100.0
CLAIM = 10_000_000
ROBUST: dict[str, dict[str, Any]] = {
    "off": {"robust.norm_bound": "off"},
    "default": {},
    "trimmed_mean": {"robust.aggregator": "trimmed_mean"},
    "median": {"robust.aggregator": "median"},
}
# (name, attack, robust): attack is None, "attack" or "liar"
ROWS: tuple[tuple[str, str | None, str], ...] = (
    ("clean-off", None, "off"),
    ("clean-default", None, "default"),
    ("clean-trimmed_mean", None, "trimmed_mean"),
    ("clean-median", None, "median"),
    ("attacked-off", "attack", "off"),
    ("attacked-default", "attack", "default"),
    ("attacked-trimmed_mean", "attack", "trimmed_mean"),
    ("attacked-median", "attack", "median"),
    ("liar-off", "liar", "off"),
    ("liar-default", "liar", "default"),
    ("liar-trimmed_mean", "liar", "trimmed_mean"),
    ("liar-median", "liar", "median"),
)


class FirstSelectedPoisons:
    """A device's mechanism that, when its device is the first of the round's selection, sends
    ``scale`` x its honest delta claiming ``claim`` samples; honest otherwise."""

    def __init__(self, honest: Any, scale: float, claim: int, sent: dict[str, int]) -> None:
        self.honest, self.scale, self.claim, self.sent = honest, scale, claim, sent

    def __getattr__(self, name: str) -> Any:  # the privacy events, limits, ...: the honest ones
        return getattr(self.honest, name)

    def device_update(self, device: Any, msg: Any, exposure: int) -> Any:
        update = self.honest.device_update(device, msg, exposure)
        if not (msg.selected and device.device_id == min(msg.selected)):
            return update
        self.sent["poisoned"] += 1
        delta = (update.delta.astype(np.float64) * self.scale).astype(np.float32)
        return dataclasses.replace(update, delta=delta, n_samples=self.claim)


class LyingAgent(DeviceAgent):
    """A device that declares ``claim`` samples in its status, whatever it holds."""

    claim = CLAIM

    def status(self, online: bool) -> bytes:
        return encode_status(Status(self.device_id, online, self.claim, {}))


def attackers(
    sent: dict[str, int], scale: float = SCALE, claim: int = CLAIM, lie_in_status: bool = False
) -> Callable[[Job, int], DeviceAgent]:
    """The device factory of an attacked job: one malicious device per sync round (the first of
    the selection) sends ``scale`` x its honest delta and claims ``claim`` samples;
    ``lie_in_status``: every device also declares ``claim`` in its status. ``sent`` counts the
    poisoned updates."""

    def factory(job: Job, index: int) -> DeviceAgent:
        a = job.default_agent(index)
        mechanism = FirstSelectedPoisons(a.mechanism, scale, claim, sent)
        kind = LyingAgent if lie_in_status else DeviceAgent
        return kind(a.device_id, a.X, a.y, a.model, a.training, a.rng, mechanism, a.budget, a.codec)

    return factory


def job_overrides(robust: str, rounds: int, seed: int, **extra: Any) -> dict[str, Any]:
    return {
        "job": f"poison-{uuid.uuid4().hex[:8]}",
        "seed": seed,
        "data.dataset": "digits",
        "data.devices": 50,
        "model.name": "mlp",
        "rounds.rounds": rounds,
        "rounds.clients_per_round": 20,
        "rounds.deadline_s": 120.0,  # generous on a shared machine: every selected device answers
        **ROBUST[robust],
        **extra,
    }


def job_config(robust: str, rounds: int, seed: int, **extra: Any) -> Any:
    return load_config(None, job_overrides(robust, rounds, seed, **extra))


def run_sharded(attack: str | None, robust: str, rounds: int, seed: int, workers: int) -> dict:
    """One run with sharded ingest: ``edge-fl aggregator --workers N`` (its workers are local
    processes) on an embedded Mosquitto, and the job's fleet (with the attackers) in this
    process. Accuracy and counts from the aggregator's summary and records."""
    from edge_fl.config import set_path
    from edge_fl.transport.broker import EmbeddedBroker
    from edge_fl.transport.url import parse_broker_url

    sent = {"poisoned": 0}
    factory = attackers(sent, lie_in_status=attack == "liar") if attack is not None else None
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(kind="mosquitto") as broker:
        data: dict[str, Any] = {}
        extra = {"broker.url": broker.url, "ingest.workers": workers}
        for key, value in job_overrides(robust, rounds, seed, **extra).items():
            set_path(data, key, value)
        config, out = Path(tmp) / "job.yaml", Path(tmp) / "run"
        config.write_text(json.dumps(data))  # JSON is YAML
        edge_fl_cli = str(Path(sys.executable).with_name("edge-fl"))
        t0 = time.perf_counter()
        aggregator = subprocess.Popen(
            [edge_fl_cli, "aggregator", "--config", str(config), "--out", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            job = build_job(load_config(config), device_factory=factory)
            asyncio.run(job.fleet_runtime(parse_broker_url(broker.url)).run())
            _, err = aggregator.communicate(timeout=600)
        finally:
            if aggregator.poll() is None:
                aggregator.kill()
                aggregator.wait()
        elapsed = time.perf_counter() - t0
        if aggregator.returncode != 0:
            raise RuntimeError(f"aggregator failed: {err.decode(errors='replace')[-2000:]}")
        summary = json.loads((out / "summary.json").read_text())
        lines = (out / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
    row = result_row(summary, records, sent, elapsed)
    row["workers_missing"] = sum(len(r.get("workers_missing") or ()) for r in records)
    return row


def result_row(summary: dict, records: list[dict], sent: dict, elapsed: float) -> dict:
    """A run's accuracy and what the aggregator counted, from its summary and records."""
    return {
        "accuracy": summary["final_accuracy"],
        "rounds_closed": summary["rounds_closed"],
        "poisoned_sent": sent["poisoned"],
        "norm_clipped": sum(r.get("norm_clipped") or 0 for r in records),
        "norm_rejected": sum(r.get("norm_rejected") or 0 for r in records),
        "capped_samples": sum(r.get("capped_samples") or 0 for r in records),
        "sample_capped": sum(r.get("max_samples_capped") or 0 for r in records),
        "received": sum(r.get("received") or 0 for r in records),
        "seconds": round(elapsed, 2),
    }


def run_one(attack: str | None, robust: str, rounds: int, seed: int, **extra: Any) -> dict:
    """One simulation; accuracy and what the aggregator counted."""
    cfg = job_config(robust, rounds, seed, **extra)
    sent = {"poisoned": 0}
    factory = attackers(sent, lie_in_status=attack == "liar") if attack is not None else None
    t0 = time.perf_counter()
    result = run_simulation(build_job(cfg, device_factory=factory))
    elapsed = time.perf_counter() - t0
    return result_row(result.summary, result.records, sent, elapsed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="fleet/model seed (same for every run)")
    ap.add_argument("--only", action="append", help="row name(s) to run (default: all)")
    ap.add_argument("--out", type=Path, help="also write the raw results here (JSON)")
    ap.add_argument(
        "--workers",
        type=int,
        default=0,
        help="N > 0: sharded ingest (edge-fl aggregator --workers N on an embedded Mosquitto, "
        "the fleet in this process) instead of run_simulation",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    rows = [r for r in ROWS if not args.only or r[0] in args.only]
    results: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for name, attack, robust in rows:  # interleaved: machine load hits every row alike
            if args.workers:
                res = run_sharded(attack, robust, args.rounds, args.seed, args.workers)
            else:
                res = run_one(attack, robust, args.rounds, args.seed)
            results.setdefault(name, []).append(res)
            print(
                f"[{rep + 1}/{args.repeats}] {name:22s} acc {res['accuracy']:.4f}  "
                f"clipped {res['norm_clipped']:3d}  capped {res['capped_samples']:3d}  "
                f"sample-capped {res.get('sample_capped', '-')}  "
                f"shares lost {res.get('workers_missing', '-')}  "
                f"{res['seconds']:.1f}s",
                file=sys.stderr,
            )
    clean = results.get("clean-off")
    base = statistics.mean(r["accuracy"] for r in clean) if clean else None
    lines = [
        f"`.venv/bin/python tools/bench_poisoning.py --repeats {args.repeats} --rounds "
        f"{args.rounds}{f' --workers {args.workers}' if args.workers else ''}` (digits, MLP, 50 devices, 20 per round, {args.rounds} rounds, seed "
        f"{args.seed}; attack: one selected device per round sends x{SCALE:g} its delta with "
        f"n = {CLAIM:,}; liar: and every status declares n = {CLAIM:,}):",
        "",
        f"| run | robust | accuracy (mean of {args.repeats}) | min-max | lost vs clean/off | "
        "clipped / capped per run |",
        "|---|---|---|---|---|---|",
    ]
    for name, _attack, robust in rows:
        accs = [r["accuracy"] for r in results[name]]
        mean = statistics.mean(accs)
        cost = f"{(base - mean) * 100:+.1f} pts" if base is not None else "-"
        clipped = statistics.mean(r["norm_clipped"] for r in results[name])
        capped = statistics.mean(r["capped_samples"] for r in results[name])
        lines.append(
            f"| {name.split('-')[0]} | {robust} | {mean:.4f} | {min(accs):.4f}-{max(accs):.4f} | "
            f"{cost} | {clipped:.1f} / {capped:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out is None:
        return
    args.out.write_text(
        json.dumps(
            {
                "python": platform.python_version(),
                "args": {**vars(args), "out": str(args.out)},
                "results": results,
                "table": table,
            },
            indent=2,
            default=str,
        )
    )


if __name__ == "__main__":
    main()
