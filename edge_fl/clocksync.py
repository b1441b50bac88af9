"""Virtual time, the pure part: conservative discrete-event synchronisation of the aggregator and
a simulated fleet (no I/O, no clock; the service and the fleet runtime carry it over MQTT with the
messages of :mod:`edge_fl.protocol.clock`).

Two logical processes, each with its own pending events: the aggregator's next deadline or
dispatch timeout, the fleet's devices' next download, compute, upload or availability change.
Lookahead is zero (an update at t closes a window at t; the window's model reaches devices at t),
so the aggregator, which holds the grant, alternates:

1. it acts at its time ``now`` (decides, closes, publishes);
2. it grants ``now`` again if it published anything since its last grant (a same-time exchange),
   else the minimum of its own next event and the fleet's, and waits for the fleet's report and
   for every update and status the report counts;
3. it moves to the granted time and hands what arrived to the engine in a fixed order
   (:func:`arrival_order`), then back to 1.

Neither side runs ahead: the fleet never carries out an event later than the grant, and the
aggregator never moves past the fleet's earliest event, except where nothing the fleet publishes
can change a decision before the aggregator's own next event (sync rounds paced by a period:
between rounds, statuses only update availability); it then grants that event's time ``through``
the fleet's, the fleet carries out all its events up to it in one step, and their messages are
taken at that time. When both have nothing pending there is
nothing left to happen (:meth:`AggregatorClock.grant` returns None).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["AggregatorClock", "Grant", "TimerQueue", "arrival_order"]

T = TypeVar("T")


class TimerQueue:
    """Pending events by (time, key, insertion): same-time events come out in key order, so the
    order never depends on which coroutine happened to register first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, Any, int, Any]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, t: float, item: Any, key: Hashable = ()) -> None:
        if math.isnan(t):
            raise ValueError("a timer at NaN")
        heapq.heappush(self._heap, (t, key, next(self._seq), item))

    def entries(self) -> Iterable[tuple[Any, Any]]:
        """(key, item) of every pending entry, in no particular order."""
        for _t, key, _seq, item in self._heap:
            yield key, item

    def next_time(self, alive: Any = None) -> float:
        """The earliest pending time (inf: none); ``alive(item)`` False drops an entry."""
        while self._heap and alive is not None and not alive(self._heap[0][3]):
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else math.inf

    def pop_due(self, until: float, alive: Any = None) -> tuple[float, list[Any]]:
        """Every item at the earliest pending time if that is <= ``until`` (key order), with
        that time; (inf, []) when none is due."""
        t = self.next_time(alive)
        if t > until:
            return math.inf, []
        due: list[Any] = []
        while self._heap and self._heap[0][0] == t:
            item = heapq.heappop(self._heap)[3]
            if alive is None or alive(item):
                due.append(item)
        return t, due


@dataclass(frozen=True)
class Grant:
    g: int  # sequence number, echoed by the fleet's report
    t: float  # the fleet may carry out its events up to this simulated time
    n: int  # aggregator messages published so far (all at times <= t)


