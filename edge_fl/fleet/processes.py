"""A simulated fleet over several processes, so a simulation trains on every core.

``fleet.processes`` = N splits the devices as ``edge-fl fleet --shard I/N`` does (device i runs
in share i mod N). Share 0 runs in the aggregator's process; shares 1..N-1 in processes forked
from it once the job is built (they inherit its data, model and agents: nothing is imported or
built twice). Nothing simulated changes: every device keeps its own MQTT session, its own last
will and its own bytes on the wire, and every message crosses the broker as before. Only the
simulator's bookkeeping crosses the pipe to each share: the broker to use, each round's counts
(:class:`~edge_fl.fleet.counts.RoundCounts`) when the aggregator records a round, and the
share's totals when its devices have left.

A share stops when the job's done marker reaches its devices, as any fleet does. It ignores
SIGINT and SIGTERM (Ctrl-C reaches the whole process group): the aggregator's process decides
the open round and publishes that marker. If the aggregator's process dies, the pipe closes
and the share exits at once: its sessions' sockets close and the broker publishes each
device's last will, as for any fleet process that dies (leaving one by one would wait out a
publish timeout on a broker that usually died with the aggregator). A share that fails is reported to the aggregator's process,
which stops the job cleanly (the open round decided, everything written, resumable)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe
from typing import TYPE_CHECKING, Any, NoReturn

from edge_fl.fleet.counts import FleetTotals, RoundCounts

if TYPE_CHECKING:
    from edge_fl.transport.url import BrokerSpec

log = logging.getLogger(__name__)

#: the longest a round's record waits for a share's counts, blocking the aggregator's event
#: loop (a share answers between two trainings: milliseconds, unless the machine stalls or the
#: share is stopped); counts that come later go into the next record
TAKE_TIMEOUT_S = 2.0
#: after the job, how long a share's devices have to leave on the done marker, as the
#: aggregator's own share did, before the share is asked to make them leave (it missed the
#: marker: it was still connecting when a stop came, say)
LEAVE_GRACE_S = 1.0
#: the longest the end of a job waits for a share's devices to leave
END_TIMEOUT_S = 10.0
#: what every share imports to build and run its fleet (the devices' connects encode the host
#: name with the idna codec)
SHARE_IMPORTS = ("edge_fl.fleet.runtime", "edge_fl.device.runtime", "yaml", "encodings.idna")


class FleetProcessError(RuntimeError):
    """A fleet process failed; the job was stopped cleanly at its failure."""


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the platform says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def share_fleet(job: Any, spec: BrokerSpec, index: int, n: int, verifier: Any) -> Any:
    """Share ``index`` of ``n`` of ``job``'s fleet (``edge-fl fleet --shard`` devices; ``n`` =
    1: the whole fleet), each share with its own downlink session."""
    devices = range(index, job.cfg.data.devices, n) if n > 1 else None
    fleet = job.fleet_runtime(spec, devices, trust=job.trust(verifier))
    if n > 1:
        fleet.downlink_id += f"-{index}of{n}"
    return fleet


@dataclass
class Share:
    """The aggregator process's handle on one forked share."""

    index: int
    pid: int
    conn: Connection
    counts: list[RoundCounts] = field(default_factory=list)  # taken, not yet merged
    asked: int = 0  # takes asked for and not answered yet
    totals: FleetTotals | None = None  # its devices left (the job is over)
    last: RoundCounts | None = None  # what moved after the last record
    error: str | None = None
    closed: bool = False
    reaped: bool = False


