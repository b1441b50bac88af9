"""Aggregator ingest rate (decode + validate + admit + accumulate) against raw MQTT subscribers.

All three subscribers drain the SAME pre-queued updates from the same private Mosquitto in the same
run, so the ratios are fair on a shared, noisy machine:
  1. paho-mqtt, raw (counts bytes only)        -- the baseline
  2. aiomqtt, raw (counts bytes only)          -- the client library the aggregator uses
  3. the edge-fl aggregator: aiomqtt + AggregatorCore.on_update for every message

Updates are queued first (persistent session, QoS 1; Mosquitto configured with unlimited queue
length), then the subscriber reconnects and drains: no publisher competes for the two cores.

    .venv/bin/python tools/bench_ingest.py --updates 2000 --model mlp
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import aiomqtt
import numpy as np
import paho.mqtt.client as paho

from edge_fl.models import make_model
from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import DenseUpdate, Status, Topics, UpdateLimits, encode_status, encode_update
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings
from edge_fl.transport.broker import EmbeddedBroker

TOPICS = Topics("bench")


def make_payloads(n: int, n_params: int) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        delta = rng.standard_normal(n_params).astype(np.float32) * 0.01
        dev = f"d{i:05d}"
        out.append((dev, encode_update(DenseUpdate(dev, 1, 0, 30, delta))))
    return out


def queue_updates(spec, client_id: str, payloads: list[tuple[str, bytes]]) -> None:
    """Create the subscriber's persistent session, then publish everything into its queue."""
    sub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
    sub.connect(spec.host, spec.port)
    sub.loop_start()
    sub.subscribe(TOPICS.all_updates, qos=1)
    time.sleep(0.2)
    sub.disconnect()
    sub.loop_stop()
    pub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"{client_id}-pub")
    pub.max_inflight_messages_set(100)
    pub.connect(spec.host, spec.port)
    pub.loop_start()
    infos = [pub.publish(TOPICS.update(dev), p, qos=1) for dev, p in payloads]
    for info in infos:
        info.wait_for_publish(30)
    pub.disconnect()
    pub.loop_stop()


def drain_paho(spec, client_id: str, n: int) -> float:
    done = threading.Event()
    count = [0, 0]
    t0 = [0.0]

    def on_message(_c, _u, msg):
        if count[0] == 0:
            t0[0] = time.perf_counter()
        count[0] += 1
        count[1] += len(msg.payload)
        if count[0] == n:
            done.set()

    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
    c.on_message = on_message
    c.max_inflight_messages_set(100)
    c.connect(spec.host, spec.port)
    c.loop_start()
    assert done.wait(120), f"paho received {count[0]} of {n}"
    elapsed = time.perf_counter() - t0[0]
    c.disconnect()
    c.loop_stop()
    return (n - 1) / elapsed


async def drain_aiomqtt(spec, client_id: str, n: int, handle) -> float:
    async with aiomqtt.Client(
        spec.host, spec.port, identifier=client_id, clean_session=False, max_inflight_messages=100
    ) as c:
        count = 0
        t0 = 0.0
        async for msg in c.messages:
            if count == 0:
                t0 = time.perf_counter()
            handle(msg)
            count += 1
            if count == n:
                return (n - 1) / (time.perf_counter() - t0)
    raise RuntimeError("connection closed")


def make_core(n: int, n_params: int) -> AggregatorCore:
    core = AggregatorCore(
        AggregatorSettings(job="bench", rounds=1, target=n, min_updates=n, deadline_s=1e9),
        np.zeros(n_params, np.float32),
        UpdateLimits(n_params),
        seeded_generator(0),
    )
    for i in range(n):
        dev = f"d{i:05d}"
        core.on_status(dev, encode_status(Status(dev, True, 30)))
    core.open_round(0.0)
    return core


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=2000)
    ap.add_argument("--model", default="mlp", help="mlp (4810 params) or logreg (650)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = make_model(args.model, 64, 10)
    payloads = make_payloads(args.updates, model.n_params)
    size = len(payloads[0][1])
    rates: dict[str, list[float]] = {"paho raw": [], "aiomqtt raw": [], "edge-fl aggregator": []}
    with EmbeddedBroker(kind="mosquitto") as broker:
        spec = broker.spec
        for rep in range(args.repeats):
            for name in rates:
                cid = f"bench-{name.split()[0]}-{rep}"
                queue_updates(spec, cid, payloads)
                if name == "paho raw":
                    rate = drain_paho(spec, cid, args.updates)
                elif name == "aiomqtt raw":
                    rate = asyncio.run(drain_aiomqtt(spec, cid, args.updates, lambda m: None))
                else:
                    core = make_core(args.updates, model.n_params)
                    topics = TOPICS

                    def handle(m, core=core, topics=topics):
                        reason = core.on_update(topics.device_of(str(m.topic), "up"), m.payload)
                        assert reason is None, reason

                    rate = asyncio.run(drain_aiomqtt(spec, cid, args.updates, handle))
                    assert core.current is not None and len(core.current.accepted) == args.updates
                rates[name].append(rate)
    base = statistics.median(rates["paho raw"])
    print(f"updates: {args.updates} x {size} bytes ({args.model}, {model.n_params} params), QoS 1")
    print(f"{'subscriber':<22}{'median upd/s':>14}{'MB/s':>8}{'vs paho':>9}   runs")
    for name, values in rates.items():
        med = statistics.median(values)
        runs = " ".join(f"{v:,.0f}" for v in values)
        print(f"{name:<22}{med:>14,.0f}{med * size / 1e6:>8.1f}{med / base:>9.2f}   {runs}")


if __name__ == "__main__":
    main()
