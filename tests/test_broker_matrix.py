"""The broker matrix: what edge-fl relies on, checked against each real MQTT engine.

Mosquitto (the session fixture), a 3-node NATS cluster with JetStream and its MQTT listener, and a
RabbitMQ node with the MQTT plugin, all started by the tests on free loopback ports (tests/engines.py).
Each scenario runs on every engine; where an engine lacks a feature the test pins down what the
engine does instead (docs/brokers.md summarises it). The NATS node-kill failover test is at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiomqtt
import paho.mqtt.client as paho
import pytest
from engines import NatsCluster, RabbitNode

from edge_fl.config import load_config
from edge_fl.device.runtime import run_device
from edge_fl.job import build_job
from edge_fl.server.service import AggregatorService
from edge_fl.simulation import simulate
from edge_fl.transport import client_adapter
from edge_fl.transport.broker import EmbeddedBroker, find_mosquitto, free_port
from edge_fl.transport.url import parse_broker_url

pytestmark = pytest.mark.broker

ENGINES = ("mosquitto", "nats", "rabbitmq")
# NATS redelivers an unacknowledged QoS 1 message after mqtt.ack_wait (default 30 s; measured 29 s
# after the reconnect), not when the persistent session reconnects: the tests' cluster uses 2 s.
NATS_ACK_WAIT = "2s"


# ----------------------------------------------------------------------------- engines
@dataclass
class Engine:
    """One engine under test: a URL, and a restart that keeps the engine's state."""

    name: str
    url: str
    restart: Callable[[], float]
    notes: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="session")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    try:
        cluster = NatsCluster(tmp_path_factory.mktemp("nats"), ack_wait=NATS_ACK_WAIT)
    except FileNotFoundError:
        pytest.skip("no nats-server binary (apt-get install nats-server) for the NATS matrix")
    try:
        cluster.start()
        print(
            f"\nnats: 3-node cluster up (meta leader, MQTT on every node) in {cluster.start_s:.2f} s"
        )
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def rabbitmq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitNode]:
    try:
        node = RabbitNode(tmp_path_factory.mktemp("rabbitmq"))
    except FileNotFoundError:
        pytest.skip("no rabbitmq-server (apt-get install rabbitmq-server) for the RabbitMQ matrix")
    try:
        node.start()
        print(f"\nrabbitmq: node with the MQTT plugin up in {node.start_s:.2f} s")
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def persistent_mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list]:
    """A Mosquitto with persistence on (the embedded one has it off: simulations are
    throw-away), restartable on its port; a list so a restart can swap the process."""
    if find_mosquitto() is None:
        pytest.skip("no mosquitto binary (apt-get install mosquitto)")
    store = tmp_path_factory.mktemp("mosquitto-db")
    port = free_port()
    extra = ["persistence true", f"persistence_location {store}/", "autosave_interval 0"]
    t0 = time.perf_counter()
    brokers = [EmbeddedBroker(kind="mosquitto", port=port, extra_config=extra).start()]
    print(f"\nmosquitto: up in {time.perf_counter() - t0:.3f} s")
    brokers.append(extra)
    try:
        yield brokers
    finally:
        brokers[0].stop()


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Engine:
    if request.param == "mosquitto":
        holder = request.getfixturevalue("persistent_mosquitto")

        def restart() -> float:
            t0 = time.perf_counter()
            port = holder[0].port
            holder[0].stop()  # SIGTERM: Mosquitto writes its database on the way out
            holder[0] = EmbeddedBroker(kind="mosquitto", port=port, extra_config=holder[1])
            holder[0].start()
            return time.perf_counter() - t0

        return Engine("mosquitto", holder[0].url, restart)
    if request.param == "nats":
        cluster = request.getfixturevalue("nats_cluster")
        return Engine("nats", cluster.url, cluster.restart)
    node = request.getfixturevalue("rabbitmq")
    return Engine("rabbitmq", node.url, node.restart)


def wait_until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def client(url: str, identifier: str, **options) -> aiomqtt.Client:
    """An aiomqtt client as the runtimes build one (MQTT 3.1.1: aiomqtt's default)."""
    return aiomqtt.Client(
        **parse_broker_url(url).aiomqtt_kwargs(), identifier=identifier, **options
    )


