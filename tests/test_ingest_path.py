"""The aggregator's ingest path: the tap that parses PUBLISH packets off paho's socket, and the
service's acknowledgements over a real Mosquitto (sent, and only after the journal's fsync)."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import paho.mqtt.client as paho
import pytest

from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import DenseUpdate, Status, Topics, UpdateLimits, encode_status, encode_update
from edge_fl.server import journal as journal_module
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings
from edge_fl.server.service import AggregatorService, IngestTap
from edge_fl.storage import OutputError
from edge_fl.transport.broker import EmbeddedBroker

NONCE = bytes(range(16))
TOPICS = Topics("ingest")
N_PARAMS = 20


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def publish(topic: str, payload: bytes, mid: int = 0, qos: int = 0, retain: bool = False) -> bytes:
    body = len(topic).to_bytes(2, "big") + topic.encode() + (mid.to_bytes(2, "big") if qos else b"")
    body += payload
    return bytes([0x30 | qos << 1 | int(retain)]) + varint(len(body)) + body


CONNACK = b"\x20\x02\x00\x00"
SUBACK = b"\x90\x03\x00\x01\x01"
PINGRESP = b"\xd0\x00"


def read_all(tap: IngestTap) -> bytes:
    """What paho would read: one byte, then more, until the tap has nothing for it."""
    got = b""
    while True:
        try:
            chunk = tap.recv(1 if len(got) % 2 == 0 else 3)
        except BlockingIOError:
            return got
        if not chunk:
            return got
        got += chunk


@pytest.mark.parametrize("step", [1, 7, 100_000])
def test_tap_hands_publishes_over_and_the_rest_to_paho_in_order(step):
    """Fed in pieces of ``step`` bytes over a real socket: every QoS 0/1 PUBLISH reaches the
    handler whole and once; CONNACK/SUBACK/PINGRESP and a QoS 2 PUBLISH reach paho byte for byte;
    a packet for paho stops the tap until paho has read it (stream order is kept)."""
    big = bytes(range(256)) * 80  # 20 KB: a remaining length of three bytes
    qos2 = publish("x/up/q2", b"two", mid=9, qos=2)
    stream = [
        CONNACK,
        publish("x/up/d1", b"one", mid=1, qos=1),
        publish("x/status/d2", b"", qos=0, retain=True),
        SUBACK,
        publish("x/up/d3", big, mid=65535, qos=1),
        qos2,
        PINGRESP,
        publish("x/up/d4", b"last", mid=2, qos=1),
    ]
    data = b"".join(stream)
    a, b = socket.socketpair()
    a.setblocking(False)
    seen: list[tuple] = []
    tap = IngestTap(a, lambda *m: seen.append(m))
    to_paho = b""
    try:
        for i in range(0, len(data), step):
            b.sendall(data[i : i + step])  # a socket pair: readable at once
            to_paho += read_all(tap)
            while tap.pending():
                to_paho += read_all(tap)
        to_paho += read_all(tap)
    finally:
        a.close()
        b.close()
    assert seen == [
        ("x/up/d1", b"one", 1, 1, False),
        ("x/status/d2", b"", 0, 0, True),
        ("x/up/d3", big, 65535, 1, False),
        ("x/up/d4", b"last", 2, 1, False),
    ]
    assert to_paho == CONNACK + SUBACK + qos2 + PINGRESP
    assert (tap.diverted, tap.passed) == (4, 4)


def test_tap_holds_publishes_behind_a_packet_paho_has_not_read():
    a, b = socket.socketpair()
    a.setblocking(False)
    seen: list[tuple] = []
    tap = IngestTap(a, lambda *m: seen.append(m))
    try:
        b.sendall(SUBACK + publish("x/up/d1", b"1", mid=5, qos=1))
        time.sleep(0.01)
        assert tap.recv(1) == SUBACK[:1]
        assert seen == []  # the PUBLISH after the SUBACK waits for paho to finish reading it
        assert tap.pending() > 0
        assert tap.recv(100) == SUBACK[1:]
        with pytest.raises(BlockingIOError):
            tap.recv(1)
        assert seen == [("x/up/d1", b"1", 5, 1, False)]
        assert tap.pending() == 0
        b.close()
        assert tap.recv(1) == b""  # the broker closed: paho sees the end of the stream
    finally:
        a.close()


# ------------------------------------------------------------------ the service over Mosquitto


def make_core(n: int) -> AggregatorCore:
    core = AggregatorCore(
        AggregatorSettings(job="ingest", rounds=1, target=n, min_updates=n, deadline_s=60),
        np.zeros(N_PARAMS, np.float32),
        UpdateLimits(N_PARAMS),
        seeded_generator(0),
    )
    for i in range(n):
        core.on_status(f"d{i:04d}", encode_status(Status(f"d{i:04d}", True, 30)))
    core.open_round(0.0)
    assert core.current is not None
    core.current.nonce = NONCE
    return core


def queue(spec, client_id: str, n: int) -> None:
    """The service's persistent session exists and holds ``n`` QoS 1 updates (more than the
    broker's 100 in flight: the drain stalls unless acknowledgements flow back)."""
    sub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
    sub.connect(spec.host, spec.port)
    sub.loop_start()
    sub.subscribe(TOPICS.all_updates, qos=1)
    time.sleep(0.2)
    sub.disconnect()
    sub.loop_stop()
    pub = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"{client_id}-pub")
    pub.connect(spec.host, spec.port)
    pub.loop_start()
    rng = np.random.default_rng(1)
    infos = []
    for i in range(n):
        dev = f"d{i:04d}"
        delta = rng.standard_normal(N_PARAMS).astype(np.float32)
        payload = encode_update(DenseUpdate(dev, 1, 0, 10, delta, nonce=NONCE))
        infos.append(pub.publish(TOPICS.update(dev), payload, qos=1))
    for info in infos:
        info.wait_for_publish(10)
    pub.disconnect()
    pub.loop_stop()


