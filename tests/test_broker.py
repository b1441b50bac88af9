"""Broker URLs, the embedded broker launcher and the shipped Mosquitto configs (real sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import resource
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiomqtt
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

import edge_fl.transport.broker as broker_mod
from edge_fl.transport.broker import (
    AMQTT_MAX_DEVICES,
    AmqttFallbackWarning,
    BrokerError,
    EmbeddedBroker,
    ListenerTLS,
    find_mosquitto,
)
from edge_fl.transport.url import BrokerSpec, BrokerUrlError, parse_broker_url

REPO = Path(__file__).resolve().parents[1]
BROKER_DIR = REPO / "broker"
T = TypeVar("T")


def run(coro: Awaitable[T], timeout: float = 15.0) -> T:
    """Run one async scenario with a hard bound, so a broker bug fails instead of hanging."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def job_id() -> str:
    return "t" + uuid.uuid4().hex[:10]  # the session broker is shared: unique topics per test


async def take(client: aiomqtt.Client, n: int) -> list[aiomqtt.Message]:
    got: list[aiomqtt.Message] = []
    async for message in client.messages:
        got.append(message)
        if len(got) >= n:
            break
    return got


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (PID 1 in a container may not reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_dead(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


# --------------------------------------------------------------------------------- broker URLs
def test_parse_defaults() -> None:
    assert parse_broker_url("mqtt://localhost") == BrokerSpec("localhost", 1883)
    spec = parse_broker_url("mqtts://broker.example.org")
    assert (spec.port, spec.tls, spec.ca_file, spec.insecure) == (8883, True, None, False)
    assert parse_broker_url("mqtt://[::1]:1884").host == "::1"
    assert parse_broker_url("  MQTT://Host:1999/ ").host == "host"


def test_parse_credentials_and_options() -> None:
    url = "mqtts://pi%2F7:p%40ss%3Aw%2Bd@10.0.0.2:8884?ca=/etc/edge-fl/ca+1.crt&cert=/c.pem&key=/k.pem&insecure=yes"
    spec = parse_broker_url(url)
    assert spec.username == "pi/7"
    assert spec.password == "p@ss:w+d"
    assert (spec.host, spec.port, spec.tls) == ("10.0.0.2", 8884, True)
    assert spec.ca_file == "/etc/edge-fl/ca+1.crt"  # '+' in a path is not a space
    assert (spec.cert_file, spec.key_file, spec.insecure) == ("/c.pem", "/k.pem", True)
    assert parse_broker_url(spec.to_url()) == spec
    assert parse_broker_url("mqtt://user@h").username == "user"
    assert parse_broker_url("mqtt://user@h").password is None


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://h", "scheme 'http' is not supported"),
        ("localhost:1883", "has no scheme"),
        ("mqtt://h:abc", "port 'abc' is not an integer"),
        ("mqtt://h:0", "port 0 is not in 1..65535"),
        ("mqtt://h:65536", "is not an integer in 1..65535"),
        ("mqtt://h:", "empty port"),
        ("mqtt://", "missing host"),
        ("mqtt://h/a/b", "unexpected path"),
        ("mqtt://h#x", "unexpected fragment"),
        ("mqtt://:secret@h", "password given without a username"),
        ("mqtt://h?ca=/ca.pem", "use mqtts://"),
        ("mqtts://h?bogus=1", "unknown option 'bogus'"),
        ("mqtts://h?ca=a&ca=b", "given more than once"),
        ("mqtts://h?ca=", "needs a value"),
        ("mqtts://h?insecure=maybe", "insecure='maybe'"),
        ("mqtts://h?key=/k.pem", "key= given without cert="),
        ("mqtt://[::1", "malformed"),
        ("", "non-empty string"),
    ],
)
def test_parse_errors(url: str, message: str) -> None:
    with pytest.raises(BrokerUrlError, match=re.escape(message)) as info:
        parse_broker_url(url)
    assert "\n" not in str(info.value)  # the CLI prints it as its one error line


