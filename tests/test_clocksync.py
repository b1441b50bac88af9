"""Virtual time without a broker: the timer queue, the aggregator's grants, the arrival order, the
clock messages and the fleet's VirtualClock (edge_fl.clocksync, edge_fl.protocol.clock,
edge_fl.fleet.clock)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from edge_fl.clocksync import AggregatorClock, TimerQueue, arrival_order, first_difference
from edge_fl.config import load_config
from edge_fl.fleet.clock import VirtualClock
from edge_fl.protocol.clock import ClockMessage, ClockMessageError, clock_topic, decode_clock

# ------------------------------------------------------------------ timer queue


def test_timers_come_out_by_time_then_key_never_by_insertion() -> None:
    q = TimerQueue()
    q.push(5.0, "d2-work", key=("d2", 1))
    q.push(5.0, "d1-work", key=("d1", 1))
    q.push(5.0, "d2-availability", key=("d2", 0))
    q.push(2.0, "early", key=("d9", 1))
    assert q.next_time() == 2.0
    assert q.pop_due(1.0) == (math.inf, [])  # nothing due yet
    assert q.pop_due(10.0) == (2.0, ["early"])
    assert q.pop_due(10.0) == (5.0, ["d1-work", "d2-availability", "d2-work"])
    assert q.next_time() == math.inf


def test_dead_timers_are_dropped() -> None:
    q = TimerQueue()
    q.push(1.0, "cancelled")
    q.push(3.0, "live")
    alive = lambda item: item != "cancelled"  # noqa: E731
    assert q.next_time(alive) == 3.0
    assert q.pop_due(3.0, alive) == (3.0, ["live"])


# ------------------------------------------------------------------ the aggregator's grants


def started(t: float = 100.0, fleet_next: float = math.inf, fleet_n: int = 0) -> AggregatorClock:
    c = AggregatorClock()
    for _ in range(fleet_n):
        c.received_one()
    c.start(t, fleet_next, fleet_n)
    return c


def answer(c: AggregatorClock, fleet_next: float, fleet_n: int) -> float:
    """The fleet answers the pending grant (the next one, if none is pending)."""
    g = c.pending or c.grant(math.inf)
    assert g is not None
    assert c.on_report(g.g, g.t, fleet_next, fleet_n)
    return c.advance()


def test_the_first_grant_is_at_the_start_time() -> None:
    c = started(100.0, fleet_next=103.0)
    g = c.grant(own_next=110.0)
    assert g is not None and (g.t, g.n) == (100.0, 0)


def test_a_publication_is_exchanged_at_the_same_time_before_time_moves() -> None:
    c = started(100.0, fleet_next=math.inf)
    answer(c, math.inf, 0)  # the first exchange at 100
    c.published_one()  # e.g. the round's model
    g = c.grant(own_next=120.0)
    assert g is not None and (g.t, g.n) == (100.0, 1)  # zero lookahead: same time, counted
    assert answer(c, fleet_next=101.5, fleet_n=0) == 100.0
    g = c.grant(own_next=120.0)
    assert g is not None and g.t == 101.5  # quiescent: the earliest event on either side


def test_time_moves_to_the_aggregators_deadline_when_it_comes_first() -> None:
    c = started(0.0, fleet_next=50.0)
    answer(c, 50.0, 0)
    g = c.grant(own_next=30.0)
    assert g is not None and g.t == 30.0


def test_a_grant_through_goes_past_the_fleets_events_to_the_aggregators_own() -> None:
    c = started(0.0, fleet_next=50.0)
    answer(c, 50.0, 0)
    g = c.grant(own_next=600.0, through=True)  # between paced rounds: the next opening
    assert g is not None and g.t == 600.0
    assert answer(c, fleet_next=612.0, fleet_n=0) == 600.0
    c.published_one()  # the round's model: a same-time exchange comes first, through or not
    g = c.grant(own_next=1200.0, through=True)
    assert g is not None and g.t == 600.0
    answer(c, 612.0, 0)
    # nothing of its own ahead: through changes nothing (never a grant at infinity)
    assert c.next_time(math.inf, through=True) == 612.0


def test_a_sync_round_is_granted_through_the_arrival_that_can_decide_it() -> None:
    """The fleet reports when its pending uploads can land at the earliest and its next
    status: a round that needs 3 more updates is granted through the third upload time, but
    never past the next status (an offline device can close a round early) or its deadline."""
    c = started(0.0, fleet_next=10.0)
    g = c.grant(math.inf)
    assert g is not None
    assert c.on_report(g.g, g.t, 10.0, 0, ups=(10.0, 12.0, 15.0, 40.0), status=30.0)
    c.advance()
    assert c.next_time(120.0) == 10.0  # without a count: the fleet's next event
    assert c.next_time(120.0, arrivals=3) == 15.0
    assert c.next_time(120.0, arrivals=4) == 30.0  # the status comes first
    assert c.next_time(13.0, arrivals=3) == 13.0  # the deadline comes first
    assert c.next_time(120.0, arrivals=5) == 30.0  # fewer uploads than needed: up to the status
    c.published_one()
    assert c.next_time(120.0, arrivals=3) == 0.0  # a same-time exchange comes first, always


def test_a_cut_lookahead_grants_only_through_its_last_upload() -> None:
    c = started(0.0, fleet_next=1.0)
    g = c.grant(math.inf)
    assert g is not None
    ups = tuple(float(i) for i in range(1, 65))
    assert c.on_report(g.g, g.t, 1.0, 0, ups=ups, status=math.inf, ups_cut=True)
    c.advance()
    assert c.next_time(1000.0, arrivals=100) == 64.0  # more may land before the 100th
    c2 = started(0.0, fleet_next=1.0)
    g = c2.grant(math.inf)
    assert g is not None
    assert c2.on_report(g.g, g.t, 1.0, 0, ups=ups[:10], status=math.inf)
    c2.advance()
    assert c2.next_time(1000.0, arrivals=100) == 1000.0  # 10 pending cannot make 100


def test_a_report_without_lookahead_leaves_grants_as_they_were() -> None:
    c = started(0.0, fleet_next=10.0)
    answer(c, 10.0, 0)
    assert c.next_time(120.0, arrivals=3) == 10.0


def test_nothing_pending_anywhere_means_no_grant() -> None:
    c = started(0.0)
    answer(c, math.inf, 0)
    assert c.grant(own_next=math.inf) is None


def test_time_does_not_move_until_every_counted_message_arrived() -> None:
    c = started(0.0, fleet_next=5.0)
    answer(c, 5.0, 0)
    g = c.grant(math.inf)
    assert g is not None and g.t == 5.0
    assert c.on_report(g.g, g.t, math.inf, 2)  # the fleet published two updates at 5
    assert not c.ready
    c.received_one()
    assert not c.ready
    c.received_one()
    assert c.ready and c.advance() == 5.0


def test_a_report_for_another_grant_is_ignored() -> None:
    c = started(0.0, fleet_next=5.0)
    g = c.grant(math.inf)
    assert g is not None
    assert not c.on_report(g.g + 1, g.t, 1.0, 0)
    assert not c.on_report(g.g, g.t + 1, 1.0, 0)
    assert c.grant(math.inf) is g  # unanswered: the same grant
    with pytest.raises(RuntimeError):
        c.advance()


def test_a_conservative_run_never_passes_an_event_on_either_side() -> None:
    """Two logical processes in lock-step: the fleet publishes at 1, 4 and 9; each update makes
    the aggregator publish at once (zero lookahead), which makes the fleet schedule an event 2 s
    later; the aggregator's own deadlines are at 6 and 100. Every event is handled at its time."""
    c = started(0.0, fleet_next=1.0)
    fleet_events = [1.0, 4.0, 9.0]
    deadlines = [6.0, 100.0]
    handled: list[tuple[str, float]] = []
    fleet_n = 0
    while True:
        own = deadlines[0] if deadlines else math.inf
        g = c.grant(own)
        if g is None:
            break
        # the fleet: carry out every event up to g.t, in time order
        due = sorted(t for t in fleet_events if t <= g.t)
        for t in due:
            fleet_events.remove(t)
            handled.append(("fleet", t))
            fleet_n += 1
            c.received_one()
        nxt = min(fleet_events, default=math.inf)
        assert c.on_report(g.g, g.t, nxt, fleet_n)
        now = c.advance()
        assert all(t >= now for t in fleet_events)  # nothing left behind
        for _ in due:  # the aggregator reacts at once
            handled.append(("agg", now))
            c.published_one()
            fleet_events.append(now + 2.0)
        if deadlines and deadlines[0] <= now:
            handled.append(("deadline", deadlines.pop(0)))
        if len(handled) > 40:
            break
    times = [t for _, t in handled]
    assert times == sorted(times)  # causality: never an event before one already handled
    assert ("deadline", 6.0) in handled and ("fleet", 9.0) in handled
    assert c.same_time >= 3  # each reaction was exchanged at its own time


