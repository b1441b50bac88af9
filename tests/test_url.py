"""Broker URLs with a node list (`mqtt://h1:p1,h2:p2`): parsing, round trip, and the rotation
that makes every reconnect loop fail over to the next node of a cluster."""

from __future__ import annotations

import re
import threading
from collections import Counter

import paho.mqtt.client as paho
import pytest

from edge_fl.transport import client_adapter
from edge_fl.transport.url import BrokerSpec, BrokerUrlError, parse_broker_url

CLUSTER = "mqtts://dev:s%40cret@n1.example:8883,10.0.0.2,[::1]:9883?ca=/etc/ca+1.pem&insecure=1"


def test_node_list_shares_credentials_and_options() -> None:
    spec = parse_broker_url(CLUSTER)
    assert spec.nodes == (("n1.example", 8883), ("10.0.0.2", 8883), ("::1", 9883))
    assert (spec.host, spec.port) == spec.nodes[0]  # the first node, for single-node callers
    assert (spec.username, spec.password, spec.tls) == ("dev", "s@cret", True)
    assert (spec.ca_file, spec.insecure) == ("/etc/ca+1.pem", True)
    plain = parse_broker_url("mqtt://a,b:1884")
    assert plain.nodes == (("a", 1883), ("b", 1884))  # the scheme's default port per node


def test_node_list_round_trips_and_redacts() -> None:
    spec = parse_broker_url(CLUSTER)
    assert parse_broker_url(spec.to_url()) == spec
    assert spec.redacted() == (
        "mqtts://dev:***@n1.example:8883,10.0.0.2:8883,[::1]:9883?ca=/etc/ca%2B1.pem&insecure=1"
    )
    for text in (spec.redacted(), str(spec), repr(spec)):
        assert "s@cret" not in text and "s%40cret" not in text
    single = parse_broker_url("mqtt://localhost")
    assert single == BrokerSpec("localhost", 1883)
    assert single.nodes == (("localhost", 1883),)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mqtt://a:1,,b:2", "missing host"),
        ("mqtt://a:1,", "missing host"),
        ("mqtt://a:1,b:x", "port 'x' is not an integer"),
        ("mqtt://a:1,b:", "empty port"),
        ("mqtt://a:1,b:0", "port 0 is not in 1..65535"),
        ("mqtt://a:1,A:1", "listed more than once"),
        ("mqtt://u:hunter2@a:1,b:99999", "***"),
    ],
)
def test_node_list_errors(url: str, message: str) -> None:
    with pytest.raises(BrokerUrlError, match=re.escape(message)) as info:
        parse_broker_url(url)
    assert "hunter2" not in str(info.value)


def test_each_connection_attempt_gets_the_next_node() -> None:
    """The runtimes call aiomqtt_kwargs() once per attempt: consecutive calls cycle all nodes."""
    spec = parse_broker_url("mqtt://u:p@a:1,b:2,c:3")
    seen = [(kw["hostname"], kw["port"]) for kw in (spec.aiomqtt_kwargs() for _ in range(9))]
    start = spec.nodes.index(seen[0])  # a random start spreads a fleet over the cluster
    assert seen == [spec.nodes[(start + i) % 3] for i in range(9)]
    assert all(spec.aiomqtt_kwargs()["username"] == "u" for _ in range(3))
    single = parse_broker_url("mqtt://a:1")
    assert {single.aiomqtt_kwargs()["hostname"] for _ in range(5)} == {"a"}


def test_random_start_spreads_processes_over_the_nodes() -> None:
    firsts = Counter(parse_broker_url("mqtt://a,b,c").next_node()[0] for _ in range(300))
    assert set(firsts) == {"a", "b", "c"}
    assert min(firsts.values()) > 50  # each ~100 of 300; fails only by a ~1e-6 fluke


def test_rotation_is_shared_by_threads_without_losing_a_turn() -> None:
    spec = parse_broker_url("mqtt://a,b,c,d")
    counts: Counter = Counter()
    lock = threading.Lock()

    def worker() -> None:
        local = Counter(spec.next_node()[0] for _ in range(1000))
        with lock:
            counts.update(local)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == {"a": 1000, "b": 1000, "c": 1000, "d": 1000}


def test_configure_paho_returns_the_next_node_and_sets_tls_once(tmp_path) -> None:
    spec = parse_broker_url("mqtts://u:p@a:1,b:2?insecure=1")
    client = paho.Client(paho.CallbackAPIVersion.VERSION2)
    first = spec.configure_paho(client)
    second = spec.configure_paho(client)  # a reconnect: TLS already set, no ValueError
    assert {first, second} == {("a", 1), ("b", 2)}
    assert client_adapter.tls_configured(client) and client.username == "u"


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("ca=/nonexistent/ca.crt", "ca='/nonexistent/ca.crt': file does not exist"),
        ("ca={junk}", "ca='{junk}': not a readable PEM CA certificate"),
        ("cert={junk}&key={junk}", "cert='{junk}', key='{junk}': not a readable PEM certificate"),
        ("cert=/nonexistent/c.pem", "cert='/nonexistent/c.pem': file does not exist"),
    ],
)
def test_unusable_tls_files_are_one_line_url_errors(tmp_path, query: str, message: str) -> None:
    """A TLS file the operator named but cannot be used is a mistake in the URL: one line naming
    the option and the file, the password masked, when the first connection is prepared."""
    junk = tmp_path / "junk.pem"
    junk.write_text("not PEM\n")
    spec = parse_broker_url("mqtts://u:hunter2@h:8883?" + query.format(junk=junk))
    with pytest.raises(BrokerUrlError, match=re.escape(message.format(junk=junk))) as info:
        spec.aiomqtt_kwargs()
    text = str(info.value)
    assert "\n" not in text and "hunter2" not in text and "u:***@h:8883" in text