def test_password_never_printed() -> None:
    spec = parse_broker_url("mqtts://dev:hunter2@h?ca=/ca.pem")
    for text in (spec.redacted(), str(spec), repr(spec)):
        assert "hunter2" not in text
    assert spec.redacted() == "mqtts://dev:***@h:8883?ca=/ca.pem"
    with pytest.raises(BrokerUrlError) as info:
        parse_broker_url("mqtt://dev:hunter2@h:99999")
    assert "hunter2" not in str(info.value) and "***" in str(info.value)


def test_tls_context_and_client_kwargs(secure_files: dict[str, Any]) -> None:
    ca = secure_files["ca"]
    assert parse_broker_url("mqtt://h").tls_context() is None
    context = parse_broker_url(f"mqtts://h?ca={ca}").tls_context()
    assert context is not None
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    insecure = parse_broker_url("mqtts://h?insecure=1").tls_context()
    assert insecure is not None and insecure.verify_mode == ssl.CERT_NONE
    with pytest.raises(
        BrokerUrlError, match=re.escape("ca='/nonexistent/ca.pem': file does not exist")
    ):
        parse_broker_url("mqtts://h?ca=/nonexistent/ca.pem").tls_context()
    kwargs = parse_broker_url(f"mqtts://u:p@h:9?ca={ca}").aiomqtt_kwargs()
    assert {k: kwargs[k] for k in ("hostname", "port", "username", "password")} == {
        "hostname": "h",
        "port": 9,
        "username": "u",
        "password": "p",
    }
    assert isinstance(kwargs["tls_context"], ssl.SSLContext)


# ------------------------------------------------------------------------ launcher (no process)
def test_embedded_config_has_the_loss_guards() -> None:
    broker = EmbeddedBroker("mosquitto", mosquitto_binary="/nonexistent/mosquitto")
    text = broker.render_config(4321, Path("/tmp/x.log"))
    for line in (
        "max_queued_messages 0",
        "max_queued_bytes 1073741824",
        "max_inflight_messages 100",
        "max_packet_size 16777216",
        "persistence false",
        "set_tcp_nodelay true",
        "allow_anonymous true",
        "listener 4321 127.0.0.1",
        "log_dest file /tmp/x.log",
    ):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line
    assert broker.max_devices is not None and broker.max_devices > AMQTT_MAX_DEVICES


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kind": "emqx"}, "kind must be one of"),
        ({"port": 0}, "port must be an int in 1..65535"),
        ({"startup_timeout": 0}, "startup_timeout must be > 0"),
        ({"max_queued_bytes": -1}, "max_queued_bytes must be an int >= 0"),
    ],
)
def test_launcher_rejects_bad_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EmbeddedBroker(**options)


def test_fallback_selection_without_mosquitto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(broker_mod, "find_mosquitto", lambda: None)
    broker = EmbeddedBroker()
    assert broker.kind == "amqtt" and broker.max_devices == AMQTT_MAX_DEVICES
    with pytest.raises(ValueError, match=r"\['password_file'\] need Mosquitto .*no mosquitto"):
        EmbeddedBroker(password_file="/etc/passwd")
    with pytest.raises(BrokerError, match="no mosquitto binary"):
        EmbeddedBroker("mosquitto")


# ------------------------------------------------------------------------ embedded Mosquitto
@pytest.mark.broker
def test_mosquitto_lifecycle(make_broker: Callable[..., EmbeddedBroker]) -> None:
    broker = make_broker()
    pid, directory = broker.pid, broker.directory
    assert pid is not None and directory is not None and broker.running
    assert broker.kind == "mosquitto"
    assert broker.url == f"mqtt://127.0.0.1:{broker.port}"
    assert broker.startup_seconds is not None and broker.startup_seconds < 5
    limits = Path(f"/proc/{pid}/limits").read_text()
    soft = int(re.search(r"Max open files\s+(\d+)", limits).group(1))  # type: ignore[union-attr]
    assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # raised to the hard limit
    assert "max_queued_messages 0" in (directory / "mosquitto.conf").read_text()
    with socket.create_connection((broker.host, broker.port), timeout=2):
        pass
    broker.stop()
    assert wait_dead(pid) and not directory.exists() and not broker.running
    broker.stop()  # idempotent


