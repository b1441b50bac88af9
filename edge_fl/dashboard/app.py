"""One dashboard process: a source (broker or run directory) feeding the state, and the server."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from edge_fl.dashboard.server import DashboardServer
from edge_fl.dashboard.sources import BrokerSource, RunDirSource
from edge_fl.dashboard.state import DashboardState

__all__ = ["Dashboard"]


@dataclass
class Dashboard:
    """``Dashboard.live(url, job)`` or ``Dashboard.run_dir(path)``, then ``await serve(...)``."""

    state: DashboardState
    source: BrokerSource | RunDirSource
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    public: bool = False
    max_rate: float = 4.0
    server: DashboardServer | None = None
    port: int = 0

    @classmethod
    def live(cls, broker_url: str, job: str, prefix: str = "edgefl", **kw) -> Dashboard:
        state = DashboardState()
        return cls(state, BrokerSource(state, broker_url, job, prefix), **kw)

    @classmethod
    def run_dir(cls, path: str | Path, **kw) -> Dashboard:
        state = DashboardState()
        source = RunDirSource(state, path)
        source.check()
        source.poll()
        return cls(state, source, **kw)

    async def serve(self, host: str, port: int, started: asyncio.Event | None = None) -> None:
        """Serve until cancelled; ``started`` is set once the port listens (``self.port``)."""
        self.server = DashboardServer(self.state, self.token, self.public, self.max_rate)
        self.source.on_change = self.server.notify
        http = await self.server.start(host, port)
        self.port = http.sockets[0].getsockname()[1]
        if started is not None:
            started.set()
        async with http:
            feed = asyncio.create_task(self.source.run())
            try:
                await http.serve_forever()
            finally:
                feed.cancel()
