"""The one place that reaches inside paho-mqtt and aiomqtt.

aiomqtt is an asyncio front for a paho ``Client``; a few things edge-fl needs exist only on that
paho client, or only as its private attributes:

* the paho client under an ``aiomqtt.Client`` (aiomqtt keeps it as ``_client``): manual
  acknowledgements after the journal's fsync, publishing from a paho callback without awaiting,
  whether the session is up, and its socket (a simulated crash shuts it without a DISCONNECT);
* the socket paho reads and writes (``_sock``), replaced by a wrapper that parses PUBLISH packets
  in large reads (the aggregator's ingest tap);
* whether a connection uses TLS (``_ssl``) and whether TLS was already configured
  (``_ssl_context``: paho refuses a second ``tls_set_context``);
* per-packet byte counts: paho has no hook for them, so :func:`install_packet_hooks` wraps two
  methods of paho's ``Client`` class, ``_sock_send`` (each write of MQTT bytes) and
  ``_packet_handle`` (each whole packet read; ``_in_packet`` holds its length fields).

Everything else in edge-fl calls the functions below and names no private attribute of either
library. ``tests/test_transport_adapter.py`` checks each behaviour relied on here against a real
Mosquitto, so an upgrade of paho-mqtt or aiomqtt that breaks one fails there, by name.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import paho.mqtt.client as paho

if TYPE_CHECKING:
    import aiomqtt

    #: an aiomqtt client, or a paho client (the light agent and tools use paho directly)
    MqttClient: TypeAlias = aiomqtt.Client | paho.Client

__all__ = [
    "PacketListener",
    "ack",
    "install_packet_hooks",
    "is_connected",
    "is_mqtt5",
    "listen_to_packets",
    "manual_acks",
    "paho_client",
    "publish_nowait",
    "quiet_on_loss",
    "raw_socket",
    "replace_misc_loop",
    "tls_configured",
    "uses_tls",
    "wrap_sockets",
]


class PacketListener(Protocol):
    """What :func:`install_packet_hooks` reports to (``edge_fl.transport.wire.WireCounter``)."""

    def sent(self, n: int, tls: bool, connect: bool = False) -> None: ...

    def received(self, n: int, tls: bool) -> None: ...


def paho_client(client: MqttClient) -> paho.Client:
    """The paho client doing the work of ``client`` (``client`` itself if it is one)."""
    if isinstance(client, paho.Client):
        return client
    return client._client  # aiomqtt keeps its paho client here (aiomqtt 2.x)


def is_connected(client: MqttClient) -> bool:
    """Whether the client's MQTT session is up now (aiomqtt has no public flag for it)."""
    return bool(paho_client(client).is_connected())


def raw_socket(client: MqttClient) -> Any:
    """The socket of the current connection (a ``socket.socket``, an ``ssl.SSLSocket``, or the
    wrapper :func:`wrap_sockets` installed), or None when not connected."""
    return paho_client(client).socket()


def no_delay(client: MqttClient) -> None:
    """Send small packets at once (TCP_NODELAY) on the current connection: paho leaves Nagle's
    algorithm on, so a PUBLISH written right after a PUBACK waits for the broker's delayed ACK
    (about 40 ms on Linux). For exchanges where latency is the cost (virtual time's clock)."""
    import socket

    sock = raw_socket(client)
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def manual_acks(client: MqttClient, on_message: Callable[[paho.MQTTMessage], None]) -> None:
    """Acknowledge QoS 1/2 messages only through :func:`ack`, and deliver every message paho
    parses to ``on_message`` instead of aiomqtt's queue. Call before connecting."""
    pc = paho_client(client)
    pc.manual_ack_set(True)
    pc.on_message = lambda _client, _userdata, message: on_message(message)


def ack(client: MqttClient, mid: int, qos: int) -> None:
    """Acknowledge message ``mid`` now (PUBACK for QoS 1, PUBCOMP for QoS 2); with
    :func:`manual_acks` on, this is the only acknowledgement the broker gets (so calling it on
    receipt acknowledges on receipt). Safe from any paho callback or the event loop's thread."""
    paho_client(client).ack(mid, qos)


