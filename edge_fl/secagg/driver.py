"""One SecAgg+ round run in memory between device and aggregator sessions, with devices vanishing
at chosen phases: what the tests, the test vectors and tools/bench_secagg.py drive. It routes
bytes exactly as the broker would (device -> aggregator, aggregator -> one device's inbox) and
counts them per device."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from edge_fl.protocol.envelope import Signs, Verifies
from edge_fl.secagg.aggregator import AggregatorSession, Observer
from edge_fl.secagg.device import DeviceSession
from edge_fl.secagg.primitives import RandBytes
from edge_fl.secagg.session import (
    Aborted,
    Deliver,
    Finished,
    Outcome,
    RoundParams,
    Send,
)

#: the phases a device can vanish before: it sends nothing from that phase on
VANISH = ("advertise", "share", "mask", "unmask")


@dataclass
class Trace:
    outcome: Outcome
    up: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # bytes a device sent
    down: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # bytes it received
    sent: list[tuple[str, str, bytes]] = field(default_factory=list)  # (direction, device, payload)
    aborted: dict[str, str] = field(default_factory=dict)
    cpu_device: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cpu_aggregator: float = 0.0


def run_round(
    params: RoundParams,
    inputs: Mapping[str, np.ndarray],
    vanish: Mapping[str, str] | None = None,
    *,
    randbytes: Callable[[str], RandBytes] | None = None,
    observer: Observer | None = None,
    record: bool = False,
    tamper: Callable[[str, str, bytes], bytes] | None = None,
    clock: Callable[[], float] | None = None,
    modular: bool = False,
    signers: Mapping[str, Signs] | None = None,
    directory: Callable[[str], Verifies | None] | None = None,
    noise: Mapping[str, np.ndarray] | None = None,
) -> Trace:
    """Run a round; ``vanish[device]`` is the phase (in :data:`VANISH`) before which it stops.
    ``tamper(direction, device, payload)`` may replace any payload in transit ("up": device to
    aggregator, "down": aggregator to device), as a hostile broker would. ``noise[device]``:
    the distributed-DP noise inside its input (revealed if the aggregator asks for it)."""
    vanish = dict(vanish or {})
    gone: set[str] = set()
    agg = AggregatorSession(params, observer=observer, device_key=directory)
    devs = {
        d: DeviceSession(
            d,
            params,
            randbytes=randbytes(d) if randbytes else os.urandom,
            signer=signers[d] if signers else None,
            peer_key=directory,
        )
        for d in params.roster
    }
    trace = Trace(outcome=None)  # type: ignore[arg-type]
    pending: list[Deliver] = []

    def aggregator_does(call: Callable[[], list]) -> None:
        """Time the aggregator's call and route its effects."""
        start = clock() if clock else 0.0
        effects = call()
        if clock:
            trace.cpu_aggregator += clock() - start
        for effect in effects:
            if isinstance(effect, Deliver):
                pending.append(effect)
            elif isinstance(effect, Finished):
                trace.outcome = effect.outcome

    def up(device: str, payload: bytes) -> None:
        if tamper is not None:
            payload = tamper("up", device, payload)
        trace.up[device] += len(payload)
        if record:
            trace.sent.append(("up", device, payload))
        aggregator_does(lambda: agg.receive(device, payload))

    def handle(device: str, effects: list) -> None:
        for effect in effects:
            if isinstance(effect, Send):
                up(device, effect.payload)
            elif isinstance(effect, Aborted):
                trace.aborted[device] = effect.reason

    def vanished(device: str, phase: str) -> bool:
        if vanish.get(device) == phase:
            gone.add(device)
        return device in gone

    def timed(device: str, call: Callable[[], Any]) -> Any:
        start = clock() if clock else 0.0
        effects = call()
        if clock:
            trace.cpu_device[device] += clock() - start
        return effects

    for d in params.roster:
        if not vanished(d, "advertise"):
            handle(d, [timed(d, devs[d].advertise)])
    for phase in ("share", "mask", "unmask", None):
        if trace.outcome is not None:
            break
        if not pending:
            aggregator_does(agg.close_phase)
        batch, pending[:] = list(pending), []
        if phase is None:
            break
        for d in {e.device for e in batch}:
            vanished(d, phase)
        for effect in batch:
            if effect.device in gone:
                continue
            payload = tamper("down", effect.device, effect.payload) if tamper else effect.payload
            trace.down[effect.device] += len(payload)
            if record:
                trace.sent.append(("down", effect.device, payload))
            dev = devs[effect.device]
            handle(effect.device, timed(effect.device, partial(dev.receive, payload)))
            if phase == "mask" and dev.phase == "ready":
                x, z = inputs[effect.device], (noise or {}).get(effect.device)
                submit = partial(dev.submit, x, modular=modular, noise=z)
                handle(effect.device, timed(effect.device, submit))
    if trace.outcome is None:
        aggregator_does(agg.close_phase)  # a Deliver now has no phase left to go to
    return trace
