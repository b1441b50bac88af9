"""The dashboard's HTTP side: one page, its static files, and a server-sent-events stream.

A few dozen lines of stdlib asyncio rather than a web framework: the page needs four GET routes,
and the process shares a machine with an aggregator. The stream sends the page's whole view when
it connects and then, at most ``max_rate`` times a second, whenever the state changed: new
records and the current counters, never one event per MQTT message (10,000 devices publishing
statuses must not become 10,000 repaints).

Access: a random operator token (printed once; ``--token-file`` to set it) opens the operator
view; the page carries it in an HttpOnly, SameSite=Strict cookie. Without it the server answers
401, or with ``public=True`` the public view (:meth:`DashboardState.view` ``operator=False``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import mimetypes
import time
import urllib.parse
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from edge_fl.dashboard.state import DashboardState

__all__ = ["COOKIE", "DashboardServer"]

COOKIE = "edgefl_dashboard"
MAX_REQUEST = 16384  # bytes of a request head
HEARTBEAT_S = 15.0


def _static(name: str) -> bytes | None:
    """A file under ``edge_fl/dashboard/static`` (package data), or None."""
    parts = [p for p in name.split("/") if p]
    if not parts or any(p in (".", "..") or p.startswith(".") for p in parts):
        return None
    node = resources.files("edge_fl.dashboard").joinpath("static", *parts)
    try:
        return node.read_bytes() if node.is_file() else None
    except OSError:
        return None


@dataclass
class DashboardServer:
    state: DashboardState
    token: str
    public: bool = False
    max_rate: float = 4.0  # SSE updates per second per page, at most
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _waking: bool = False
    events_sent: int = 0

    def notify(self) -> None:
        """The state changed: wake the streams (they coalesce to ``max_rate``); one wake-up in
        flight at a time, however many messages arrive meanwhile."""
        if self._waking:
            return
        self._waking = True

        async def wake() -> None:
            self._waking = False
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(wake())

    async def start(self, host: str, port: int) -> asyncio.Server:
        return await asyncio.start_server(self._serve, host, port)

    # ------------------------------------------------------------------ HTTP

    def _is_operator(self, query: dict[str, list[str]], headers: dict[str, str]) -> bool:
        given = (query.get("token") or [""])[0]
        if not given:
            for part in headers.get("cookie", "").split(";"):
                name, _, value = part.strip().partition("=")
                if name == COOKIE:
                    given = value
        return bool(given) and hmac.compare_digest(given.encode(), self.token.encode())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        try:
            await self._route(head, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _route(self, head: bytes, writer: asyncio.StreamWriter) -> None:
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, _ = lines[0].split(" ", 2)
        except ValueError:
            await self._send(writer, 400, b"bad request\n")
            return
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        url = urllib.parse.urlsplit(target)
        query = urllib.parse.parse_qs(url.query)
        if method != "GET":
            await self._send(writer, 405, b"GET only\n")
            return
        path = url.path
        if path == "/favicon.ico":  # browsers ask for it: no icon, no error in the console
            await self._send(writer, 204, b"")
            return
        if path.startswith("/static/"):
            body = _static(path[len("/static/") :])
            if body is None:
                await self._send(writer, 404, b"not found\n")
                return
            kind = mimetypes.guess_type(path)[0] or "application/octet-stream"
            await self._send(writer, 200, body, kind, cache=True)
            return
        operator = self._is_operator(query, headers)
        if "token" in query:  # from the printed URL: keep it in a cookie, not in the address bar
            if not operator:
                await self._send(writer, 401, b"wrong operator token\n")
                return
            cookie = f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/"
            await self._send(writer, 303, b"", extra={"Location": url.path, "Set-Cookie": cookie})
            return
        if not operator and not self.public:
            await self._send(
                writer,
                401,
                b"operator token required: open the URL `edge-fl dashboard` printed\n",
            )
            return
        if path in ("/", "/index.html"):
            page = _static("index.html")
            assert page is not None, "edge_fl/dashboard/static/index.html is package data"
            await self._send(writer, 200, page, "text/html; charset=utf-8")
        elif path == "/api/view":
            body = json.dumps(self.state.view(operator), allow_nan=False).encode()
            await self._send(writer, 200, body, "application/json")
        elif path == "/events":
            await self._stream(writer, operator)
        else:
            await self._send(writer, 404, b"not found\n")

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        kind: str = "text/plain; charset=utf-8",
        *,
        cache: bool = False,
        extra: dict[str, str] | None = None,
    ) -> None:
        reason = {
            200: "OK",
            204: "No Content",
            303: "See Other",
            400: "Bad Request",
            401: "Unauthorized",
        }.get(status, "Not Found" if status == 404 else "Error")
        head = [
            f"HTTP/1.1 {status} {reason}",
            f"Content-Type: {kind}",
            f"Content-Length: {len(body)}",
            "Cache-Control: " + ("max-age=3600" if cache else "no-store"),
            "X-Content-Type-Options: nosniff",
            "Content-Security-Policy: default-src 'self'; style-src 'self' 'unsafe-inline'",
            "Connection: close",
            *(f"{k}: {v}" for k, v in (extra or {}).items()),
        ]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, operator: bool) -> None:
        """Server-sent events: ``view`` events, each the records the page lacks and the rest."""
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
            b"X-Accel-Buffering: no\r\nConnection: keep-alive\r\n\r\nretry: 2000\n\n"
        )
        sent_seq, have, epoch = -1, 0, 0  # the state's seq, the records the page holds, their epoch
        gap = 1.0 / self.max_rate
        last = 0.0
        while True:
            if self.state.seq == sent_seq:
                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), HEARTBEAT_S)
                if self.state.seq == sent_seq:
                    writer.write(b": keep-alive\n\n")
                    await writer.drain()
                    continue
            wait = last + gap - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # coalesce a burst into one event
            sent_seq = self.state.seq
            view = self.state.view(operator)
            rows: list[Any] = view["records"]
            if view["rows_epoch"] != epoch:  # rows the page holds have changed: all again
                have, epoch = 0, view["rows_epoch"]
            start = max(0, min(have, len(rows)) - 1)  # the last one again: a round may be redone
            view["records"], view["records_from"] = rows[start:], start
            have = len(rows)
            data = json.dumps(view, allow_nan=False, separators=(",", ":"))
            writer.write(f"event: view\ndata: {data}\n\n".encode())
            await writer.drain()
            self.events_sent += 1
            last = time.monotonic()