def publish_nowait(client: MqttClient, topic: str, payload: bytes, qos: int = 1) -> None:
    """Queue a publish from synchronous code (a paho callback), without awaiting its ack as
    ``aiomqtt.Client.publish`` would; paho writes it when its loop next runs."""
    paho_client(client).publish(topic, payload, qos=qos)


def is_mqtt5(client: MqttClient) -> bool:
    """Whether the client speaks MQTT 5 (its PUBLISH packets carry properties)."""
    return bool(paho_client(client).protocol == paho.MQTTv5)


def uses_tls(client: MqttClient) -> bool:
    """Whether the client's connections use TLS (set by ``tls_set_context``)."""
    return bool(paho_client(client)._ssl)


def tls_configured(client: MqttClient) -> bool:
    """Whether TLS was already set on the client: paho raises on a second ``tls_set_context``,
    so a reconnect that applies the same settings again must skip it."""
    return paho_client(client)._ssl_context is not None


def wrap_sockets(client: MqttClient, wrap: Callable[[Any], Any]) -> None:
    """Make paho read and write every socket it opens from now on through ``wrap(sock)``.

    The wrapper must offer what paho and aiomqtt use of a socket (``recv``, ``send``,
    ``fileno``, ``close``, ``setblocking``, and ``pending`` for a TLS socket): paho keeps it as its
    socket, and aiomqtt registers it with the event loop. Call before connecting."""
    pc = paho_client(client)
    opened = pc.on_socket_open  # aiomqtt's: registers the socket with the event loop

    def on_socket_open(inner: paho.Client, userdata: Any, sock: Any) -> None:
        wrapped = wrap(sock)
        inner._sock = wrapped  # paho reads and writes through it from now on
        if opened is not None:
            opened(inner, userdata, wrapped)

    pc.on_socket_open = on_socket_open


def replace_misc_loop(
    client: aiomqtt.Client, misc: Callable[[paho.Client], Coroutine[Any, Any, None]]
) -> None:
    """Run ``misc(paho client)`` as the client's housekeeping task instead of aiomqtt's.

    aiomqtt starts one task per connection that wakes every second to call paho's ``loop_misc``
    (keepalive PINGREQ, ping timeout): 10,000 sessions in one process made 10,000 timer wake-ups
    a second, the fleet's largest CPU cost (docs/bench/profile-10k.md). ``misc`` is awaited in its
    place (started when the socket opens, cancelled when it closes, as aiomqtt's is), so one
    shared timer can call ``loop_misc`` for every session. Call before connecting."""
    pc = paho_client(client)
    client._misc_loop = lambda: misc(pc)  # type: ignore[method-assign]


# ------------------------------------------------------------------------ losing the broker


class _LoopGuard:
    """The event loop as one aiomqtt client's socket callbacks see it (aiomqtt keeps it as
    ``_loop``): registrations for a socket that is no longer the client's are dropped.

    Why: paho asks aiomqtt to watch a socket for writing from the thread that queued a publish,
    and aiomqtt schedules ``add_writer(fd)`` for later; when the broker dies in between, paho has
    closed that fd and asyncio logged an ``OSError: [Errno 9] Bad file descriptor`` traceback.
    And aiomqtt's close unregisters the reader only: a writer left on the closed fd made the next
    connection that reused the number fail to register its reader."""

    def __init__(self, loop: Any, pc: paho.Client) -> None:
        self._loop = loop
        self._pc = pc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)

    def _current(self, fd: int) -> bool:
        sock = self._pc.socket()
        try:
            return sock is not None and sock.fileno() == fd >= 0
        except OSError:
            return False

    def add_reader(self, fd: int, callback: Callable[..., Any], *args: Any) -> None:
        if self._current(fd):
            self._loop.add_reader(fd, callback, *args)

    def add_writer(self, fd: int, callback: Callable[..., Any], *args: Any) -> None:
        if self._current(fd):
            self._loop.add_writer(fd, callback, *args)

    def remove_reader(self, fd: int) -> bool:
        """The socket is closing (aiomqtt calls this only then): stop watching it entirely."""
        removed = False
        with contextlib.suppress(OSError, ValueError):
            removed = bool(self._loop.remove_writer(fd))
        with contextlib.suppress(OSError, ValueError):
            removed = bool(self._loop.remove_reader(fd)) or removed
        return removed

    def remove_writer(self, fd: int) -> bool:
        with contextlib.suppress(OSError, ValueError):
            return bool(self._loop.remove_writer(fd))
        return False


