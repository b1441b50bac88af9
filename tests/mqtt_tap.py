"""An independent MQTT subscriber for tests: records every payload the broker forwards on a topic."""

from __future__ import annotations

import asyncio
import threading

import aiomqtt

from edge_fl.protocol import Topics
from edge_fl.transport.url import parse_broker_url


class UpdateTap:
    """Runs in a thread of its own, so it shares nothing with the run it observes."""

    def __init__(
        self, url: str, topics: Topics, identifier: str = "tap", topic: str | None = None
    ) -> None:
        """``topic``: the filter to record (default: every device's update topic)."""
        self.spec = parse_broker_url(url)
        self.topics = topics
        self.topic = topic or topics.all_updates
        self.identifier = identifier
        self.payloads: list[tuple[str, bytes]] = []
        self.arrived = threading.Condition()  # notified on every recorded message
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        kwargs = self.spec.aiomqtt_kwargs()
        async with aiomqtt.Client(**kwargs, identifier=self.identifier) as client:
            await client.subscribe(self.topic, qos=1)
            self.ready.set()
            # One reader for the whole session, cancelled only at the end: a timeout around each
            # read (as before) can cancel a read that already took a message off the queue, and
            # that message is lost (under load the retained job document was, 2 runs of 10).
            reader = asyncio.create_task(self._read(client))
            await asyncio.to_thread(self.stop.wait)
            reader.cancel()

    async def _read(self, client: aiomqtt.Client) -> None:
        async for msg in client.messages:
            with self.arrived:
                self.payloads.append((str(msg.topic), bytes(msg.payload)))
                self.arrived.notify_all()

    def wait_for_messages(self, count: int = 1, timeout: float = 60.0) -> bool:
        """Whether ``count`` messages were recorded within ``timeout`` s (a retained one counts
        at once)."""
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.payloads) >= count, timeout)

    @property
    def bytes(self) -> int:
        return sum(len(p) for _, p in self.payloads)

    @property
    def messages(self) -> int:
        return len(self.payloads)

    def __enter__(self) -> UpdateTap:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
