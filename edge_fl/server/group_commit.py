"""Acknowledge received QoS 1 messages only once the journal holding their effects is on disk.

Why a module of its own: it is the journal's durability rule seen from MQTT (nothing acknowledged
is lost in a crash, since the broker re-delivers what was not acknowledged), and it batches: the
messages read in one burst share one fsync (group commit), which is what keeps ingest at
thousands of updates a second (BENCHMARKS.md, ``tools/bench_ingest.py``). The service tells it
what it received and when a connection is up; it decides when to sync and acknowledge.

Updates that trickle in one per read (devices training one after another, the default simulation)
would cost one fsync each, on the event loop: a lone message waits up to :data:`ACK_DELAY_S` for
company instead. A burst of :data:`MIN_BURST` or more (a backlog being drained) is synced at the
end of its read as before, so the broker's in-flight window never waits on the timer. Either way
no acknowledgement leaves before the fsync that holds its message's effects.

The fsync of a scheduled group runs on a thread of its own (a journal offering ``write_now`` and
``fsync_written``): the records are written on the event loop, the fsync (milliseconds of disk
wait, during which a 10,000-device simulation's loop used to stand still: 6% of a round's samples,
docs/bench/profile-10k.md) overlaps whatever the loop does next, and the group's acknowledgements
follow once it is done. Messages arriving meanwhile form the next group. :meth:`GroupCommit.flush`
(a round's commit, a new connection) stays synchronous: it returns with everything durable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ACK_BATCH", "ACK_DELAY_S", "MIN_BURST", "GroupCommit"]

#: at most this many received messages wait for one journal fsync before their acknowledgements
ACK_BATCH = 256
#: at most this long a message read on its own waits for others to share its fsync
ACK_DELAY_S = 0.01
#: this many messages waiting at the end of a read are synced at once (a backlog, not a trickle)
MIN_BURST = 4

Acker = Callable[[int, int], None]


class GroupCommit:
    """Received messages waiting for one journal fsync, then acknowledged together.

    ``add(mid, qos)`` after a message's effects are journaled (not yet synced): the sync and the
    acknowledgements run once the event loop has nothing more to do for the current read
    (``call_soon``; fewer than :data:`MIN_BURST` messages wait until the first of them is
    :data:`ACK_DELAY_S` old), or at once after :data:`ACK_BATCH` messages. ``acker`` acknowledges one
    message id on the current connection (None while there is none: ids then wait, and are void
    once a new connection starts, see :meth:`forget`). ``on_error`` gets an exception raised by a
    scheduled flush (a full disk): ingest cannot go on."""

    def __init__(
        self,
        journal: Any = None,  # edge_fl.server.journal.Journal
        *,
        on_error: Callable[[Exception], None] | None = None,
        batch: int = ACK_BATCH,
        delay_s: float = ACK_DELAY_S,
    ) -> None:
        self.journal = journal
        self.on_error = on_error
        self.batch = batch
        self.delay_s = delay_s
        self.acker: Acker | None = None
        self.acknowledge = True  # False: acks were sent on receipt (the chaos tool's comparison)
        self.pending: list[tuple[int, int]] = []
        self._handle: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._oldest = 0.0  # when the first message still waiting was added (monotonic)
        self.failed = False
        # a group whose fsync runs on the syncer thread; forget() makes its ids void
        self._inflight = False
        self._generation = 0
        self._syncer: concurrent.futures.ThreadPoolExecutor | None = None

    def add(self, mid: int, qos: int, loop: asyncio.AbstractEventLoop | None) -> None:
        """A QoS >= 1 message whose effects are journaled: acknowledge it after the next sync."""
        if not self.pending:
            self._oldest = time.monotonic()
        self.pending.append((mid, qos))
        if len(self.pending) >= self.batch and not self._inflight:
            self.flush()
        elif self._handle is None and loop is not None:
            self._loop = loop
            self._handle = loop.call_soon(self._scheduled)

    def flush(self) -> None:
        """Journal to disk, then acknowledge the messages whose effects it holds."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self.journal is not None:
            self.journal.sync()
        acker = self.acker
        if acker is None:
            return  # connecting (acknowledged once connected) or gone (ids are void then)
        if self.acknowledge:
            for mid, qos in self.pending:
                acker(mid, qos)
        self.pending.clear()

    def forget(self) -> None:
        """A new connection: message ids of an earlier one mean nothing now."""
        self.pending.clear()
        self._generation += 1  # a group in flight is not acknowledged on the new one

    def _background(self) -> bool:
        """Sync the waiting group on the syncer thread (False: not possible, flush instead)."""
        journal, loop = self.journal, self._loop
        fsync_written = getattr(journal, "fsync_written", None)  # a journal that can split
        if fsync_written is None or loop is None or self.acker is None:
            return False
        if self._inflight:
            return True  # the group in flight schedules the next one when it is done
        group, self.pending = self.pending, []
        journal.write_now()
        if self._syncer is None:
            self._syncer = concurrent.futures.ThreadPoolExecutor(1, "journal-fsync")
        self._inflight = True
        generation = self._generation
        done = loop.run_in_executor(self._syncer, fsync_written)
        done.add_done_callback(lambda f: self._synced(f, group, generation))
        return True

    def close(self) -> None:
        """Stop the syncer thread (after the fsync in flight, if any): a process that ran a job
        keeps no thread of it (one would keep the next simulation's fleet in one process)."""
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None

    def _synced(self, done: asyncio.Future[None], group: list[tuple[int, int]], gen: int) -> None:
        """The group's fsync is done (event loop thread): acknowledge it, start the next."""
        self._inflight = False
        if done.cancelled():
            return  # the loop is closing: unacknowledged, the broker delivers them again
        exc = done.exception()
        if exc is not None:
            self.failed = True
            if self.on_error is not None and isinstance(exc, Exception):
                self.on_error(exc)
            return
        if gen == self._generation:
            acker = self.acker
            if acker is None:
                self.pending[:0] = group  # connecting: acknowledged once connected
            elif self.acknowledge:
                for mid, qos in group:
                    acker(mid, qos)
        if self.pending and self._handle is None and self._loop is not None:
            self._handle = self._loop.call_soon(self._scheduled)

    def _scheduled(self) -> None:
        """End of a read (or the delay ran out): sync a burst now, let a lone message wait."""
        self._handle = None
        if self.failed:
            return
        if self.pending and len(self.pending) < MIN_BURST and self._loop is not None:
            wait = self._oldest + self.delay_s - time.monotonic()
            if wait > 0:
                self._handle = self._loop.call_later(wait, self._scheduled)
                return
        try:
            if not self._background():
                self.flush()
        except Exception as exc:
            if self.on_error is not None:
                self.on_error(exc)
            else:
                raise
