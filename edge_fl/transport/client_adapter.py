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
  ``_packet_handle`` (each whole packet read; ``_in_packet`` holds its length fields);
* writing a packet as it is queued (:func:`write_through`): paho's ``on_socket_register_write``
  (aiomqtt's handler, kept for what the socket does not take at once), its outgoing queue
  ``_out_packet``, ``_registered_write`` and ``_in_callback_mutex``, and the loop aiomqtt
  registers sockets with (``_loop``);
* connecting without aiomqtt's thread hop (:func:`connect`): aiomqtt runs paho's blocking
  ``connect`` in the loop's default executor, one thread-pool job per session (its lock,
  ``_client_connect``, ``_connected``/``_disconnected`` futures, ``_wait_for`` and socket
  options), and paho opens the TCP connection in ``_create_socket_connection``.

Everything else in edge-fl calls the functions below and names no private attribute of either
library. ``tests/test_transport_adapter.py`` checks each behaviour relied on here against a real
Mosquitto, so an upgrade of paho-mqtt or aiomqtt that breaks one fails there, by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
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
    "connect",
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
    "write_through",
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
    (about 40 ms on Linux). The aggregator's session, the fleet's sessions and the clocks'."""
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


# ------------------------------------------------------------------------ connecting

#: how to reach a broker, (host, port) -> (expiry, family, sockaddr), or (expiry, None, None)
#: when paho would go through a proxy: a fleet connecting 10,000 sessions to one broker resolved
#: its name and scanned the environment for proxies 10,000 times (getaddrinfo alone was 5% of the
#: connect phase's samples); an entry lives ADDRESS_TTL_S, so a changed DNS record is seen
ADDRESS_TTL_S = 60.0
_routes: dict[tuple[str, int], tuple[float, int | None, Any]] = {}


def _numeric(host: str) -> int | None:
    """The address family of an IP literal (no resolver needed), else None."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return family
    return None


async def _route(pc: paho.Client, host: str, port: int) -> tuple[int, Any] | None:
    """The family and address to connect to, or None when paho uses a proxy for ``host``."""
    now = time.monotonic()
    hit = _routes.get((host, port))
    if hit is None or hit[0] <= now:
        if pc._get_proxy():
            hit = (now + ADDRESS_TTL_S, None, None)
        elif _numeric(host) is not None:
            hit = (now + ADDRESS_TTL_S, _numeric(host), (host, port))
        else:
            loop = asyncio.get_running_loop()
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            hit = (now + ADDRESS_TTL_S, family, sockaddr)
        _routes[(host, port)] = hit
    return None if hit[1] is None else (hit[1], hit[2])


async def connect(client: aiomqtt.Client) -> None:
    """Connect ``client`` as ``async with client`` / ``await client.__aenter__()`` does (leave
    with ``client.__aexit__``), without a thread per connect.

    aiomqtt hands paho's blocking ``connect`` to the default executor: for a fleet that is one
    thread-pool job, two cross-thread wake-ups and the GIL passed back and forth per session
    (a sixth of the connect phase's samples, docs/bench/profile-10k.md). Here the TCP connection
    is opened by the event loop (``sock_connect``, non-blocking; the broker's address resolved
    once a minute), handed to paho as the socket it would have opened, and paho's ``connect``
    (which then only writes CONNECT into its queue) runs on the loop's thread. Same packets,
    same session. TLS, websockets, unix sockets and proxies take aiomqtt's own path (paho's TLS
    handshake blocks)."""
    import aiomqtt

    pc = paho_client(client)
    try:
        route = None
        if not pc._ssl and pc._transport == "tcp" and not pc._proxy:
            route = await _route(pc, client._hostname, client._port)
    except OSError as exc:  # the name does not resolve
        raise aiomqtt.MqttError(str(exc)) from None
    if route is None:
        await client.__aenter__()
        return
    if client._lock.locked():
        raise aiomqtt.MqttReentrantError(
            "The client context manager is reusable, but not reentrant"
        )
    await client._lock.acquire()
    sock: socket.socket | None = None
    try:
        family, sockaddr = route
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        if client._bind_address or client._bind_port:
            sock.bind((client._bind_address, client._bind_port))
        await asyncio.get_running_loop().sock_connect(sock, sockaddr)
        opened = sock
        pc._create_socket_connection = lambda: opened  # type: ignore[method-assign]
        try:
            client._client_connect()
        finally:
            del pc._create_socket_connection  # the class's method again, for any reconnect
        for option in client._socket_options:  # what aiomqtt sets on the socket it connects
            opened.setsockopt(*option)
    except (OSError, paho.WebsocketConnectionError) as exc:
        if sock is not None and pc.socket() is not sock:
            sock.close()
        client._lock.release()
        # asyncio words a refused connect "Connect call failed (addr)": say what the OS said,
        # as paho's own connect did ("[Errno 111] Connection refused")
        errno_ = getattr(exc, "errno", None)
        text = f"[Errno {errno_}] {os.strerror(errno_)}" if errno_ else str(exc)
        raise aiomqtt.MqttError(text) from None
    except BaseException:
        if sock is not None and pc.socket() is not sock:
            sock.close()
        client._lock.release()
        raise
    try:
        await client._wait_for(client._connected, timeout=None)
    except aiomqtt.MqttError:
        client._lock.release()
        client._connected = asyncio.Future()
        raise
    if client._disconnected.done():
        client._disconnected = asyncio.Future()


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

    def call_soon_threadsafe(self, callback: Callable[..., Any], *args: Any) -> Any:
        """aiomqtt schedules every socket registration this way, also from the loop's own
        thread (a connect made there, every publish): there a plain ``call_soon`` runs it at the
        same point without writing to the loop's self-pipe and waking it once more."""
        try:
            running: Any = asyncio.get_running_loop()
        except RuntimeError:  # another thread (paho's blocking connect in aiomqtt's executor)
            running = None
        if running is not None and running is self._loop:
            return running.call_soon(callback, *args)
        return self._loop.call_soon_threadsafe(callback, *args)

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


