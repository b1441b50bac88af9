"""Devices trust only the aggregator, over a real Mosquitto without ACLs: forged, unsigned, replayed
and fuzzed global messages (10,000 of them) change nothing; the job finishes with every update; a
device learns on its ack topic why an update was refused."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import msgpack
import numpy as np
import paho.mqtt.client as paho
import pytest

from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.protocol import GlobalModel, decode_ack, encode_global
from edge_fl.protocol.signing import Signer
from edge_fl.server.service import AggregatorService
from edge_fl.transport.url import parse_broker_url

pytestmark = pytest.mark.broker


def _paho(url: str, name: str) -> paho.Client:
    host, port = url.removeprefix("mqtt://").split(":")
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=name)
    client.connect(host, int(port))
    client.loop_start()
    return client


def _fuzz(job: str, dim: int, n: int, rng: np.random.Generator) -> list[bytes]:
    """Random bytes, and valid-looking global messages with one field mutated (unsigned)."""
    base = msgpack.unpackb(
        encode_global(GlobalModel(job, 0, 1, np.zeros(dim, np.float32), selected=("d00000",)))
    )
    junk: list = [None, True, -1, 2**40, 1.5, "x", b"\x00", [], {}, [1, 2], {"a": 1}]
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(os.urandom(int(rng.integers(0, 200))))
            continue
        obj = dict(base)
        key = list(obj)[i % len(obj)]
        obj[key] = junk[i % len(junk)]
        out.append(msgpack.packb(obj))
    return out


def test_forged_and_fuzzed_global_messages_change_nothing(mosquitto):
    job_id = f"trust-{uuid.uuid4().hex[:6]}"
    cfg = load_config(
        None,
        {
            "job": job_id,
            "broker.url": mosquitto.url,
            "data.devices": 4,
            "model.name": "logreg",
            "rounds.rounds": 1000,  # stopped once the flood is counted (a loaded box is slow)
            "rounds.clients_per_round": 4,
            "rounds.deadline_s": 20,
        },
    )
    job = build_job(cfg)
    signer, forger = Signer.generate(), Signer.generate()
    core = job.aggregator_core()
    spec = parse_broker_url(mosquitto.url)
    records: list[dict] = []
    topics = job.topics
    dim = job.model.n_params
    attacker = _paho(mosquitto.url, f"attacker-{job_id}")
    acks: list[bytes] = []
    listener = _paho(mosquitto.url, f"ack-listener-{job_id}")
    listener.on_message = lambda _c, _u, m: acks.append(bytes(m.payload))
    listener.subscribe(topics.ack("d00003"), qos=1)
    # before the job: a retained unsigned model far in the future, and one signed by another key
    frozen = GlobalModel(job_id, 2**39, 2**39, np.zeros(dim, np.float32))
    attacker.publish(
        topics.global_model, encode_global(frozen), qos=1, retain=True
    ).wait_for_publish()
    forged = GlobalModel(job_id, 0, 1, np.full(dim, 9.0, np.float32), selected=("d00000",))
    attacker.publish(
        topics.global_model, encode_global(forged, signer=forger), qos=1
    ).wait_for_publish()
    fuzz = _fuzz(job_id, dim, 10_000, np.random.default_rng(0))
    flooded = threading.Event()

    def flood() -> None:
        for payload in fuzz:
            attacker.publish(topics.global_model, payload, qos=0)
        flooded.set()

    async def scenario():
        service = AggregatorService(
            core, spec, topics, expected_devices=4, on_record=records.append,
            signer=signer, acks="rejections",
        )  # fmt: skip
        agg = asyncio.create_task(service.run())
        await service.connected.wait()
        fleet = job.fleet_runtime(spec, trust=job.trust(signer.verifier))
        fleet_task = asyncio.create_task(fleet.run())
        while not records:
            await asyncio.sleep(0.01)
        # a device's own broken update is answered on its ack topic: sent while rounds 2 and 3
        # are still to come (after the flood the job may be over, and nobody left to answer)
        attacker.publish(topics.update("d00003"), b"\x81\xa1v\x01", qos=1).wait_for_publish()
        for _ in range(400):
            if acks:
                break
            await asyncio.sleep(0.05)
        forged_payload = encode_global(forged, signer=forger)
        attacker.publish(topics.global_model, forged_payload, qos=1).wait_for_publish()
        threading.Thread(target=flood, daemon=True).start()
        # the job goes on (rounds keep closing) until the devices have judged the flood
        for _ in range(2400):
            if flooded.is_set() and sum(fleet.trust.rejected.values()) >= 1000:
                break
            await asyncio.sleep(0.05)
        service.request_stop("test: the flood was counted")
        await asyncio.wait_for(agg, 60)
        await asyncio.wait_for(fleet_task, 30)
        return fleet

    try:
        fleet = asyncio.run(scenario())
    finally:
        attacker.loop_stop()
        attacker.disconnect()
    # every round before the stop closed with all four honest updates (the stop decides the
    # open one with what it has)
    assert len(records) >= 2 and [r["status"] for r in records[:-1]] == ["closed"] * (
        len(records) - 1
    )
    assert all(r["received"] == 4 for r in records[:-1])
    rejected = fleet.trust.rejected
    assert sum(rejected.values()) >= 1000, rejected  # the flood reached the devices, counted
    assert rejected["unsigned"] >= 1 and rejected["bad_signature"] >= 1
    listener.loop_stop()
    listener.disconnect()
    answers = [decode_ack(a, topic_device="d00003") for a in acks]
    assert any(not a.ok and a.reason and a.detail for a in answers), answers


def test_offline_statuses_left_by_an_earlier_run_do_not_start_round_one_short(mosquitto):
    """The same job id ran before: every device's last will (offline) is still retained. Half the
    fleet connects at once, half a second later: round 1 waits for the whole fleet instead of
    starting with the first half because the stale wills looked like answers."""
    from edge_fl.protocol import Status, encode_status

    job_id = f"stale-{uuid.uuid4().hex[:6]}"
    cfg = load_config(
        None,
        {
            "job": job_id,
            "broker.url": mosquitto.url,
            "data.devices": 4,
            "model.name": "logreg",
            "rounds.rounds": 1,
            "rounds.clients_per_round": 4,
            "rounds.min_updates": 2,
            "rounds.deadline_s": 20,
        },
    )
    job = build_job(cfg)
    topics = job.topics
    old = _paho(mosquitto.url, f"earlier-run-{job_id}")
    for i in range(4):
        dev = f"d{i:05d}"
        old.publish(topics.status(dev), encode_status(Status(dev, False)), qos=1, retain=True)
    old.loop_stop()
    old.disconnect()
    spec = parse_broker_url(mosquitto.url)
    records: list[dict] = []

    async def scenario() -> None:
        core = job.aggregator_core()
        service = AggregatorService(
            core, spec, topics, expected_devices=4, on_record=records.append
        )
        agg = asyncio.create_task(service.run())
        await service.connected.wait()
        first = job.fleet_runtime(spec, range(0, 2), prefix=f"{job_id}-a")
        second = job.fleet_runtime(spec, range(2, 4), prefix=f"{job_id}-b")
        tasks = [asyncio.create_task(first.run())]
        await asyncio.sleep(0.5)
        tasks.append(asyncio.create_task(second.run()))
        await asyncio.wait_for(agg, 60)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)

    asyncio.run(scenario())
    assert records[0]["selected"] == 4 and records[0]["received"] == 4, records[0]