# ------------------------------------------------------------------ arrival order


def test_arrivals_are_ordered_by_device_keeping_each_devices_own_order() -> None:
    arrived = [("d3", "update"), ("d1", "status"), ("d3", "status"), ("d1", "update")]
    ordered = arrival_order(arrived, lambda m: m[0])
    assert ordered == [("d1", "status"), ("d1", "update"), ("d3", "update"), ("d3", "status")]


def test_first_difference_ignores_wall_clock_fields() -> None:
    a = [{"round": 1, "accuracy": 0.5, "wall_time_s": 1.0}]
    b = [{"round": 1, "accuracy": 0.5, "wall_time_s": 9.0}]
    assert first_difference(a, b, ["wall_time_s"]) is None
    b[0]["accuracy"] = 0.6
    assert "accuracy" in (first_difference(a, b, ["wall_time_s"]) or "")
    assert first_difference(a, [], []) == "1 records against 0"


# ------------------------------------------------------------------ clock messages


def test_clock_messages_round_trip() -> None:
    for msg in (
        ClockMessage("grant", g=3, t=28800.25, n=7),
        ClockMessage("report", g=3, t=28800.25, n=12, next=28801.5, seen=7),
        ClockMessage("ready", g=0, t=28800.0, n=30, next=math.inf, seen=0),
        ClockMessage("report", g=4, t=5.0, n=1, next=6.0, seen=2, ups=(6.0, 6.0, 9.5), st=7.0),
        ClockMessage("report", g=4, t=5.0, n=1, next=6.0, seen=2, ups=(), st=math.inf),
        ClockMessage("gone"),
    ):
        assert decode_clock(msg.encode()) == msg
    assert b'"next":null' in ClockMessage("report", next=math.inf).encode()
    assert clock_topic("edgefl/job1", "agg") == "edgefl/job1/clock/agg"


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b'{"v": 2, "k": "grant", "g": 1, "t": 0, "n": 0}',
        b'{"v": 1, "k": "later", "g": 1, "t": 0, "n": 0}',
        b'{"v": 1, "k": "grant", "g": -1, "t": 0, "n": 0}',
        b'{"v": 1, "k": "grant", "g": 1, "t": NaN, "n": 0}',
        b'{"v": 1, "k": "grant", "g": 1, "t": 0, "n": true}',
        b'{"v": 1, "k": "report", "g": 1, "t": 0, "n": 0, "next": "soon", "seen": 0}',
        b'{"v": 1, "k": "report", "g": 1, "t": 0, "n": 0, "next": 1, "seen": 0, "ups": [2, 1]}',
        b'{"v": 1, "k": "report", "g": 1, "t": 0, "n": 0, "next": 1, "seen": 0, "ups": 3}',
        b'{"v": 1, "k": "report", "g": 1, "t": 0, "n": 0, "next": 1, "seen": 0, "ups": ['
        + b",".join([b"1"] * 65)
        + b"]}",
        b'{"v": 1, "k": "report", "g": 1, "t": 0, "n": 0, "next": 1, "seen": 0, "ups": ["a"]}',
        b'{"v": 1, "k": "report", "g": 1, "t": 0, "n": 0, "next": 1, "seen": 0, "ups": [],'
        b' "st": "x"}',
    ],
)
def test_malformed_clock_messages_are_refused(data: bytes) -> None:
    with pytest.raises(ClockMessageError):
        decode_clock(data)


