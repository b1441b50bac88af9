"""The fleet runtime carries out the devices' policy (edge_fl/device/policy.py), without a broker:
device sessions are stand-ins that record (or refuse) what is published."""

from __future__ import annotations

import asyncio
import threading
import time

import aiomqtt
import numpy as np

from edge_fl.device.agent import DeviceAgent
from edge_fl.fleet.runtime import INLINE_TRAIN_S, Fleet
from edge_fl.models import make_model
from edge_fl.models.training import LocalTraining
from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import GlobalModel, Topics
from edge_fl.transport.url import parse_broker_url

TOPICS = Topics("job")
N_PARAMS = 4 * 3 + 3


class Session:
    """A device's MQTT session: records publishes; the first ``fail`` update publishes raise."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.updates: list[bytes] = []
        self.statuses: list[bytes] = []

    async def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False):
        if "/up/" in topic:
            if self.fail:
                self.fail -= 1
                raise aiomqtt.MqttError("the broker went away")
            self.updates.append(payload)
        else:
            self.statuses.append(payload)


def agent(i: int) -> DeviceAgent:
    g = np.random.default_rng(i)
    X = g.normal(size=(12, 4)).astype(np.float32)
    y = (np.arange(12) % 3).astype(np.int64)
    return DeviceAgent(
        f"d{i}", X, y, make_model("logreg", 4, 3), LocalTraining(1, 4, 0.1), seeded_generator(i)
    )


def fleet(n: int, **sessions: Session) -> Fleet:
    f = Fleet([agent(i) for i in range(n)], parse_broker_url("mqtt://127.0.0.1:1"), TOPICS)
    for i in range(n):
        f.clients[f"d{i}"] = sessions.get(f"d{i}", Session())  # type: ignore[assignment]
    return f


def gm(version: int, selected: tuple[str, ...] | None) -> GlobalModel:
    return GlobalModel(
        "job", version, version, np.zeros(N_PARAMS, np.float32), mode="fedbuff", selected=selected
    )


def updates(f: Fleet) -> dict[str, int]:
    return {d: len(c.updates) for d, c in f.clients.items()}  # type: ignore[attr-defined]


def test_a_dispatch_of_replacements_makes_no_answered_device_publish_again():
    """FedBuff with a concurrency limit re-publishes version 1 to dispatch d2: d0 and d1, which
    answered version 1, send nothing more (before: both re-sent, counted as duplicates)."""

    async def scenario() -> Fleet:
        f = fleet(4)
        f.hand_out(gm(1, ("d0", "d1")), 100)
        await f.settled()
        f.hand_out(gm(1, ("d2",)), 100)
        await f.settled()
        return f

    f = asyncio.run(scenario())
    assert updates(f) == {"d0": 1, "d1": 1, "d2": 1, "d3": 0}
    assert (f.published, f.resent) == (3, 0)


def test_the_published_count_includes_an_update_that_only_a_resend_delivered():
    """Issue 24 item 10: d0's first publish fails (the broker went away); the re-broadcast round
    brings the same bytes through. The fleet's "updates published" counts it once, as the ledger
    does; a further re-send is a re-send, not another update."""

    async def scenario() -> Fleet:
        f = fleet(2, d0=Session(fail=1))
        msg = gm(1, ("d0", "d1"))
        f.hand_out(msg, 100)
        await f.settled()
        assert (f.published, f.publish_failures, f.resent) == (1, 1, 0)
        f.hand_out(msg, 100)  # the aggregator re-broadcasts the open round
        await f.settled()
        return f

    f = asyncio.run(scenario())
    assert updates(f) == {"d0": 1, "d1": 2}  # d1 re-sent too: a copy the aggregator counts
    assert (f.published, f.resent) == (2, 2)
    assert f.agents["d0"].state.exposures == 1  # one release, delivered late


def test_a_device_busy_training_answers_only_the_newest_model_next():
    async def scenario() -> Fleet:
        f = fleet(1)
        for v in (1, 2, 3):  # 2 and 3 arrive while it trains on 1
            f.hand_out(gm(v, None), 100)
        await f.settled()
        return f

    f = asyncio.run(scenario())
    assert updates(f) == {"d0": 2}
    assert f.agents["d0"].state.answered_round == 3


def trained_on(f: Fleet, device: str, spin_s: float = 0.0) -> list[str]:
    """Record which thread runs ``device``'s trainings (spinning ``spin_s`` more in each)."""
    threads: list[str] = []
    a = f.agents[device]
    train = a.on_global

    def on_global(msg):
        threads.append(threading.current_thread().name)
        t_end = time.thread_time() + spin_s
        while time.thread_time() < t_end:
            pass
        return train(msg)

    a.on_global = on_global  # type: ignore[method-assign]
    return threads


