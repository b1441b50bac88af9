"""Every release a device published is charged, in every mode, and every output says the same.

An independent subscriber on the devices' update topics sees what the fleet published; the
ledger must hold one release per (device, round or version) it saw, and the console, summary.json,
metrics.jsonl and the plotted series must carry the ledger's final epsilon. (Issue 23, F1: in
FedBuff the ledger charged 7 of 16 published releases; the outputs disagreed 5.33 / 2.67.)
"""

from __future__ import annotations

import json
import threading
import uuid

import msgpack
import paho.mqtt.client as paho
import pytest

from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.protocol import Topics
from edge_fl.report import read_run
from edge_fl.simulation import simulate
from edge_fl.transport.url import parse_broker_url

pytestmark = pytest.mark.broker

MODES = {
    "sync": {"rounds.mode": "sync", "rounds.clients_per_round": 4},
    "fedbuff": {"rounds.mode": "fedbuff", "rounds.buffer_size": 2, "rounds.concurrency": 0},
    "fedbuff-c": {"rounds.mode": "fedbuff", "rounds.buffer_size": 2, "rounds.concurrency": 5},
    "fedasync": {"rounds.mode": "fedasync", "rounds.concurrency": 0},
}


class Sniffer:
    """A paho client on its own network thread, subscribed (QoS 1) to every device's update
    topic: it shares nothing with the run it observes, and its callback loses no message."""

    def __init__(self, url: str, topics: Topics) -> None:
        self.spec = parse_broker_url(url)
        self.topic = topics.all_updates
        self.payloads: list[tuple[str, bytes]] = []
        self.subscribed = threading.Event()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, f"sniff-{uuid.uuid4().hex}")
        self.client.on_connect = lambda c, *_: c.subscribe(self.topic, qos=1)
        self.client.on_subscribe = lambda *_: self.subscribed.set()
        self.client.on_message = lambda _c, _u, m: self.payloads.append((m.topic, m.payload))

    def __enter__(self) -> Sniffer:
        host, port = self.spec.configure_paho(self.client)
        self.client.connect(host, port)
        self.client.loop_start()
        assert self.subscribed.wait(10), "the sniffer could not subscribe"
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def published_releases(payloads: list[tuple[str, bytes]]) -> set[tuple[str, int]]:
    """(device, round) of every update on the wire; a re-sent copy is the same release."""
    out = set()
    for topic, payload in payloads:
        body = msgpack.unpackb(payload, raw=False)
        out.add((topic.rsplit("/", 1)[1], int(body["r"])))
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_every_published_release_is_charged_and_reported_once(mosquitto, tmp_path, mode):
    job = f"charge-{mode}-{uuid.uuid4().hex[:6]}"
    cfg = load_config(
        None,
        {
            "job": job,
            "broker.url": mosquitto.url,
            "data.devices": 6,
            "model.name": "logreg",
            "rounds.rounds": 3,
            "rounds.deadline_s": 10,
            "privacy.mechanism": "laplace",
            "privacy.epsilon": 8.0,
            **MODES[mode],
        },
    )
    with Sniffer(mosquitto.url, Topics(job)) as tap:
        summary = simulate(cfg, tmp_path)
    published = published_releases(tap.payloads)
    assert published, "the fleet published nothing"
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # one ledger release per published (device, round): nothing the devices released is missing
    assert summary["after_last_round"]["device_updates"] == len(published)
    assert records[-1]["device_updates"] == len(published)
    # the true worst device: its releases x the per-release epsilon (Laplace composes additively;
    # PLD may be a hair tighter than the sum)
    per_device: dict[str, int] = {}
    for device, _ in published:
        per_device[device] = per_device.get(device, 0) + 1
    eps = summary["privacy"]["epsilon"]
    true = max(per_device.values()) * 8.0 / 3
    assert 0.999 * true <= eps <= true + 1e-9
    # console/summary, the last metrics record and the plotted series agree
    assert summary["epsilon"] == eps
    assert records[-1]["epsilon"] == eps
    assert read_run(tmp_path).records[-1]["epsilon"] == eps


def test_releases_the_decoder_refuses_as_implausible_are_charged(mosquitto, tmp_path):
    """F4: noise calibrated for a clip of 1000 makes every update exceed the decoder's |x| bound;
    all are refused, yet each was a release of a selected device (right nonce): charged."""
    job = f"implausible-{uuid.uuid4().hex[:6]}"
    cfg = load_config(
        None,
        {
            "job": job,
            "broker.url": mosquitto.url,
            "data.devices": 4,
            "model.name": "logreg",
            "rounds.rounds": 2,
            "rounds.clients_per_round": 4,
            "rounds.min_updates": 1,
            "rounds.deadline_s": 3,
            "rounds.on_short_round": "skip",
            "privacy.mechanism": "gaussian",
            "privacy.epsilon": 0.5,
            "privacy.clip": 1000.0,
        },
    )
    with Sniffer(mosquitto.url, Topics(job)) as tap:
        summary = simulate(build_job(cfg, noise_must_fit=False), tmp_path)
    published = published_releases(tap.payloads)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["total_received"] == 0  # every one refused
    assert sum(r["rejected_by_reason"].get("implausible", 0) for r in records) > 0
    assert summary["after_last_round"]["device_updates"] == len(published) > 0
    eps = summary["privacy"]["epsilon"]
    assert eps > 0 and summary["epsilon"] == eps == records[-1]["epsilon"]
