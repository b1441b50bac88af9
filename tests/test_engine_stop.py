"""A stop signal at the worst moment, without a broker: it arrives while the round's global model
is being published, just before the service sleeps until the round's deadline (issue 24, item 5:
the wake-up was cleared by that sleep and the aggregator waited out the deadline)."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import Status, Topics, UpdateLimits, encode_status
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings
from edge_fl.server.service import AggregatorService
from edge_fl.transport.url import parse_broker_url

DEADLINE_S = 30.0


class SignalDuringPublish:
    """A client whose publish of a round's global model is interrupted by a stop signal."""

    def __init__(self, topics: Topics) -> None:
        self.topics = topics
        self.service: AggregatorService | None = None
        self.published: list[str] = []

    async def publish(self, topic: str, payload: bytes = b"", qos: int = 0, retain: bool = False):
        self.published.append(topic)
        await asyncio.sleep(0)
        if topic == self.topics.global_model and payload and self.service is not None:
            self.service.request_stop("SIGTERM")


def test_a_stop_during_the_global_publish_decides_the_round_at_once():
    settings = AggregatorSettings(job="j", rounds=5, target=2, min_updates=2,
                                  deadline_s=DEADLINE_S)  # fmt: skip
    core = AggregatorCore(settings, np.zeros(4, np.float32), UpdateLimits(4), seeded_generator(1))
    for d in ("d0", "d1", "d2"):
        core.on_status(d, encode_status(Status(d, True, 10)))
    topics = Topics("j")
    client = SignalDuringPublish(topics)
    service = AggregatorService(core, parse_broker_url("mqtt://127.0.0.1:1"), topics)
    client.service = service

    async def run() -> float:
        t0 = time.perf_counter()
        await asyncio.wait_for(service._run_rounds(client), DEADLINE_S / 2)  # type: ignore[arg-type]
        return time.perf_counter() - t0

    took = asyncio.run(run())
    assert took < 2.0
    assert service.stopped == "SIGTERM" and core.ended_early == "stopped by SIGTERM"
    assert [r["status"] for r in core.records] == ["skipped"]
    assert core.records[0]["stopped"] == "SIGTERM"
    # the done marker goes out first (devices stop releasing), then the record
    assert client.published == [topics.global_model, topics.global_model, topics.metrics]