async def collect(c: aiomqtt.Client, n: int, timeout: float) -> list[aiomqtt.Message]:
    """Up to n messages, or what arrived before the timeout."""
    got: list[aiomqtt.Message] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            async for message in c.messages:
                got.append(message)
                if len(got) >= n:
                    break
    return got


# ------------------------------------------------------------------------ the scenarios
def test_end_to_end_job(engine: Engine, tmp_path: Path) -> None:
    """A whole job (aggregator service + fleet, each device its own MQTT session with a will)
    over the engine as an external broker: every round closes with every selected update."""
    cfg = load_config(
        None,
        {
            "job": uid("mx"),
            "broker.url": engine.url,
            "data.devices": 8,
            "rounds.rounds": 3,
            "rounds.clients_per_round": 8,
            "rounds.deadline_s": 10.0,
            "data.dataset": "digits",
            "model.name": "mlp",
        },
    )
    t0 = time.perf_counter()
    summary = simulate(cfg, tmp_path)
    print(f"{engine.name}: 3-round job in {time.perf_counter() - t0:.2f} s")
    assert summary["rounds_closed"] == 3
    assert summary["total_received"] == 3 * 8


async def retained_on(url: str, topic: str, want: bytes, timeout: float = 10.0) -> float | None:
    """Seconds until a fresh subscriber gets `want` as the retained message of `topic` (b"" = no
    retained message), polling with new sessions: NATS spreads retained messages to the other
    nodes asynchronously, so a subscriber on another node may briefly see the old state."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        async with client(url, uid("late")) as late:
            await late.subscribe(topic, qos=1)
            got = [m.payload for m in await collect(late, 1, 0.5) if m.retain and m.payload]
        if got == ([want] if want else []):
            return time.perf_counter() - t0
    return None


def test_retained_global_model_reaches_a_late_subscriber(engine: Engine) -> None:
    """The global model is published retained; a device that connects later gets it at once,
    and the empty retained publish the aggregator uses to forget an old run clears it."""
    topic = f"edgefl/{uid('ret')}/global"
    model = bytes(range(256)) * 40

    async def scenario() -> tuple[float | None, float | None]:
        async with client(engine.url, uid("agg")) as agg:
            await agg.publish(topic, model, qos=1, retain=True)
        seen = await retained_on(engine.url, topic, model)
        async with client(engine.url, uid("agg")) as agg:
            await agg.publish(topic, b"", qos=1, retain=True)
        cleared = await retained_on(engine.url, topic, b"")
        return seen, cleared

    seen, cleared = asyncio.run(scenario())
    print(f"{engine.name}: retained seen after {seen} s, cleared after {cleared} s")
    assert seen is not None and cleared is not None


def test_retained_statuses_through_a_wildcard(engine: Engine) -> None:
    """An aggregator that starts (or resumes) after its devices learns who is online from their
    retained statuses through `status/+`. RabbitMQ 3.10 sends no retained message for a topic
    filter with a wildcard (documented limitation): it sees none."""
    base = f"edgefl/{uid('st')}/status"

    async def scenario() -> list[bytes]:
        async with client(engine.url, uid("dev")) as dev:
            for i in range(3):
                await dev.publish(f"{base}/d{i}", b"online", qos=1, retain=True)
        for i in range(3):  # NATS spreads retained messages to the other nodes asynchronously
            assert await retained_on(engine.url, f"{base}/d{i}", b"online") is not None
        async with client(engine.url, uid("agg")) as agg:
            await agg.subscribe(f"{base}/+", qos=1)
            return [m.payload for m in await collect(agg, 3, 1.5) if m.retain]

    got = asyncio.run(scenario())
    assert got == ([] if engine.name == "rabbitmq" else [b"online"] * 3)


def test_last_will_on_an_abrupt_disconnect(engine: Engine) -> None:
    """A device that vanishes (TCP reset, no DISCONNECT) is marked offline by its will, which is
    retained so an aggregator that starts later still sees it."""
    topic = f"edgefl/{uid('will')}/status/d1"
    dev = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=uid("dev"))
    dev.will_set(topic, b"offline", qos=1, retain=True)

    async def watch() -> tuple[list, float | None, float]:
        async with client(engine.url, uid("agg")) as agg:
            await agg.subscribe(topic, qos=1)
            dev.connect(*parse_broker_url(engine.url).configure_paho(dev), keepalive=5)
            dev.loop_start()
            dev.publish(topic, b"online", qos=1, retain=True).wait_for_publish(5)
            seen = await collect(agg, 1, 5.0)
            dev.loop_stop()
            sock = dev.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            t0 = time.perf_counter()
            sock.close()  # RST: the broker sees a network failure, not a DISCONNECT
            seen += await collect(agg, 1, 10.0)
            will_s = time.perf_counter() - t0
        return seen, await retained_on(engine.url, topic, b"offline"), will_s

    seen, retained, will_s = asyncio.run(watch())
    print(f"{engine.name}: will after {will_s:.3f} s, retained will seen after {retained} s")
    assert [m.payload for m in seen] == [b"online", b"offline"]
    assert retained is not None


def test_qos1_updates_wait_in_a_persistent_session(engine: Engine) -> None:
    """The aggregator's session (clean_session=False) keeps QoS 1 updates published while it is
    away, and redelivers one it received but had not acknowledged (the journal's premise)."""
    agg_id = uid("agg")
    topic_base = f"edgefl/{uid('q1')}/up"

    def aggregator(manual_ack: bool) -> paho.Client:
        c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=agg_id, clean_session=False)
        c.manual_ack_set(manual_ack)
        return c

    received: list[tuple[bytes, bool]] = []
    spec = parse_broker_url(engine.url)
    a = aggregator(manual_ack=False)
    granted: list[list[int]] = []
    a.on_subscribe = lambda c, u, mid, codes, p: granted.append([code.value for code in codes])
    a.connect(*spec.configure_paho(a))
    a.loop_start()
    t0 = time.perf_counter()
    a.subscribe(f"{topic_base}/+", qos=1)
    wait_until(lambda: bool(granted), 10)  # NATS: a JetStream consumer, 0.1-0.8 s to SUBACK
    suback_s = time.perf_counter() - t0
    a.disconnect()
    a.loop_stop()
    assert granted == [[1]]

    pub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=uid("dev"))
    pub.connect(*spec.configure_paho(pub))
    pub.loop_start()
    for i in range(20):
        pub.publish(f"{topic_base}/d{i:02d}", f"u{i}".encode(), qos=1).wait_for_publish(5)
    pub.disconnect()
    pub.loop_stop()

    # back, but "crashes" before acknowledging: nothing is PUBACKed
    b = aggregator(manual_ack=True)
    flags: list[bool] = []
    b.on_connect = lambda c, u, f, rc, p: flags.append(bool(f.session_present))
    b.on_message = lambda c, u, m: received.append((m.payload, m.dup))
    b.connect(*spec.configure_paho(b))
    b.loop_start()
    wait_until(lambda: len(received) >= 20, 3)
    b.loop_stop()
    b.socket().close()
    first = sorted(p for p, _ in received)
    received.clear()

    c = aggregator(manual_ack=False)
    c.on_message = lambda cl, u, m: received.append((m.payload, m.dup))
    c.on_connect = lambda cl, u, f, rc, p: flags.append(bool(f.session_present))
    c.connect(*spec.configure_paho(c))
    c.loop_start()
    wait_until(lambda: len(received) >= 20, 10)
    time.sleep(0.3)  # and nothing more
    c.disconnect()
    c.loop_stop()
    expected = sorted(f"u{i}".encode() for i in range(20))
    # all queued while away; RabbitMQ hands a session at most mqtt.prefetch (default 10)
    # unacknowledged messages, the others wait for acknowledgements
    window = {"rabbitmq": 10}.get(engine.name, 20)
    assert len(first) == window and set(first) <= set(expected)
    assert sorted(p for p, _ in received) == expected  # unacknowledged: all again
    assert flags == [True, True]
    print(f"{engine.name}: QoS 1 SUBACK of a persistent session in {suback_s:.3f} s")


