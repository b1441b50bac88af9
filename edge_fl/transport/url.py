"""Broker URLs: one string (`mqtts://user:pass@host:8883?ca=ca.pem`) configures every client.

A single URL is what an operator pastes into a device config or a CLI flag, so every connection
detail (credentials, TLS files, port) lives in it; this module turns it into the keyword arguments
that aiomqtt and paho expect, and never lets the password reach a log line.

A clustered broker (NATS, RabbitMQ, EMQX, ...) is one URL with a node list,
`mqtt://user:pass@h1:1883,h2:1883,h3:1883?ca=...`: credentials and options apply to every node, and
each connection attempt goes to the next node (round robin from a random start, so a fleet spreads
over the cluster and a client whose node died reconnects to another one on its next attempt).
"""

from __future__ import annotations

import itertools
import os
import random
import re
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlsplit

if TYPE_CHECKING:  # paho is only needed by the light agent
    import paho.mqtt.client

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}
QUERY_KEYS = ("ca", "cert", "key", "insecure")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


Node = tuple[str, int]


class BrokerUrlError(ValueError):
    """A broker URL an operator must fix (syntax, an option, a TLS file): the message is one line
    that names the offending part, with any password masked; the CLI prints it as it is."""


@dataclass(frozen=True)
class BrokerSpec:
    """Where and how to connect to an MQTT broker (parsed from a URL by `parse_broker_url`).

    `host`/`port` are the first node; `nodes` is the whole list (one entry for a single broker).
    `aiomqtt_kwargs()` and `configure_paho()` each hand out the next node, so a reconnect loop that
    asks once per attempt fails over to the other nodes of a cluster.
    """

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    # repr=False: a spec printed in a traceback or a log must not leak the password.
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False
    nodes: tuple[Node, ...] = ()
    # Which node the next connection attempt gets; shared by every client using this spec, so a
    # fleet's connections spread over the cluster. Not part of the spec's value (compare=False).
    _cursor: itertools.count = field(
        default_factory=itertools.count, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        if not self.nodes:
            object.__setattr__(self, "nodes", ((self.host, self.port),))
        nodes = tuple((str(h), int(p)) for h, p in self.nodes)
        object.__setattr__(self, "nodes", nodes)
        if nodes[0] != (self.host, self.port):
            raise ValueError(
                f"BrokerSpec: host/port {self.host}:{self.port} must be the first node of {nodes}"
            )
        if len(nodes) > 1:
            # A random start per process: devices that all parse the same URL do not all pile
            # onto the first node. next() on itertools.count is atomic under the GIL, so paho
            # threads and the event loop can share one spec.
            object.__setattr__(self, "_cursor", itertools.count(random.randrange(len(nodes))))

    def next_node(self) -> Node:
        """The (host, port) for the next connection attempt: round robin over `nodes`."""
        if len(self.nodes) == 1:
            return self.nodes[0]
        return self.nodes[next(self._cursor) % len(self.nodes)]

    def to_url(self, *, redact: bool = False) -> str:
        """Rebuild a URL that `parse_broker_url` maps back to this spec."""
        scheme = "mqtts" if self.tls else "mqtt"
        auth = ""
        if self.username is not None:
            auth = quote(self.username, safe="")
            if self.password is not None:
                auth += ":" + ("***" if redact else quote(self.password, safe=""))
            auth += "@"
        hosts = ",".join(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in self.nodes
        )
        query = [
            f"{name}={quote(value, safe='/~.-_')}"
            for name, value in (
                ("ca", self.ca_file),
                ("cert", self.cert_file),
                ("key", self.key_file),
            )
            if value is not None
        ]
        if self.insecure:
            query.append("insecure=1")
        tail = ("?" + "&".join(query)) if query else ""
        return f"{scheme}://{auth}{hosts}{tail}"

    def redacted(self) -> str:
        """The URL with the password replaced by `***`, safe for logs and metrics files."""
        return self.to_url(redact=True)

    def __str__(self) -> str:
        return self.redacted()

    def tls_context(self) -> ssl.SSLContext | None:
        """A client TLS context (None for plain `mqtt://`).

        Without `ca=` the system trust store is used, which is right for a broker with a public
        certificate; `insecure=1` disables verification and exists only for debugging.
        """
        if not self.tls:
            return None
        for option, path in (
            ("ca", self.ca_file),
            ("cert", self.cert_file),
            ("key", self.key_file),
        ):
            if path is not None and not os.path.isfile(path):
                raise BrokerUrlError(
                    f"broker URL option {option}={path!r}: file does not exist "
                    f"(broker {self.redacted()})"
                )
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise BrokerUrlError(
                f"broker URL option ca={self.ca_file!r}: not a readable PEM CA certificate "
                f"({exc.__class__.__name__}: {exc}) (broker {self.redacted()})"
            ) from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert_file is not None:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError) as exc:
                raise BrokerUrlError(
                    f"broker URL options cert={self.cert_file!r}, key={self.key_file!r}: not a "
                    f"readable PEM certificate and key ({exc.__class__.__name__}: {exc}) "
                    f"(broker {self.redacted()})"
                ) from None
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def aiomqtt_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `aiomqtt.Client(**kwargs, identifier=..., will=...)`.

        Call it once per connection attempt: each call names the next node of a cluster."""
        host, port = self.next_node()
        return {
            "hostname": host,
            "port": port,
            "username": self.username,
            "password": self.password,
            "tls_context": self.tls_context(),
        }

    def configure_paho(self, client: paho.mqtt.client.Client) -> Node:
        """Apply credentials and TLS to a paho client; returns the node to connect to next.

        `client.connect(*spec.configure_paho(client))`; on a lost connection call it again (TLS
        is set once per client: paho refuses a second `tls_set_context`) for the next node."""
        if self.username is not None:
            client.username_pw_set(self.username, self.password)
        from edge_fl.transport.client_adapter import tls_configured

        context = self.tls_context()
        if context is not None and not tls_configured(client):
            client.tls_set_context(context)
        return self.next_node()


_PASSWORD_IN_URL = re.compile(r"(://[^/@?#]*?:)[^/@?#]*@")


def _safe(url: str) -> str:
    """The URL with any password masked, for error messages (they end up in logs)."""
    return _PASSWORD_IN_URL.sub(r"\1***@", url)


def _parse_bool(name: str, value: str, url: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise BrokerUrlError(
        f"broker URL option {name}={value!r} in {url!r}: expected one of {sorted(_TRUE | _FALSE)}"
    )


def _parse_query(query: str, url: str) -> dict[str, str]:
    # Split by hand rather than parse_qsl: parse_qsl turns '+' into a space, which would
    # silently corrupt file paths that contain '+'.
    options: dict[str, str] = {}
    for item in query.split("&"):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = unquote(name)
        if name not in QUERY_KEYS:
            raise BrokerUrlError(
                f"broker URL {url!r}: unknown option {name!r}; "
                f"allowed options are {list(QUERY_KEYS)}"
            )
        if name in options:
            raise BrokerUrlError(f"broker URL {url!r}: option {name!r} given more than once")
        if not sep or not value:
            raise BrokerUrlError(f"broker URL {url!r}: option {name!r} needs a value ({name}=...)")
        options[name] = unquote(value)
    return options


def _parse_node(hostport: str, scheme: str, url: str) -> Node:
    """One `host[:port]` of the node list (`url` is the masked whole URL, for messages)."""
    try:
        parts = urlsplit(f"{scheme}://{hostport}")
        host = parts.hostname
    except ValueError as exc:
        raise BrokerUrlError(f"broker URL {url!r} is malformed: {exc}") from None
    if not host:
        where = f" in node {hostport!r}" if hostport else ""
        raise BrokerUrlError(f"broker URL {url!r}: missing host{where}")
    try:
        port = parts.port
    except ValueError:
        raw = hostport.rpartition(":")[2]
        raise BrokerUrlError(
            f"broker URL {url!r}: port {raw!r} is not an integer in 1..65535"
        ) from None
    if port is None:
        if hostport.endswith(":"):
            raise BrokerUrlError(f"broker URL {url!r}: empty port after ':'")
        port = DEFAULT_PORTS[scheme]
    if not 1 <= port <= 65535:
        raise BrokerUrlError(f"broker URL {url!r}: port {port} is not in 1..65535")
    return host, port


def parse_broker_url(url: str) -> BrokerSpec:
    """Parse `mqtt://[user[:pass]@]host[:port][,host2[:port2]...]` or
    `mqtts://...[?ca=&cert=&key=&insecure=1]` (credentials and options apply to every node).

    Raises BrokerUrlError naming the offending part for anything else, so a typo in a device config
    fails at start-up instead of as a connection timeout.
    """
    if not isinstance(url, str) or not url.strip():
        raise BrokerUrlError(
            f"broker URL must be a non-empty string like mqtt://host:1883, got {url!r}"
        )
    raw_url = url.strip()
    url = _safe(raw_url)  # only the masked form appears in error messages
    if "://" not in url:
        raise BrokerUrlError(
            f"broker URL {url!r} has no scheme; expected mqtt://host[:port] or mqtts://host[:port]"
        )
    try:
        parts = urlsplit(raw_url)
    except ValueError as exc:
        raise BrokerUrlError(f"broker URL {url!r} is malformed: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise BrokerUrlError(
            f"broker URL {url!r}: scheme {parts.scheme!r} is not supported; "
            f"use one of {sorted(DEFAULT_PORTS)}"
        )
    if parts.path not in ("", "/"):
        raise BrokerUrlError(
            f"broker URL {url!r}: unexpected path {parts.path!r} (MQTT URLs have none)"
        )
    if parts.fragment:
        raise BrokerUrlError(f"broker URL {url!r}: unexpected fragment #{parts.fragment}")
    hostlist = parts.netloc.rpartition("@")[2]
    nodes = [_parse_node(item, scheme, url) for item in hostlist.split(",")]
    if len(set(nodes)) != len(nodes):
        raise BrokerUrlError(f"broker URL {url!r}: a node is listed more than once")

    username = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    if username == "":
        if password is not None:
            raise BrokerUrlError(f"broker URL {url!r}: password given without a username")
        username = None

    options = _parse_query(parts.query, url)
    tls = scheme == "mqtts"
    tls_options = [name for name in QUERY_KEYS if name in options]
    if tls_options and not tls:
        raise BrokerUrlError(
            f"broker URL {url!r}: options {tls_options} only apply to TLS; use mqtts:// instead"
        )
    if "key" in options and "cert" not in options:
        raise BrokerUrlError(f"broker URL {url!r}: key= given without cert= (client certificate)")

    def path(name: str) -> str | None:
        value = options.get(name)
        return os.path.expanduser(value) if value is not None else None

    return BrokerSpec(
        host=nodes[0][0],
        port=nodes[0][1],
        nodes=tuple(nodes),
        tls=tls,
        username=username,
        password=password,
        ca_file=path("ca"),
        cert_file=path("cert"),
        key_file=path("key"),
        insecure=_parse_bool("insecure", options["insecure"], url)
        if "insecure" in options
        else False,
    )
