"""A new run of a finished job id, the fleet started first (issue 24 item 3): the previous run's
done marker, still retained on the broker, reaches the fleet before the new aggregator clears it.
It must not move the fleet's window, or round 1 of the new run is "stale" and no round closes."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import paho.mqtt.client as paho
import pytest

from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.protocol import GlobalModel, Reject, encode_global
from edge_fl.server.service import AggregatorService
from edge_fl.transport.url import parse_broker_url

pytestmark = pytest.mark.broker


def retain(url: str, topic: str, payload: bytes) -> None:
    """Leave ``payload`` retained on ``topic``, as a finished run leaves its done marker."""
    host, port = url.removeprefix("mqtt://").split(":")
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"old-{uuid.uuid4().hex[:6]}")
    client.connect(host, int(port))
    client.loop_start()
    client.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
    client.loop_stop()
    client.disconnect()


def test_a_rerun_with_the_fleet_started_first_closes_every_round(mosquitto):
    rounds = 3
    cfg = load_config(
        None,
        {
            "job": f"rerun-{uuid.uuid4().hex[:6]}",
            "broker.url": mosquitto.url,
            "data.devices": 4,
            "rounds.rounds": rounds,
            "rounds.clients_per_round": 4,
            "rounds.min_updates": 4,
            "rounds.deadline_s": 20.0,
        },
    )
    job = build_job(cfg)
    n_params = job.agent(0).model.n_params
    old_end = GlobalModel(cfg.job, rounds, rounds, np.zeros(n_params, np.float32), done=True)
    old_end_payload = encode_global(old_end)
    retain(mosquitto.url, job.topics.global_model, old_end_payload)
    spec = parse_broker_url(mosquitto.url)
    records: list[dict] = []

    async def scenario():
        fleet = job.fleet_runtime(spec)
        run = asyncio.create_task(fleet.run())
        # the fleet has the previous run's marker before the new aggregator exists
        while fleet.downlink_wire.totals()["down"] < len(old_end_payload):
            assert not run.done(), run
            await asyncio.sleep(0.02)
        core = job.aggregator_core()
        service = AggregatorService(
            core, spec, job.topics, wait_for_devices_s=20, expected_devices=4,
            on_record=records.append,
        )  # fmt: skip
        await asyncio.wait_for(service.run(), 120)
        await asyncio.wait_for(run, 30)
        return fleet

    fleet = asyncio.run(scenario())
    assert [r["status"] for r in records] == ["closed"] * rounds, records
    assert [r["received"] for r in records] == [4] * rounds
    assert fleet.trust.rejected[Reject.STALE] == 0
    assert fleet.published == 4 * rounds