@pytest.mark.parametrize(
    "engine",
    [
        "mosquitto",
        pytest.param("nats", marks=pytest.mark.slow),  # a full cluster restart: ~11-12 s
        pytest.param("rabbitmq", marks=pytest.mark.slow),  # ~6-7.5 s
    ],
    indirect=True,
)
def test_state_survives_an_engine_restart(engine: Engine) -> None:
    """Stop and start the whole engine (every node): the retained global model and the QoS 1
    updates queued for the aggregator's offline persistent session are still there."""
    topic = f"edgefl/{uid('rs')}"
    agg_id = uid("agg")

    async def before() -> None:
        async with client(engine.url, agg_id, clean_session=False) as agg:
            await agg.subscribe(f"{topic}/up/+", qos=1)
        async with client(engine.url, uid("dev")) as dev:
            await dev.publish(f"{topic}/global", b"model-7", qos=1, retain=True)
            for i in range(5):
                await dev.publish(f"{topic}/up/d{i}", f"u{i}".encode(), qos=1)

    async def after() -> tuple[float | None, list[bytes]]:
        retained = await retained_on(engine.url, f"{topic}/global", b"model-7", timeout=15.0)
        async with client(engine.url, agg_id, clean_session=False) as agg:
            updates = sorted(m.payload for m in await collect(agg, 5, 15.0))
        return retained, updates

    asyncio.run(before())
    restart_s = engine.restart()
    retained, updates = asyncio.run(after())
    print(f"{engine.name}: restart {restart_s:.2f} s, retained back after {retained} s")
    assert retained is not None
    assert updates == [f"u{i}".encode() for i in range(5)]


