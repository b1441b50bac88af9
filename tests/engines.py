"""Test-owned MQTT engines besides Mosquitto: a 3-node NATS cluster (JetStream + MQTT listener)
and a RabbitMQ node with the MQTT plugin, each on free loopback ports in a private directory.

Never the system services (NATS on 4222, RabbitMQ on 5672/1883, the system epmd on 4369): every
port here is picked free, RabbitMQ gets its own node name, cookie and epmd, and everything lives in
the directory the caller gives. `start_s` records how long each start took (docs/brokers.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import paho.mqtt.client as paho

NATS_LOCATIONS = ("/usr/sbin/nats-server", "/usr/bin/nats-server")
RABBITMQ_LOCATIONS = ("/usr/lib/rabbitmq/bin/rabbitmq-server",)
EPMD_LOCATIONS = ("/usr/bin/epmd",)


def find_binary(name: str, locations: tuple[str, ...]) -> str | None:
    """`name` on PATH or at one of the Debian package's locations."""
    for path in (shutil.which(name), *locations):
        if path and os.access(path, os.X_OK):
            return path
    return None


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports that were free a moment ago (held together while picking)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def mqtt_ready(port: int, timeout: float = 2.0) -> bool:
    """A full MQTT CONNECT/CONNACK (a listening socket is not enough: NATS accepts TCP before
    its MQTT streams exist, RabbitMQ before its plugin is ready)."""
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"ready-{port}")
    try:
        client.connect("127.0.0.1", port, keepalive=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            client.loop(0.05)
            if client.is_connected():
                return True
        return False
    except OSError:
        return False
    finally:
        client.disconnect()


def _wait(what: str, check, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"{what} not ready within {timeout:.0f} s; log tail:\n{tail}")


def _stop(proc: subprocess.Popen | None, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL of the process group we created (start_new_session)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


class NatsCluster:
    """`size` nats-server nodes routed into one cluster, JetStream on, an MQTT listener each."""

    name = "nats"

    def __init__(
        self,
        root: Path,
        size: int = 3,
        binary: str | None = None,
        ack_wait: str | None = None,
    ) -> None:
        """`ack_wait` (e.g. "2s"): NATS redelivers an unacknowledged QoS 1 message only after it
        (default 30 s), even to a persistent session that reconnected."""
        self.ack_wait = ack_wait
        self.binary = binary or find_binary("nats-server", NATS_LOCATIONS)
        if self.binary is None:
            raise FileNotFoundError("nats-server")
        self.root = Path(root)
        self.size = size
        ports = free_ports(4 * size)
        self.client_ports = ports[0:size]
        self.route_ports = ports[size : 2 * size]
        self.mqtt_ports = ports[2 * size : 3 * size]
        self.http_ports = ports[3 * size : 4 * size]
        self.procs: list[subprocess.Popen | None] = [None] * size
        self.start_s: float | None = None
        for i in range(size):
            self._write_config(i)

    def _write_config(self, i: int) -> None:
        routes = ", ".join(
            f'"nats-route://127.0.0.1:{p}"' for j, p in enumerate(self.route_ports) if j != i
        )
        ack_wait = f', ack_wait: "{self.ack_wait}"' if self.ack_wait else ""
        store = self.root / f"n{i}"
        store.mkdir(parents=True, exist_ok=True)
        (self.root / f"n{i}.conf").write_text(
            f"server_name: n{i}\n"
            f"listen: 127.0.0.1:{self.client_ports[i]}\n"
            f"http: 127.0.0.1:{self.http_ports[i]}\n"
            f'jetstream {{ store_dir: "{store}" }}\n'
            f"cluster {{ name: edgefl-test, listen: 127.0.0.1:{self.route_ports[i]}, "
            f"routes: [{routes}] }}\n"
            # stream_replicas explicit: left out, 2.9.10 created the MQTT streams with 2 replicas
            # (the peers it knew at the first MQTT connect), and losing one of those 2 nodes
            # stalled every session ("NO quorum") until it came back
            f"mqtt {{ listen: 127.0.0.1:{self.mqtt_ports[i]}, "
            f"stream_replicas: {min(self.size, 3)}{ack_wait} }}\n"
        )

    # ------------------------------------------------------------------ URLs
    @property
    def url(self) -> str:
        """Every node: what a client given the whole cluster uses."""
        return "mqtt://" + ",".join(f"127.0.0.1:{p}" for p in self.mqtt_ports)

    def node_url(self, i: int) -> str:
        return f"mqtt://127.0.0.1:{self.mqtt_ports[i]}"

    # ------------------------------------------------------------- lifecycle
    def start_node(self, i: int) -> None:
        log = (self.root / f"n{i}.log").open("ab")
        self.procs[i] = subprocess.Popen(
            [self.binary, "-c", str(self.root / f"n{i}.conf")],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def start(self, timeout: float = 30.0) -> NatsCluster:
        t0 = time.perf_counter()
        for i in range(self.size):
            self.start_node(i)
        self.wait_ready(timeout)
        self.start_s = time.perf_counter() - t0
        return self

    def running(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def jsz(self, i: int) -> dict:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.http_ports[i]}/jsz", timeout=1
        ) as reply:
            return json.loads(reply.read())

    def meta_leader(self) -> str | None:
        """The JetStream meta leader as every running node sees it (None until they agree)."""
        seen = set()
        for i in self.running():
            try:
                seen.add((self.jsz(i).get("meta_cluster") or {}).get("leader"))
            except OSError:
                return None
        return seen.pop() if len(seen) == 1 and None not in seen else None

    def wait_ready(self, timeout: float = 30.0) -> None:
        """A JetStream meta leader and a working MQTT CONNECT on every running node (the first
        MQTT connection creates the cluster's MQTT streams: ~1 s here)."""
        log = self.root / "n0.log"
        _wait("NATS JetStream meta leader", lambda: self.meta_leader() is not None, timeout, log)
        for i in self.running():
            _wait(
                f"NATS MQTT on node {i}", lambda i=i: mqtt_ready(self.mqtt_ports[i]), timeout, log
            )

    def kill(self, i: int) -> None:
        """SIGKILL one node (no goodbye to its clients or routes)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def node_of_client(self, client_id: str) -> int | None:
        """Which running node holds the MQTT connection of `client_id` (monitoring /connz)."""
        for i in self.running():
            try:
                url = f"http://127.0.0.1:{self.http_ports[i]}/connz?limit=10000"
                with urllib.request.urlopen(url, timeout=1) as reply:
                    conns = json.loads(reply.read()).get("connections") or []
            except OSError:
                continue
            if any(c.get("mqtt_client") == client_id for c in conns):
                return i
        return None

    def restart(self, timeout: float = 30.0) -> float:
        """Stop every node (SIGTERM) and start them again on the same store; returns seconds."""
        t0 = time.perf_counter()
        for proc in self.procs:
            _stop(proc)
        for i in range(self.size):
            self.start_node(i)
        self.wait_ready(timeout)
        return time.perf_counter() - t0

    def stop(self) -> None:
        for proc in self.procs:
            _stop(proc)


class RabbitNode:
    """One RabbitMQ node with rabbitmq_mqtt, private to the test session.

    Its own node name, Erlang cookie (HOME in our dir), epmd on a free port (ERL_EPMD_PORT; the
    system node registers with the default epmd on 4369), mnesia/log dirs, plugins file and
    config file; the AMQP, distribution and MQTT listeners on free loopback ports.
    """

    name = "rabbitmq"

    def __init__(self, root: Path, binary: str | None = None) -> None:
        self.binary = binary or find_binary("rabbitmq-server", RABBITMQ_LOCATIONS)
        # /usr/sbin/rabbitmq-server is a wrapper that su's to the rabbitmq user and writes the
        # system log dir: use the real script, as ourselves.
        if self.binary == "/usr/sbin/rabbitmq-server":
            self.binary = RABBITMQ_LOCATIONS[0]
        self.epmd = find_binary("epmd", EPMD_LOCATIONS)
        if self.binary is None or not os.path.exists(self.binary) or self.epmd is None:
            raise FileNotFoundError("rabbitmq-server")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.start_s: float | None = None
        self._epmd: subprocess.Popen | None = None
        self._proc: subprocess.Popen | None = None
        self._pick_ports()
        (self.root / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        (self.root / "rabbitmq-env.conf").write_text("")  # not /etc/rabbitmq/rabbitmq-env.conf
        cookie = self.root / ".erlang.cookie"
        cookie.write_text(f"edgefltest{os.getpid()}{self.mqtt_port}")
        cookie.chmod(0o400)

    def _pick_ports(self) -> None:
        """Free ports and the config naming them (again after losing a port race: the node takes
        ~10 s to bind, and other test sessions on the machine pick free ports too)."""
        self.epmd_port, self.mqtt_port, self.amqp_port, self.dist_port = free_ports(4)
        self.nodename = f"edgefl-test-{os.getpid()}-{self.mqtt_port}@localhost"
        (self.root / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.amqp_port}\n"
            f"mqtt.listeners.tcp.default = 127.0.0.1:{self.mqtt_port}\n"
            "mqtt.allow_anonymous = true\n"
            "log.console = true\n"
            "log.file = false\n"
        )

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.mqtt_port}"

    def _env(self) -> dict[str, str]:
        r = str(self.root)
        return {
            "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": r,  # the Erlang cookie: ours, not the system node's
            "LANG": "C.UTF-8",
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": f"{r}/mnesia",
            "RABBITMQ_LOG_BASE": f"{r}/log",
            "RABBITMQ_PID_FILE": f"{r}/rabbitmq.pid",
            "RABBITMQ_ENABLED_PLUGINS_FILE": f"{r}/enabled_plugins",
            "RABBITMQ_CONFIG_FILE": f"{r}/rabbitmq.conf",
            "RABBITMQ_ADVANCED_CONFIG_FILE": f"{r}/advanced.config",
            "RABBITMQ_CONF_ENV_FILE": f"{r}/rabbitmq-env.conf",
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }

    def start(self, timeout: float = 180.0, attempts: int = 3) -> RabbitNode:
        t0 = time.perf_counter()
        for attempt in range(attempts):
            try:
                self._start_once(timeout)
                break
            except RuntimeError as exc:
                fresh = self.start_s is None  # a restart must keep its ports (and its state)
                if "eaddrinuse" not in str(exc) or not fresh or attempt == attempts - 1:
                    raise
                _stop(self._epmd)
                self._epmd = None
                self._pick_ports()
        self.start_s = time.perf_counter() - t0
        return self

    def _start_once(self, timeout: float) -> None:
        if self._epmd is None or self._epmd.poll() is not None:
            self._epmd = subprocess.Popen(
                [self.epmd, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        log_path = self.root / "server.log"
        with log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [self.binary],
                env=self._env(),
                cwd=self.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def ready() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(
                    f"rabbitmq-server exited {self._proc.returncode}; log tail:\n"
                    + log_path.read_text(errors="replace")[-3000:]
                )
            return mqtt_ready(self.mqtt_port)

        _wait("RabbitMQ MQTT listener", ready, timeout, log_path)

    def stop_node(self) -> None:
        """Stop the broker (SIGTERM: a clean shutdown that keeps its durable state)."""
        _stop(self._proc, timeout=30.0)
        self._proc = None

    def restart(self, timeout: float = 60.0) -> float:
        t0 = time.perf_counter()
        self.stop_node()
        self.start(timeout)
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.stop_node()
        _stop(self._epmd)
        self._epmd = None