def test_stop_kills_only_a_broker_that_keeps_nothing(
    make_broker: Callable[..., EmbeddedBroker], tmp_path: Path
) -> None:
    """Mosquitto holds SIGTERM while in epoll_wait (up to 100 ms a stop): the embedded broker,
    which persists nothing, is killed at once; one given `persistence true` still gets SIGTERM
    and writes its database."""
    assert make_broker().stop() == -signal.SIGKILL
    keeping = make_broker(extra_config=["persistence true", f"persistence_location {tmp_path}/"])
    assert keeping.stop() == 0  # a clean SIGTERM shutdown
    assert (tmp_path / "mosquitto.db").exists()


@pytest.mark.broker
def test_retained_qos1_pubsub_aiomqtt_and_paho(mosquitto: EmbeddedBroker) -> None:
    job = job_id()
    topic = f"edgefl/{job}/global"

    async def scenario() -> tuple[list[aiomqtt.Message], list[aiomqtt.Message]]:
        kwargs = mosquitto.spec.aiomqtt_kwargs()
        async with aiomqtt.Client(**kwargs, identifier=f"{job}-agg") as agg:
            await agg.publish(topic, b"model-v1", qos=1, retain=True)
        async with aiomqtt.Client(**kwargs, identifier=f"{job}-dev") as dev:
            await dev.subscribe(f"edgefl/{job}/#", qos=1)
            retained = await take(dev, 1)
            await dev.publish(f"edgefl/{job}/up/dev", b"update", qos=1)
            live = await take(dev, 1)
        return retained, live

    retained, live = run(scenario())
    assert retained[0].payload == b"model-v1" and retained[0].retain and retained[0].qos == 1
    assert str(live[0].topic) == f"edgefl/{job}/up/dev" and not live[0].retain

    got: list[paho.MQTTMessage] = []
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"{job}-paho")
    mosquitto.spec.configure_paho(client)
    client.on_message = lambda c, u, m: got.append(m)
    client.connect(mosquitto.spec.host, mosquitto.spec.port)
    client.subscribe(topic, qos=1)
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        client.loop(0.05)
    client.disconnect()
    assert got and got[0].payload == b"model-v1" and got[0].retain


@pytest.mark.broker
def test_async_context_manager() -> None:
    if find_mosquitto() is None:
        pytest.skip("no mosquitto binary")

    async def scenario() -> tuple[bytes, int, Path]:
        async with EmbeddedBroker("mosquitto") as broker:
            assert broker.directory is not None
            directory, pid = broker.directory, broker.pid
            async with aiomqtt.Client(**broker.spec.aiomqtt_kwargs(), identifier="a") as client:
                await client.subscribe("edgefl/j/metrics", qos=1)
                await client.publish("edgefl/j/metrics", b"m", qos=1)
                message = (await take(client, 1))[0]
        assert pid is not None
        return bytes(message.payload), pid, directory  # type: ignore[arg-type]

    payload, pid, directory = run(scenario())
    assert payload == b"m" and wait_dead(pid) and not directory.exists()