# ------------------------------------------------------------- features that differ
def test_mqtt_version_and_qos(engine: Engine) -> None:
    """edge-fl's clients speak MQTT 3.1.1 (aiomqtt's and paho's default) and use QoS 0/1 only,
    the common ground: NATS 2.9 refuses MQTT 5, RabbitMQ 3.10 never answers its CONNECT, and
    RabbitMQ grants QoS 2 as QoS 1."""

    async def probe() -> tuple[str, int | None]:
        try:
            async with client(
                engine.url, uid("v5"), protocol=aiomqtt.ProtocolVersion.V5, timeout=2
            ):
                v5 = "ok"
        except aiomqtt.MqttError as exc:
            v5 = "refused" if "nsupported protocol" in str(exc) else "timeout"
        topic = f"edgefl/{uid('q')}/global"
        async with client(engine.url, uid("v311")) as c:
            granted = await c.subscribe(topic, qos=1)
        return v5, getattr(granted[0], "value", granted[0]) if granted else None

    v5, granted = asyncio.run(probe())
    assert granted == 1  # 3.1.1 with QoS 1 works everywhere
    assert v5 == {"mosquitto": "ok", "nats": "refused", "rabbitmq": "timeout"}[engine.name]


def test_shared_subscriptions(engine: Engine) -> None:
    """`$share/group/topic` splits a stream between workers on Mosquitto (also for 3.1.1
    clients); NATS 2.9 and RabbitMQ 3.10 treat it as a plain topic that nothing publishes to, so
    sharded ingest there must partition the topic space instead (docs/brokers.md)."""
    base = f"edgefl/{uid('sh')}/up"
    counts = {"a": 0, "b": 0}

    async def scenario() -> None:
        async with client(engine.url, uid("wa")) as a, client(engine.url, uid("wb")) as b:
            for c in (a, b):
                await c.subscribe(f"$share/ingest/{base}/+", qos=1)
            async with client(engine.url, uid("dev")) as pub:
                for i in range(20):
                    await pub.publish(f"{base}/d{i:02d}", b"u", qos=1)

            async def count(c: aiomqtt.Client, key: str) -> None:
                async for _ in c.messages:
                    counts[key] += 1

            tasks = [asyncio.create_task(count(a, "a")), asyncio.create_task(count(b, "b"))]
            await asyncio.sleep(1.0)
            for t in tasks:
                t.cancel()

    asyncio.run(scenario())
    if engine.name == "mosquitto":
        assert counts["a"] + counts["b"] == 20 and min(counts.values()) > 0
    else:
        assert counts == {"a": 0, "b": 0}, "the engine now supports shared subscriptions?"


