"""Wire-level bytes: what a device's MQTT session really sends and receives, and an estimate of
what TLS and TCP/IP add on top (what a cellular data plan bills).

Two parts:

* :func:`mqtt_packet_bytes`: the exact size of an MQTT 3.1.1 packet (fixed header with its
  remaining-length varint, variable header, payload), a pure function. ``edge-fl comm-cost``
  prices a round with it.
* :class:`WireCounter` and :func:`install`: measured counts. ``install()`` has paho report each
  write of MQTT bytes (exact even on partial writes) and each whole packet received (1 + varint
  + remaining length), through :mod:`edge_fl.transport.client_adapter`'s packet hooks. A client
  with a counter attached (:func:`attach`) adds to it; every client in the process adds to
  :data:`PROCESS` (which is what a broker's ``$SYS/broker/bytes/*`` sees of this process). Cost: a few integer additions per packet, nothing per payload byte, so it
  runs for thousands of simulated devices.

The TLS/TCP/IP figures are a model (:class:`LinkModel`), applied per MQTT packet (paho writes
one packet per ``send``; a broker writes one per ``SSL_write``/``write``):

* TLS 1.3 (AEAD, e.g. AES-GCM): each record carries at most 16,384 plaintext bytes and adds 22
  bytes (5 header + 1 inner content type + 16 tag); a connection's handshake adds a fixed number
  of bytes per direction (measured once with a packet capture for the embedded broker's
  certificate; a longer chain costs more) and the close_notify alert adds one record each way.
* TCP/IP: a write of n bytes is ceil(n / MSS) segments, each with 52 header bytes (IPv4 20 +
  TCP 20 + timestamps option 12). The receiver acknowledges with a pure ACK (52 bytes) per
  ``ack_ratio`` of the data segments it gets (delayed ACK). A connection adds SYN / SYN-ACK /
  ACK (60 + 60 + 52) and FIN / ACK each way (2 x 52). MSS 1448 is Ethernet-sized (MTU 1500
  with timestamps), what a device's link has; loopback's MTU 65,536 gives MSS 65,483.

Validated against a packet capture on loopback and the broker's ``$SYS`` counters
(``tests/test_wire_bytes.py``, ``tools/bench_wire.py``).
"""

from __future__ import annotations

import math
import operator
import threading
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PROCESS",
    "LinkModel",
    "WireCounter",
    "attach",
    "install",
    "mqtt_packet_bytes",
    "percentiles",
    "varint_len",
]

# MQTT control packet types (high nibble of the first byte)
CONNECT, CONNACK, PUBLISH, PUBACK = 1, 2, 3, 4
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK = 8, 9, 10, 11
PINGREQ, PINGRESP, DISCONNECT = 12, 13, 14

_FIXED_REMAINING = {
    "connack": 2,
    "puback": 2,
    "pubrec": 2,
    "pubrel": 2,
    "pubcomp": 2,
    "unsuback": 2,
    "pingreq": 0,
    "pingresp": 0,
    "disconnect": 0,
}


def varint_len(n: int) -> int:
    """Bytes of MQTT's remaining-length varint for ``n`` (1 to 4: up to 268,435,455)."""
    if n < 0 or n > 268_435_455:
        raise ValueError(f"remaining length {n} is outside MQTT's 0..268435455")
    if n < 128:
        return 1
    if n < 16_384:
        return 2
    if n < 2_097_152:
        return 3
    return 4


def _str_len(value: str | bytes | None) -> int:
    """An MQTT UTF-8 string or binary field: 2-byte length prefix + the bytes."""
    if value is None:
        return 0
    return 2 + len(value.encode() if isinstance(value, str) else value)


def _payload_len(value: int | bytes | str | None) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    return len(value.encode() if isinstance(value, str) else value)


