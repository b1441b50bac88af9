"""Wire-level bytes (edge_fl.transport.wire): exact MQTT packet sizes, per-device counters on real
sessions, and their agreement with the broker's $SYS byte counters, a loopback packet capture
(tcpdump, root; slow) and ``edge-fl comm-cost``'s per-round figure."""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from pathlib import Path

import aiomqtt
import pytest

from edge_fl.cli.comm_cmds import comm_cost_report, round_wire, wire_round_cost
from edge_fl.config import load_config
from edge_fl.device.runtime import run_device
from edge_fl.job import build_job
from edge_fl.server.service import AggregatorService
from edge_fl.transport.url import parse_broker_url
from edge_fl.transport.wire import (
    LinkModel,
    WireCounter,
    attach,
    ip_bytes,
    mqtt_packet_bytes,
    packet_counts,
    percentiles,
    varint_len,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_wire

TOLERANCE = 0.02  # the bar: within 2%


# ------------------------------------------------------------------------------- pure functions
def test_remaining_length_varint_boundaries() -> None:
    for n, size in ((0, 1), (127, 1), (128, 2), (16_383, 2), (16_384, 3), (2_097_151, 3)):
        assert varint_len(n) == size, n
    assert varint_len(2_097_152) == 4 and varint_len(268_435_455) == 4
    with pytest.raises(ValueError, match="outside"):
        varint_len(268_435_456)


def test_packet_sizes_by_the_mqtt_311_rules() -> None:
    assert mqtt_packet_bytes("pingreq") == mqtt_packet_bytes("pingresp") == 2
    assert mqtt_packet_bytes("disconnect") == 2
    assert mqtt_packet_bytes("puback") == mqtt_packet_bytes("connack") == 4
    # PUBLISH: 1 + varint + (2 + topic) + packet id (QoS > 0) + payload
    assert mqtt_packet_bytes("publish", topic="a/b", payload=10, qos=0) == 1 + 1 + 5 + 10
    assert mqtt_packet_bytes("publish", topic="a/b", payload=b"x" * 10, qos=1) == 1 + 1 + 7 + 10
    # remaining length 128 needs a 2-byte varint: 2 + 3 + 2 + 121 = 128
    assert mqtt_packet_bytes("publish", topic="a/b", payload=121, qos=1) == 1 + 2 + 128
    assert mqtt_packet_bytes("publish", topic="é", payload=0) == 1 + 1 + 2 + 2  # UTF-8 bytes
    # CONNECT: 10 variable header + client id, will topic/message, username, password
    assert mqtt_packet_bytes("connect", client_id="c") == 1 + 1 + 10 + 3
    full = mqtt_packet_bytes(
        "connect", client_id="c", will_topic="w", will_payload=5, username="u", password="pw"
    )
    assert full == 1 + 1 + 10 + 3 + 3 + 7 + 3 + 4
    assert mqtt_packet_bytes("subscribe", topics=["a/b", "c"]) == 1 + 1 + 2 + 6 + 4
    assert mqtt_packet_bytes("suback", topics=["a/b", "c"]) == 1 + 1 + 4
    with pytest.raises(ValueError, match="unknown"):
        mqtt_packet_bytes("auth")
    with pytest.raises(ValueError, match="qos"):
        mqtt_packet_bytes("publish", topic="t", qos=3)


def test_link_model_tls_records_segments_and_acks() -> None:
    link = LinkModel(mss=1448)
    assert link.tls_bytes(100) == 122 and link.tls_bytes(16_385) == 16_385 + 44
    counts = packet_counts([3000], [4], tls=False, link=link)
    assert counts["up_segments"] == 3 and counts["down_segments"] == 1
    up, down = ip_bytes(counts, link)
    assert up == 3000 + 52 * (3 + 1)  # 3 data segments, 1 pure ACK for the 1 received
    assert down == 4 + 52 * (1 + 2)  # 1 data segment, ACKs for every other of the 3
    assert percentiles([]) == {"p50": 0, "p95": 0, "max": 0}
    assert percentiles(list(range(1, 101))) == {"p50": 50, "p95": 95, "max": 100}


# ------------------------------------------------------------------------------- real sessions
@pytest.mark.broker
def test_counter_is_the_packet_size_function_on_a_real_session(mosquitto) -> None:
    """Every byte one client sends and receives, counted by the paho hooks, is exactly what
    mqtt_packet_bytes says for the packets it exchanged (varint boundaries included)."""
    spec = parse_broker_url(mosquitto.url)
    topic = f"wire/{uuid.uuid4().hex[:8]}"
    sizes = [0, 1, 121, 122, 16_370, 16_400, 300_000]
    counter = WireCounter()

    async def session() -> None:
        client = aiomqtt.Client(**spec.aiomqtt_kwargs(), identifier=f"w-{topic[5:]}")
        attach(client, counter)
        async with client:
            await client.subscribe(topic, qos=1)
            for n in sizes:
                await client.publish(topic, b"x" * n, qos=1)
            got = 0
            async for _ in client.messages:
                got += 1
                if got == len(sizes):
                    break

    asyncio.run(session())
    client_id = f"w-{topic[5:]}"
    publishes = sum(mqtt_packet_bytes("publish", topic=topic, payload=n, qos=1) for n in sizes)
    puback = mqtt_packet_bytes("puback")
    up = (
        mqtt_packet_bytes("connect", client_id=client_id)
        + mqtt_packet_bytes("subscribe", topics=[topic])
        + publishes
        + puback * len(sizes)  # for every message delivered to us
        + mqtt_packet_bytes("disconnect")
    )
    down = (
        mqtt_packet_bytes("connack")
        + mqtt_packet_bytes("suback", topics=[topic])
        + puback * len(sizes)
        + publishes
    )
    totals = counter.totals()
    assert (totals["up"], totals["down"]) == (up, down)
    assert totals["connections"] == 1


def _per_device_round(records: list[dict], devices: int) -> tuple[float, float]:
    """Mean wire bytes of one device in one round, rounds after the first (which also carries
    every session's CONNECT, status and subscription)."""
    later = records[1:]
    up = sum(r["wire_up"] for r in later) / (len(later) * devices)
    down = sum(r["wire_down"] for r in later) / (len(later) * devices)
    return up, down


@pytest.mark.broker
def test_job_wire_bytes_match_sys_counters_and_comm_cost() -> None:
    """A real job (3 devices, 3 rounds, each device receiving the model on its own session):
    the process's MQTT bytes equal the broker's $SYS counters; the records' per-device per-round
    bytes match comm-cost's wire figure; the summary totals add up."""
    devices = 3
    out = bench_wire.measure(devices, 3, capture=False, device_downlink=True)
    ratios = bench_wire.ratios(out)
    assert ratios["mqtt_up_vs_sys_received"] == pytest.approx(1, abs=TOLERANCE)
    assert ratios["mqtt_down_vs_sys_sent"] == pytest.approx(1, abs=TOLERANCE)
    records, summary = out["records"], out["summary"]
    assert len(records) == 3
    for r in records:
        assert r["wire_devices"] == devices
        assert r["wire_up"] > r["bytes_up"] and r["wire_down"] > r["bytes_down"] / 2
        assert r["wire_up_p50"] <= r["wire_up_p95"] <= r["wire_up_max"] <= r["wire_up"]
        assert r["wire_up_ip"] > r["wire_up"] and r["wire_down_ip"] > r["wire_down"]
    for key in ("wire_up", "wire_down", "wire_up_ip", "wire_down_ip"):
        after = summary["wire"]["after_last_round"][key]
        assert summary[f"total_{key}"] == sum(r[key] for r in records) + after
    # device sessions are part of what the broker counted
    assert summary["total_wire_up"] < out["sys"]["received"]
    up, down = _per_device_round(records, devices)
    predicted = wire_round_cost(summary["n_params"], selected=devices, job=out["job"])
    assert up == pytest.approx(predicted["up"], rel=TOLERANCE)
    assert down == pytest.approx(predicted["down"], rel=TOLERANCE)
    report = comm_cost_report(summary["n_params"], samples=2, job=out["job"])
    assert report["codecs"]["f32"]["wire"]["up"] == pytest.approx(up, rel=TOLERANCE)


@pytest.mark.broker
def test_a_q8_downlink_jobs_wire_bytes_match_comm_cost() -> None:
    """The quantised global model (compression.downlink: q8): a real job's per-device per-round
    downlink is what comm-cost's wire model says for it, and about a quarter of f32's."""
    devices = 3
    out = bench_wire.measure(
        devices, 3, capture=False, device_downlink=True, **{"compression.downlink": "q8"}
    )
    ratios = bench_wire.ratios(out)
    assert ratios["mqtt_down_vs_sys_sent"] == pytest.approx(1, abs=TOLERANCE)
    up, down = _per_device_round(out["records"], devices)
    n_params = out["summary"]["n_params"]
    q8 = wire_round_cost(n_params, selected=devices, job=out["job"], downlink="q8")
    f32 = wire_round_cost(n_params, selected=devices, job=out["job"])
    assert up == pytest.approx(q8["up"], rel=TOLERANCE)
    assert down == pytest.approx(q8["down"], rel=TOLERANCE)
    assert q8["down"] < f32["down"] / 3.5


@pytest.mark.broker
def test_charged_downlink_matches_measured_per_device_downlink() -> None:
    """The fleet's default (one shared downlink, each device charged its own subscription's
    packets) gives the same per-device figures as devices that really subscribe."""
    measured = bench_wire.measure(3, 3, capture=False, device_downlink=True)
    charged = bench_wire.measure(3, 3, capture=False, device_downlink=False)
    for key in ("wire_up", "wire_down"):
        a = sum(r[key] for r in measured["records"])
        b = sum(r[key] for r in charged["records"])
        assert b == pytest.approx(a, rel=TOLERANCE), key
    # the shared downlink's copy is not billed to any device
    assert charged["summary"]["wire"]["shared_downlink"]["down"] > 0
    assert charged["summary"]["wire"]["device_downlink"] is False


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_wire_bytes_match_a_loopback_capture(tls: bool) -> None:
    """$SYS and a tcpdump capture of the broker port for the same job: MQTT bytes within 2% of
    $SYS, the TLS + TCP/IP model within 2% of the captured TCP payload and IP bytes."""
    why = bench_wire.capture_unavailable()
    if why:
        pytest.skip(why)
    out = bench_wire.measure(4, 3, tls=tls, capture=True, device_downlink=True)
    for name, ratio in bench_wire.ratios(out).items():
        assert ratio == pytest.approx(1, abs=TOLERANCE), (name, ratio, out["capture"])
    if tls:  # the capture sees TLS records: more than the MQTT bytes
        assert out["capture"]["up_tcp"] > out["process"]["up"]


@pytest.mark.broker
def test_device_agent_logs_its_own_wire_bytes(mosquitto, caplog) -> None:
    """`edge-fl device`'s agent counts its sessions and logs per round and in total; the
    total is what its counter holds, and a round's line matches comm-cost's round."""
    cfg = load_config(
        None,
        {
            "job": f"wdev-{uuid.uuid4().hex[:6]}",
            "broker.url": mosquitto.url,
            "data.devices": 2,
            "data.dataset": "digits",
            "model.name": "mlp",
            "rounds.rounds": 3,
            "rounds.clients_per_round": 2,
        },
    )
    job = build_job(cfg)
    core = job.aggregator_core()
    spec = parse_broker_url(mosquitto.url)
    counters = [WireCounter(), WireCounter()]
    records: list[dict] = []

    async def scenario() -> None:
        service = AggregatorService(
            core,
            spec,
            job.topics,
            wait_for_devices_s=20,
            expected_devices=2,
            on_record=records.append,
        )
        agg = asyncio.create_task(service.run())
        await service.connected.wait()
        devices = [
            asyncio.create_task(run_device(job.agent(i), spec, job.topics, wire=counters[i]))
            for i in range(2)
        ]
        await asyncio.wait_for(agg, 60)
        await asyncio.wait_for(asyncio.gather(*devices), 30)

    with caplog.at_level(logging.INFO, logger="edge_fl.device"):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if "wire up" in r.getMessage()]
    totals = [line for line in lines if "total" in line]
    assert len(totals) == 2
    for counter in counters:
        t = counter.totals()
        assert any(f"wire up {t['up']} B, down {t['down']} B" in line for line in totals)
        assert t["connections"] == 1
    rounds = [line for line in lines if line.startswith("round 2:")]
    assert len(rounds) == 2
    # a round's line follows its own update (it once came at the model's arrival, so each line
    # carried the previous round's update: a data bill one round late)
    said = [r.getMessage() for r in caplog.records]
    sent = [i for i, m in enumerate(said) if m.startswith("round 2: sent")]
    logged = [i for i, m in enumerate(said) if m.startswith("round 2: wire up")]
    assert len(sent) == len(logged) == 2
    assert all(s < w for s, w in zip(sent, logged, strict=True))
    predicted = round_wire(0, 0, job=cfg.job)  # the packets' overhead, without the payloads
    assert predicted["up"] > 0
    # round 2's line: the model down, the update up, PUBACKs (and round 1's update PUBACK)
    up = int(rounds[0].split("wire up ")[1].split(" B")[0])
    payload_up = records[1]["bytes_up"] / 2
    overhead = round_wire(int(payload_up), 0, job=cfg.job)["up"]
    assert up == pytest.approx(overhead, rel=TOLERANCE)
    # exactly the update's PUBLISH: the model arrives at QoS 0 (the device subscribes at QoS 0),
    # so the device sends no PUBACK for it
    assert up == overhead