class FleetProcesses:
    """Shares 1..N-1 of a fleet, each in a forked process (share 0 is the caller's).

    ``fork`` them once the job is built (before any thread starts: a forked process holds only
    the thread that forked), ``start`` them with the broker once it listens, ``take_round`` at
    every record, ``finish`` when the job is done, ``close`` always."""

    def __init__(self, shares: list[Share], n: int) -> None:
        self.shares = shares
        self.n = n
        self._on_failure: Callable[[str], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()  # a share's message was handled

    @classmethod
    def fork(cls, job: Any, n: int, verifier: Any) -> FleetProcesses:
        """Fork shares 1..n-1 of ``job``'s fleet (``n`` = 1: none). ``verifier``: the global
        messages' signature key, which every device checks."""
        shares: list[Share] = []
        if n > 1:  # once, before the fork, rather than in every share
            for module in SHARE_IMPORTS:
                importlib.import_module(module)
        try:
            for index in range(1, n):
                ours, theirs = Pipe()
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the share's process: it never returns from here
                    ours.close()
                    for earlier in shares:
                        earlier.conn.close()
                    _share_main(theirs, job, index, n, verifier)
                theirs.close()
                shares.append(Share(index, pid, ours))
        except BaseException:
            cls(shares, n).close()
            raise
        return cls(shares, n)

    def start(
        self,
        spec: BrokerSpec,
        on_failure: Callable[[str], None],
        released: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """Give every share the broker (and, resumed, each device's releases so far:
        ``DeviceAgent.resume``); from here on, a share that fails (or exits before its devices
        left) calls ``on_failure(why)`` on the running event loop."""
        self._on_failure = on_failure
        self._loop = asyncio.get_running_loop()
        for share in self.shares:
            self._send(share, ("go", spec, released or {}))
            if not share.closed:
                self._loop.add_reader(share.conn.fileno(), self._readable, share)

    def take_round(self) -> list[RoundCounts]:
        """Every live share's counts since its previous take (a round's record)."""
        for share in self.shares:
            if self._send(share, ("take",)):
                share.asked += 1
        deadline = time.monotonic() + TAKE_TIMEOUT_S
        for share in self.shares:
            while share.asked and not share.closed and share.totals is None:
                if not self._receive(share, max(0.0, deadline - time.monotonic())):
                    if not share.closed:  # (a closed one said why, or exited: reported)
                        log.warning(
                            "fleet process %d/%d did not give its counts within %.0f s: its "
                            "devices' wire bytes go into a later record",
                            share.index,
                            self.n,
                            TAKE_TIMEOUT_S,
                        )
                    break
        taken = [c for s in self.shares for c in s.counts]
        for share in self.shares:
            share.counts.clear()
        return taken

    async def finish(self, *, wait: bool) -> tuple[list[FleetTotals], list[RoundCounts]]:
        """After the job: with ``wait``, each share's totals once its devices left (the done
        marker reached them); without (the broker is gone: no marker can), the shares are told
        to leave at once. Returns the totals and what moved after the last record."""
        start = time.monotonic()
        deadline = start + END_TIMEOUT_S
        asked_to_leave = False
        while wait and any(s.totals is None and not s.closed for s in self.shares):
            if not asked_to_leave and time.monotonic() - start >= LEAVE_GRACE_S:
                asked_to_leave = True
                for share in self.shares:
                    if share.totals is None:
                        self._send(share, ("leave",))
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "fleet processes: devices had not left %.0f s after the job ended; "
                    "stopping them",
                    END_TIMEOUT_S,
                )
                break
            self._changed.clear()
            wake = left if asked_to_leave else min(left, LEAVE_GRACE_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wake)
        self.close()
        totals = [s.totals for s in self.shares if s.totals is not None]
        after = [c for s in self.shares for c in (*s.counts, *([s.last] if s.last else []))]
        return totals, after

    def failures(self) -> list[str]:
        """Why shares failed, one line each (empty: none did)."""
        return [f"fleet process {s.index}/{self.n}: {s.error}" for s in self.shares if s.error]

    def close(self) -> None:
        """Close every pipe (a share still running sees it closed and exits: the broker
        publishes its devices' last wills) and reap every share, killing one that does not exit
        within a few seconds."""
        for share in self.shares:
            self._closed(share)
        for share in self.shares:
            if not share.reaped:
                share.reaped = True
                _reap(share.pid, share.index, self.n)

    # ------------------------------------------------------------------ plumbing

    def _send(self, share: Share, message: tuple) -> bool:
        if share.closed:
            return False
        try:
            share.conn.send(message)
        except OSError:  # the share is gone: why is on its way (or it is EOF)
            self._receive(share, 0.0)
            return not share.closed
        return True

    def _readable(self, share: Share) -> None:
        self._receive(share, 0.0)

    def _receive(self, share: Share, timeout: float) -> bool:
        """Handle one message from ``share`` if one arrives within ``timeout``; False if none
        did (or the pipe is closed)."""
        if share.closed:
            return False
        try:
            if not share.conn.poll(timeout):
                return False
            message = share.conn.recv()
        except (EOFError, OSError):
            if share.totals is None and share.error is None:
                share.error = "exited before its devices left"
                self._failed(share)
            self._closed(share)
            self._changed.set()
            return False
        kind = message[0]
        if kind == "take":
            share.counts.append(message[1])
            share.asked = max(0, share.asked - 1)
        elif kind == "end":
            share.totals, share.last = message[1], message[2]
        elif kind == "error":
            share.error = message[1]
            self._failed(share)
        self._changed.set()
        return True

    def _failed(self, share: Share) -> None:
        log.error("fleet process %d/%d failed: %s", share.index, self.n, share.error)
        if self._on_failure is not None:
            self._on_failure(f"fleet process {share.index}/{self.n} failing")

    def _closed(self, share: Share) -> None:
        if share.closed:
            return
        share.closed = True
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(Exception):
                self._loop.remove_reader(share.conn.fileno())
        share.conn.close()


def _reap(pid: int, index: int, n: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            log.warning("fleet process %d/%d did not exit: killed", index, n)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.005)


# ---------------------------------------------------------------------- the share's process


def _share_main(conn: Connection, job: Any, index: int, n: int, verifier: Any) -> NoReturn:
    """A forked share's whole life: wait for the broker, run its devices until the done marker
    (or until the aggregator's process is gone), report, exit. Never returns: ``os._exit``, so
    nothing of the aggregator's process (its exit handlers, its output directory's lock, the
    embedded broker's clean-up) runs here."""
    code = 0
    try:
        if threading.current_thread() is threading.main_thread():
            # the aggregator's event loop wakes on this fd; a signal here must not wake it
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C reaches the process group:
                signal.signal(sig, signal.SIG_IGN)  # the aggregator's process stops the job
        try:
            _kind, spec, released = conn.recv()
        except EOFError:  # the job ended before it started (a broker that failed to start)
            os._exit(0)
        # on a thread of its own: the forked thread is inside the aggregator's event loop
        outcome: list[BaseException] = []

        def serve() -> None:
            try:
                asyncio.run(_serve(conn, job, index, n, spec, verifier, released))
            except BaseException as exc:  # reported below
                outcome.append(exc)

        thread = threading.Thread(target=serve, name=f"fleet-{index}of{n}")
        thread.start()
        thread.join()
        if outcome and not isinstance(outcome[0], asyncio.CancelledError):
            raise outcome[0]
    except BaseException as exc:
        code = 1
        what = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        with contextlib.suppress(Exception):
            conn.send(("error", what))
        log.debug("fleet process %d/%d failed", index, n, exc_info=exc)
    finally:
        _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """End the share's process, from any of its threads: what it logged is flushed, nothing of
    the aggregator's process (exit handlers, the run's lock, the broker's clean-up) runs."""
    with contextlib.suppress(Exception):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


async def _serve(
    conn: Connection,
    job: Any,
    index: int,
    n: int,
    spec: BrokerSpec,
    verifier: Any,
    released: dict[str, tuple[int, int]],
) -> None:
    fleet = share_fleet(job, spec, index, n, verifier)
    fleet.resume_devices(released)
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(fleet.run(), name=f"fleet-{index}of{n}")

    def readable() -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the aggregator's process is gone: nobody to report to
            log.warning(
                "fleet process %d/%d: the aggregator's process closed its pipe (it stopped "
                "without a done marker, or died); exiting (the broker publishes its devices' "
                "last wills)",
                index,
                n,
            )
            _exit_now(0)
        if message[0] == "take":
            conn.send(("take", fleet.take_round()))
        elif message[0] == "leave" and not fleet.leaving:
            told_to_leave.append(True)
            task.cancel()  # the job is over and its done marker missed this share: leave now

    told_to_leave: list[bool] = []
    loop.add_reader(conn.fileno(), readable)
    try:
        await task
    except asyncio.CancelledError:
        if not told_to_leave:
            raise
    finally:
        with contextlib.suppress(Exception):
            loop.remove_reader(conn.fileno())
    conn.send(("end", fleet.totals(), fleet.take_round()))
