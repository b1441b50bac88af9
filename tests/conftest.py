"""Shared fixtures: private brokers on free ports (never the system broker on 1883)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from edge_fl.transport.broker import EmbeddedBroker, find_mosquitto

NO_MOSQUITTO = (
    "no mosquitto binary on PATH or in /usr/sbin: install it (apt-get install mosquitto) to run "
    "the broker tests"
)


def _require_mosquitto() -> None:
    if find_mosquitto() is None:
        pytest.skip(NO_MOSQUITTO)


@pytest.fixture(scope="session")
def mosquitto() -> Iterator[EmbeddedBroker]:
    """One private Mosquitto for the session (embedded config). Shared: use unique job ids."""
    _require_mosquitto()
    broker = EmbeddedBroker(kind="mosquitto").start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def make_broker() -> Iterator[Callable[..., EmbeddedBroker]]:
    """Factory: `make_broker(**EmbeddedBroker options)` -> a started broker, stopped after the test.

    kind defaults to "mosquitto" (skipped without the binary); pass kind="amqtt" for the fallback.
    """
    started: list[EmbeddedBroker] = []

    def factory(**options: Any) -> EmbeddedBroker:
        options.setdefault("kind", "mosquitto")
        if options["kind"] == "mosquitto":
            _require_mosquitto()
        broker = EmbeddedBroker(**options)
        started.append(broker)
        return broker.start()

    yield factory
    for broker in started:
        broker.stop()


@pytest.fixture(autouse=True)
def _no_repeat_collapser_outlives_a_test() -> Iterator[None]:
    """A command run in this process (click's CliRunner) installs the CLI's repeat collapser on
    the root handlers; removed after each test, or it folds a later test's warnings into one
    (test_magrr after an in-process `edge-fl simulate`, in CI)."""
    yield
    from edge_fl.logs import uncollapse

    uncollapse()
