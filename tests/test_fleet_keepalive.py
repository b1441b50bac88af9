"""The fleet's shared keepalive timer (edge_fl.fleet.keepalive) against a real Mosquitto: every
device session still pings the broker on its own connection and stays up across several keepalive
periods, with one timer for all of them instead of one aiomqtt task per session."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from edge_fl.config import load_config
from edge_fl.fleet.runtime import Fleet
from edge_fl.job import build_job
from edge_fl.transport import client_adapter
from edge_fl.transport.url import parse_broker_url

pytestmark = pytest.mark.broker

DEVICES = 12
KEEPALIVE_S = 4  # below the config's floor on purpose: pings due quickly (timer every 1 s)


async def _until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def test_every_session_pings_on_its_own_connection_through_one_timer(mosquitto):
    cfg = load_config(
        None,
        {"job": f"ka-{uuid.uuid4().hex[:6]}", "broker.url": mosquitto.url, "data.devices": DEVICES},
    )
    job = build_job(cfg)
    fleet = Fleet(
        job.agents(),
        parse_broker_url(mosquitto.url),
        job.topics,
        keepalive_s=KEEPALIVE_S,
    )

    async def scenario() -> tuple[int, dict[str, int], bool, bool]:
        await fleet.connect_all()
        sessions = len(fleet.keepalive)
        after_connect = {d: c.totals()["up_packets"] for d, c in fleet.wire.items()}

        def pinged_twice() -> bool:
            # CONNECT and the status publish came before; nothing else is sent but PINGREQs
            return all(
                c.totals()["up_packets"] >= after_connect[d] + 2 for d, c in fleet.wire.items()
            )

        # two keepalive periods of silence: without pings the broker drops a session after 1.5x
        pinged = await _until(pinged_twice, timeout_s=10 * KEEPALIVE_S)
        alive = all(client_adapter.is_connected(c) for c in fleet.clients.values())
        await fleet.disconnect_all()
        await fleet.keepalive.close()
        return sessions, after_connect, pinged, alive

    sessions, after_connect, pinged, alive = asyncio.run(scenario())
    assert sessions == DEVICES  # every session's housekeeping is on the shared timer
    assert len(after_connect) == DEVICES
    assert pinged, "some device session sent no keepalive PINGREQs"
    assert alive, "the broker dropped a session whose keepalive was on the shared timer"


def test_a_closed_session_leaves_the_timer(mosquitto):
    cfg = load_config(
        None,
        {"job": f"ka-{uuid.uuid4().hex[:6]}", "broker.url": mosquitto.url, "data.devices": 3},
    )
    job = build_job(cfg)
    fleet = Fleet(job.agents(), parse_broker_url(mosquitto.url), job.topics)

    async def scenario() -> tuple[int, int]:
        await fleet.connect_all()
        during = len(fleet.keepalive)
        await fleet.disconnect_all()
        left = await _until(lambda: len(fleet.keepalive) == 0, timeout_s=10)
        await fleet.keepalive.close()
        return during, 0 if left else len(fleet.keepalive)

    assert asyncio.run(scenario()) == (3, 0)
