"""Received MQTT PUBLISH packets parsed straight off paho's socket, past paho and aiomqtt.

Why a module of its own: this is packet framing (MQTT 3.1.1 and 5 fixed and variable headers),
the transport's job; the aggregator service and the ingest workers only hand it a callback.
It imports nothing else of ours (the transport layer's rule).
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

__all__ = ["TAP_BURST", "TAP_CHUNK", "IngestTap", "PublishHandler"]

#: PUBLISH packet type (MQTT 3.1.1 section 2.2.1)
_PUBLISH = 0x30
#: bytes read from the socket per system call (paho reads a packet in 3-5 small reads)
TAP_CHUNK = 1 << 18
#: at most this many bytes are read and dispatched per call of the tap before paho runs again
TAP_BURST = 1 << 20

PublishHandler = Callable[[str, bytes, int, int, bool], None]


class IngestTap:
    """paho's socket, read in large chunks, with PUBLISH packets handed straight to a handler.

    Why: paho reads a packet in 3-5 ``recv`` calls and builds an ``MQTTMessage``, and aiomqtt
    then converts it, queues it and wakes a task for it: that plumbing cost more than decoding,
    validating and folding the update (BENCHMARKS.md). The tap reads up to :data:`TAP_CHUNK`
    bytes per call, parses each PUBLISH (QoS 0 or 1) itself and calls
    ``handler(topic, payload, mid, qos, retain)``; every other packet (CONNACK, SUBACK, PUBACK
    of our publishes, PINGRESP, a QoS 2 PUBLISH, a topic that is not UTF-8) goes to paho
    unchanged, in stream order: parsing pauses until paho has read it. paho still writes
    everything, acknowledges nothing by itself (manual acks) and keeps the connection state.

    ``pending()`` says whether a complete packet waits in the buffer, which aiomqtt's reader
    asks (as it does of a TLS socket) to call ``loop_read`` again before waiting on the socket.
    """

    def __init__(self, sock: Any, handler: PublishHandler, mqtt5: bool = False) -> None:
        self._sock = sock
        self._handler = handler
        self._mqtt5 = mqtt5
        self._buf = bytearray()  # read, not yet parsed
        self._out = bytearray()  # a packet for paho, not yet read by it
        self._eof = False
        self.diverted = 0  # PUBLISH packets handed to the handler
        self.passed = 0  # packets left to paho

    def __getattr__(self, name: str) -> Any:  # send, fileno, close, setblocking, ...
        return getattr(self._sock, name)

    def recv(self, n: int) -> bytes:
        if not self._out:
            self._fill()
        if self._out:
            chunk = bytes(self._out[:n])
            del self._out[:n]
            return chunk
        if self._eof:
            return b""  # paho: connection lost
        raise BlockingIOError(errno.EAGAIN, "no complete packet for paho yet")

    def pending(self) -> int:
        """Bytes that can be read without waiting on the socket (0 unless a whole packet)."""
        inner = getattr(self._sock, "pending", None)
        more = inner() if inner is not None else 0
        return len(self._out) + (1 if self._frame_end() is not None else 0) + more

    def _frame_end(self) -> tuple[int, int] | None:
        """(offset of the variable header, end) of the first buffered packet, if complete."""
        buf = self._buf
        length, mult, i = 0, 1, 1
        while True:
            if i >= len(buf):
                return None
            byte = buf[i]
            length += (byte & 0x7F) * mult
            i += 1
            if not byte & 0x80:
                break
            mult *= 128
            if i > 4:  # malformed: let paho see it and drop the connection
                return 1, len(buf)
        end = i + length
        return (i, end) if end <= len(buf) else None

    def _fill(self) -> None:
        """Parse buffered packets, reading the socket as needed, until one is for paho, the
        socket has nothing more or :data:`TAP_BURST` bytes were read."""
        read = 0
        while not self._out:
            frame = self._frame_end()
            if frame is None:
                if self._eof or read >= TAP_BURST:
                    return
                try:
                    data = self._sock.recv(TAP_CHUNK)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:  # TLS want-read/want-write and errors: paho handles them
                    if read:
                        return
                    raise
                if not data:
                    self._eof = True
                    return
                read += len(data)
                self._buf += data
                continue
            start, end = frame
            if not self._divert(start, end):
                self._out += self._buf[:end]
                self.passed += 1
            del self._buf[:end]

    def _divert(self, start: int, end: int) -> bool:
        """Hand a QoS 0/1 PUBLISH packet to the handler; False: paho reads it."""
        buf = self._buf
        cmd = buf[0]
        qos = (cmd >> 1) & 3
        if cmd & 0xF0 != _PUBLISH or qos > 1 or end - start < 2:
            return False
        tlen = (buf[start] << 8) | buf[start + 1]
        if tlen == 0:  # an MQTT 5 topic alias: paho resolves it
            return False
        i = start + 2 + tlen
        mid = 0
        if qos:
            if i + 2 > end:
                return False
            mid = (buf[i] << 8) | buf[i + 1]
            i += 2
        if self._mqtt5:  # skip the properties (variable byte integer length, then that many)
            plen, mult = 0, 1
            while i < end:
                byte = buf[i]
                i += 1
                plen += (byte & 0x7F) * mult
                mult *= 128
                if not byte & 0x80:
                    break
            i += plen
        if i > end:
            return False
        try:
            topic = buf[start + 2 : start + 2 + tlen].decode("utf-8")
        except UnicodeDecodeError:
            return False
        self.diverted += 1
        self._handler(topic, bytes(buf[i:end]), mid, qos, bool(cmd & 1))
        return True
