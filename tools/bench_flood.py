"""One device floods an asynchronous aggregator: its memory, through a real broker and service.

    .venv/bin/python tools/bench_flood.py [--mb 1024] [--modes fedbuff fedasync] [--phase both]

Issue 24 (item 2): 1,000 x 1 MiB from one known device grew a FedBuff aggregator's RSS from 155
to 1,159 MB while it waited for devices (FedAsync, during rounds: 870 MB). Here everything is
real: a private Mosquitto, ``edge-fl aggregator`` as its own process (with ``--out``, so its
journal too), for the ``rounds`` phase ``edge-fl fleet`` with 4 honest devices, and the attacker,
device d00004 of the job (its status says online), publishing ``--mb`` messages of 1 MiB each
(a dense update whose ``x`` is 1 MiB) at QoS 1 on its own ``up`` topic.

Phases: ``wait`` floods while the aggregator waits for devices (no window is open: every update
would be held); ``rounds`` floods while the fleet's rounds run (windows open and full alike).
The aggregator's RSS (VmRSS of its process) is sampled every 20 ms from just before the flood
until it has consumed the flood (every message refused as ``oversized`` in the records, or, while
waiting, its CPU time idle for 2 s); growth = peak - before. The refusals are read from the
metrics records (the wait phase's are in round 1's, once the fleet has started), which proves
the flood reached the aggregator.

Measured (``--mb 1024``, 2 shared cores): growth 6.1 / 8.2 MB (FedBuff, wait / rounds) and
6.4 / 10.2 MB (FedAsync); at 52d4911^ (updates held undecoded) 1,030 / 5,454 MB and
1,042 / 6,541 MB.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import msgpack
import paho.mqtt.client as paho
import yaml

from edge_fl.protocol import Status, Topics, encode_status
from edge_fl.transport.broker import EmbeddedBroker

EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))
MIB = 1 << 20
ATTACKER = "d00004"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


class Sampler(threading.Thread):
    """The peak RSS of a process, sampled every 20 ms until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.halt = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.peak = max(self.peak, rss_mb(self.pid))
            except (OSError, RuntimeError):
                return
            self.halt.wait(0.02)


def client(url: str, name: str) -> paho.Client:
    host, port = url.removeprefix("mqtt://").split(":")
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"{name}-{uuid.uuid4().hex[:6]}")
    c.max_inflight_messages_set(20)
    c.connect(host, int(port))
    c.loop_start()
    return c


def wait_for_message(url: str, topic: str, timeout: float) -> bytes:
    """The first non-empty message on ``topic`` (retained or live)."""
    got: list[bytes] = []
    ready = threading.Event()

    def on_message(_c, _u, msg) -> None:
        if msg.payload:
            got.append(bytes(msg.payload))
            ready.set()

    c = client(url, "watch")
    c.on_message = on_message
    c.subscribe(topic, qos=1)
    try:
        if not ready.wait(timeout):
            raise RuntimeError(f"nothing on {topic} within {timeout:.0f} s")
    finally:
        c.loop_stop()
        c.disconnect()
    return got[0]


class Metrics:
    """The aggregator's metrics records (JSON on ``<prefix>/<job>/metrics``), as they come."""

    def __init__(self, url: str, topics: Topics) -> None:
        import json

        self.records: list[dict] = []
        self.changed = threading.Condition()

        def on_message(_c, _u, msg) -> None:
            with self.changed:
                self.records.append(json.loads(msg.payload))
                self.changed.notify_all()

        self.client = client(url, "metrics")
        self.client.on_message = on_message
        self.client.subscribe(topics.metrics, qos=0)

    def wait(self, predicate, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self.records), timeout)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def oversized(records: list[dict]) -> int:
    return sum((r.get("rejected_by_reason") or {}).get("oversized", 0) for r in records)


def flood(url: str, topics: Topics, messages: int) -> float:
    """Publish ``messages`` updates of 1 MiB as d00004; seconds until the broker took them all."""
    c = client(url, ATTACKER)
    c.publish(
        topics.status(ATTACKER), encode_status(Status(ATTACKER, True, 30)), qos=1, retain=True
    ).wait_for_publish(30)
    t0 = time.perf_counter()
    pending = []
    for i in range(messages):
        payload = msgpack.packb(
            {
                "v": 1,
                "r": 0,
                "bv": 0,
                "n": 30,
                "nc": bytes(16),
                "k": "u",
                "dt": "f4",
                "m": "none",
                "x": os.urandom(MIB),
            },
            use_bin_type=True,
        )
        pending.append(c.publish(topics.update(ATTACKER), payload, qos=1))
        if len(pending) >= 20:
            pending.pop(0).wait_for_publish(60)
        if i % 256 == 255:
            print(f"  sent {i + 1} MiB", file=sys.stderr)
    for info in pending:
        info.wait_for_publish(60)
    elapsed = time.perf_counter() - t0
    c.loop_stop()
    c.disconnect()
    return elapsed