def test_large_payloads(engine: Engine) -> None:
    """A 4 MB retained global model reaches a late subscriber and a 4 MB QoS 1 update waits in
    the aggregator's persistent session (above NATS's 1 MB core max_payload and within the
    embedded Mosquitto's 16 MB max_packet_size)."""
    size = 4_000_000
    topic = f"edgefl/{uid('big')}"
    agg_id = uid("agg")

    async def scenario() -> tuple[int, int]:
        async with client(engine.url, agg_id, clean_session=False) as agg:
            await agg.subscribe(f"{topic}/up/+", qos=1)
        async with client(engine.url, uid("pub")) as pub:
            await pub.publish(f"{topic}/global", b"g" * size, qos=1, retain=True)
            await pub.publish(f"{topic}/up/d1", b"u" * size, qos=1)
        async with client(engine.url, uid("late")) as late:
            await late.subscribe(f"{topic}/global", qos=1)
            model = await collect(late, 1, 10.0)
        async with client(engine.url, agg_id, clean_session=False) as agg:
            update = await collect(agg, 1, 10.0)
        async with client(engine.url, agg_id, clean_session=True):
            pass  # drop the session
        return (len(model[0].payload) if model else 0), (len(update[0].payload) if update else 0)

    assert asyncio.run(scenario()) == (size, size)


def test_dots_in_job_and_device_ids(engine: Engine) -> None:
    """Job and device ids may contain '.' (edge_fl.protocol.topics), but both engines map MQTT's
    '/' to a '.' separator of their own: NATS 2.9 drops a client that publishes such a topic, and
    RabbitMQ 3.10 accepts it and splits the level, so `up/+` silently misses `up/d.1`."""
    job = f"{uid('dot')}.v2"

    async def scenario() -> list[str] | str:
        try:
            async with client(engine.url, uid("agg")) as agg:
                await agg.subscribe(f"edgefl/{job}/up/+", qos=1)
                async with client(engine.url, uid("dev"), timeout=3) as dev:
                    await dev.publish(f"edgefl/{job}/up/d.1", b"u", qos=1)
                return [str(m.topic) for m in await collect(agg, 1, 1.5)]
        except aiomqtt.MqttError as exc:
            return f"error: {exc}"

    got = asyncio.run(scenario())
    if engine.name == "nats":
        assert isinstance(got, str), got  # the publisher is dropped: use ids without '.'
    elif engine.name == "rabbitmq":
        assert got == []  # PUBACKed, never delivered: use ids without '.'
    else:
        assert got == [f"edgefl/{job}/up/d.1"]


# ------------------------------------------------------------ failover in a NATS cluster
def kill_job_config(url: str, rounds: int) -> object:
    return load_config(
        None,
        {
            "job": uid("kill"),
            "broker.url": url,  # all three nodes
            "data.devices": 6,
            "rounds.rounds": rounds,
            "rounds.clients_per_round": 6,
            "rounds.min_updates": 6,  # one lost update makes a round short, then skipped
            # above the engine's failover: the aggregator's first CONNECT to a surviving node can
            # time out (aiomqtt's 10 s, measured 10.4 s after the kill) while NATS elects new
            # JetStream leaders, and round 3 then completed up to 16 s after the kill; with 15 s,
            # 4 of 14 runs failed (round 3 skipped in both failures examined; docs/brokers.md)
            "rounds.deadline_s": 30.0,
            "rounds.on_short_round": "skip",
            "training.epochs": 20,  # the node dies with training and uploads in flight
        },
    )


def paho_session(cluster: NatsCluster, node: int, client_id: str) -> paho.Client | None:
    """A connected clean-session paho client on `node`, or None if refused (NATS answers a
    CONNECT with an error while it still tears down the same id's session elsewhere)."""
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id)
    codes: list[int] = []
    c.on_connect = lambda cl, u, f, rc, p: codes.append(rc.value)
    try:
        c.connect("127.0.0.1", cluster.mqtt_ports[node])
    except OSError:
        return None
    c.loop_start()
    if wait_until(lambda: bool(codes), 10) and codes[0] == 0:
        return c
    c.loop_stop()
    return None


def subscribed(c: paho.Client, topic: str, qos: int) -> None:
    done: list[int] = []
    c.on_subscribe = lambda *args: done.append(1)
    c.subscribe(topic, qos)
    assert wait_until(lambda: bool(done), 10)