def left_in_session(spec, client_id: str) -> int:
    """Messages the broker still holds for the session (delivered again: never acknowledged)."""
    got = []
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
    c.on_message = lambda _c, _u, m: got.append(m.mid)
    c.connect(spec.host, spec.port)
    c.loop_start()
    time.sleep(0.5)
    c.disconnect()
    c.loop_stop()
    return len(got)


@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker(kind="mosquitto") as b:
        yield b


def test_service_drains_a_queued_session_and_acks_each_update_after_its_fsync(
    broker, tmp_path, monkeypatch
):
    """300 updates queued for the service's session: all accepted, each acknowledged (nothing
    left in the session), and no acknowledgement leaves before an fsync has made durable as many
    journal records as there are acknowledgements (each accepted update journals at least one
    record, in the order received). Both sync paths count: ``sync`` on the event loop, and
    ``write_now`` then ``fsync_written`` on the syncer thread while the loop reads the next group."""
    n, cid = 300, "ingest-acks"
    queue(broker.spec, cid, n)
    journal_cls = journal_module.Journal
    append, sync = journal_cls.append, journal_cls.sync
    write_now, fsync_written = journal_cls.write_now, journal_cls.fsync_written
    ack = paho.Client.ack
    count = {"appended": 0, "written": 0, "durable": 0, "acks": 0, "early": 0}

    def tracking_append(self, kind, **fields):
        count["appended"] += 1
        return append(self, kind, **fields)

    def tracking_sync(self):
        upto = count["appended"]
        sync(self)
        count["durable"] = max(count["durable"], upto)

    def tracking_write_now(self):
        count["written"] = count["appended"]
        return write_now(self)

    def tracking_fsync_written(self):  # the syncer thread
        upto = count["written"]
        fsync_written(self)
        count["durable"] = max(count["durable"], upto)

    def tracking_ack(self, mid, qos):
        count["acks"] += 1
        if count["acks"] > count["durable"]:
            count["early"] += 1
        return ack(self, mid, qos)

    monkeypatch.setattr(journal_cls, "append", tracking_append)
    monkeypatch.setattr(journal_cls, "sync", tracking_sync)
    monkeypatch.setattr(journal_cls, "write_now", tracking_write_now)
    monkeypatch.setattr(journal_cls, "fsync_written", tracking_fsync_written)
    monkeypatch.setattr(paho.Client, "ack", tracking_ack)
    core = make_core(n)
    journal = journal_module.Journal.start(tmp_path, job="ingest", digest="x")
    service = AggregatorService(
        core,
        broker.spec,
        TOPICS,
        expected_devices=n,
        client_id=cid,
        checkpoint_dir=str(tmp_path),
        journal=journal,
    )
    asyncio.run(asyncio.wait_for(service.run(), 60))
    journal.close()
    assert (core.records[-1]["received"], core.records[-1]["rejected"]) == (n, 0)
    assert service.tap is not None and service.tap.diverted >= n
    assert count["acks"] >= n
    assert count["early"] == 0, "an acknowledgement left before the journal's fsync"
    assert left_in_session(broker.spec, cid) == 0


def test_a_journal_that_cannot_be_written_stops_the_service_unacknowledged(
    broker, tmp_path, monkeypatch
):
    """The disk fails on the first accepted update: the service stops with that error (it does
    not reconnect and go on), and the update stays in the broker's session, unacknowledged."""
    n, cid = 5, "ingest-disk"
    queue(broker.spec, cid, n)

    def full_disk(self, kind, **fields):
        raise OutputError(self.path, OSError(28, "No space left on device"))

    journal = journal_module.Journal.start(tmp_path, job="ingest", digest="x")
    monkeypatch.setattr(journal_module.Journal, "append", full_disk)
    service = AggregatorService(
        make_core(n),
        broker.spec,
        TOPICS,
        expected_devices=n,
        client_id=cid,
        checkpoint_dir=str(tmp_path),
        journal=journal,
    )
    with pytest.raises(OutputError):
        asyncio.run(asyncio.wait_for(service.run(), 30))
    journal.close()
    assert left_in_session(broker.spec, cid) == n


def test_ack_on_receipt_mode_acknowledges_every_update(broker):
    """``ack_after_processing = False`` (the chaos tool's comparison): the tap acknowledges each
    update as it is read, those delivered while connecting too (else the broker's 100 in flight
    would stall the drain)."""
    n, cid = 250, "ingest-auto-ack"
    queue(broker.spec, cid, n)
    core = make_core(n)
    service = AggregatorService(core, broker.spec, TOPICS, expected_devices=n, client_id=cid)
    service.ack_after_processing = False
    asyncio.run(asyncio.wait_for(service.run(), 60))
    assert (core.records[-1]["received"], core.records[-1]["rejected"]) == (n, 0)
    assert left_in_session(broker.spec, cid) == 0
