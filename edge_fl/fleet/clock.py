"""Simulated time: modelled compute and transfer durations become real sleeps, scaled.

``time_scale`` is real seconds per simulated second (0.01 runs a simulated hour in 36 s). Without
a scale nothing is modelled: devices run as fast as the machine allows and simulated time is wall
time. Real CPU time spent training also passes on the clock, so it adds to the modelled time.
"""

from __future__ import annotations

import asyncio
import time


class SimClock:
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

    async def sleep(self, sim_seconds: float) -> None:
        if self.time_scale is not None and sim_seconds > 0:
            await asyncio.sleep(sim_seconds * self.time_scale)

    async def sleep_until(self, sim_t: float) -> None:
        if sim_t == float("inf"):
            await asyncio.Event().wait()  # forever (cancelled at the end of the job)
        await self.sleep(max(0.0, sim_t - self.now()))
