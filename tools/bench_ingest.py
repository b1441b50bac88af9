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

``--workers N`` measures instead how ingest scales over processes sharing the update stream
through an MQTT shared subscription (``$share/ingest/<prefix>/<job>/up/+``; Mosquitto deals the
queued updates round robin): 1 worker process and N worker processes, alternately, each worker
the service's :class:`IngestTap` feeding its own ``AggregatorCore`` (its partial sum), acks after
each socket burst, no journal. The rate is all updates over the span from the first worker's first
to the last worker's last. (Merging the partial sums at round close is not part of it.)

    .venv/bin/python tools/bench_ingest.py --updates 4000 --model mlp --workers 2

``--workers N --no-broker`` measures the workers' processing alone: 1 and N processes, each
running ``IngestWorker.on_update`` over its own payloads in memory (what the broker and the
sockets cost is then out of the picture).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
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


def share_topic(group: str = "ingest") -> str:
    return f"$share/{group}/{TOPICS.all_updates}"


def queue_shared(
    spec, client_ids: list[str], payloads: list[tuple[str, bytes]], group: str
) -> None:
    """Each worker's persistent session joins the shared subscription (a group of its own: the
    sessions of earlier drains stay members of theirs), then every update is published: Mosquitto
    deals them out to the (offline) members' queues round robin."""
    for cid in client_ids:
        sub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=cid, clean_session=False)
        sub.connect(spec.host, spec.port)
        sub.loop_start()
        sub.subscribe(share_topic(group), qos=1)
        time.sleep(0.2)
        sub.disconnect()
        sub.loop_stop()
    pub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"{client_ids[0]}-pub")
    pub.max_inflight_messages_set(100)
    pub.connect(spec.host, spec.port)
    pub.loop_start()
    infos = [pub.publish(TOPICS.update(dev), p, qos=1) for dev, p in payloads]
    for info in infos:
        info.wait_for_publish(30)
    pub.disconnect()
    pub.loop_stop()