def _retrieve(future: Any) -> None:
    if not future.cancelled():
        future.exception()


def quiet_on_loss(client: aiomqtt.Client) -> None:
    """Make losing the broker one error the caller handles, nothing logged behind its back.

    Two things aiomqtt 2.x does when a connection drops otherwise reach asyncio's logger: a
    socket registration scheduled before the drop runs after it (:class:`_LoopGuard`), and the
    client's "disconnected" future holds ``MqttCodeError('Unexpected disconnection')`` that nobody
    reads when the caller replaces the client instead of leaving its ``async with`` (a fleet
    re-opening a device session): asyncio then printed "Future exception was never retrieved"
    for each, 45 three-line blocks per restart in a fleet. The error itself still reaches whoever
    awaits the client (publish, messages, ``__aexit__``). Call before connecting."""
    pc = paho_client(client)
    loop = client._loop
    if not isinstance(loop, _LoopGuard):
        client._loop = _LoopGuard(loop, pc)  # type: ignore[assignment]
    disconnected = pc.on_disconnect  # aiomqtt's: sets the future

    def on_disconnect(*args: Any, **kwargs: Any) -> None:
        if disconnected is not None:
            disconnected(*args, **kwargs)
        client._disconnected.add_done_callback(_retrieve)

    pc.on_disconnect = on_disconnect
    opened = pc.on_socket_open

    def on_socket_open(inner: paho.Client, userdata: Any, sock: Any) -> None:
        # a read or write error sets the future without a disconnect callback
        client._disconnected.add_done_callback(_retrieve)
        if opened is not None:
            opened(inner, userdata, sock)

    pc.on_socket_open = on_socket_open


# ------------------------------------------------------------------------ packet byte counts

_LISTENER_ATTR = "_edge_fl_packet_listener"
_process_listeners: list[PacketListener] = []
_hooks_lock = threading.Lock()
_hooks_installed = False


def install_packet_hooks(process: PacketListener) -> None:
    """Report every MQTT packet any paho client of this process sends or reads to ``process``
    (and to the client's own listener, :func:`listen_to_packets`). Idempotent per listener.

    Sent: each ``_sock_send`` write (exact on partial writes; paho writes one packet per call),
    ``connect`` when it starts a CONNECT. Read: each whole packet, ``1 + len(varint) + remaining
    length`` bytes. Cost: a few integer additions per packet, nothing per payload byte."""
    global _hooks_installed
    with _hooks_lock:
        if process not in _process_listeners:
            _process_listeners.append(process)
        if _hooks_installed:
            return
        sock_send = paho.Client._sock_send
        packet_handle = paho.Client._packet_handle

        def _sock_send(self: paho.Client, buf: bytes | bytearray) -> int:
            n = sock_send(self, buf)
            if n:
                tls = bool(self._ssl)
                connect = bool(buf) and (buf[0] & 0xF0) == paho.CONNECT
                for listener in _process_listeners:
                    listener.sent(n, tls, connect)
                own = getattr(self, _LISTENER_ATTR, None)
                if own is not None:
                    own.sent(n, tls, connect)
            return n

        def _packet_handle(self: paho.Client) -> Any:
            packet = self._in_packet
            n = 1 + len(packet["remaining_count"]) + packet["remaining_length"]
            tls = bool(self._ssl)
            for listener in _process_listeners:
                listener.received(n, tls)
            own = getattr(self, _LISTENER_ATTR, None)
            if own is not None:
                own.received(n, tls)
            return packet_handle(self)

        paho.Client._sock_send = _sock_send  # type: ignore[method-assign]
        paho.Client._packet_handle = _packet_handle  # type: ignore[method-assign]
        _hooks_installed = True


def listen_to_packets(client: MqttClient, listener: PacketListener) -> None:
    """Also report ``client``'s packets to ``listener`` (once :func:`install_packet_hooks` ran).
    Attach before connecting, so CONNECT/CONNACK are counted."""
    setattr(paho_client(client), _LISTENER_ATTR, listener)
