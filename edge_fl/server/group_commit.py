"""Acknowledge received QoS 1 messages only once the journal holding their effects is on disk.

Why a module of its own: it is the journal's durability rule seen from MQTT (nothing acknowledged
is lost in a crash, since the broker re-delivers what was not acknowledged), and it batches: the
messages read in one burst share one fsync (group commit), which is what keeps ingest at
thousands of updates a second (BENCHMARKS.md, ``tools/bench_ingest.py``). The service tells it
what it received and when a connection is up; it decides when to sync and acknowledge.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["ACK_BATCH", "GroupCommit"]

#: at most this many received messages wait for one journal fsync before their acknowledgements
ACK_BATCH = 256

Acker = Callable[[int, int], None]


class GroupCommit:
    """Received messages waiting for one journal fsync, then acknowledged together.

    ``add(mid, qos)`` after a message's effects are journaled (not yet synced): the sync and the
    acknowledgements run once the event loop has nothing more to do for the current read
    (``call_soon``), or at once after :data:`ACK_BATCH` messages. ``acker`` acknowledges one
    message id on the current connection (None while there is none: ids then wait, and are void
    once a new connection starts, see :meth:`forget`). ``on_error`` gets an exception raised by a
    scheduled flush (a full disk): ingest cannot go on."""

    def __init__(
        self,
        journal: Any = None,  # edge_fl.server.journal.Journal
        *,
        on_error: Callable[[Exception], None] | None = None,
        batch: int = ACK_BATCH,
    ) -> None:
        self.journal = journal
        self.on_error = on_error
        self.batch = batch
        self.acker: Acker | None = None
        self.acknowledge = True  # False: acks were sent on receipt (the chaos tool's comparison)
        self.pending: list[tuple[int, int]] = []
        self._handle: asyncio.Handle | None = None
        self.failed = False

    def add(self, mid: int, qos: int, loop: asyncio.AbstractEventLoop | None) -> None:
        """A QoS >= 1 message whose effects are journaled: acknowledge it after the next sync."""
        self.pending.append((mid, qos))
        if len(self.pending) >= self.batch:
            self.flush()
        elif self._handle is None and loop is not None:
            self._handle = loop.call_soon(self._scheduled)

    def flush(self) -> None:
        """Journal to disk, then acknowledge the messages whose effects it holds."""
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

    def _scheduled(self) -> None:
        self._handle = None
        if self.failed:
            return
        try:
            self.flush()
        except Exception as exc:
            if self.on_error is not None:
                self.on_error(exc)
            else:
                raise