def test_a_short_training_runs_on_the_event_loop_after_the_first():
    """The first training goes to the pool and measures the cost per sample; a training it
    predicts under INLINE_TRAIN_S then runs on the loop (a thread handoff cost more than it)."""

    async def scenario() -> tuple[Fleet, list[str]]:
        f = fleet(1)
        threads = trained_on(f, "d0")
        for v in (1, 2, 3):
            f.hand_out(gm(v, ("d0",)), 100)
            await f.settled()
        return f, threads

    f, threads = asyncio.run(scenario())
    assert threads[0].startswith("train")
    assert threads[1:] == [threading.main_thread().name] * 2
    assert f.inline_trainings == 2


def test_a_long_training_stays_in_the_pool():
    """A training longer than INLINE_TRAIN_S would hold every session's I/O: never inline."""

    async def scenario() -> list[str]:
        f = fleet(1)
        threads = trained_on(f, "d0", spin_s=2 * INLINE_TRAIN_S)
        for v in (1, 2, 3):
            f.hand_out(gm(v, ("d0",)), 100)
            await f.settled()
        return threads

    threads = asyncio.run(scenario())
    assert len(threads) == 3 and all(t.startswith("train") for t in threads)


def test_devices_handed_the_first_model_together_wait_for_its_measured_cost():
    """The trainings that start while the job's first one measures the cost in the pool take the
    same choice later rounds take (here: the loop), not one pool hand-off each."""

    async def scenario() -> tuple[Fleet, list[list[str]]]:
        f = fleet(4)
        threads = [trained_on(f, f"d{i}") for i in range(4)]
        f.hand_out(gm(1, None), 100)
        await f.settled()
        return f, threads

    f, threads = asyncio.run(scenario())
    assert [t[0].startswith("train") for t in threads] == [True, False, False, False]
    assert f.inline_trainings == 3
    assert updates(f) == {f"d{i}": 1 for i in range(4)}


def test_the_others_still_train_when_the_measuring_training_fails():
    async def scenario() -> Fleet:
        f = fleet(3)

        def broken(msg):
            raise RuntimeError("the device's training failed")

        f.agents["d0"].on_global = broken  # type: ignore[method-assign]
        f.hand_out(gm(1, None), 100)
        await asyncio.wait_for(f.settled(), 10)
        return f

    f = asyncio.run(scenario())
    assert f.device_failures == 1
    assert updates(f) == {"d0": 0, "d1": 1, "d2": 1}


class Unacknowledged(Session):
    """A session lost right after the update went out: its PUBACK never comes."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = asyncio.Event()

    async def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False):
        if "/up/" in topic:
            self.updates.append(payload)
            self.sent.set()
            await asyncio.Event().wait()  # aiomqtt would wait out its 10 s timeout here


def test_an_update_stuck_on_a_lost_session_is_re_sent_on_the_new_one():
    """The session watcher gives up on an update whose session died before its PUBACK (a socket
    reset under a cluster node), so the device re-sends it on its new session at once, not
    after aiomqtt's timeout, when its round had closed without it."""

    async def scenario() -> tuple[Fleet, Unacknowledged, Session]:
        lost = Unacknowledged()
        f = fleet(1, d0=lost)
        msg = gm(1, ("d0",))
        f.hand_out(msg, 100)
        await lost.sent.wait()
        await asyncio.wait_for(f.abandon_upload("d0"), 5)  # what re-opening it does first
        assert f.publish_failures == 1
        new = Session()
        f.clients["d0"] = new  # type: ignore[assignment]
        f.hand_out(msg, 100)  # the retained model on the new session
        await asyncio.wait_for(f.settled(), 5)
        return f, lost, new

    f, lost, new = asyncio.run(scenario())
    assert new.updates == lost.updates  # the same release, not a second one
    assert f.agents["d0"].state.exposures == 1