@pytest.mark.slow  # kills and restarts a node of the session cluster: ~30 s
def test_nats_subscriptions_made_right_after_a_node_died(nats_cluster: NatsCluster) -> None:
    """The engine behaviour behind the node-kill xfail. Six clean sessions subscribed on the node
    that dies reconnect to another node (three under their old client id, three under a new one)
    and subscribe again, four at QoS 1 and two at QoS 0. The QoS 0 subscriptions (plain NATS
    interest) get every message; QoS 1 subscriptions (a JetStream consumer each) made in the
    seconds after the death sometimes get nothing, and which one varies from run to run."""
    cluster = nats_cluster
    topic = f"edgefl/{uid('st')}/global"
    tag = uid("c")
    # name: (client id before, client id after, qos)
    cases = {
        "same-qos1-a": (f"{tag}-1", f"{tag}-1", 1),
        "same-qos1-b": (f"{tag}-2", f"{tag}-2", 1),
        "same-qos0": (f"{tag}-3", f"{tag}-3", 0),
        "new-qos1-a": (f"{tag}-4", f"{tag}-4n", 1),
        "new-qos1-b": (f"{tag}-5", f"{tag}-5n", 1),
        "new-qos0": (f"{tag}-6", f"{tag}-6n", 0),
    }
    old = []
    for before, _, qos in cases.values():
        c = paho_session(cluster, 1, before)
        assert c is not None
        subscribed(c, topic, qos)
        old.append(c)
    got: dict[str, list[bytes]] = {name: [] for name in cases}
    fresh: list[paho.Client] = []
    try:
        cluster.kill(1)
        for c in old:
            c.loop_stop()
        for name, (_, after, qos) in cases.items():
            deadline = time.monotonic() + 30
            c = None
            while c is None and time.monotonic() < deadline:
                c = paho_session(cluster, 0, after)
                if c is None:
                    time.sleep(0.5)
            assert c is not None, name
            c.on_message = lambda cl, u, m, name=name: got[name].append(m.payload)
            subscribed(c, topic, qos)
            fresh.append(c)
        pub = paho_session(cluster, 2, f"{tag}-pub")
        assert pub is not None
        for i in range(5):
            pub.publish(topic, f"m{i}".encode(), qos=1).wait_for_publish(10)
        wait_until(lambda: all(len(v) >= 5 for v in got.values()), 5)
        time.sleep(3)  # past the tests' 2 s ack_wait: a redelivery would have come by now
        pub.disconnect()
        pub.loop_stop()
    finally:
        for c in fresh:
            c.disconnect()
            c.loop_stop()
        cluster.start_node(1)
        cluster.wait_ready()
    print("messages received per re-made subscription:", {k: len(v) for k, v in got.items()})
    five = [f"m{i}".encode() for i in range(5)]
    assert got["same-qos0"] == five and got["new-qos0"] == five
    assert all(got[k] in ([], five) for k in got)  # all or nothing, never a partial stream


