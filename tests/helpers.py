"""Helpers more than one test module needs: the job's CLI processes started as a deployment
would, a real device agent on a small fixed data set."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import numpy as np
from processes import EDGE_FL

# unbuffered, so a process's last lines reach its pipe before it is stopped
UNBUFFERED = {**os.environ, "PYTHONUNBUFFERED": "1"}


def start_fleet_and_aggregator(
    args: list[str], out: Path
) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """`edge-fl fleet` then `edge-fl aggregator --out out` of the job ``args`` names, both with
    their output piped; the caller stops them."""
    fleet = subprocess.Popen(
        [EDGE_FL, "fleet", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=UNBUFFERED,
    )  # fmt: skip
    agg = subprocess.Popen(
        [EDGE_FL, "aggregator", *args, "--out", str(out)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=UNBUFFERED,
    )  # fmt: skip
    return fleet, agg


def real_agent(device_id: str = "d0"):
    """A real :class:`~edge_fl.device.agent.DeviceAgent` (logreg, 12 fixed samples, seeded), for
    the device-policy tests that drive the agent through the policy's events."""
    from edge_fl.device.agent import DeviceAgent
    from edge_fl.models import make_model
    from edge_fl.models.training import LocalTraining
    from edge_fl.privacy.rng import seeded_generator

    g = np.random.default_rng(0)
    X = g.normal(size=(12, 4)).astype(np.float32)
    y = (np.arange(12) % 3).astype(np.int64)
    return DeviceAgent(
        device_id, X, y, make_model("logreg", 4, 3), LocalTraining(1, 4, 0.1),
        seeded_generator(1),
    )  # fmt: skip


# A fleet of two tiers 50x apart in compute, always available, no dropout: the modelled times (not
# luck) decide who is late, and async jobs with a concurrency limit send dispatch messages.
TWO_SPEED_PROFILE = """\
name: two-speed
description: test fleet - fast and slow devices, always on
tiers:
  - name: fast
    share: 0.5
    compute_samples_per_s: 5000
    uplink_mbit_s: 20
    downlink_mbit_s: 50
    latency_ms: 20
  - name: slow
    share: 0.5
    compute_samples_per_s: 100
    uplink_mbit_s: 2
    downlink_mbit_s: 10
    latency_ms: 80
"""


def records(out: Path) -> list[dict]:
    """A run's metrics records (``metrics.jsonl``; none yet: an empty list, for polling)."""
    import json

    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_quiet_then_loaded(cfg, tmp_path: Path):
    """The same job twice, the second time beside a CPU-bound process (virtual time's claim:
    the machine's load changes nothing): (first, second, first's records, second's)."""
    import sys

    from edge_fl.simulation import run_simulation

    first = run_simulation(cfg, tmp_path / "quiet")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        second = run_simulation(cfg, tmp_path / "loaded")
    finally:
        hog.kill()
        hog.wait()
    return first, second, records(tmp_path / "quiet"), records(tmp_path / "loaded")


@contextlib.contextmanager
def mechanisms_registered(*mechanisms):
    """Register test mechanisms for the block only: the registries (mechanisms and the wire
    layer's parameter schemas) are process-wide, and other tests list every registered name."""
    import pytest

    import edge_fl.mechanisms as registry
    import edge_fl.protocol.params as params

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
        patch.setattr(params, "_SCHEMAS", dict(params._SCHEMAS))
        for mechanism in mechanisms:
            registry.register_mechanism(mechanism.name, mechanism)
        yield


def relay_control(workers, coordinator, payload: bytes, gone=()) -> None:
    """In-memory sharded ingest: an ingest control message to every worker not ``gone``, and
    each worker's answers to the coordinator (what the broker would carry)."""
    for worker in workers.values():
        if worker.name in gone:
            continue
        for kind, data in worker.on_control(payload):
            coordinator.on_message(kind, worker.name, data)


def relay_update(worker, coordinator, device: str, payload: bytes, mute: bool = False) -> None:
    """In-memory sharded ingest: a device's message to its worker, and the worker's progress
    report to the coordinator (``mute``: the report is lost on the way)."""
    worker.on_update(device, payload)
    progress = worker.progress()
    if progress is not None and not mute:
        coordinator.on_message("progress", worker.name, progress)


def answer_inbox(sessions, inputs, up, deliveries) -> None:
    """In-memory SecAgg+ devices: each delivered inbox message to its device's session, its
    input submitted once the session is ready, every message it sends handed to ``up``."""
    from edge_fl.secagg import Send

    for effect in deliveries:
        session = sessions[effect.device]
        out = session.receive(effect.payload)
        if session.phase == "ready":
            out += session.submit(inputs[effect.device])
        for sent in out:
            if isinstance(sent, Send):
                up(effect.device, sent.payload)
