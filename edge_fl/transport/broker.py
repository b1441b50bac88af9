"""A private MQTT broker for one process (simulations, tests, `edge-fl broker`).

Each `EmbeddedBroker` runs its own Mosquitto (or, without the binary, the pure-Python amqtt) on a
free loopback port with a config written from `templates/mosquitto-embedded.conf`. It never uses a
system broker: a shared broker's stock limits silently drop QoS 1 messages under fan-in, and tests
must not see each other's retained messages.

    with EmbeddedBroker() as broker:          # or: async with EmbeddedBroker() as broker
        client = aiomqtt.Client(**broker.spec.aiomqtt_kwargs(), identifier="agg")
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import functools
import logging
import os
import pwd
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Literal
from urllib.parse import quote

from edge_fl.transport.url import BrokerSpec, parse_broker_url

logger = logging.getLogger(__name__)

BrokerKind = Literal["mosquitto", "amqtt"]
KINDS = ("auto", "mosquitto", "amqtt")

# Where Mosquitto lives when it is not on PATH: Debian/Ubuntu put it in /usr/sbin, which a
# non-root PATH usually lacks; Homebrew uses its own sbin.
MOSQUITTO_LOCATIONS = (
    "/usr/sbin/mosquitto",
    "/usr/local/sbin/mosquitto",
    "/opt/homebrew/sbin/mosquitto",
    "/usr/local/opt/mosquitto/sbin/mosquitto",
)

# amqtt loses most QoS 1 messages of bursts from thousands of clients (measured 92-99% lost at
# 10k); the simulator caps fleets on it to a size where it was still reliable.
AMQTT_MAX_DEVICES = 1000
# File descriptors Mosquitto needs besides client sockets (listeners, log, epoll, config).
FD_RESERVE = 100

DEFAULT_MAX_QUEUED_BYTES = 1 << 30  # per client; bounds memory now that the count is unlimited
DEFAULT_MAX_INFLIGHT = 100
DEFAULT_MAX_PACKET_SIZE = 16 * 1024 * 1024

_READY_MARKERS: dict[str, re.Pattern[str]] = {
    # Mosquitto logs this after every listener is open; amqtt_server prints its line after start().
    "mosquitto": re.compile(r"mosquitto version \S+ running\s*$"),
    "amqtt": re.compile(r"^amqtt listening on "),
}
_PORT_IN_USE_MARKERS = ("Address already in use", "address already in use", "Errno 98")
_PORT_ATTEMPTS = 5
_AMQTT_BOOT = (
    "import sys; sys.path.append(sys.argv[1]); "
    "from edge_fl.transport.amqtt_server import main; sys.exit(main(sys.argv[2:]))"
)
TEMPLATE_PATH = Path(__file__).with_name("templates") / "mosquitto-embedded.conf"
_POLL_SECONDS = 0.005


class BrokerError(RuntimeError):
    """The embedded broker failed to start or died; the message carries its log tail."""


class AmqttFallbackWarning(UserWarning):
    """No Mosquitto binary: the slow, lossy amqtt broker is used instead."""


@dataclass(frozen=True)
class ListenerTLS:
    """Turns the embedded listener into a TLS listener (its URL becomes `mqtts://...?ca=`)."""

    cafile: str
    certfile: str
    keyfile: str
    require_certificate: bool = False
    use_identity_as_username: bool = False


def find_mosquitto() -> str | None:
    """Path of the mosquitto binary, looking beyond PATH (it is usually in /usr/sbin)."""
    found = shutil.which("mosquitto")
    if found:
        return found
    for candidate in MOSQUITTO_LOCATIONS:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller must cope with losing the race)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _nofile_target() -> int:
    """The soft RLIMIT_NOFILE the broker gets: the hard limit (Mosquitto never raises its own)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        return max(soft, 1 << 20)
    return max(soft, hard)


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's prctl on Linux (None elsewhere); dlopen(NULL) avoids find_library's ldconfig run."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def make_preexec(parent_death_signal: bool) -> Callable[[], None]:
    """Runs in the child between fork and exec: raise the fd limit, die with the parent."""
    target = _nofile_target()
    prctl = _prctl() if parent_death_signal else None  # resolved before the fork
    parent = os.getpid()

    def preexec() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        for value in (target, hard):
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (value, hard))
                break
            except (ValueError, OSError):
                continue
        if prctl is not None:
            prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # parent already gone between fork and prctl
                os._exit(1)

    return preexec


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def _current_user() -> str | None:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return None


_LIVE: weakref.WeakSet[EmbeddedBroker] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # a forgotten broker must not outlive the interpreter
    for broker in list(_LIVE):
        with contextlib.suppress(Exception):
            broker.stop(timeout=2.0)


