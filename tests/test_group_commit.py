"""Group commit: no acknowledgement before the fsync holding its message, a trickle shares fsyncs
(bounded wait), a burst is synced at the end of its read."""

from __future__ import annotations

import asyncio
import threading

from edge_fl.server.group_commit import ACK_DELAY_S, MIN_BURST, GroupCommit


class Log:
    """A journal and an acker writing one event log, to check their order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.appended = 0

    def sync(self) -> None:
        self.events.append(("sync", self.appended))

    def ack(self, mid: int, qos: int) -> None:
        self.events.append(("ack", mid))


def synced_before_acked(log: Log) -> bool:
    """Every ack follows a sync that came after its message was journaled."""
    synced = 0
    for kind, value in log.events:
        if kind == "sync":
            synced = value
        elif value > synced:
            return False
    return True


def test_a_trickle_shares_fsyncs_and_waits_at_most_the_delay():
    async def main() -> tuple[Log, list[float]]:
        loop = asyncio.get_running_loop()
        log = Log()
        commit = GroupCommit(log)
        commit.acker = log.ack
        waits = []
        for mid in range(1, 7):  # one message per read, a few ms apart
            log.appended = mid
            commit.add(mid, 1, loop)
            t = loop.time()
            await asyncio.sleep(ACK_DELAY_S / 4)
            waits.append(loop.time() - t)
        t = loop.time()
        while commit.pending:
            await asyncio.sleep(0.001)
        waits.append(loop.time() - t)
        return log, waits

    log, waits = asyncio.run(main())
    syncs = [e for e in log.events if e[0] == "sync"]
    assert sorted(mid for kind, mid in log.events if kind == "ack") == [1, 2, 3, 4, 5, 6]
    assert synced_before_acked(log)
    assert len(syncs) < 6  # shared: not one fsync per message
    assert waits[-1] < ACK_DELAY_S * 20  # bounded (generous: a loaded machine)


def test_a_burst_is_synced_at_the_end_of_its_read():
    async def main() -> Log:
        loop = asyncio.get_running_loop()
        log = Log()
        commit = GroupCommit(log, delay_s=60.0)  # a burst must not wait for the timer
        commit.acker = log.ack
        for mid in range(1, MIN_BURST + 1):
            log.appended = mid
            commit.add(mid, 1, loop)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return log

    log = asyncio.run(main())
    assert log.events == [("sync", MIN_BURST), *[("ack", m) for m in range(1, MIN_BURST + 1)]]


def test_a_lone_message_is_not_acknowledged_before_its_sync():
    async def main() -> tuple[Log, Log]:
        loop = asyncio.get_running_loop()
        log = Log()
        commit = GroupCommit(log, delay_s=60.0)
        commit.acker = log.ack
        log.appended = 1
        commit.add(1, 1, loop)
        await asyncio.sleep(0.02)
        before = Log()
        before.events = list(log.events)
        commit.flush()  # a round's commit flushes whatever waits
        return before, log

    before, after = asyncio.run(main())
    assert before.events == []  # waiting for company, neither synced nor acknowledged
    assert after.events == [("sync", 1), ("ack", 1)]


class HeldJournal:
    """A real journal whose background fsync waits until the test lets it go."""

    def __init__(self, directory) -> None:
        from edge_fl.server.journal import Journal

        self.inner = Journal.start(directory, job="j", digest="d")
        self.release = threading.Event()
        self.fsynced = threading.Event()

    def append(self) -> None:
        self.inner.append("release", d="d00000", r=1, n=1)

    def sync(self) -> None:
        self.inner.sync()

    def write_now(self) -> None:
        self.inner.write_now()

    def fsync_written(self) -> None:
        self.release.wait(10)
        self.inner.fsync_written()
        self.fsynced.set()


def held_burst(tmp_path, loop) -> tuple[HeldJournal, GroupCommit, list[int]]:
    """A burst of MIN_BURST updates added to a group commit whose fsync is held back."""
    journal = HeldJournal(tmp_path)
    acks: list[int] = []
    commit = GroupCommit(journal, delay_s=60.0)
    commit.acker = lambda mid, qos: acks.append(mid)
    for mid in range(1, MIN_BURST + 1):
        journal.append()
        commit.add(mid, 1, loop)
    return journal, commit, acks


def test_a_group_synced_on_the_syncer_thread_is_acknowledged_after_its_fsync(tmp_path):
    """The fsync runs off the event loop; its group's acknowledgements wait for it, and the
    messages that arrive meanwhile wait for the next fsync."""

    async def main() -> tuple[list[int], list[int], list[int], bool]:
        loop = asyncio.get_running_loop()
        journal, commit, acks = held_burst(tmp_path, loop)
        for _ in range(5):
            await asyncio.sleep(0)  # the loop runs on while the fsync waits
        during = list(acks)
        journal.append()
        commit.add(99, 1, loop)  # arrives while the first group's fsync is in flight
        journal.release.set()
        while len(acks) < MIN_BURST:
            await asyncio.sleep(0.001)
        first = list(acks)
        commit.flush()  # a round's commit: synchronous, everything durable and acknowledged
        return during, first, list(acks), journal.fsynced.is_set()

    during, first, after, fsynced = asyncio.run(main())
    assert during == []
    assert fsynced
    assert first == list(range(1, MIN_BURST + 1))
    assert after == [*range(1, MIN_BURST + 1), 99]


def test_a_group_in_flight_when_the_connection_changes_is_not_acknowledged(tmp_path):
    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        journal, commit, acks = held_burst(tmp_path, loop)
        await asyncio.sleep(0)
        commit.forget()  # a new connection: those ids mean nothing on it
        journal.release.set()
        while not journal.fsynced.is_set():
            await asyncio.sleep(0.001)
        for _ in range(5):
            await asyncio.sleep(0)
        return acks

    assert asyncio.run(main()) == []
