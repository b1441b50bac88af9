"""Losing the broker is one line per process, not asyncio tracebacks (issue 23).

A broker restart used to print an asyncio ``OSError: [Errno 9] Bad file descriptor`` traceback in
the aggregator and one three-line "Future exception was never retrieved ... MqttCodeError" block
per device session in the fleet. Both came from aiomqtt 2.x: a socket registration scheduled
before the connection dropped ran after paho had closed the fd, and every dropped client's
"disconnected" future held an exception nobody read once the fleet replaced the client.
``client_adapter.quiet_on_loss`` fixes both; these tests stage each cause on a real Mosquitto
(the first two fail without it) and then restart a real broker under ``edge-fl aggregator`` and
``edge-fl fleet``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
import uuid
from pathlib import Path

import aiomqtt
import pytest
from helpers import start_fleet_and_aggregator

from edge_fl.transport import client_adapter
from edge_fl.transport.broker import EmbeddedBroker, free_port

pytestmark = pytest.mark.broker

NOISE = ("Traceback", "never retrieved", "Bad file descriptor", "Exception in callback")


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += " " + repr(record.exc_info[1])
        self.lines.append(text)


@pytest.fixture
def asyncio_log():
    # an earlier test's dropped client (a plain aiomqtt one, say) must not be collected, and
    # logged, while this test listens: collect what is already garbage before listening
    gc.collect()
    handler = Records()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("mqtt://").rsplit(":", 1)
    return host, int(port)


@pytest.mark.parametrize("quiet", [True, False], ids=["quiet_on_loss", "plain_aiomqtt"])
def test_a_write_registration_that_runs_after_the_socket_closed_logs_nothing(
    mosquitto, asyncio_log, quiet
):
    """paho asks to be watched for writing, then the connection dies before the loop runs the
    registration: without the guard asyncio logs an EBADF traceback (the plain case shows the
    staging reproduces it)."""

    async def scenario() -> None:
        host, port = host_port(mosquitto.url)
        client = aiomqtt.Client(host, port, identifier=f"ebadf-{uuid.uuid4().hex[:6]}")
        if quiet:
            client_adapter.quiet_on_loss(client)
        await client.__aenter__()
        pc = client_adapter.paho_client(client)
        sock = client_adapter.raw_socket(client)
        assert sock is not None
        register = pc.on_socket_register_write
        assert register is not None
        register(pc, None, sock)  # scheduled with call_soon_threadsafe, as from paho's thread
        sock.close()  # ... and the broker dropped the connection before it ran
        for _ in range(5):
            await asyncio.sleep(0)  # the loop runs the registration
        # the DISCONNECT cannot be acknowledged on the closed socket: wait 1 s for it, not
        # aiomqtt's default 10 s (the registration already ran above)
        client.timeout = 1
        with contextlib.suppress(aiomqtt.MqttError):
            await client.__aexit__(None, None, None)

    asyncio.run(scenario())
    noisy = [line for line in asyncio_log if "Bad file descriptor" in line or "callback" in line]
    if quiet:
        assert noisy == []
    else:
        assert noisy, "the staging no longer reproduces the EBADF traceback (aiomqtt changed?)"


@pytest.mark.parametrize("quiet", [True, False], ids=["quiet_on_loss", "plain_aiomqtt"])
def test_clients_dropped_after_the_broker_died_leave_no_unretrieved_future(
    make_broker, asyncio_log, quiet
):
    """A fleet re-opens a device's session with a new client and drops the old one: its
    'Unexpected disconnection' future must not be logged when it is collected."""
    broker = make_broker()

    async def scenario() -> None:
        host, port = host_port(broker.url)
        clients = []
        for i in range(5):
            client = aiomqtt.Client(host, port, identifier=f"drop-{i}-{uuid.uuid4().hex[:6]}")
            if quiet:
                client_adapter.quiet_on_loss(client)
            await client.__aenter__()
            clients.append(client)
        broker.stop()
        until = time.monotonic() + 10
        while any(client_adapter.is_connected(c) for c in clients):
            assert time.monotonic() < until, "the clients never saw the broker go"
            await asyncio.sleep(0.02)
        clients.clear()  # dropped, as the fleet drops a dead session's client
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    gc.collect()
    unretrieved = [line for line in asyncio_log if "never retrieved" in line]
    if quiet:
        assert unretrieved == []
    else:
        assert len(unretrieved) == 5


def metrics_lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_a_broker_restart_is_one_line_in_the_aggregator_and_no_traceback_anywhere(tmp_path):
    """``edge-fl aggregator`` and ``edge-fl fleet`` (20 devices) over a Mosquitto that is stopped
    mid-job and started again on the same port: the job finishes, the aggregator says the
    outage once, and neither process prints a traceback or an unretrieved future."""
    port = free_port()
    brokers = [EmbeddedBroker(kind="mosquitto", port=port).start()]
    url = brokers[0].url
    out = tmp_path / "run"
    args = [
        "--broker", url, "--job", f"restart-{uuid.uuid4().hex[:6]}", "--devices", "20",
        "--rounds", "4", "--clients-per-round", "20", "--deadline", "30", "--model", "logreg",
        "--epochs", "1",
    ]  # fmt: skip
    fleet, agg = start_fleet_and_aggregator(args, out)
    try:
        until = time.monotonic() + 120
        while metrics_lines(out) < 1:
            assert agg.poll() is None and fleet.poll() is None, "a process exited early"
            assert time.monotonic() < until, "round 1 never closed"
            time.sleep(0.05)
        brokers[0].stop()
        brokers.append(EmbeddedBroker(kind="mosquitto", port=port).start())
        _, agg_err = agg.communicate(timeout=180)
        _, fleet_err = fleet.communicate(timeout=60)
    finally:
        for p in (agg, fleet):
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for b in brokers:
            b.stop()
    assert agg.returncode == 0, agg_err
    assert fleet.returncode == 0, fleet_err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 4
    for name, err in (("aggregator", agg_err), ("fleet", fleet_err)):
        noisy = [line for line in err.splitlines() if any(n in line for n in NOISE)]
        assert noisy == [], f"{name}: {noisy}"
    outage = [line for line in agg_err.splitlines() if "unavailable" in line]
    assert len(outage) == 1, agg_err
    # the fleet's own retry line (edge_fl/fleet/runtime.py) is said once, plus, when it retried
    # more than once, the exit summary of repeated warnings
    assert 1 <= sum("unavailable" in line for line in fleet_err.splitlines()) <= 2, fleet_err
