"""Simulated time for the fleet: scaled wall time (``SimClock``) or virtual time
(``VirtualClock``).

``SimClock``: ``time_scale`` is real seconds per simulated second (0.01 runs a simulated hour in
36 s); modelled compute and transfer durations become real sleeps, scaled. Without a scale nothing
is modelled: devices run as fast as the machine allows and simulated time is wall time. Real CPU
time spent training also passes on this clock, so it adds to the modelled time (results depend on
the machine's load: use it for demonstrations in real time).

``VirtualClock``: simulated time moves only when the fleet is told it may
(:meth:`VirtualClock.fire_until`, driven by the aggregator's grants, ``edge_fl.clocksync``):
a device's sleep is a timer, and the machine's time never enters. Idle simulated time costs
nothing.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable, Hashable
from typing import Any

from edge_fl.clocksync import TimerQueue


class SimClock:
    virtual = False

    def __init__(self, time_scale: float | None, start_s: float = 0.0) -> None:
        if time_scale is not None and not time_scale > 0:
            raise ValueError(f"time_scale = {time_scale!r} must be > 0 (or None: no modelling)")
        self.time_scale = time_scale
        self.start_s = start_s  # simulated seconds at wall-clock start (e.g. 8 h = 28800)
        self._t0 = time.monotonic()

    @property
    def modelled(self) -> bool:
        return self.time_scale is not None

    def reset(self) -> None:
        self._t0 = time.monotonic()

    def now(self) -> float:
        """Simulated seconds since the simulated epoch."""
        elapsed = time.monotonic() - self._t0
        return self.start_s + (elapsed / self.time_scale if self.time_scale else elapsed)

    def to_wall(self, sim_seconds: float) -> float:
        return sim_seconds * self.time_scale if self.time_scale else sim_seconds

    async def sleep(self, sim_seconds: float, key: Hashable = (), lead: float = 0.0) -> None:
        if self.time_scale is not None and sim_seconds > 0:
            await asyncio.sleep(sim_seconds * self.time_scale)

    async def sleep_until(self, sim_t: float, key: Hashable = (), lead: float = 0.0) -> None:
        if sim_t == float("inf"):
            await asyncio.Event().wait()  # forever (cancelled at the end of the job)
        await self.sleep(max(0.0, sim_t - self.now()))


class VirtualClock:
    """Simulated time that advances only through :meth:`fire_until`.

    ``sleep``/``sleep_until`` register a timer (with a ``key``: same-time timers fire in key
    order) and wait for it; ``waiting`` counts the coroutines blocked on a timer, so the fleet
    can tell when every device task is blocked on the clock (quiescent). ``lead``: how long
    after the timer, at the earliest, what it wakes can publish anything (a download's end
    leads to a publication no sooner than the compute and the upload's latency later), so
    :meth:`lookahead` can promise the aggregator more than the next timer."""

    virtual = True
    time_scale = None
    modelled = True

    def __init__(self, start_s: float = 0.0) -> None:
        self.start_s = start_s
        self.t = start_s
        self.queue = TimerQueue()
        self.waiting = 0  # coroutines blocked on a timer (or forever)
        self.fired = 0
        self._changed: asyncio.Event | None = None
        #: :meth:`lookahead`'s index: per kind, a heap of (bound, seq, future) of the timers
        #: pushed since it was built (dead ones dropped lazily), for ``_index_kind_of``
        self._index: dict[Hashable, list[tuple[float, int, asyncio.Future]]] = {}
        self._index_kind_of: Callable[[Any], Hashable] | None = None
        self._index_seq = 0

    @property
    def changed(self) -> asyncio.Event:
        """Set whenever a coroutine starts waiting on the clock (quiescence may have come)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def reset(self) -> None:
        """(Scaled clocks restart at the fleet's start; virtual time starts where it is.)"""

    def now(self) -> float:
        return self.t

    def to_wall(self, sim_seconds: float) -> float:
        return sim_seconds  # deadlines are in simulated seconds on the aggregator's clock too

    async def sleep(self, sim_seconds: float, key: Hashable = (), lead: float = 0.0) -> None:
        await self.sleep_until(self.t + max(0.0, sim_seconds), key, lead)

    async def sleep_until(self, sim_t: float, key: Hashable = (), lead: float = 0.0) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not math.isinf(sim_t):
            t = max(sim_t, self.t)
            bound = t + max(0.0, lead)
            self.queue.push(t, (fut, bound), key)
            kind_of = self._index_kind_of
            if kind_of is not None:
                self._index_seq += 1
                heap = self._index.setdefault(kind_of(key), [])
                heapq.heappush(heap, (bound, self._index_seq, fut))
        self.waiting += 1
        self.changed.set()
        try:
            await fut
        finally:
            if not fut.done() or fut.cancelled():
                self.waiting -= 1  # cancelled while waiting (the end of the job)

    def next_time(self) -> float:
        """The earliest pending timer (inf: none)."""
        return self.queue.next_time(_alive)

    def lookahead(
        self, kind_of: Callable[[Any], Hashable], limit: int
    ) -> tuple[float, dict[Hashable, list[float]]]:
        """In one pass over the pending timers (a report's cost, with a timer per device): the
        earliest simulated time anything waiting on this clock can publish (inf: none), unless
        something from outside (a model, a dispatch) sets new work off first; and, per
        ``kind_of(key)``, the ``limit`` earliest publication times, ascending."""
        if kind_of is not self._index_kind_of:  # a new kind function: index what is pending
            self._index_kind_of = kind_of
            self._index = {}
            for key, (fut, bound) in self.queue.entries():
                self._index_seq += 1
                self._index.setdefault(kind_of(key), []).append((bound, self._index_seq, fut))
            for heap in self._index.values():
                heapq.heapify(heap)
        # per kind, the ``limit`` smallest bounds of live timers, ascending: a best-first walk
        # of the kind's heap from its root (a report costs its lookahead, not every device's
        # timer: with 1,000 availability loops the full scan was 5% of a simulated day's time)
        earliest = math.inf
        by_kind: dict[Hashable, list[float]] = {}
        for kind, heap in list(self._index.items()):
            while heap and heap[0][2].done():
                heapq.heappop(heap)
            if len(heap) > 64 and len(heap) > 2 * len(self.queue):  # many dead: compact
                heap[:] = [e for e in heap if not e[2].done()]
                heapq.heapify(heap)
            if not heap:
                del self._index[kind]
                continue
            found: list[float] = []
            frontier = [(heap[0][0], heap[0][1], 0)]
            n = len(heap)
            while frontier and len(found) < limit:
                bound, _seq, i = heapq.heappop(frontier)
                if not heap[i][2].done():
                    found.append(bound)
                for c in (2 * i + 1, 2 * i + 2):
                    if c < n:
                        heapq.heappush(frontier, (heap[c][0], heap[c][1], c))
            if found:
                by_kind[kind] = found
                earliest = min(earliest, found[0])
        return earliest, by_kind

    def fire_due(self, until: float) -> bool:
        """Wake every timer at the earliest pending time if it is <= ``until`` (the clock moves
        there); False if none is due."""
        t, due = self.queue.pop_due(until, _alive)
        if not due:
            return False
        self.t = max(self.t, t)
        for fut, _bound in due:
            self.waiting -= 1
            self.fired += 1
            fut.set_result(None)
        return True

    def move_to(self, t: float) -> None:
        if t < self.t:
            raise ValueError(f"virtual time cannot go back from {self.t} to {t}")
        self.t = t


def _alive(item: tuple[asyncio.Future, float]) -> bool:
    return not item[0].done()