def settle(pid: int, quiet_s: float = 2.0, limit_s: float = 600.0) -> float:
    """Seconds until the process's CPU time stopped growing for ``quiet_s``."""
    t0 = time.perf_counter()
    last, since = cpu_ticks(pid), time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        time.sleep(0.2)
        now = cpu_ticks(pid)
        if now != last:
            last, since = now, time.perf_counter()
        elif time.perf_counter() - since >= quiet_s:
            break
    return time.perf_counter() - t0


def start_fleet(config: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """The 4 honest devices d00000-d00003 (``edge-fl fleet``)."""
    return subprocess.Popen(
        [EDGE_FL, "fleet", "--config", str(config), "--indices", "0:4"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def one(mode: str, phase: str, messages: int, workdir: Path) -> dict:
    broker = EmbeddedBroker(kind="mosquitto").start()
    procs: list[subprocess.Popen] = []
    try:
        job = f"flood-{mode}-{phase}-{uuid.uuid4().hex[:6]}"
        topics = Topics(job)
        cfg = {
            "job": job,
            "broker": {"url": broker.url},
            "data": {"devices": 5},
            "rounds": {
                "mode": mode,
                "rounds": 100000,  # never over during the flood
                "wait_for_devices_s": 3600.0 if phase == "wait" else 60.0,
                "buffer_size": 2,
                "deadline_s": 30.0,
            },
        }
        path = workdir / f"{job}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = dict(os.environ)
        out = workdir / job
        log = (workdir / f"{job}.aggregator.log").open("w")
        agg = subprocess.Popen(
            [EDGE_FL, "aggregator", "--config", str(path), "--out", str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        procs.append(agg)
        wait_for_message(broker.url, topics.job_document, 180)  # connected and announced
        metrics = Metrics(broker.url, topics)
        if phase == "rounds":
            procs.append(start_fleet(path, workdir / f"{job}.fleet.log", env))
            if not metrics.wait(lambda r: len(r) >= 3, 300):  # rounds are running
                raise RuntimeError("the fleet's rounds did not start")
        else:
            settle(agg.pid)  # waiting for devices: idle
        before = rss_mb(agg.pid)
        start = len(metrics.records)
        sampler = Sampler(agg.pid)
        sampler.start()
        sent_s = flood(broker.url, topics, messages)
        t0 = time.perf_counter()
        if phase == "rounds":  # every flood message refused (oversized) and counted in a record
            metrics.wait(lambda r: oversized(r[start:]) >= messages, 600)
        else:
            settle(agg.pid)
        drained_s = time.perf_counter() - t0
        after = rss_mb(agg.pid)
        sampler.halt.set()
        sampler.join()
        if phase == "wait":  # the flood's refusals are in round 1's record: start the devices
            procs.append(start_fleet(path, workdir / f"{job}.fleet.log", env))
            metrics.wait(lambda r: len(r) > start, 300)
        counted = oversized(metrics.records[start:])
        metrics.close()
        alive = agg.poll() is None
        return {
            "mode": mode,
            "phase": phase,
            "sent_mib": messages,
            "rss_before_mb": round(before, 1),
            "rss_peak_mb": round(sampler.peak, 1),
            "rss_after_mb": round(after, 1),
            "growth_mb": round(sampler.peak - before, 1),
            "send_s": round(sent_s, 1),
            "drain_s": round(drained_s, 1),
            "aggregator_alive": alive,
            "oversized_counted": counted,
        }
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        broker.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=1024, help="messages of 1 MiB (default 1 GiB)")
    ap.add_argument("--modes", nargs="+", default=["fedbuff", "fedasync"])
    ap.add_argument("--phase", choices=["wait", "rounds", "both"], default="both")
    args = ap.parse_args()
    phases = ["wait", "rounds"] if args.phase == "both" else [args.phase]
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgefl-flood-") as tmp:
        for mode in args.modes:
            for phase in phases:
                print(f"{mode} / {phase}: flooding {args.mb} MiB", file=sys.stderr)
                row = one(mode, phase, args.mb, Path(tmp))
                print(f"  {row}", file=sys.stderr, flush=True)
                rows.append(row)
    print(
        f"`tools/bench_flood.py --mb {args.mb}` (one device, {args.mb} x 1 MiB at QoS 1, "
        "private Mosquitto, `edge-fl aggregator --out`, digits MLP; RSS = VmRSS):\n"
    )
    print("| mode | phase | RSS before (MB) | peak (MB) | after (MB) | growth (MB) | refused "
          "(oversized) | send s | drain s | alive |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['phase']} | {r['rss_before_mb']} | {r['rss_peak_mb']} | "
            f"{r['rss_after_mb']} | {r['growth_mb']} | {r['oversized_counted']} | {r['send_s']} | "
            f"{r['drain_s']} | "
            f"{r['aggregator_alive']} |"
        )


if __name__ == "__main__":
    main()