def fan_in_burst(broker: EmbeddedBroker, clients: int = 200, per_client: int = 10) -> int:
    """QoS 1 burst from many devices to one aggregator that is busy (not reading) meanwhile.

    The subscriber is a paho client whose network loop we do not run during the burst, so it
    sends no PUBACKs: the broker must queue everything beyond its in-flight window. Returns how
    many messages the aggregator finally receives.
    """
    topic = "edgefl/burst/up"
    received: list[str] = []
    subscribed: list[int] = []
    sub = paho.Client(CallbackAPIVersion.VERSION2, client_id="aggregator")
    sub.on_message = lambda c, u, m: received.append(m.topic)
    sub.on_subscribe = lambda *args: subscribed.append(1)
    sub.connect(broker.host, broker.port)
    sub.subscribe(f"{topic}/#", qos=1)
    deadline = time.monotonic() + 5
    while not subscribed and time.monotonic() < deadline:
        sub.loop(0.05)
    assert subscribed, "no SUBACK"

    async def publish_all() -> None:
        connect_slots = asyncio.Semaphore(50)  # the listen backlog is 100: pace the connects
        async with contextlib.AsyncExitStack() as stack:

            async def connect(i: int) -> aiomqtt.Client:
                async with connect_slots:
                    client = aiomqtt.Client(broker.host, broker.port, identifier=f"dev-{i}")
                    return await stack.enter_async_context(client)

            devices = await asyncio.gather(*(connect(i) for i in range(clients)))
            await asyncio.gather(
                *(
                    device.publish(f"{topic}/dev-{i}", b"u" * 256, qos=1)
                    for i, device in enumerate(devices)
                    for _ in range(per_client)
                )
            )  # every publish got its PUBACK here

    run(publish_all(), timeout=30)
    total = clients * per_client
    deadline, last_progress, seen = time.monotonic() + 15, time.monotonic(), 0
    while len(received) < total and time.monotonic() < deadline:
        sub.loop(0.05)
        if len(received) != seen:
            seen, last_progress = len(received), time.monotonic()
        elif time.monotonic() - last_progress > 1.0:
            break  # quiet for 1 s: whatever is missing was dropped by the broker
    sub.disconnect()
    return len(received)


@pytest.mark.broker
def test_fan_in_burst_fully_delivered(make_broker: Callable[..., EmbeddedBroker]) -> None:
    assert fan_in_burst(make_broker()) == 2000


@pytest.mark.broker
def test_stock_queue_limits_lose_the_burst(make_broker: Callable[..., EmbeddedBroker]) -> None:
    """Control: Mosquitto's defaults (1000 queued, 20 in flight) drop the same burst silently."""
    broker = make_broker(extra_config=["max_queued_messages 1000", "max_inflight_messages 20"])
    received = fan_in_burst(broker)
    assert 1000 <= received <= 1020 + 50, received


@pytest.mark.broker
def test_start_failure_reports_the_log(make_broker: Callable[..., EmbeddedBroker]) -> None:
    with pytest.raises(BrokerError, match=r"(?s)exited with code .*no_such_option"):
        make_broker(extra_config=["no_such_option 1"])


@pytest.mark.broker
def test_explicit_port_in_use(make_broker: Callable[..., EmbeddedBroker]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BrokerError, match="Address already in use"):
            make_broker(port=port)