def write_through(client: aiomqtt.Client) -> None:
    """Write each packet queued on the loop's own thread at once, as paho does without an
    external loop, instead of asking the loop to watch the socket for writing first.

    aiomqtt answers paho's "register write" with ``call_soon(add_writer)``: every packet (a
    device's status, its PUBACK, a clock message) cost a loop pass, an ``epoll_ctl`` to watch
    the socket, a wake-up when it is writable, the write, and an ``epoll_ctl`` to stop watching.
    Here the write happens inside paho's ``_packet_queue`` (the same bytes, in the same order on
    the session; only sooner); only what the socket does not take at once (a full send buffer,
    ``EAGAIN``) is left to aiomqtt's writer as before. From another thread, or inside a paho
    callback (paho's own rule for writing directly), aiomqtt's path is kept; so it is for a
    DISCONNECT (a leaving fleet's last packets stay after the stop's record, whose wire counts
    would otherwise take them in: the bytes are the same, the record would not be). Call after
    :func:`quiet_on_loss` (it guards the loop aiomqtt registers sockets with)."""
    pc = paho_client(client)
    register = pc.on_socket_register_write  # aiomqtt's: call_soon(add_writer) for the socket
    guard = client._loop
    loop = guard._loop if isinstance(guard, _LoopGuard) else guard
    in_callback = pc._in_callback_mutex
    writing = False

    def on_socket_register_write(inner: paho.Client, userdata: Any, sock: Any) -> None:
        nonlocal writing
        queued = inner._out_packet
        if (
            writing
            or _running_loop() is not loop
            or (queued and queued[-1]["command"] & 0xF0 == paho.DISCONNECT)
            or not in_callback.acquire(False)
        ):
            if register is not None:
                register(inner, userdata, sock)
            return
        in_callback.release()
        writing = True
        try:
            inner.loop_write()  # writes what is queued; unregisters when nothing is left
        except Exception as exc:  # what aiomqtt's writer callback does with a broken pipe (or
            if not client._disconnected.done():  # a raising callback: then the rest of the
                client._disconnected.set_exception(exc)  # queue is still written, below)
        finally:
            writing = False
        if inner._registered_write and register is not None:  # not all of it was written
            register(inner, userdata, sock)

    pc.on_socket_register_write = on_socket_register_write


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # another thread (paho's blocking connect in aiomqtt's executor)
        return None


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