# ------------------------------------------------------------------ the fleet's clock


def test_virtual_sleeps_take_no_real_time_and_wake_in_order() -> None:
    async def main() -> tuple[list[str], float, int]:
        clock = VirtualClock(start_s=1000.0)
        woke: list[str] = []

        async def sleeper(name: str, d: float, key: tuple) -> None:
            await clock.sleep(d, key=key)
            woke.append(f"{name}@{clock.now():g}")

        tasks = [
            asyncio.create_task(sleeper("b", 3600.0, ("d2", 1))),
            asyncio.create_task(sleeper("a", 3600.0, ("d1", 1))),
            asyncio.create_task(sleeper("c", 10.0, ("d3", 1))),
        ]
        while clock.waiting < 3:
            await asyncio.sleep(0)
        assert clock.next_time() == 1010.0
        t0 = time.perf_counter()
        while clock.fire_due(math.inf):
            for _ in range(3):  # the woken coroutines run (no real time passes)
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return woke, time.perf_counter() - t0, clock.waiting

    woke, wall, waiting = asyncio.run(main())
    assert woke == ["c@1010", "a@4600", "b@4600"]
    assert wall < 1.0 and waiting == 0


def test_a_cancelled_sleeper_no_longer_counts_as_waiting() -> None:
    async def main() -> tuple[int, float]:
        clock = VirtualClock()
        task = asyncio.create_task(clock.sleep(5.0))
        forever = asyncio.create_task(clock.sleep_until(math.inf))
        while clock.waiting < 2:
            await asyncio.sleep(0)
        task.cancel()
        forever.cancel()
        await asyncio.gather(task, forever, return_exceptions=True)
        return clock.waiting, clock.next_time()

    assert asyncio.run(main()) == (0, math.inf)


