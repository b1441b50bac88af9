"""Aggregator ingest while 1,000 devices upload AT ONCE over their own connections.

A separate process holds N device connections (aiomqtt, one per device) and, on a signal, has
every device publish its update (QoS 1) concurrently. The subscriber under test is either a raw
paho subscriber (baseline: receive and count, paho acknowledges) or the edge-fl aggregator service
itself (``AggregatorService.run()``: its ingest tap, decode + validate + admit + accumulate in
AggregatorCore, manual acknowledgements; no journal) on a round that closes with the N-th update.
Both face the same burst from the same uploaders on the same private Mosquitto, alternately, in one
run; the rate is updates received per second from the first to the last.

    .venv/bin/python tools/bench_ingest_live.py --uploaders 1000 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import threading
import time

import aiomqtt
import paho.mqtt.client as paho
from bench_ingest import TOPICS, Stamped, make_core, make_payloads

from edge_fl.models import make_model
from edge_fl.server.service import AggregatorService
from edge_fl.transport.broker import EmbeddedBroker
from edge_fl.transport.limits import ensure_open_files


def uploader_process(host, port, payloads, ready, go, done) -> None:
    async def run() -> None:
        ensure_open_files(len(payloads) + 10)
        clients = []
        gate = asyncio.Semaphore(64)

        async def connect(dev):
            async with gate:
                c = aiomqtt.Client(host, port, identifier=f"up-{dev}")
                await c.__aenter__()
                clients.append((dev, c))

        await asyncio.gather(*(connect(dev) for dev, _ in payloads))
        by_dev = dict(payloads)
        for _rep in range(100):
            ready.set()
            while not go.is_set():
                if done.is_set():
                    return
                await asyncio.sleep(0.01)
            go.clear()
            await asyncio.gather(
                *(c.publish(TOPICS.update(dev), by_dev[dev], qos=1) for dev, c in clients)
            )

    asyncio.run(run())


def paho_burst(spec, n, go) -> float:
    got = threading.Event()
    count, t0 = [0], [0.0]

    def on_message(_c, _u, msg):
        if count[0] == 0:
            t0[0] = time.perf_counter()
        count[0] += 1
        if count[0] == n:
            got.set()

    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="raw-paho")
    c.on_message = on_message
    c.max_inflight_messages_set(100)
    c.connect(spec.host, spec.port)
    c.subscribe(TOPICS.all_updates, qos=1)
    c.loop_start()
    time.sleep(0.3)
    go.set()
    assert got.wait(120), f"paho got {count[0]} of {n}"
    rate = (n - 1) / (time.perf_counter() - t0[0])
    c.disconnect()
    c.loop_stop()
    return rate


async def service_burst(spec, n, n_params, go, rep: int) -> float:
    """The aggregator service on a round that needs every uploader's update."""
    core = make_core(n, n_params)
    stamp = Stamped(core)
    service = AggregatorService(
        core, spec, TOPICS, expected_devices=n, client_id=f"edge-fl-agg-{rep}"
    )
    run = asyncio.create_task(service.run())
    await service.connected.wait()
    await asyncio.sleep(0.3)
    go.set()
    await asyncio.wait_for(run, 120)
    assert stamp.count == n, f"{stamp.count} of {n} accepted"
    return stamp.rate()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--uploaders", type=int, default=1000)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = make_model(args.model, 64, 10)
    payloads = make_payloads(args.uploaders, model.n_params)
    rates: dict[str, list[float]] = {"paho raw": [], "edge-fl service": []}
    ctx = mp.get_context("spawn")
    with EmbeddedBroker(kind="mosquitto") as broker:
        spec = broker.spec
        ready, go, done = ctx.Event(), ctx.Event(), ctx.Event()
        proc = ctx.Process(
            target=uploader_process, args=(spec.host, spec.port, payloads, ready, go, done)
        )
        proc.start()
        try:
            for rep in range(args.repeats):
                for name in rates:
                    assert ready.wait(120), "uploaders did not connect"
                    ready.clear()
                    if name == "paho raw":
                        rates[name].append(paho_burst(spec, args.uploaders, go))
                    else:
                        rate = asyncio.run(
                            service_burst(spec, args.uploaders, model.n_params, go, rep)
                        )
                        rates[name].append(rate)
        finally:
            done.set()
            proc.join(30)
    base = statistics.median(rates["paho raw"])
    size = len(payloads[0][1])
    print(
        f"{args.uploaders} concurrent uploaders, 1 update each, {size} bytes ({args.model}), QoS 1"
    )
    print(f"{'subscriber':<22}{'median upd/s':>14}{'vs paho':>9}   runs")
    for name, values in rates.items():
        med = statistics.median(values)
        runs = " ".join(f"{v:,.0f}" for v in values)
        print(f"{name:<22}{med:>14,.0f}{med / base:>9.2f}   {runs}")
    ratios = [s / p for s, p in zip(rates["edge-fl service"], rates["paho raw"], strict=True)]
    print(
        "edge-fl service / paho raw per repeat: "
        + " ".join(f"{r:.2f}" for r in ratios)
        + f" (median {statistics.median(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