class EmbeddedBroker:
    """A private broker process: Mosquitto when installed, otherwise amqtt (with a warning).

    Args:
        kind: "auto" (Mosquitto if found, else amqtt), "mosquitto" or "amqtt".
        port: listen port; None picks a free one (and retries if another process grabs it).
        bind: listen address; "0.0.0.0" exposes it to the LAN (`edge-fl broker`).
        allow_anonymous, password_file, acl_file, tls: Mosquitto auth and TLS (not for amqtt).
        extra_config: more mosquitto.conf lines, appended after the listener line (so
            listener-scoped options such as `use_username_as_clientid` apply to it).
        max_queued_bytes, max_inflight_messages, max_packet_size: see the template.
        startup_timeout: seconds to wait for the broker to accept connections.
        mosquitto_binary: explicit path (default: `find_mosquitto()`).
        parent_death_signal: on Linux, SIGTERM the broker if the starting thread dies; only
            applied when started from the main thread (PR_SET_PDEATHSIG fires when the forking
            *thread* exits, which would kill a broker started from a worker thread too early).
    """

    def __init__(
        self,
        kind: str = "auto",
        *,
        port: int | None = None,
        bind: str = "127.0.0.1",
        allow_anonymous: bool = True,
        password_file: str | os.PathLike[str] | None = None,
        acl_file: str | os.PathLike[str] | None = None,
        tls: ListenerTLS | None = None,
        extra_config: Iterable[str] | str = (),
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        max_inflight_messages: int = DEFAULT_MAX_INFLIGHT,
        max_packet_size: int = DEFAULT_MAX_PACKET_SIZE,
        startup_timeout: float = 10.0,
        connection_messages: bool = True,
        mosquitto_binary: str | None = None,
        parent_death_signal: bool = True,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
        if port is not None and not (isinstance(port, int) and 1 <= port <= 65535):
            raise ValueError(f"port must be an int in 1..65535 or None (free port), got {port!r}")
        if startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be > 0 seconds, got {startup_timeout!r}")
        for name, value in (
            ("max_queued_bytes", max_queued_bytes),
            ("max_inflight_messages", max_inflight_messages),
            ("max_packet_size", max_packet_size),
        ):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0 = no limit), got {value!r}")
        if isinstance(extra_config, str):
            extra_config = extra_config.splitlines()
        self._extra = [str(line) for line in extra_config]

        binary = mosquitto_binary or find_mosquitto()
        if kind == "mosquitto" and binary is None:
            raise BrokerError(
                "kind='mosquitto' but no mosquitto binary on PATH or in "
                f"{list(MOSQUITTO_LOCATIONS)}; install it (apt-get install mosquitto) or use "
                "kind='auto'"
            )
        self.kind: BrokerKind = "mosquitto" if kind != "amqtt" and binary is not None else "amqtt"
        self._fallback = kind == "auto" and self.kind == "amqtt"
        self._binary = binary
        if self.kind == "amqtt":
            needs = [
                name
                for name, used in (
                    ("password_file", password_file is not None),
                    ("acl_file", acl_file is not None),
                    ("tls", tls is not None),
                    ("extra_config", bool(self._extra)),
                    ("allow_anonymous=False", not allow_anonymous),
                )
                if used
            ]
            if needs:
                why = " (no mosquitto binary found)" if self._fallback else ""
                raise ValueError(
                    f"options {needs} need Mosquitto but the broker kind is amqtt{why}"
                )

        self._requested_port = port
        self.bind = bind
        self.host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(bind, bind)
        self._allow_anonymous = allow_anonymous
        self._password_file = None if password_file is None else os.fspath(password_file)
        self._acl_file = None if acl_file is None else os.fspath(acl_file)
        self.tls = tls
        self._max_queued_bytes = max_queued_bytes
        self._max_inflight = max_inflight_messages
        self._max_packet_size = max_packet_size
        self._startup_timeout = float(startup_timeout)
        self._connection_messages = connection_messages
        self._parent_death_signal = parent_death_signal

        self.port: int | None = None
        self.startup_seconds: float | None = None
        self.max_devices: int | None = self._device_cap()
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._attempt = 0
        self._deadline = 0.0
        self._t0 = 0.0

    # ----------------------------------------------------------------- public properties
    @property
    def url(self) -> str:
        """`mqtt://127.0.0.1:PORT` (or `mqtts://...?ca=CAFILE` with a TLS listener)."""
        if self.port is None:
            raise BrokerError("broker not started: no URL yet")
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.tls is not None:
            return f"mqtts://{host}:{self.port}?ca={quote(self.tls.cafile, safe='/~.-_')}"
        return f"mqtt://{host}:{self.port}"

    @property
    def spec(self) -> BrokerSpec:
        return parse_broker_url(self.url)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def directory(self) -> Path | None:
        """The private temp dir (config, logs); removed by stop()."""
        return self._dir

    @property
    def config_path(self) -> Path | None:
        return None if self._dir is None else self._dir / "mosquitto.conf"

    @property
    def log_path(self) -> Path | None:
        return None if self._dir is None else self._dir / "broker.log"

    def log_tail(self, lines: int = 20) -> str:
        """Last lines of the broker log and its stdout/stderr (for error messages)."""
        if self._dir is None:
            return ""
        out = _tail(self._dir / "broker.log", lines) + _tail(self._dir / "stdout.log", lines)
        return "\n".join(out[-lines:])

    def _device_cap(self) -> int | None:
        if self.kind == "amqtt":
            return AMQTT_MAX_DEVICES
        return max(0, _nofile_target() - FD_RESERVE)

    # ----------------------------------------------------------------- configuration
    def render_config(self, port: int, log_file: Path) -> str:
        """The mosquitto.conf text for this broker (public so `edge-fl broker` can show it)."""
        template = TEMPLATE_PATH.read_text("utf-8")
        auth = []
        if self._password_file is not None:
            auth.append(f"password_file {self._password_file}")
        if self._acl_file is not None:
            auth.append(f"acl_file {self._acl_file}")
        listener = []
        if self.tls is not None:
            listener += [
                f"cafile {self.tls.cafile}",
                f"certfile {self.tls.certfile}",
                f"keyfile {self.tls.keyfile}",
                "tls_version tlsv1.2",
                f"require_certificate {str(self.tls.require_certificate).lower()}",
                f"use_identity_as_username {str(self.tls.use_identity_as_username).lower()}",
            ]
        user = _current_user()
        return Template(template).substitute(
            user=user if user is not None else "mosquitto",
            max_queued_bytes=self._max_queued_bytes,
            max_inflight_messages=self._max_inflight,
            max_packet_size=self._max_packet_size,
            log_file=log_file,
            log_types="\n".join(
                f"log_type {kind}" for kind in ("error", "warning", "notice", "information")
            ),
            connection_messages=str(self._connection_messages).lower(),
            allow_anonymous=str(self._allow_anonymous).lower(),
            auth_lines="\n".join(auth),
            port=port,
            bind=self.bind,
            listener_lines="\n".join(listener),
            extra_lines="\n".join(self._extra),
        )

    # ----------------------------------------------------------------- lifecycle
    def _spawn(self) -> None:
        """Start one attempt: pick the port, write the config, exec the broker (no waiting)."""
        assert self._dir is not None
        self._attempt += 1
        port = self._requested_port or free_port(self.host)
        log_file = self._dir / "broker.log"
        stdout_file = self._dir / "stdout.log"
        for stale in (log_file, stdout_file):
            stale.unlink(missing_ok=True)
        if self.kind == "mosquitto":
            assert self._binary is not None
            config = self._dir / "mosquitto.conf"
            config.write_text(self.render_config(port, log_file), "utf-8")
            argv = [self._binary, "-c", str(config)]
            env = None
        else:
            # Our package root goes at the END of sys.path: found even when edge_fl is not
            # installed, without shadowing anything (PYTHONPATH would come before the stdlib).
            package_root = str(Path(__file__).resolve().parents[2])
            argv = [sys.executable, "-c", _AMQTT_BOOT, package_root]
            argv += ["--host", self.bind, "--port", str(port)]
            env = None
            log_file.touch()
        use_pdeathsig = (
            self._parent_death_signal and threading.current_thread() is threading.main_thread()
        )
        out = stdout_file.open("wb")
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                env=env,
                preexec_fn=make_preexec(use_pdeathsig),
                # Own session: a terminal Ctrl-C reaches only us; we then stop the broker
                # after the clients, instead of it dying under them mid-shutdown.
                start_new_session=True,
            )
        finally:
            out.close()
        self.port = port

    def _poll(self) -> bool:
        """One readiness check: True when ready; respawns on a lost port race; raises on failure."""
        assert self._proc is not None and self._dir is not None
        code = self._proc.poll()
        if code is not None:
            tail = self.log_tail(30)
            if (
                self._requested_port is None
                and self._attempt < _PORT_ATTEMPTS
                and any(marker in tail for marker in _PORT_IN_USE_MARKERS)
            ):
                logger.info("broker port %s taken by another process; retrying", self.port)
                self._spawn()
                return False
            raise BrokerError(
                f"{self.kind} broker exited with code {code} during start-up "
                f"(port {self.port}, dir {self._dir}); log tail:\n{tail}"
            )
        marker_file = "broker.log" if self.kind == "mosquitto" else "stdout.log"
        marker = _READY_MARKERS[self.kind]
        if not any(marker.search(line) for line in _tail(self._dir / marker_file, 50)):
            return False
        # The marker says the listener is up; a TCP connect proves it is ours and reachable.
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def _timeout_error(self) -> BrokerError:
        tail = self.log_tail(30)
        self._terminate(timeout=2.0)
        return BrokerError(
            f"{self.kind} broker did not accept connections on {self.host}:{self.port} within "
            f"{self._startup_timeout:.1f} s; log tail:\n{tail}"
        )

    def _begin(self) -> None:
        if self._proc is not None:
            raise BrokerError("broker already started (one EmbeddedBroker = one process)")
        if self.kind == "amqtt":
            message = (
                "using the pure-Python amqtt broker: it is 20-40x slower than Mosquitto and "
                f"silently loses QoS 1 messages at scale; fleets are capped at {AMQTT_MAX_DEVICES}"
                " devices. Install mosquitto (apt-get install mosquitto) for real runs."
            )
            logger.warning(message)
            if self._fallback:
                warnings.warn(message, AmqttFallbackWarning, stacklevel=3)
        self._dir = Path(tempfile.mkdtemp(prefix=f"edgefl-{self.kind}-"))
        self._attempt = 0
        self._t0 = time.perf_counter()
        self._deadline = time.monotonic() + self._startup_timeout
        _LIVE.add(self)
        self._spawn()

    def _ready(self) -> None:
        self.startup_seconds = time.perf_counter() - self._t0
        logger.info(
            "%s broker ready at %s in %.3f s (pid %s)",
            self.kind,
            self.url,
            self.startup_seconds,
            self.pid,
        )

    def start(self) -> EmbeddedBroker:
        """Start and wait until the broker accepts connections; returns self."""
        return self.spawn().wait_ready()

    def spawn(self) -> EmbeddedBroker:
        """Start the broker's process without waiting for it (:meth:`wait_ready` waits): a
        simulation builds its job while the broker starts."""
        self._begin()
        return self

    def wait_ready(self) -> EmbeddedBroker:
        """Wait until the spawned broker accepts connections (stopped if it never does)."""
        try:
            while not self._poll():
                if time.monotonic() > self._deadline:
                    raise self._timeout_error()
                time.sleep(_POLL_SECONDS)
        except BaseException:
            self.stop(timeout=2.0)
            raise
        self._ready()
        return self

    async def astart(self) -> EmbeddedBroker:
        """Like start() but waits without blocking the event loop."""
        self._begin()
        try:
            while not self._poll():
                if time.monotonic() > self._deadline:
                    raise self._timeout_error()
                await asyncio.sleep(_POLL_SECONDS)
        except BaseException:
            self.stop(timeout=2.0)
            raise
        self._ready()
        return self

    def _terminate(self, timeout: float) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL if self._keeps_nothing() else signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s broker pid %s ignored SIGTERM; killing", self.kind, proc.pid)
                proc.kill()
                proc.wait()
        return proc.returncode

    def _keeps_nothing(self) -> bool:
        """Whether SIGKILL loses nothing: a Mosquitto without persistence. Mosquitto 2.0 blocks
        SIGTERM while it waits in epoll_wait (up to 100 ms), so a graceful stop cost every
        simulation 0.05-0.1 s for nothing; its log is written line by line already."""
        return self.kind == "mosquitto" and not any(
            line.split()[:2] == ["persistence", "true"] for line in self._extra
        )

    def stop(self, timeout: float = 5.0) -> int | None:
        """SIGTERM (SIGKILL at once when the broker keeps nothing), SIGKILL after `timeout` s,
        then remove the temp dir; returns the broker's exit code (None if it was not running).
        Idempotent."""
        code = self._terminate(timeout)
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        _LIVE.discard(self)
        return code

    async def astop(self, timeout: float = 5.0) -> None:
        """Like stop() but polls the exit without blocking the event loop."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL if self._keeps_nothing() else signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        self.stop(timeout=0.5)

    def run_forever(self) -> int:
        """Hold the broker open until SIGINT/SIGTERM (then stop it) or until it exits by itself.

        For `edge-fl broker`. Returns 0 after a signal; raises BrokerError if the broker died.
        """
        if not self.running:
            self.start()
        assert self._proc is not None
        previous = None
        if threading.current_thread() is threading.main_thread():

            def on_term(signum: int, frame: object) -> None:
                raise KeyboardInterrupt

            previous = signal.signal(signal.SIGTERM, on_term)
        try:
            code = self._proc.wait()
        except KeyboardInterrupt:
            return 0
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            tail = self.log_tail(30)
            self.stop()
        raise BrokerError(
            f"{self.kind} broker exited by itself with code {code}; log tail:\n{tail}"
        )

    # ----------------------------------------------------------------- context managers
    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedBroker:
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        await self.astop()

    def __repr__(self) -> str:
        where = self.url if self.port is not None else "not started"
        return f"EmbeddedBroker(kind={self.kind!r}, {where}, pid={self.pid})"