def _kind(key: tuple) -> object:
    return key[1]


def brute_force_lookahead(clock: VirtualClock, limit: int) -> tuple[float, dict]:
    """What a report's lookahead must be: every live timer's bound, per kind, sorted."""
    bounds: dict = {}
    for key, (fut, bound) in clock.queue.entries():
        if not fut.done():
            bounds.setdefault(key[1], []).append(bound)
    earliest = min((min(v) for v in bounds.values()), default=math.inf)
    return earliest, {k: sorted(v)[:limit] for k, v in bounds.items()}


@pytest.mark.parametrize("seed", range(4))
def test_the_indexed_lookahead_is_every_live_timers_bound_in_order(seed: int) -> None:
    """The fleet's report reads its lookahead from per-kind heaps kept beside the timer queue
    (not a scan of ~1,000 timers each time): after any mix of new sleepers, cancellations and
    firings, it equals the scan."""
    import random

    rng = random.Random(seed)

    async def main() -> int:
        clock = VirtualClock(start_s=0.0)
        tasks: list[asyncio.Task] = []
        checks = 0
        for step in range(600):
            action = rng.random()
            if action < 0.5:
                t = clock.now() + rng.choice([0.0, rng.uniform(0, 50), rng.uniform(0, 5000)])
                key = (f"d{rng.randrange(40)}", rng.choice([0, 1]))
                lead = rng.choice([0.0, rng.uniform(0, 30)])
                tasks.append(asyncio.create_task(clock.sleep_until(t, key=key, lead=lead)))
            elif action < 0.65 and tasks:
                tasks.pop(rng.randrange(len(tasks))).cancel()
            elif action < 0.8:
                clock.fire_due(clock.now() + rng.uniform(0, 100))
            for _ in range(2):
                await asyncio.sleep(0)
            if step % 3 == 0:
                limit = rng.choice([1, 3, 64])
                assert clock.lookahead(_kind, limit) == brute_force_lookahead(clock, limit)
                checks += 1
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert clock.lookahead(_kind, 64) == (math.inf, {})
        return checks

    assert asyncio.run(main()) == 200


# ------------------------------------------------------------------ configuration


def test_the_clock_defaults_to_virtual_for_a_named_profile_only() -> None:
    assert not load_config(None, {}).fleet.virtual  # the default job: nothing modelled
    assert load_config(None, {"fleet.profile": "phone-fleet"}).fleet.virtual
    scaled = load_config(None, {"fleet.profile": "phone-fleet", "fleet.time_scale": 0.5})
    assert not scaled.fleet.virtual  # --time-scale: a demonstration in real time
    assert load_config(None, {"fleet.clock": "virtual"}).fleet.virtual
    with pytest.raises(ValueError, match="drop time_scale"):
        load_config(None, {"fleet.clock": "virtual", "fleet.time_scale": 1.0})