def mqtt_packet_bytes(
    kind: str,
    *,
    topic: str | bytes = "",
    payload: int | bytes | str = 0,
    qos: int = 0,
    topics: tuple[str, ...] | list[str] = (),
    client_id: str = "",
    will_topic: str | None = None,
    will_payload: int | bytes | str | None = None,
    username: str | None = None,
    password: str | None = None,
) -> int:
    """Exact size in bytes of one MQTT 3.1.1 packet, fixed header included.

    ``kind``: connect, connack, publish, puback, pubrec, pubrel, pubcomp, subscribe, suback,
    unsubscribe, unsuback, pingreq, pingresp, disconnect. ``payload`` is a length or the bytes.
    ``topics``: the filters of a (un)subscribe, or of the subscribe a suback answers."""
    kind = kind.lower()
    if kind in _FIXED_REMAINING:
        remaining = _FIXED_REMAINING[kind]
    elif kind == "publish":
        if qos not in (0, 1, 2):
            raise ValueError(f"qos must be 0, 1 or 2, got {qos!r}")
        remaining = _str_len(topic) + (2 if qos else 0) + _payload_len(payload)
    elif kind == "connect":
        # protocol name "MQTT" (2+4), level, flags, keep-alive; then the payload fields
        remaining = 10 + _str_len(client_id)
        if will_topic is not None:
            remaining += _str_len(will_topic) + 2 + _payload_len(will_payload)
        remaining += _str_len(username) + _str_len(password)
    elif kind == "subscribe":
        remaining = 2 + sum(_str_len(t) + 1 for t in topics)
    elif kind == "suback":
        remaining = 2 + max(len(topics), 1)
    elif kind == "unsubscribe":
        remaining = 2 + sum(_str_len(t) for t in topics)
    else:
        raise ValueError(f"unknown MQTT packet kind {kind!r}")
    return 1 + varint_len(remaining) + remaining


# ---------------------------------------------------------------------------------- link model


@dataclass(frozen=True)
class LinkModel:
    """How MQTT bytes become TLS records and TCP/IP segments (see the module docstring)."""

    mss: int = 1448  # Ethernet MTU 1500 - 20 IPv4 - 20 TCP - 12 timestamps
    header: int = 52  # IPv4 20 + TCP 20 + timestamps option 12, per segment
    syn_extra: int = 8  # SYN and SYN-ACK carry 40 option bytes instead of 12
    ack_ratio: float = 0.5  # pure ACKs per data segment received (delayed ACK: every other)
    tls_record_max: int = 16_384
    tls_record_overhead: int = 22  # TLS 1.3 AEAD: 5 header + 1 content type + 16 tag
    # TLS 1.3 handshake of a client to a broker with broker/make-certs.sh's certificate (one
    # EC P-256 certificate under the CA), measured once on loopback with tcpdump
    # (tools/bench_wire.py --handshake): client hello, change cipher spec and finished up;
    # server hello, certificate, verify, finished and two session tickets down. A longer
    # certificate chain or RSA keys cost more.
    tls_handshake_up: int = 573
    tls_handshake_down: int = 1_795

    def tls_bytes(self, n: int) -> int:
        """TLS bytes of one write of ``n`` MQTT bytes."""
        records = max(1, math.ceil(n / self.tls_record_max))
        return n + records * self.tls_record_overhead

    def segments(self, n: int) -> int:
        return max(1, math.ceil(n / self.mss))


DEFAULT_LINK = LinkModel()


class WireCounter:
    """Bytes a set of MQTT sessions sent (``up``) and received (``down``), both exact at the MQTT
    layer, plus the model's TCP payload and segment counts for the same packets.

    ``take()`` returns what happened since the last ``take()`` (a round's share)."""

    __slots__ = (
        "_lock",
        "_mark",
        "connections",
        "down",
        "down_packets",
        "down_segments",
        "down_tcp",
        "link",
        "up",
        "up_packets",
        "up_segments",
        "up_tcp",
    )

    FIELDS = (
        "up",
        "down",
        "up_packets",
        "down_packets",
        "up_tcp",
        "down_tcp",
        "up_segments",
        "down_segments",
        "connections",
    )

    up: int
    down: int
    up_packets: int
    down_packets: int
    up_tcp: int
    down_tcp: int
    up_segments: int
    down_segments: int
    connections: int

    def __init__(self, link: LinkModel | None = None) -> None:
        self.link = link or DEFAULT_LINK
        for name in self.FIELDS:
            setattr(self, name, 0)
        self._mark: tuple[int, ...] = (0,) * len(self.FIELDS)
        self._lock = threading.Lock()  # paho may run in a thread (the PROCESS counter)

    # -- what the hooks call

    def sent(self, n: int, tls: bool, connect: bool = False) -> None:
        """One write of ``n`` MQTT bytes (one packet, or the rest of a partial write)."""
        link = self.link
        tcp = link.tls_bytes(n) if tls else n
        with self._lock:
            self.up += n
            self.up_packets += 1
            self.up_tcp += tcp
            self.up_segments += link.segments(tcp)
            if connect:
                self._connection(tls)

    def received(self, n: int, tls: bool) -> None:
        """One whole MQTT packet of ``n`` bytes."""
        link = self.link
        tcp = link.tls_bytes(n) if tls else n
        with self._lock:
            self.down += n
            self.down_packets += 1
            self.down_tcp += tcp
            self.down_segments += link.segments(tcp)

    def _connection(self, tls: bool) -> None:
        """A new TCP (and TLS) connection: handshakes and the eventual close."""
        link = self.link
        self.connections += 1
        if tls:
            # handshake flights, and one close_notify alert each way (2-byte alert + overhead)
            self.up_tcp += link.tls_handshake_up + 2 + link.tls_record_overhead
            self.down_tcp += link.tls_handshake_down + 2 + link.tls_record_overhead
            self.up_segments += 2  # client hello; finished
            self.down_segments += max(1, math.ceil(link.tls_handshake_down / link.mss)) + 1

    # -- reading

    def _now(self) -> tuple[int, ...]:
        """The counts in :attr:`FIELDS` order (one tuple: a fleet reads 10,000 counters a round)."""
        with self._lock:
            return (
                self.up,
                self.down,
                self.up_packets,
                self.down_packets,
                self.up_tcp,
                self.down_tcp,
                self.up_segments,
                self.down_segments,
                self.connections,
            )

    def totals(self) -> dict[str, int]:
        return dict(zip(self.FIELDS, self._now(), strict=True))

    def take(self) -> dict[str, int]:
        """Counts since the previous ``take()``."""
        now = self._now()
        delta = dict(zip(self.FIELDS, map(operator.sub, now, self._mark), strict=True))
        self._mark = now
        return delta

    def add(self, other: dict[str, int]) -> None:
        """Add modelled traffic (e.g. a global model this device would receive on its own
        subscription) given as counts."""
        with self._lock:
            for name, value in other.items():
                setattr(self, name, getattr(self, name) + value)


