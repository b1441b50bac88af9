"""An aggregator selects only devices of its own job's population (issue 24, item 7).

The shipped ACL lets any credentialed device write ``status/<its id>`` under any job id, so
d00011, minted for another job, can announce itself in a 6-device job; selected, it never answers
and rounds that need all 6 wait for it. Its status is ignored and counted."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import paho.mqtt.client as paho
import pytest

from edge_fl.config import load_config
from edge_fl.identity import device_id, in_population
from edge_fl.job import build_job
from edge_fl.protocol import Status, encode_status
from edge_fl.server.service import AggregatorService
from edge_fl.transport.url import parse_broker_url


def test_the_population_is_the_minted_scheme_below_data_devices():
    assert [in_population(device_id(i), 6) for i in (0, 5, 6, 11)] == [True, True, False, False]
    assert in_population(device_id(123456), 200_000) and not in_population(device_id(123456), 6)
    # named devices (provisioned with their own credentials) are the ACL's to decide
    assert in_population("pi-kitchen", 6) and in_population("alice", 6)
    assert in_population("kitchen-7", 6) and in_population("d3", 6)  # not the minted scheme


def test_a_foreign_status_is_ignored_and_counted_by_the_core():
    job = build_job(load_config(None, {"job": "pop", "data.devices": 6}))
    core = job.aggregator_core()
    core.settings = dataclasses.replace(core.settings, population=6)
    for i in (0, 11):
        core.on_status(device_id(i), encode_status(Status(device_id(i), True, 30)))
    assert core.available() == ["d00000"]
    assert core.tally.foreign_status == 1 and core.foreign_seen == 1


@pytest.mark.broker
def test_a_device_of_another_job_is_never_selected(mosquitto):
    rounds = 2
    job_id = f"pop-{uuid.uuid4().hex[:6]}"
    cfg = load_config(
        None,
        {
            "job": job_id,
            "broker.url": mosquitto.url,
            "data.devices": 6,
            "model.name": "logreg",
            "rounds.rounds": rounds,
            "rounds.clients_per_round": 6,
            "rounds.min_updates": 6,  # the README's 6-device job: every device must answer
            "rounds.deadline_s": 20.0,
            "rounds.on_short_round": "skip",
        },
    )
    job = build_job(cfg)
    topics = job.topics
    host, port = mosquitto.url.removeprefix("mqtt://").split(":")
    intruder = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"d00011-{job_id}")
    intruder.connect(host, int(port))
    intruder.loop_start()
    foreign = encode_status(Status("d00011", True, 30))
    intruder.publish(topics.status("d00011"), foreign, qos=1, retain=True).wait_for_publish(10)
    spec = parse_broker_url(mosquitto.url)
    records: list[dict] = []
    core = job.aggregator_core()
    # edge_fl.job builds the core with population = data.devices (see the report); here by hand
    core.settings = dataclasses.replace(core.settings, population=cfg.data.devices)

    async def scenario() -> None:
        service = AggregatorService(
            core, spec, topics, expected_devices=6, on_record=records.append
        )
        agg = asyncio.create_task(service.run())
        await service.connected.wait()
        fleet = job.fleet_runtime(spec)
        devices = asyncio.create_task(fleet.run())
        await asyncio.wait_for(agg, 120)
        await asyncio.wait_for(devices, 30)

    try:
        asyncio.run(scenario())
    finally:
        intruder.publish(topics.status("d00011"), b"", qos=1, retain=True).wait_for_publish(10)
        intruder.loop_stop()
        intruder.disconnect()
    assert "d00011" not in core.devices and "d00011" not in core.ever_selected
    assert [r["status"] for r in records] == ["closed"] * rounds, records
    assert [(r["selected"], r["received"]) for r in records] == [(6, 6)] * rounds
    assert core.foreign_seen >= 1