def ingest_worker(
    host: str, port: int, cid: str, group: str, n: int, n_params: int, ready, go, out
) -> None:
    """One ingest worker process: ``edge-fl ingest``'s :class:`IngestService` (the IngestTap on
    its socket, :class:`IngestWorker` folding into its own core, acknowledgements and a progress
    message to the coordinator after each burst) on a round opened in advance. Its session is
    persistent here (the real worker's is clean) so the updates can be queued before it starts.
    Stops after 0.5 s without a new update; reports (count, first, last) on ``out``."""
    from edge_fl.server.ingest import IngestService
    from edge_fl.server.sharding import IngestWorker
    from edge_fl.transport.url import parse_broker_url

    async def run() -> None:
        core = make_core(n, n_params)
        worker = IngestWorker(cid.rsplit("-", 1)[-1], core)
        stamp = Stamped(core)
        spec = parse_broker_url(f"mqtt://{host}:{port}")
        service = IngestService(
            worker, spec, TOPICS, group=group, clean_session=False, client_id=cid
        )
        ready.set()
        while not go.is_set():
            await asyncio.sleep(0.001)
        task = asyncio.ensure_future(service.run())
        before = -1
        while stamp.count == 0 or stamp.count != before:
            before = stamp.count
            await asyncio.sleep(0.5)
        service.ended.set()
        await task
        out.put((stamp.count, stamp.first, stamp.last))

    asyncio.run(run())


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), in seconds."""
    import os

    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drain_workers(spec, tag: str, workers: int, payloads, n_params: int, broker_pid: int = 0):
    """(rate, the broker's busy share of one core during the drain)."""
    ctx = mp.get_context("spawn")
    cids = [f"{tag}-w{k}" for k in range(workers)]
    queue_shared(spec, cids, payloads, group=tag)
    go, out = ctx.Event(), ctx.Queue()
    readies = [ctx.Event() for _ in cids]
    procs = [
        ctx.Process(
            target=ingest_worker,
            args=(spec.host, spec.port, cid, tag, len(payloads), n_params, ready, go, out),
        )
        for cid, ready in zip(cids, readies, strict=True)
    ]
    for proc in procs:
        proc.start()
    for ready in readies:
        assert ready.wait(60), "a worker did not start"
    cpu0 = cpu_seconds(broker_pid) if broker_pid else 0.0
    go.set()
    results = [out.get(timeout=120) for _ in procs]
    broker_cpu = cpu_seconds(broker_pid) - cpu0 if broker_pid else 0.0
    for proc in procs:
        proc.join(10)
    total = sum(r[0] for r in results)
    assert total == len(payloads), f"{total} of {len(payloads)} updates accepted"
    first, last = min(r[1] for r in results), max(r[2] for r in results)
    # the drain's last 0.5 s are the workers noticing the end: the broker is idle then
    return (total - 1) / (last - first), broker_cpu / (last - first)


def offline_worker(n: int, n_params: int, model: str, go, out) -> None:
    """The worker's processing alone, no MQTT: ``IngestWorker.on_update`` over ``n`` payloads
    made in this process (progress after every 50, as after a socket burst)."""
    from edge_fl.server.sharding import IngestWorker, Recording

    payloads = make_payloads(n, n_params)
    core = make_core(n, n_params)
    worker = IngestWorker("w", core)
    core.strategy = Recording(core.strategy)  # as a mirrored round's
    go.wait()
    t0 = time.perf_counter()
    for i, (device, data) in enumerate(payloads):
        assert worker.on_update(device, data) is None
        if i % 50 == 49:
            worker.progress()
    out.put((n, t0, time.perf_counter()))


def offline_rate(k: int, n: int, n_params: int, model: str) -> float:
    """Updates per second of ``k`` worker processes, each with its own ``n`` payloads."""
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=offline_worker, args=(n, n_params, model, go, out)) for _ in range(k)
    ]
    for proc in procs:
        proc.start()
    time.sleep(3.0)  # imports and payloads made before the clock starts
    go.set()
    results = [out.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(10)
    first, last = min(r[1] for r in results), max(r[2] for r in results)
    return sum(r[0] for r in results) / (last - first)


def offline_main(args, n_params: int) -> None:
    rates: dict[int, list[float]] = {1: [], args.workers: []}
    for _ in range(args.repeats):
        for k in rates:
            rates[k].append(offline_rate(k, args.updates, n_params, args.model))
    one = statistics.median(rates[1])
    print(f"worker processing without MQTT ({args.model}, {args.updates} updates per process)")
    for k, values in rates.items():
        med = statistics.median(values)
        runs = " ".join(f"{v:,.0f}" for v in values)
        print(f"{k} process(es): {med:,.0f} updates/s ({med / one:.2f}x one)   {runs}")


def workers_main(args, payloads, n_params: int) -> None:
    size = len(payloads[0][1])
    names = ("paho raw", "1 worker", f"{args.workers} workers")
    rates: dict[str, list[float]] = {name: [] for name in names}
    busy: dict[str, list[float]] = {name: [] for name in names[1:]}
    with EmbeddedBroker(kind="mosquitto") as broker:
        spec, pid = broker.spec, broker.pid or 0
        for rep in range(args.repeats):
            cid = f"bench-paho-{rep}"
            queue_updates(spec, cid, payloads)
            rates["paho raw"].append(drain_paho(spec, cid, len(payloads)))
            for name, tag, k in ((names[1], "one", 1), (names[2], "many", args.workers)):
                rate, load = drain_workers(spec, f"{tag}{rep}", k, payloads, n_params, pid)
                rates[name].append(rate)
                busy[name].append(load)
    base = statistics.median(rates["1 worker"])
    print(
        f"{len(payloads)} updates x {size} bytes ({args.model}), QoS 1, queued for the members of "
        f"{share_topic('<group>')} (a group per drain) on one private Mosquitto"
    )
    print(f"{'ingest':<18}{'median upd/s':>14}{'vs 1 worker':>13}   runs")
    for name, values in rates.items():
        med = statistics.median(values)
        runs = " ".join(f"{v:,.0f}" for v in values)
        print(f"{name:<18}{med:>14,.0f}{med / base:>13.2f}   {runs}")
    for name, loads in busy.items():
        print(f"Mosquitto busy during '{name}': " + " ".join(f"{x:.0%}" for x in loads)
              + " of one core")  # fmt: skip
    many = rates[f"{args.workers} workers"]
    ratios = [m / o for m, o in zip(many, rates["1 worker"], strict=True)]
    print(
        f"{args.workers} workers / 1 worker per repeat: "
        + " ".join(f"{r:.2f}" for r in ratios)
        + f" (median {statistics.median(ratios):.2f})"
    )


SUBSCRIBERS = ("paho raw", "aiomqtt raw", "edge-fl service", "edge-fl service+journal")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=2000)
    ap.add_argument(
        "--model", default="mlp", help="mlp (4,810 params), logreg (650), lenet (61,706; torch)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--journal-dir", default=None, help="where the journal goes (default: /tmp)")
    ap.add_argument("--workers", type=int, default=0, help="compare 1 and N ingest workers")
    ap.add_argument(
        "--no-broker",
        action="store_true",
        help="with --workers: the workers' processing alone (no MQTT), 1 vs N processes",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="Mosquitto on CPU 0, every subscriber on CPU 1 (single-ingest comparison only): "
        "each drain gets one core of its own, as on a quiet machine",
    )
    args = ap.parse_args()
    # digits' 64 features for logreg/MLP; 28x28 images for LeNet (FEMNIST's size)
    model = make_model(args.model, 784 if args.model in ("lenet", "cnn") else 64, 10)
    payloads = make_payloads(args.updates, model.n_params)
    if args.workers and args.no_broker:
        offline_main(args, model.n_params)
        return
    if args.workers:
        workers_main(args, payloads, model.n_params)
        return
    size = len(payloads[0][1])
    journal_dir = args.journal_dir or tempfile.gettempdir()
    rates: dict[str, list[float]] = {name: [] for name in SUBSCRIBERS}
    with EmbeddedBroker(kind="mosquitto") as broker:
        spec = broker.spec
        if args.pin:
            import os

            os.sched_setaffinity(broker.pid, {0})
            os.sched_setaffinity(0, {1})
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
