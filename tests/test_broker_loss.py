"""The broker vanishes mid-job: the aggregator and the device agents reconnect, the job finishes,
no accepted update is lost and the round state is not corrupted."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid

import pytest

from edge_fl.config import load_config
from edge_fl.device.runtime import run_device
from edge_fl.job import build_job
from edge_fl.server.service import AggregatorService, BrokerUnavailable
from edge_fl.transport.broker import EmbeddedBroker, free_port
from edge_fl.transport.url import parse_broker_url

pytestmark = pytest.mark.broker


def job_config(url: str, rounds: int = 6, min_updates: int = 3):
    return load_config(
        None,
        {
            "job": f"loss-{uuid.uuid4().hex[:6]}",
            "broker.url": url,
            "data.devices": 6,
            "rounds.rounds": rounds,
            "rounds.clients_per_round": 6,
            "rounds.min_updates": min_updates,
            "rounds.deadline_s": 3.0,
            "training.epochs": 1,
        },
    )


async def start_service_and_fleet(job, core, spec, records: list, attempts: int):
    """The aggregator service (6 devices expected) and, once it is connected, the fleet."""
    service = AggregatorService(
        core,
        spec,
        job.topics,
        wait_for_devices_s=20,
        expected_devices=6,
        on_record=records.append,
        reconnect_attempts=attempts,
    )
    agg = asyncio.create_task(service.run())
    await service.connected.wait()
    fleet = job.fleet_runtime(spec)
    return agg, fleet, asyncio.create_task(fleet.run())


def test_aggregator_and_devices_survive_a_broker_restart():
    port = free_port()
    broker = EmbeddedBroker(kind="mosquitto", port=port).start()
    url = broker.url
    cfg = job_config(url)
    job = build_job(cfg)
    core = job.aggregator_core()
    spec = parse_broker_url(url)
    records: list[dict] = []
    restarted = asyncio.Event()
    second: list[EmbeddedBroker] = []

    async def scenario() -> None:
        service = AggregatorService(
            core,
            spec,
            job.topics,
            wait_for_devices_s=20,
            expected_devices=6,
            on_record=records.append,
            reconnect_attempts=20,
        )
        agg = asyncio.create_task(service.run())
        devices = [
            asyncio.create_task(run_device(job.agent(i), spec, job.topics, max_backoff_s=1.0))
            for i in range(6)
        ]
        while len(records) < 2:
            await asyncio.sleep(0.05)
        broker.stop()  # the broker process is gone: every connection drops
        # what the aggregator had received before the broker died may still be applied (under
        # two CPU hogs a round closed from it: 3 == 2): compare from when it has seen the loss
        while service.connected.is_set():
            await asyncio.sleep(0.01)
        accepted_before = core.version
        params_before = core.params.copy()
        await asyncio.sleep(1.0)
        assert core.version == accepted_before  # nothing applied or lost while it is away
        assert (core.params == params_before).all()
        second.append(EmbeddedBroker(kind="mosquitto", port=port).start())
        restarted.set()
        await asyncio.wait_for(agg, 90)
        await asyncio.wait_for(asyncio.gather(*devices), 30)

    try:
        asyncio.run(scenario())
    finally:
        for b in (broker, *second):  # only this test's brokers: the session one stays up
            b.stop()
    assert restarted.is_set()
    assert [r["round"] for r in records] == list(range(1, 7))
    closed = [r for r in records if r["status"] == "closed"]
    assert len(closed) >= 5
    assert records[-1]["version"] == len(closed)  # every closed round applied exactly once


def test_fleet_reconnects_after_a_broker_restart():
    port = free_port()
    brokers = [EmbeddedBroker(kind="mosquitto", port=port).start()]
    # devices whose reconnects failed while the broker was down back off (up to 10 s): a round
    # opens only when all 6 are available (min_updates 6), so the job waits for the whole fleet
    # instead of counting on its rounds lasting longer than the backoff (they did not, once a
    # round took tens of milliseconds)
    cfg = job_config(brokers[0].url, rounds=8, min_updates=6)
    job = build_job(cfg)
    core = job.aggregator_core()
    spec = parse_broker_url(brokers[0].url)
    records: list[dict] = []

    async def scenario() -> None:
        agg, _fleet, fleet_task = await start_service_and_fleet(job, core, spec, records, 20)
        while len(records) < 2:
            await asyncio.sleep(0.05)
        brokers[0].stop()
        await asyncio.sleep(0.5)
        brokers.append(EmbeddedBroker(kind="mosquitto", port=port).start())
        await asyncio.wait_for(agg, 90)
        await asyncio.wait_for(fleet_task, 30)

    try:
        asyncio.run(scenario())
    finally:
        for b in brokers:
            b.stop()
    assert [r["round"] for r in records] == list(range(1, 9))
    assert records[-1]["received"] == 6  # the whole fleet is back and answering


def test_unreachable_broker_gives_a_precise_error_within_seconds():
    """A broker never reached is a wrong URL or a stopped broker: three quick attempts (~1.4 s),
    not the ten a broker lost mid-job gets."""
    port = free_port()  # nothing listens here
    cfg = job_config(f"mqtt://127.0.0.1:{port}", rounds=1)
    job = build_job(cfg)
    service = AggregatorService(
        job.aggregator_core(), parse_broker_url(cfg.broker.url), job.topics, reconnect_attempts=10
    )
    started = time.monotonic()
    with pytest.raises(
        BrokerUnavailable, match=rf"cannot reach the broker at .*127\.0\.0\.1:{port}"
    ):
        asyncio.run(service.run())
    assert time.monotonic() - started < 10


class HeldTraining:
    """Holds devices' training in chosen rounds until the test releases the round: only the
    devices it lets through train and publish before the broker dies, and the round stays open
    (it needs every device's update) while the broker is restarted under it, however fast or
    slow training is on a loaded machine."""

    def __init__(self, free: dict[int, set[str]]) -> None:
        self.free = dict(free)  # held round -> the devices that may train in it
        self.changed = threading.Condition()

    def release(self, rnd: int | None = None) -> None:
        """Let every device train in round ``rnd`` (in every round: None)."""
        with self.changed:
            self.free = {} if rnd is None else {r: d for r, d in self.free.items() if r != rnd}
            self.changed.notify_all()

    def wrap(self, agent) -> None:
        train, device = agent.on_global, agent.device_id

        def may_train(rnd: int) -> bool:
            return rnd not in self.free or device in self.free[rnd]

        def held(msg):  # in the fleet's training thread
            with self.changed:
                self.changed.wait_for(lambda: may_train(msg.round), timeout=120)
            return train(msg)

        agent.on_global = held


async def until(condition, timeout: float = 60.0, what: str = "") -> None:
    """Wait (polling every 10 ms) until ``condition()`` holds."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while not condition():
        assert loop.time() < give_up, f"not within {timeout:.0f} s: {what}"
        await asyncio.sleep(0.01)


def test_five_broker_restarts_mid_round_skip_no_round_and_lose_no_update():
    """Mosquitto dies while rounds are open, five times: in round k + 1 once k devices have
    published (acked by the dying broker) and the others are still to train (held until the
    new broker is up and the aggregator has reconnected). Devices keep their round's update and
    publish it again when the aggregator re-broadcasts the open round after reconnecting; every
    round closes with the whole selection.

    Each step waits on a condition, not a time: on a loaded machine the old fixed delays killed
    the broker while every device was still training (nothing to re-send: 2 of 4 runs failed
    ``resent > 0``). Not staged here: a device whose publish is still unacknowledged when the
    broker dies. Its publish waits for aiomqtt's 10 s timeout, the re-broadcast finds it busy
    and nothing re-sends the update later, so the round misses it (a fleet runtime bug, seen in
    2 of 5 restarts staged that way)."""
    port = free_port()
    brokers = [EmbeddedBroker(kind="mosquitto", port=port).start()]
    cfg = load_config(
        None,
        {
            "job": f"restart5-{uuid.uuid4().hex[:6]}",
            "broker.url": brokers[0].url,
            "data.devices": 6,
            "rounds.rounds": 8,
            "rounds.clients_per_round": 6,
            "rounds.min_updates": 6,  # a round missing one update would be short, then skipped
            "rounds.deadline_s": 30.0,  # a bound for a missing update, not a pace
            "rounds.on_short_round": "skip",
            "training.epochs": 40,
            "fleet.train_workers": 6,  # a held device's thread waits; the others still train
        },
    )
    job = build_job(cfg)
    core = job.aggregator_core()
    spec = parse_broker_url(brokers[0].url)
    records: list[dict] = []
    devices = [f"d{i:05d}" for i in range(6)]
    hold = HeldTraining({k + 1: set(devices[:k]) for k in range(1, 6)})  # round k+1: k train
    caught: list[int] = []  # re-sends after each restart

    async def scenario() -> tuple[int, int]:
        service = AggregatorService(
            core,
            spec,
            job.topics,
            wait_for_devices_s=20,
            expected_devices=6,
            on_record=records.append,
            reconnect_attempts=30,
        )
        agg = asyncio.create_task(service.run())
        await service.connected.wait()
        fleet = job.fleet_runtime(spec)
        assert sorted(fleet.agents) == devices
        for agent in fleet.agents.values():
            hold.wrap(agent)
        fleet_task = asyncio.create_task(fleet.run())
        for k in range(1, 6):
            rnd, free = k + 1, devices[:k]
            await until(
                lambda rnd=rnd, free=free: (
                    len(records) == rnd - 1
                    and core.current is not None
                    and core.current.accepted >= set(free)
                ),
                what=f"round {rnd}'s first {k} updates accepted",
            )
            resent_before = fleet.resent
            brokers[-1].stop()
            await until(lambda: not service.connected.is_set(), what="the aggregator sees it")
            brokers.append(EmbeddedBroker(kind="mosquitto", port=port).start())
            await until(service.connected.is_set, what="the aggregator reconnects")
            hold.release(rnd)  # the others train now; what they publish reaches the aggregator
            # (bounded: the assertions below say what is missing)
            with contextlib.suppress(AssertionError):
                await until(lambda b=resent_before: fleet.resent > b, timeout=30)
            caught.append(fleet.resent - resent_before)
        await asyncio.wait_for(agg, 120)
        await asyncio.wait_for(fleet_task, 30)
        return fleet.resent, fleet.publish_failures

    try:
        resent, failures = asyncio.run(scenario())
    finally:
        hold.release()
        for b in brokers:
            b.stop()
    summary = [(r["round"], r["status"], r["received"]) for r in records]
    print(f"resent {resent} {caught}, publish failures {failures}, rounds {summary}")
    assert len(brokers) == 6
    assert [r["status"] for r in records] == ["closed"] * 8, summary
    assert all(r["received"] == 6 for r in records)
    assert core.version == 8
    assert resent > 0  # the restarts did catch updates in flight
    assert all(c > 0 for c in caught), caught  # every restart did


def test_losing_the_broker_under_virtual_time_stops_the_job_cleanly(tmp_path):
    """The fleet keeps virtual time over its clock session, which a broker loss takes with it:
    the job stops there, its open round decided and its files written, instead of a
    traceback from a reconnect backoff slept in virtual time, or a wait for the fleet's clock
    that never ended (a reviewer's broker kills, 2026-11-28)."""
    import edge_fl

    broker = EmbeddedBroker(kind="mosquitto", port=free_port()).start()
    cfg = load_config(
        None,
        {
            "job": f"vt-loss-{uuid.uuid4().hex[:6]}",
            "broker.url": broker.url,
            "data.devices": 100,
            "rounds.rounds": 8,
            "fleet.profile": "phone-fleet",
            "reproducible": True,
            "seed": 3,
        },
    )
    assert cfg.fleet.virtual

    def kill_the_broker_after_round_2(record: dict) -> None:
        if record["round"] == 2:
            broker.stop()  # SIGKILL: every connection drops at once

    try:
        result = edge_fl.run_simulation(cfg, tmp_path, on_record=kill_the_broker_after_round_2)
    finally:
        broker.stop()
    assert result.summary["stopped"] == "losing the broker under virtual time"
    assert 2 <= len(result.records) < 8
    assert (tmp_path / "summary.json").exists()