@pytest.mark.broker
def test_lost_port_race_is_retried(
    make_broker: Callable[..., EmbeddedBroker], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        real_free_port = broker_mod.free_port
        monkeypatch.setattr(
            broker_mod, "free_port", lambda host: next(ports, None) or real_free_port(host)
        )
        broker = make_broker()
        assert broker.running and broker.port != busy


BROKER_CHILD = """
import sys, time
from edge_fl.transport.broker import EmbeddedBroker
broker = EmbeddedBroker("mosquitto").start()
print(broker.pid, broker.directory, flush=True)
{action}
"""


def spawn_child(action: str) -> tuple[subprocess.Popen[str], int, Path]:
    child = subprocess.Popen(
        [sys.executable, "-c", BROKER_CHILD.format(action=action)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    pid, directory = child.stdout.readline().split()
    return child, int(pid), Path(directory)


@pytest.mark.broker
def test_broker_dies_with_its_parent() -> None:
    if find_mosquitto() is None:
        pytest.skip("no mosquitto binary")
    child, pid, directory = spawn_child("time.sleep(60)")
    try:
        assert alive(pid)
        child.kill()  # SIGKILL: no atexit, no __exit__; only PR_SET_PDEATHSIG can stop the broker
        child.wait(5)
        assert wait_dead(pid), "broker outlived its parent"
    finally:
        child.kill()
        shutil.rmtree(directory, ignore_errors=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def catches(pid: int, signum: int, timeout: float = 10.0) -> bool:
    """Wait until process ``pid`` has a handler for ``signum`` (Linux: SigCgt in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, StopIteration):
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            caught = int(next(x for x in status if x.startswith("SigCgt:")).split()[1], 16)
            if caught & (1 << (signum - 1)):
                return True
        time.sleep(0.01)
    return False


@pytest.mark.broker
def test_run_forever_stops_on_sigterm() -> None:
    if find_mosquitto() is None:
        pytest.skip("no mosquitto binary")
    child, pid, directory = spawn_child("sys.exit(broker.run_forever())")
    try:
        assert catches(child.pid, signal.SIGTERM), "run_forever installed no SIGTERM handler"
        child.send_signal(signal.SIGTERM)
        assert child.wait(5) == 0
        assert wait_dead(pid) and not directory.exists()
    finally:
        child.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------ secure broker (TLS + ACL)
@pytest.fixture(scope="module")
def secure_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """CA + server cert and users, made by the shipped make-certs.sh and mint-credentials.sh."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    directory = tmp_path_factory.mktemp("secure")
    subprocess.run(
        ["bash", str(BROKER_DIR / "make-certs.sh"), "-o", str(directory), "localhost", "127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    files: dict[str, Any] = {
        "dir": directory,
        "ca": str(directory / "ca.crt"),
        "cert": str(directory / "server.crt"),
        "key": str(directory / "server.key"),
        "passwd": str(directory / "passwd"),
        "passwords": {},
    }
    if shutil.which("mosquitto_passwd") is not None:
        minted = subprocess.run(
            [
                *("bash", str(BROKER_DIR / "mint-credentials.sh"), "-f", files["passwd"]),
                *("-H", "127.0.0.1:8883", "--ca", files["ca"], "aggregator", "dev-a", "dev-b"),
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        for line in minted.splitlines():
            name, url = line.split("\t")
            spec = parse_broker_url(url)
            assert spec.username == name and spec.ca_file == files["ca"]
            files["passwords"][name] = spec.password
    return files


@pytest.fixture
def secure_broker(
    make_broker: Callable[..., EmbeddedBroker], secure_files: dict[str, Any]
) -> EmbeddedBroker:
    if not secure_files["passwords"]:
        pytest.skip("mosquitto_passwd not installed")
    return make_broker(
        allow_anonymous=False,
        password_file=secure_files["passwd"],
        acl_file=str(BROKER_DIR / "aclfile.example"),
        tls=ListenerTLS(secure_files["ca"], secure_files["cert"], secure_files["key"]),
        extra_config=["use_username_as_clientid true"],  # as in mosquitto-secure.conf
    )


def login(broker: EmbeddedBroker, files: dict[str, Any], user: str, **extra: Any) -> aiomqtt.Client:
    kwargs = broker.spec.aiomqtt_kwargs() | {"username": user, "password": files["passwords"][user]}
    return aiomqtt.Client(**(kwargs | extra), identifier=user, timeout=5)


@pytest.mark.broker
def test_secure_refuses_bad_credentials(
    secure_broker: EmbeddedBroker, secure_files: dict[str, Any]
) -> None:
    async def attempt(username: str | None, password: str | None) -> None:
        kwargs = secure_broker.spec.aiomqtt_kwargs() | {"username": username, "password": password}
        async with aiomqtt.Client(**kwargs, identifier="intruder", timeout=5):
            pass

    for username, password in (("dev-a", "wrong"), ("nobody", "x"), (None, None)):
        with pytest.raises(aiomqtt.MqttError):
            run(attempt(username, password))
    run(attempt("dev-a", secure_files["passwords"]["dev-a"]))  # the right one works


@pytest.mark.broker
def test_device_publishes_only_to_its_own_topic(
    secure_broker: EmbeddedBroker, secure_files: dict[str, Any]
) -> None:
    async def scenario() -> list[tuple[str, bytes]]:
        async with login(secure_broker, secure_files, "aggregator") as agg:
            await agg.subscribe("edgefl/digits-prod/up/#", qos=1)
            await agg.subscribe("edgefl/digits-prod/status/#", qos=1)
            with contextlib.suppress(aiomqtt.MqttError):  # Mosquitto 2.0 drops it and disconnects
                async with login(secure_broker, secure_files, "dev-a") as dev_a:
                    await dev_a.publish("edgefl/digits-prod/up/dev-b", b"forged", qos=1)
                    await dev_a.publish(
                        "edgefl/digits-prod/global", b"forged-model", qos=1, retain=True
                    )
            will = aiomqtt.Will("edgefl/digits-prod/status/dev-a", b"offline", qos=1, retain=True)
            async with login(secure_broker, secure_files, "dev-a", will=will) as dev_a:
                await dev_a.publish(
                    "edgefl/digits-prod/status/dev-a", b"online", qos=1, retain=True
                )
                await dev_a.publish("edgefl/digits-prod/up/dev-a", b"own", qos=1)
            # The broker handles one connection's packets in order: had the forged update been
            # accepted, it would have arrived before these.
            got = await take(agg, 2)
        async with login(secure_broker, secure_files, "dev-b") as dev_b:
            await dev_b.subscribe("edgefl/digits-prod/global", qos=1)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.3):
                    got += await take(dev_b, 1)  # a retained forged model would show up here
        return [(str(m.topic), bytes(m.payload)) for m in got]  # type: ignore[arg-type]

    assert run(scenario()) == [
        ("edgefl/digits-prod/status/dev-a", b"online"),
        ("edgefl/digits-prod/up/dev-a", b"own"),
    ]


@pytest.mark.broker
def test_device_cannot_read_other_devices_updates(
    secure_broker: EmbeddedBroker, secure_files: dict[str, Any]
) -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        async with (
            login(secure_broker, secure_files, "aggregator") as agg,
            login(secure_broker, secure_files, "dev-b") as spy,
        ):
            await agg.subscribe(
                "$share/ingest/edgefl/digits-prod/up/#", qos=1
            )  # shared subscription
            for pattern in (
                "edgefl/digits-prod/up/#",
                "edgefl/digits-prod/status/#",
                "edgefl/#",
                "edgefl/digits-prod/metrics",
            ):
                await spy.subscribe(pattern, qos=1)
            async with login(secure_broker, secure_files, "dev-a") as dev_a:
                await dev_a.publish(
                    "edgefl/digits-prod/status/dev-a", b"online", qos=1, retain=True
                )
                await dev_a.publish("edgefl/digits-prod/up/dev-a", b"private-update", qos=1)
            agg_got = await take(agg, 1)
            await agg.publish("edgefl/digits-prod/metrics", b"round-1", qos=1)
            await agg.publish("edgefl/digits-prod/global", b"model-v2", qos=1, retain=True)
            # Routed after dev-a's messages, so the spy's queue holds dev-a's first if allowed.
            spy_got = await take(spy, 2)
        return [str(m.topic) for m in agg_got], [str(m.topic) for m in spy_got]

    agg_topics, spy_topics = run(scenario())
    assert agg_topics == ["edgefl/digits-prod/up/dev-a"]
    assert sorted(spy_topics) == ["edgefl/digits-prod/global", "edgefl/digits-prod/metrics"]


@pytest.mark.broker
def test_tls_listener(secure_broker: EmbeddedBroker, secure_files: dict[str, Any]) -> None:
    spec = secure_broker.spec
    assert spec.tls and spec.ca_file == secure_files["ca"]

    got: list[paho.MQTTMessage] = []
    connected: list[Any] = []
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="dev-b")
    device = dataclasses.replace(
        spec, username="dev-b", password=secure_files["passwords"]["dev-b"]
    )
    device.configure_paho(client)
    client.on_connect = lambda c, u, f, rc, p: connected.append(rc)
    client.on_message = lambda c, u, m: got.append(m)
    client.connect(spec.host, spec.port)
    deadline = time.monotonic() + 5
    while not connected and time.monotonic() < deadline:
        client.loop(0.05)
    assert connected and not connected[0].is_failure
    client.disconnect()

    async def plain_to_tls_port() -> None:
        plain = {"username": "dev-b", "password": secure_files["passwords"]["dev-b"]}
        async with aiomqtt.Client(spec.host, spec.port, **plain, identifier="p", timeout=1):
            pass

    async def tls_without_our_ca() -> None:
        url = f"mqtts://dev-b:{secure_files['passwords']['dev-b']}@{spec.host}:{spec.port}"
        async with aiomqtt.Client(**parse_broker_url(url).aiomqtt_kwargs(), timeout=3):
            pass

    for attempt in (plain_to_tls_port, tls_without_our_ca):
        with pytest.raises(aiomqtt.MqttError):
            run(attempt(), timeout=10)


@pytest.mark.broker
def test_shipped_secure_config_runs(secure_files: dict[str, Any], tmp_path: Path) -> None:
    """broker/mosquitto-secure.conf, with its paths and ports moved to a temp dir, really works."""
    mosquitto = find_mosquitto()
    if mosquitto is None or not secure_files["passwords"]:
        pytest.skip("needs mosquitto and mosquitto_passwd")
    files = tmp_path / "edge-fl"
    shutil.copytree(secure_files["dir"], files)
    shutil.copy(BROKER_DIR / "aclfile.example", files / "acl")
    plain_port, tls_port = broker_mod.free_port(), broker_mod.free_port()
    text = (BROKER_DIR / "mosquitto-secure.conf").read_text()
    user = broker_mod._current_user()
    for old, new in (
        ("/etc/mosquitto/edge-fl/", f"{files}/"),
        ("/run/mosquitto/", f"{tmp_path}/"),
        ("/var/lib/mosquitto/", f"{tmp_path}/"),
        ("/var/log/mosquitto/", f"{tmp_path}/"),
        ("user mosquitto", f"user {user}"),
        ("listener 1883 127.0.0.1", f"listener {plain_port} 127.0.0.1"),
        ("listener 8883", f"listener {tls_port} 127.0.0.1"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    (tmp_path / "mosquitto.conf").write_text(text)
    proc = subprocess.Popen(
        [mosquitto, "-c", str(tmp_path / "mosquitto.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    log = tmp_path / "mosquitto.log"
    try:
        deadline = time.monotonic() + 10
        while not (log.exists() and " running" in log.read_text()):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "secure broker did not start"
            time.sleep(0.01)
        pw = secure_files["passwords"]

        async def scenario() -> bytes:
            tls = parse_broker_url(
                f"mqtts://dev-a:{pw['dev-a']}@127.0.0.1:{tls_port}?ca={files}/ca.crt"
            )
            local = parse_broker_url(f"mqtt://aggregator:{pw['aggregator']}@127.0.0.1:{plain_port}")
            async with aiomqtt.Client(**local.aiomqtt_kwargs(), identifier="aggregator") as agg:
                await agg.subscribe("edgefl/digits-prod/up/#", qos=1)
                async with aiomqtt.Client(**tls.aiomqtt_kwargs(), identifier="dev-a") as dev:
                    await dev.publish("edgefl/digits-prod/up/dev-a", b"hello", qos=1)
                return bytes((await take(agg, 1))[0].payload)  # type: ignore[arg-type]

        assert run(scenario()) == b"hello"

        async def anonymous() -> None:
            async with aiomqtt.Client("127.0.0.1", plain_port, identifier="anon", timeout=3):
                pass

        with pytest.raises(aiomqtt.MqttError):
            run(anonymous())
    finally:
        proc.terminate()
        proc.wait(5)


# ------------------------------------------------------------------------------ amqtt fallback
@pytest.mark.broker
def test_amqtt_fallback_pubsub(
    make_broker: Callable[..., EmbeddedBroker], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(broker_mod, "find_mosquitto", lambda: None)
    with pytest.warns(AmqttFallbackWarning, match="20-40x slower"):
        broker = make_broker(kind="auto")
    assert broker.kind == "amqtt" and broker.max_devices == AMQTT_MAX_DEVICES
    n = 20

    async def scenario() -> tuple[list[aiomqtt.Message], list[aiomqtt.Message]]:
        kwargs = broker.spec.aiomqtt_kwargs()
        async with aiomqtt.Client(**kwargs, identifier="agg") as agg:
            await agg.publish("edgefl/j/global", b"model", qos=1, retain=True)
            await agg.subscribe("edgefl/j/up/#", qos=1)
            async with aiomqtt.Client(**kwargs, identifier="dev") as dev:
                await dev.subscribe("edgefl/j/global", qos=1)
                retained = await take(dev, 1)
                for i in range(n):
                    await dev.publish(f"edgefl/j/up/dev-{i}", str(i).encode(), qos=1)
            return retained, await take(agg, n)

    retained, updates = run(scenario(), timeout=20)
    assert retained[0].payload == b"model" and retained[0].retain
    assert sorted(int(bytes(m.payload)) for m in updates) == list(range(n))  # type: ignore[arg-type]
    pid = broker.pid
    assert pid is not None
    broker.stop()
    assert wait_dead(pid)


@pytest.mark.broker
def test_a_device_that_does_not_trust_the_brokers_certificate_stops_with_one_line(
    secure_broker: EmbeddedBroker, secure_files: dict[str, Any], tmp_path: Path
) -> None:
    """A CA that did not sign the broker's certificate: retrying cannot fix it either."""
    other = tmp_path / "other"
    subprocess.run(
        ["bash", str(BROKER_DIR / "make-certs.sh"), "-o", str(other), "localhost"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    edge_fl = str(Path(sys.executable).parent / "edge-fl")
    password = secure_files["passwords"]["dev-a"]
    url = f"mqtts://dev-a:{password}@127.0.0.1:{secure_broker.spec.port}?ca={other / 'ca.crt'}"
    done = subprocess.run(
        [edge_fl, "device", "--broker", url, "--id", "dev-a", "--index", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    errors = [x for x in done.stderr.splitlines() if x.startswith("edge-fl: error:")]
    assert len(errors) == 1 and "certificate" in errors[0], done.stderr
    assert "Traceback" not in done.stderr and password not in done.stderr


@pytest.mark.broker
def test_a_device_with_a_wrong_password_stops_with_one_line(
    secure_broker: EmbeddedBroker, secure_files: dict[str, Any]
) -> None:
    """Retrying cannot fix bad credentials: the device says so and exits (a systemd unit passes
    --retry-forever instead)."""
    edge_fl = str(Path(sys.executable).parent / "edge-fl")
    port = secure_broker.spec.port
    url = f"mqtts://dev-a:wrong-password@127.0.0.1:{port}?ca={secure_files['ca']}"
    done = subprocess.run(
        [edge_fl, "device", "--broker", url, "--id", "dev-a", "--index", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [x for x in done.stderr.splitlines() if x.startswith("edge-fl: error:")]
    assert len(errors) == 1 and "refused this device" in errors[0], done.stderr
    assert "password" in errors[0] and "wrong-password" not in errors[0]  # no secret in logs
