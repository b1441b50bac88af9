"""One timer for the MQTT housekeeping of every device session in a fleet process.

Each aiomqtt client runs a task that wakes every second to call paho's ``loop_misc`` (send a
PINGREQ when the keepalive is due, drop a session whose PINGRESP never came). With 10,000
sessions in one process that was 10,000 timer wake-ups a second whatever the fleet was doing:
the largest CPU cost of a 10,000-device simulation (docs/bench/profile-10k.md). Here one task
calls ``loop_misc`` for every session each ``period_s``; each session still sends its own
PINGREQs on its own connection, at most ``period_s`` later than paho's own timer would (well
inside the 1.5 x keepalive the broker allows).
"""

from __future__ import annotations

import asyncio
import contextlib

import paho.mqtt.client as paho

__all__ = ["SharedKeepalive"]

CHUNK = 500  # sessions checked between two turns of the event loop


class SharedKeepalive:
    """Pass :meth:`misc_loop` to ``client_adapter.replace_misc_loop`` for each session."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self._sessions: dict[paho.Client, asyncio.Future[None]] = {}
        self._ticker: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    async def misc_loop(self, pc: paho.Client) -> None:
        """One session's housekeeping task: waits until the shared timer finds the session
        gone (``loop_misc`` no longer succeeds) or aiomqtt cancels it (the socket closed)."""
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()
        self._sessions[pc] = gone
        if self._ticker is None or self._ticker.done():
            self._ticker = loop.create_task(self._tick())
        try:
            await gone
        finally:
            if self._sessions.get(pc) is gone:
                del self._sessions[pc]

    def check(self, sessions: list[tuple[paho.Client, asyncio.Future[None]]] | None = None) -> None:
        """Run ``loop_misc`` once for ``sessions`` (default: every session)."""
        for pc, gone in sessions if sessions is not None else list(self._sessions.items()):
            if not gone.done() and pc.loop_misc() != paho.MQTT_ERR_SUCCESS:
                gone.set_result(None)

    async def _tick(self) -> None:
        while self._sessions:
            await asyncio.sleep(self.period_s)
            sessions = list(self._sessions.items())
            for start in range(0, len(sessions), CHUNK):
                # in slices: 10,000 sessions at once would hold the event loop for a while
                self.check(sessions[start : start + CHUNK])
                await asyncio.sleep(0)

    async def close(self) -> None:
        """Stop the timer (sessions still open keep no housekeeping)."""
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