def ip_bytes(counts: dict[str, int], link: LinkModel | None = None) -> tuple[int, int]:
    """Estimated IP bytes (up, down) of ``counts`` (a ``WireCounter.take()``): TCP payload +
    per-segment headers + pure ACKs + connection setup and close."""
    link = link or DEFAULT_LINK
    h = link.header
    conns = counts.get("connections", 0)
    up_segs = counts["up_segments"] + math.ceil(counts["down_segments"] * link.ack_ratio)
    down_segs = counts["down_segments"] + math.ceil(counts["up_segments"] * link.ack_ratio)
    # SYN + ACK and FIN + ACK up; SYN-ACK and FIN + ACK down
    up = counts["up_tcp"] + h * (up_segs + 4 * conns) + link.syn_extra * conns
    down = counts["down_tcp"] + h * (down_segs + 3 * conns) + link.syn_extra * conns
    return up, down


def packet_counts(
    packets_up: list[int], packets_down: list[int], tls: bool, link: LinkModel | None = None
) -> dict[str, int]:
    """``WireCounter`` counts of the given packet sizes (no connection): for pricing a round."""
    counter = WireCounter(link)
    for n in packets_up:
        counter.sent(n, tls)
    for n in packets_down:
        counter.received(n, tls)
    return counter.totals()


def percentiles(values: list[int]) -> dict[str, int]:
    """p50 / p95 / max (nearest rank) of per-device counts; zeros for no devices."""
    if not values:
        return {"p50": 0, "p95": 0, "max": 0}
    ordered = sorted(values)
    n = len(ordered)

    def rank(q: float) -> int:
        return ordered[min(n - 1, max(0, math.ceil(q * n) - 1))]

    return {"p50": rank(0.5), "p95": rank(0.95), "max": ordered[-1]}


# ---------------------------------------------------------------------------------- paho hooks

PROCESS = WireCounter()  # every paho client of this process (once install() ran)


def install() -> None:
    """Count every paho client's packets into :data:`PROCESS` (idempotent)."""
    from edge_fl.transport.client_adapter import install_packet_hooks

    install_packet_hooks(PROCESS)


def attach(client: Any, counter: WireCounter) -> WireCounter:
    """Count ``client``'s packets (an ``aiomqtt.Client`` or a paho client) into ``counter``.

    Attach before connecting, so CONNECT/CONNACK are counted. An aiomqtt client is also made
    quiet on losing the broker (:func:`~edge_fl.transport.client_adapter.quiet_on_loss`): the
    fleet, whose device sessions are all attached here, re-opens them with new clients, and each
    dropped one otherwise logged an unretrieved "Unexpected disconnection" future."""
    import aiomqtt

    from edge_fl.transport.client_adapter import listen_to_packets, quiet_on_loss

    install()
    listen_to_packets(client, counter)
    if isinstance(client, aiomqtt.Client):
        quiet_on_loss(client)
    return counter
