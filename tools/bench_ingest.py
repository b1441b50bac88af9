"""Aggregator ingest rate against a raw paho subscriber, same broker, same payloads, one run.

Every subscriber drains the SAME pre-queued QoS 1 updates from the same private Mosquitto, in
turn, repeated ``--repeats`` times (interleaved, so a noisy shared machine hits all alike):
  1. paho raw: paho-mqtt's threaded loop, counts bytes, paho acknowledges   -- the baseline
  2. aiomqtt raw: ``async for`` over aiomqtt's messages, counts bytes        -- for reference
  3. edge-fl service: ``AggregatorService.run()`` itself (the ``edge-fl aggregator`` path):
     its ingest tap, decode + validate + admit + accumulate in ``AggregatorCore``, manual
     acknowledgements after each group of messages; no journal
  4. edge-fl service + journal: the same with ``--out`` (every accepted update journaled and
     fsynced before it is acknowledged), on the disk that holds ``--journal-dir``

Updates are queued first (persistent session; Mosquitto with unlimited queue length), then the
subscriber connects and drains: no publisher competes for the CPU. A rate is messages from the
first to the last received, per second.

    .venv/bin/python tools/bench_ingest.py --updates 2000 --model mlp
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
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
#: every round the benchmark opens carries this nonce, so payloads can be made in advance
NONCE = bytes(range(16))


def make_payloads(n: int, n_params: int) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        delta = rng.standard_normal(n_params).astype(np.float32) * 0.01
        dev = f"d{i:05d}"
        out.append((dev, encode_update(DenseUpdate(dev, 1, 0, 30, delta, nonce=NONCE))))
    return out


def queue_updates(spec, client_id: str, payloads: list[tuple[str, bytes]]) -> None:
    """Create the subscriber's persistent session, then publish everything into its queue."""
    sub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
    sub.connect(spec.host, spec.port)
    sub.loop_start()
    sub.subscribe(TOPICS.all_updates, qos=1)
    sub.subscribe(TOPICS.all_status, qos=1)
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


async def drain_aiomqtt(spec, client_id: str, n: int) -> float:
    async with aiomqtt.Client(
        spec.host, spec.port, identifier=client_id, clean_session=False, max_inflight_messages=100
    ) as c:
        count = 0
        t0 = 0.0
        async for _msg in c.messages:
            if count == 0:
                t0 = time.perf_counter()
            count += 1
            if count == n:
                return (n - 1) / (time.perf_counter() - t0)
    raise RuntimeError("connection closed")


def make_core(n: int, n_params: int) -> AggregatorCore:
    """One open round selecting ``n`` announced devices, whose target is all ``n`` updates."""
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
    assert core.current is not None
    core.current.nonce = NONCE
    return core


class Stamped:
    """Wraps ``core.on_update``: times the first and the last update, checks each is accepted."""

    def __init__(self, core: AggregatorCore) -> None:
        self.core, self.inner = core, core.on_update
        self.count, self.first, self.last = 0, 0.0, 0.0
        core.on_update = self  # type: ignore[method-assign]

    def __call__(self, device: str, payload: bytes, **kw) -> object:
        now = time.perf_counter()
        if self.count == 0:
            self.first = now
        reason = self.inner(device, payload, **kw)
        assert reason is None, reason
        self.count += 1
        self.last = time.perf_counter()
        return reason

    def rate(self) -> float:
        return (self.count - 1) / (self.last - self.first)


def drain_service(spec, client_id: str, n: int, n_params: int, journal_dir: str | None) -> float:
    """``AggregatorService.run()`` on a round that needs all ``n`` queued updates to close."""
    from edge_fl.server.journal import Journal
    from edge_fl.server.service import AggregatorService

    core = make_core(n, n_params)
    stamp = Stamped(core)
    with tempfile.TemporaryDirectory(dir=journal_dir) as out:
        journal = Journal.start(out, job="bench", digest="bench") if journal_dir else None
        service = AggregatorService(
            core,
            spec,
            TOPICS,
            expected_devices=n,
            client_id=client_id,
            checkpoint_dir=out if journal else None,
            journal=journal,
        )
        asyncio.run(service.run())
        if journal is not None:
            journal.close()
    assert stamp.count == n, f"{stamp.count} of {n} accepted"
    assert service.tap is not None and service.tap.diverted >= n
    return stamp.rate()


SUBSCRIBERS = ("paho raw", "aiomqtt raw", "edge-fl service", "edge-fl service+journal")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=2000)
    ap.add_argument("--model", default="mlp", help="mlp (4810 params) or logreg (650)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--journal-dir", default=None, help="where the journal goes (default: /tmp)")
    args = ap.parse_args()
    model = make_model(args.model, 64, 10)
    payloads = make_payloads(args.updates, model.n_params)
    size = len(payloads[0][1])
    journal_dir = args.journal_dir or tempfile.gettempdir()
    rates: dict[str, list[float]] = {name: [] for name in SUBSCRIBERS}
    with EmbeddedBroker(kind="mosquitto") as broker:
        spec = broker.spec
        for rep in range(args.repeats):
            for k, name in enumerate(SUBSCRIBERS):
                cid = f"bench-{k}-{rep}"
                queue_updates(spec, cid, payloads)
                if name == "paho raw":
                    rate = drain_paho(spec, cid, args.updates)
                elif name == "aiomqtt raw":
                    rate = asyncio.run(drain_aiomqtt(spec, cid, args.updates))
                else:
                    jdir = journal_dir if name.endswith("journal") else None
                    rate = drain_service(spec, cid, args.updates, model.n_params, jdir)
                rates[name].append(rate)
    base = statistics.median(rates["paho raw"])
    print(
        f"{args.updates} updates x {size} bytes ({args.model}, {model.n_params} params), QoS 1, "
        f"queued in a persistent session on one private Mosquitto; journal in {journal_dir}"
    )
    print(f"{'subscriber':<25}{'median upd/s':>14}{'MB/s':>8}{'vs paho':>9}   runs")
    for name, values in rates.items():
        med = statistics.median(values)
        runs = " ".join(f"{v:,.0f}" for v in values)
        print(f"{name:<25}{med:>14,.0f}{med * size / 1e6:>8.1f}{med / base:>9.2f}   {runs}")
    ratios = [s / p for s, p in zip(rates["edge-fl service"], rates["paho raw"], strict=True)]
    print(
        "edge-fl service / paho raw per repeat: "
        + " ".join(f"{r:.2f}" for r in ratios)
        + f" (median {statistics.median(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
