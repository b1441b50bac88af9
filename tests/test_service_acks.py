"""Every ack carries the round ``r`` of the update it answers, and held async updates are acked
with their later verdict (issue 23: positive acks and the aggregator's own rejections carried no
``r``, contradicting docs/protocol.md and its ``ack_accepted`` vector; a held update was acked
``ok: true`` at once and its real verdict never).

The policy runs on real engines (sync and FedBuff) and real encoded updates, no broker."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import numpy as np
import paho.mqtt.client as paho
import pytest

from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import (
    DenseUpdate,
    Reject,
    Status,
    Topics,
    UpdateLimits,
    decode_ack,
    encode_status,
    encode_update,
)
from edge_fl.server.acks import AckPolicy, round_of
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings
from edge_fl.server.service import AggregatorService
from edge_fl.server.staleness import Staleness
from edge_fl.transport.url import parse_broker_url

D = 4
DEVICES = ["d0", "d1", "d2"]


def engine(job: str = "j", **kw) -> AggregatorCore:
    settings = dict(job=job, rounds=5, target=3, min_updates=1, deadline_s=10.0) | kw
    core = AggregatorCore(
        AggregatorSettings(**settings), np.zeros(D, np.float32), UpdateLimits(D),
        seeded_generator(1),
    )  # fmt: skip
    for d in DEVICES:
        core.on_status(d, encode_status(Status(d, True, 100)))
    return core


def update(core: AggregatorCore, device: str, rnd: int, nonce: bytes | None = None) -> bytes:
    nonce = core.nonce_of(rnd) if nonce is None else nonce
    base = rnd if core.settings.mode != "sync" else core.version
    return encode_update(DenseUpdate(device, rnd, base, 10, np.ones(D, np.float32), nonce=nonce))


def judged(policy: AckPolicy, core: AggregatorCore, device: str, payload: bytes):
    window = core.current
    counted = window.count if window is not None else None
    reason = core.on_update(device, payload)
    held = reason is None and (core.current is None or core.current.count == counted)
    reply = policy.reply(core, device, payload, reason, held=held)
    return reason, (decode_ack(reply, device) if reply is not None else None)


def test_accepted_and_the_aggregators_own_rejections_carry_the_round():
    core = engine()
    core.open_round(0.0)
    policy = AckPolicy("all")
    reason, ack = judged(policy, core, "d0", update(core, "d0", 1))
    assert reason is None and ack is not None
    assert (ack.ok, ack.round, ack.reason) == (True, 1, None)
    reason, ack = judged(policy, core, "d0", update(core, "d0", 1))
    assert reason is Reject.DUPLICATE and ack is not None and (ack.ok, ack.round) == (False, 1)
    reason, ack = judged(policy, core, "d1", update(core, "d1", 1, nonce=b"x" * 16))
    assert reason is Reject.WRONG_NONCE and ack is not None and ack.round == 1
    reason, ack = judged(policy, core, "d2", update(core, "d2", 7, nonce=b"y" * 16))
    assert reason in (Reject.FUTURE, Reject.WRONG_NONCE) and ack is not None and ack.round == 7


def test_rejections_mode_acks_rejections_only_and_off_nothing():
    core = engine()
    core.open_round(0.0)
    rejections, off = AckPolicy("rejections"), AckPolicy("off")
    payload = update(core, "d0", 1)
    assert core.on_update("d0", payload) is None
    assert rejections.reply(core, "d0", payload, None) is None
    assert core.on_update("d0", payload) is Reject.DUPLICATE
    ack = decode_ack(rejections.reply(core, "d0", payload, Reject.DUPLICATE), "d0")
    assert (ack.ok, ack.reason, ack.round) == (False, "duplicate", 1)
    assert off.reply(core, "d0", payload, Reject.DUPLICATE) is None


def test_a_stranger_and_a_flood_get_no_flood_back():
    core = engine()
    core.open_round(0.0)
    policy = AckPolicy("all")
    payload = update(core, "d0", 1)
    assert policy.reply(core, "zz", payload, Reject.NOT_SELECTED) is None  # never announced
    replies = [policy.reply(core, "d0", payload, Reject.DUPLICATE) for _ in range(20)]
    assert sum(r is not None for r in replies) == AckPolicy.MAX_PER_ROUND


def test_a_held_async_update_is_acked_with_the_verdict_of_the_window_that_takes_it():
    core = engine(mode="fedbuff", buffer_size=1, max_staleness=4, staleness=Staleness("constant"))
    policy = AckPolicy("all")
    core.open_round(0.0)
    reason, ack = judged(policy, core, "d0", update(core, "d0", 0))
    assert reason is None and ack is not None and (ack.ok, ack.round) == (True, 0)
    # the window (K = 1) is full: d1's answer is held, not acked yet
    reason, ack = judged(policy, core, "d1", update(core, "d1", 0))
    assert reason is None and ack is None and policy.held == {("d1", 0)}
    core.decide(1.0)
    core.close_round(1.0, 0.1)
    core.open_round(2.0)
    verdicts = {d: decode_ack(p, d) for d, p in policy.held_verdicts(core)}
    assert verdicts["d1"].ok and verdicts["d1"].round == 0
    assert policy.held == set()


def test_round_of_reads_only_an_int_r_in_range():
    core = engine()
    core.open_round(0.0)
    assert round_of(update(core, "d0", 1)) == 1
    assert round_of(b"\x81\xa1r\xc3") is None  # r: true
    assert round_of(b"not msgpack \xc1") is None
    assert round_of(b"\x81\xa1r\xcf" + (2**41).to_bytes(8, "big")) is None


@pytest.mark.broker
def test_the_service_acks_over_mosquitto_name_the_round(mosquitto):
    """The aggregator service with ``acks: all`` on a real broker: a device's accepted update,
    its duplicate and another device's wrong-nonce update are each acked on ``ack/<device>``
    with ``r`` (before: only the wrong nonce's, and only with its decoder detail)."""
    job = f"acks-{uuid.uuid4().hex[:6]}"
    topics = Topics(job)
    core = engine(job)
    service = AggregatorService(
        core, parse_broker_url(mosquitto.url), topics, acks="all", wait_for_devices_s=5,
        expected_devices=3,
    )  # fmt: skip
    host, port = mosquitto.url.removeprefix("mqtt://").rsplit(":", 1)
    acks: list = []
    got = threading.Condition()
    device = paho.Client(paho.CallbackAPIVersion.VERSION2, f"dev-{job}")

    def on_message(_c, _u, msg) -> None:
        with got:
            acks.append(decode_ack(msg.payload, topics.device_of(msg.topic, "ack")))
            got.notify_all()

    device.on_message = on_message
    device.connect(host, int(port))
    device.subscribe(topics.ack("+"), qos=1)
    device.loop_start()

    async def scenario() -> None:
        run = asyncio.create_task(service.run())
        until = time.monotonic() + 30
        while core.current is None:
            assert time.monotonic() < until and not run.done(), "round 1 never opened"
            await asyncio.sleep(0.02)
        good = update(core, "d0", 1)
        device.publish(topics.update("d0"), good, qos=1)
        device.publish(topics.update("d0"), good, qos=1)
        device.publish(topics.update("d1"), update(core, "d1", 1, nonce=b"n" * 16), qos=1)
        while len(acks) < 3:
            assert time.monotonic() < until, f"acks seen: {acks}"
            await asyncio.sleep(0.02)
        service.request_stop("test")
        await asyncio.wait_for(run, 30)

    try:
        asyncio.run(scenario())
    finally:
        device.loop_stop()
        device.disconnect()
    seen = sorted((a.device, a.ok, a.reason, a.round) for a in acks)
    assert seen == [
        ("d0", False, "duplicate", 1),
        ("d0", True, None, 1),
        ("d1", False, "wrong_nonce", 1),
    ]