class AggregatorClock:
    """The aggregator's side: its simulated time and the grants it may give.

    ``published_one`` for every global or dispatch message the aggregator publishes,
    ``received_one`` for every update or status it receives from the fleet's devices (counted,
    then held until the report that covers it); ``on_report`` with each fleet report."""

    def __init__(self) -> None:
        self.now: float | None = None  # None: not started (the fleet has not said ready)
        self.published = 0
        self.received = 0
        self.fleet_next = math.inf
        self.fleet_published = 0
        #: the report's lookahead: pending uploads' earliest times (None: not reported) and the
        #: earliest status
        self.fleet_ups: tuple[float, ...] | None = None
        self.fleet_ups_cut = False  # the fleet had more pending uploads than it listed
        self.fleet_status = math.inf
        self.pending: Grant | None = None  # granted, not yet answered
        self.answered = False
        self._granted_n: int | None = None  # ``published`` at the last grant
        self._g = 0
        self.grants = 0
        self.same_time = 0  # grants at the time already reached (zero-lookahead exchanges)

    @property
    def started(self) -> bool:
        return self.now is not None

    def start(self, t: float, fleet_next: float, fleet_published: int) -> None:
        """The fleet is ready at simulated time ``t`` (its report ``ready``)."""
        self.now = t
        self.fleet_next = fleet_next
        self.fleet_published = fleet_published

    def published_one(self) -> None:
        self.published += 1

    def received_one(self) -> None:
        self.received += 1

    def must_exchange(self) -> bool:
        """Whether the fleet has yet to hear of something the aggregator did at ``now``."""
        return self._granted_n is None or self.published != self._granted_n

    def next_time(
        self, own_next: float, through: bool = False, arrivals: int | None = None
    ) -> float:
        """The time the next grant would name (``own_next``: the aggregator's next event;
        ``through``: nothing the fleet publishes before ``own_next`` can change a decision
        before it, so the fleet may carry out all its events up to it in one step;
        ``arrivals``: no decision changes before that many more updates arrive or a status
        does, so the grant may go through the time of the fleet's ``arrivals``-th pending
        upload or its next status, whichever is first, when the fleet reported them)."""
        assert self.now is not None, "virtual time has not started"
        if self.must_exchange():
            return self.now
        if through and not math.isinf(own_next):
            return max(self.now, own_next)
        t = min(own_next, self.fleet_next)
        if arrivals is not None and arrivals >= 1 and self.fleet_ups is not None:
            t = max(t, min(own_next, self.fleet_status, self._nth_upload(arrivals)))
        return max(self.now, t)

    def _nth_upload(self, arrivals: int) -> float:
        """The earliest time by which ``arrivals`` more updates can have arrived: each reported
        upload time is the earliest its work can publish (a dropped one never does: the horizon
        is then early, never late); fewer reported than needed: they cannot decide (inf),
        unless the report's list was cut (then the last one reported)."""
        ups = self.fleet_ups or ()
        if len(ups) >= arrivals:
            return ups[arrivals - 1]
        return ups[-1] if self.fleet_ups_cut else math.inf

    def grant(
        self, own_next: float, through: bool = False, arrivals: int | None = None
    ) -> Grant | None:
        """The next grant, or None when neither side has anything pending (nothing can happen).
        A grant that is not answered yet is given again (the same one)."""
        if self.pending is not None:
            return self.pending
        t = self.next_time(own_next, through, arrivals)
        if math.isinf(t):
            return None
        if t == self.now:
            self.same_time += 1
        self._g += 1
        self.grants += 1
        self._granted_n = self.published
        self.pending = Grant(self._g, t, self.published)
        self.answered = False
        return self.pending

    def on_report(
        self,
        g: int,
        t: float,
        fleet_next: float,
        fleet_published: int,
        ups: tuple[float, ...] | None = None,
        status: float = math.inf,
        ups_cut: bool = False,
    ) -> bool:
        """The fleet's answer; False (ignored) if it answers no pending grant."""
        p = self.pending
        if p is None or g != p.g or t != p.t:
            return False
        if fleet_published < self.fleet_published:
            raise ValueError(
                f"the fleet's published count went back ({fleet_published} < "
                f"{self.fleet_published})"
            )
        self.fleet_next = fleet_next
        self.fleet_published = fleet_published
        self.fleet_ups = ups
        self.fleet_ups_cut = ups_cut
        self.fleet_status = status
        self.answered = True
        return True

    @property
    def ready(self) -> bool:
        """The pending grant was answered and everything the answer counts has arrived."""
        return self.answered and self.received >= self.fleet_published

    @property
    def started_and_complete(self) -> bool:
        """Started, and every message the fleet counted so far has arrived."""
        return self.started and self.received >= self.fleet_published

    def advance(self) -> float:
        """Move to the answered grant's time; returns it."""
        p = self.pending
        if p is None or not self.ready:
            raise RuntimeError("advance() before the grant was answered and its messages came")
        self.now = p.t
        self.pending = None
        return self.now


def arrival_order(messages: Iterable[T], device: Any) -> list[T]:
    """Messages that arrived for one simulated time, in the order the engine sees them: by
    device id, each device's own in the order its session delivered them (a stable sort: MQTT
    keeps one session's order, and nothing else is relied on)."""
    return sorted(messages, key=device)


def first_difference(a: Sequence[dict], b: Sequence[dict], ignore: Iterable[str]) -> str | None:
    """Where two metrics sequences differ (``ignore``: wall-clock fields), or None."""
    skip = set(ignore)
    if len(a) != len(b):
        return f"{len(a)} records against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        keys = (set(x) | set(y)) - skip
        for k in sorted(keys):
            if x.get(k) != y.get(k):
                return f"record {i + 1} ({x.get('round')}): {k} = {x.get(k)!r} against {y.get(k)!r}"
    return None