@pytest.mark.slow  # 12-27 s (kills a node of the session cluster, restarts it afterwards)
def test_killing_the_aggregators_nats_node_mid_job(nats_cluster: NatsCluster) -> None:
    """SIGKILL the cluster node the aggregator is connected to while a round is open: the
    aggregator and the devices (each its own reconnect loop, given all three nodes) reconnect to
    the two others and finish the job; every round but the one open at the kill closes with
    every device's update, and no update is accepted twice.

    The round open at the kill also closed with all six updates in 16 of 17 runs (docs/brokers.md;
    the failing run's cause is not known). That part is printed, not asserted: a non-strict
    xfail on the whole test could never fail, so the test asserts what holds in every run."""
    cluster = nats_cluster
    rounds = 6
    cfg = kill_job_config(cluster.url, rounds)
    job = build_job(cfg)
    core = job.aggregator_core()
    spec = parse_broker_url(cfg.broker.url)
    assert len(spec.nodes) == 3
    records: list[dict] = []
    victim: list[int] = []
    killed: list[int] = []  # the round open at the kill
    heard: list[tuple[float, str, int]] = []  # (time, device, round) a device trained on

    async def scenario() -> list[int]:
        service = AggregatorService(
            core,
            spec,
            job.topics,
            wait_for_devices_s=30,
            expected_devices=6,
            on_record=records.append,
            reconnect_attempts=30,
        )
        agg = asyncio.create_task(service.run())
        await service.connected.wait()
        agents = [job.agent(i) for i in range(6)]
        for agent in agents:
            trained = agent.on_global

            def on_global(msg, trained=trained, device=agent.device_id):
                heard.append((time.perf_counter(), device, msg.round))
                return trained(msg)

            agent.on_global = on_global
        devices = [
            asyncio.create_task(run_device(agent, spec, job.topics, max_backoff_s=1.0))
            for agent in agents
        ]
        while len(records) < 2 or core.current is None or not any(r == 3 for _, _, r in heard):
            await asyncio.sleep(0.01)  # until round 3 is open and devices train on it
        node = cluster.node_of_client(service.client_id)
        assert node is not None
        victim.append(node)
        killed_in = len(records) + 1
        killed.append(killed_in)
        t0 = time.perf_counter()
        cluster.kill(node)
        await asyncio.wait_for(agg, 120)
        print(
            f"killed n{node} (the aggregator's node) in round {killed_in}; job done "
            f"{time.perf_counter() - t0:.1f} s later"
        )
        _, pending = await asyncio.wait(devices, timeout=30)
        for task in pending:
            task.cancel()
        timeline = sorted((round(t - t0, 2), d, r) for t, d, r in heard)
        summary = [(r["round"], r["status"], r["received"]) for r in records]
        assert not pending, f"{len(pending)} devices never heard the job end: {summary} {timeline}"
        return [task.result() for task in devices]

    try:
        sent = asyncio.run(scenario())
    finally:
        for i in victim:
            cluster.start_node(i)
        cluster.wait_ready()
    summary = [(r["round"], r["status"], r["received"]) for r in records]
    print("rounds:", summary, "updates sent:", sent)
    assert [r["round"] for r in records] == list(range(1, rounds + 1)), summary
    others = [r for r in records if r["round"] != killed[0]]
    assert all(r["status"] == "closed" and r["received"] == 6 for r in others), summary
    closed = [r for r in records if r["status"] == "closed"]
    assert core.version == len(closed)  # each closed round applied once
    # an update is accepted at most once: never more than the devices sent
    assert sum(r["received"] for r in records) <= sum(sent), (summary, sent)


def test_fleet_reopens_device_sessions_dropped_under_a_live_downlink(mosquitto) -> None:
    """What a cluster node dying under some device sessions (and not under the fleet's downlink)
    does to `edge-fl fleet`, on one Mosquitto: three devices' sockets are reset while round 3 is
    open. The fleet re-opens each of those sessions on its own (the downlink never drops, so
    nothing else would), and every round still closes with all six updates."""
    rounds = 5
    cfg = load_config(
        None,
        {
            "job": uid("reopen"),
            "broker.url": mosquitto.url,
            "data.devices": 6,
            "rounds.rounds": rounds,
            "rounds.clients_per_round": 6,
            "rounds.min_updates": 6,  # a device left offline makes its rounds short, then skipped
            "rounds.deadline_s": 10.0,
            "rounds.on_short_round": "skip",
            "training.epochs": 5,
        },
    )
    job = build_job(cfg)
    core = job.aggregator_core()
    spec = parse_broker_url(mosquitto.url)
    records: list[dict] = []

    async def scenario() -> tuple[int, int]:
        service = AggregatorService(
            core, spec, job.topics, wait_for_devices_s=20, expected_devices=6,
            on_record=records.append,
        )  # fmt: skip
        agg = asyncio.create_task(service.run())
        await service.connected.wait()
        fleet = job.fleet_runtime(spec)
        run = asyncio.create_task(fleet.run())
        while len(records) < 2 or core.current is None:
            await asyncio.sleep(0.01)
        for device in list(fleet.clients)[:3]:  # not `crash`: these devices are meant to return
            sock = client_adapter.raw_socket(fleet.clients[device])
            assert isinstance(sock, socket.socket)
            sock.shutdown(socket.SHUT_RDWR)
        await asyncio.wait_for(agg, 60)
        await asyncio.wait_for(run, 30)
        return fleet.reopened, fleet.published + fleet.resent

    reopened, sent = asyncio.run(scenario())
    assert reopened >= 3
    assert [r["status"] for r in records] == ["closed"] * rounds, records
    assert [r["received"] for r in records] == [6] * rounds
    assert core.version == rounds
    assert sent >= 6 * rounds
