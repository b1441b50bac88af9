"""Clock messages of virtual time (simulations only; docs/protocol.md, "Virtual time").

Under virtual time (``fleet.clock: virtual``) the aggregator and a simulated fleet agree on
simulated time through the broker, conservatively: neither runs ahead of what the other could
still send. Two topics, QoS 1, never retained, JSON objects:

* ``<prefix>/<job>/clock/agg`` (aggregator -> fleet), a **grant**: ``{"v": 1, "k": "grant",
  "g": G, "t": T, "n": N}``: the fleet may carry out every device event up to simulated time T
  (seconds since the simulated epoch); N is how many global and dispatch messages the aggregator
  has published since the clock started, all of them at simulated times <= T, and the ones not
  covered by an earlier grant exactly at T. G numbers the grants (1, 2, ...).
* ``<prefix>/<job>/clock/fleet`` (fleet -> aggregator), a **report**: ``{"v": 1, "k": "report",
  "g": G, "t": T, "next": X, "n": N, "seen": S}``: the fleet has done everything up to T (its
  answer to grant G; ``"k": "ready"`` with ``g`` 0 once, when its devices are connected and its
  downlink subscribed), none of its devices publishes before X unless an aggregator message
  sets new work off (``null``: nothing pending), its devices have
  published N updates and statuses since they connected, and it has received S of the
  aggregator's messages. Optional lookahead: ``"ups": [U1, U2, ...]`` (ascending, at most
  :data:`UPS_MAX`) the earliest time each pending piece of device work can publish an update,
  and ``"st": Y`` the earliest time any device publishes a status (``null``: none); a sync round
  can then be granted through the time its decision can first change (docs/protocol.md).
  ``"k": "gone"`` (the fleet's last will, or its leaving) ends virtual time.

Ordering rule: each side waits until it has *received* as many of the other's messages as the
other announced (counts, not MQTT order across sessions), then acts at the announced time.
A deployed device never sees these topics.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

VERSION = 1
KINDS = ("grant", "ready", "report", "gone")
#: at most this many upload times in a report's lookahead
UPS_MAX = 64


def clock_topic(base: str, side: str) -> str:
    """``<base>/clock/agg`` or ``<base>/clock/fleet`` (``base`` = ``Topics.base``)."""
    if side not in ("agg", "fleet"):
        raise ValueError(f"clock side {side!r}: agg or fleet")
    return f"{base}/clock/{side}"


class ClockMessageError(ValueError):
    """A clock message that is not well formed."""


@dataclass(frozen=True)
class ClockMessage:
    kind: str
    g: int = 0
    t: float = 0.0
    n: int = 0
    next: float = math.inf  # reports: the fleet's earliest pending event (inf: none)
    seen: int = 0  # reports: aggregator messages received
    ups: tuple[float, ...] | None = None  # reports: pending uploads' earliest times (None: unsaid)
    st: float = math.inf  # reports: the earliest status publication (inf: none)

    def encode(self) -> bytes:
        body: dict[str, object] = {"v": VERSION, "k": self.kind, "g": self.g, "t": self.t}
        body["n"] = self.n
        if self.kind != "grant":
            body["next"] = None if math.isinf(self.next) else self.next
            body["seen"] = self.seen
            if self.ups is not None:
                body["ups"] = list(self.ups)
                body["st"] = None if math.isinf(self.st) else self.st
        return json.dumps(body, separators=(",", ":")).encode()


def _number(body: dict, key: str) -> float:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ClockMessageError(f"clock message: {key} = {value!r} is not a finite number")
    return float(value)


def _count(body: dict, key: str) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ClockMessageError(f"clock message: {key} = {value!r} is not a count")
    return value


def decode_clock(data: bytes) -> ClockMessage:
    """The message in ``data``, or :class:`ClockMessageError`."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ClockMessageError(f"clock message is not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("v") != VERSION:
        raise ClockMessageError("clock message: not an object of version 1")
    kind = body.get("k")
    if kind not in KINDS:
        raise ClockMessageError(f"clock message: kind {kind!r} is not one of {KINDS}")
    if kind == "gone":
        return ClockMessage("gone")
    msg = ClockMessage(kind, g=_count(body, "g"), t=_number(body, "t"), n=_count(body, "n"))
    if kind == "grant":
        return msg
    nxt = body.get("next")
    ups: tuple[float, ...] | None = None
    st = math.inf
    if "ups" in body:
        raw = body["ups"]
        if not isinstance(raw, list) or len(raw) > UPS_MAX:
            raise ClockMessageError(f"clock message: ups is not a list of at most {UPS_MAX}")
        ups = tuple(_number({"ups": u}, "ups") for u in raw)
        if list(ups) != sorted(ups):
            raise ClockMessageError("clock message: ups is not in ascending order")
        st = math.inf if body.get("st") is None else _number(body, "st")
    return ClockMessage(
        kind,
        g=msg.g,
        t=msg.t,
        n=msg.n,
        next=math.inf if nxt is None else _number(body, "next"),
        seen=_count(body, "seen"),
        ups=ups,
        st=st,
    )
