"""Outside audit of the ledger when dispatch messages select async devices (issue 23, F1).

Written as an auditor who trusts nothing the project prints: a paho-mqtt subscriber of its own on
``edgefl/<job>/up/+`` records every release the devices publish (msgpack decoded here from
docs/protocol.md, re-sends of identical bytes counted once), epsilon is recomputed per device
with dp-accounting directly from the mechanism's documented per-release guarantee (laplace:
pure eps / L per release, basic composition or PLD, whichever is tighter), and both are compared
with the ledger (the releases checkpoint.json covers in its ledger file) and with every output:
console, summary.json, the last metrics.jsonl record and the plot's data (`edge-fl report
--csv`). Jobs run as a user runs them, through the CLI, against a private Mosquitto: `simulate`
for FedBuff and `aggregator` + `fleet` for FedAsync, both with a concurrency limit, so slots
freed mid-version are handed out by dispatch messages (the test checks that at least one was
published).
"""

from __future__ import annotations

import collections
import csv
import hashlib
import json
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import msgpack
import paho.mqtt.client as mqtt
import pytest
from dp_accounting.dp_event import LaplaceDpEvent, SelfComposedDpEvent
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from helpers import TWO_SPEED_PROFILE

pytestmark = [pytest.mark.broker, pytest.mark.slow]

EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))
TWO_SPEED = TWO_SPEED_PROFILE
LAPLACE = ["--mechanism", "laplace", "--epsilon", "8", "--model", "logreg"]


class Sniffer:
    """Every payload on the job's up/global/dispatch topics, plus a marker to flush the queue."""

    def __init__(self, url: str, job: str) -> None:
        host, port = url.removeprefix("mqtt://").rsplit(":", 1)
        self.job, self.marker = job, f"audit/{job}/marker"
        self.payloads: list[tuple[str, bytes]] = []
        self.ready, self.flushed = threading.Event(), threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"audit-{job}")
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *a: self.ready.set()
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        self.client.loop_start()
        assert self.ready.wait(10), "the audit subscriber was not subscribed"

    def _on_connect(self, client, userdata, flags, rc, props=None) -> None:
        topics = ("up/+", "global", "dispatch")
        subs = [(f"edgefl/{self.job}/{t}", 1) for t in topics] + [(self.marker, 1)]
        client.subscribe(subs)

    def _on_message(self, client, userdata, msg) -> None:
        if msg.topic == self.marker:
            self.flushed.set()
        else:
            self.payloads.append((msg.topic, bytes(msg.payload)))

    def flush_and_stop(self) -> None:
        """The broker forwards in order: once our own marker is back, every earlier message is."""
        self.client.publish(self.marker, b"1", qos=1)
        assert self.flushed.wait(10)
        self.client.loop_stop()
        self.client.disconnect()

    def releases(self) -> collections.Counter[str]:
        """Distinct releases per device (identical bytes re-sent are the same release)."""
        seen: set[str] = set()
        per_device: collections.Counter[str] = collections.Counter()
        for topic, payload in self.payloads:
            if "/up/" not in topic or not payload:
                continue
            body = msgpack.unpackb(payload, raw=False)
            assert body["k"] in ("u", "s") and "r" in body and "nc" in body, body.keys()
            digest = hashlib.sha256(payload).hexdigest()
            if digest not in seen:
                seen.add(digest)
                per_device[topic.rsplit("/", 1)[1]] += 1
        return per_device

    def bodies(self, kind: str) -> list[dict]:
        out = []
        for topic, payload in self.payloads:
            if topic == f"edgefl/{self.job}/{kind}" and payload:
                body = msgpack.unpackb(payload, raw=False)
                if body["k"] in ("gs", "ds"):  # signed envelope: the body is the signed bytes
                    body = msgpack.unpackb(body["b"], raw=False)
                out.append(body)
        return out


def laplace_epsilon(releases: int, eps: float, uploads: int, delta: float) -> float:
    """Tightest of basic composition and PLD over `releases` Laplace releases of eps / L each."""
    if releases == 0:
        return 0.0
    per = eps / uploads
    event = SelfComposedDpEvent(LaplaceDpEvent(noise_multiplier=1 / per), releases)
    return min(releases * per, PLDAccountant().compose(event).get_epsilon(delta))


def checkpoint_releases(out: Path) -> list[list]:
    """The releases the last checkpoint covers, read here from the files (not through the code
    under audit): the prefix of its ledger file it names, checked against its digest."""
    state = json.loads((out / "checkpoint.json").read_text())
    cover = state["ledger"]
    data = (out / cover["file"]).read_bytes()[: cover["bytes"]]
    assert len(data) == cover["bytes"]
    assert hashlib.sha256(data).hexdigest() == cover["sha256"]
    lines = [json.loads(line) for line in data.decode().splitlines()]
    releases = [line[1:] for line in lines if line[0] == "r"]
    assert len(releases) == cover["releases"]
    return releases


def check(sniffer: Sniffer, out: Path, console: str, *, dispatched: bool) -> None:
    models = sniffer.bodies("global")
    dispatches = sniffer.bodies("dispatch")
    if dispatched:
        assert dispatches, "no dispatch message: the case does not exercise dispatch selection"
    nonces = {m["ver"]: m["nc"] for m in models if not m.get("done")}
    assert all(d["nc"] == nonces[d["ver"]] for d in dispatches)
    mp = models[0]["mp"]
    assert mp["m"] == "laplace" and mp.get("sched", "uniform") == "uniform"
    published = sniffer.releases()
    charged = collections.Counter(dev for dev, *_ in checkpoint_releases(out))
    assert published == charged, f"published {dict(published)} != charged {dict(charged)}"
    summary = json.loads((out / "summary.json").read_text())
    delta = summary["privacy"]["delta"]
    worst = max(laplace_epsilon(k, mp["eps"], mp["L"], delta) for k in published.values())
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    subprocess.run([EDGE_FL, "report", str(out), "--csv"], check=True, capture_output=True)
    with (out / "metrics.csv").open() as fh:
        plot = float(list(csv.DictReader(fh))[-1]["epsilon"])
    printed = re.search(r"epsilon ([0-9.]+) (?:at delta|\(delta)", console)
    assert printed, console
    print(
        f"published {dict(published)} charged {dict(charged)} eps {worst} {len(dispatches)} dispatches"
    )
    assert summary["epsilon"] == pytest.approx(worst, abs=1e-6)
    assert last["epsilon"] == pytest.approx(worst, abs=1e-6)
    assert plot == pytest.approx(worst, abs=1e-6)
    assert float(printed.group(1)) == pytest.approx(worst, rel=1e-3)  # printed to 4 digits


def test_fedbuff_with_concurrency_charges_every_sniffed_release(mosquitto, tmp_path):
    job, out = f"audit-fb-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    profile = tmp_path / "two-speed.yaml"
    profile.write_text(TWO_SPEED)
    sniffer = Sniffer(mosquitto.url, job)
    cmd = [EDGE_FL, "simulate", "--job", job, "--broker", mosquitto.url, "--out", str(out)]
    cmd += [*LAPLACE, "--devices", "12", "--rounds", "6", "--mode", "fedbuff"]
    cmd += ["--buffer-size", "2", "--concurrency", "4", "--profile", str(profile)]
    cmd += ["--time-scale", "0.5", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    sniffer.flush_and_stop()
    assert done.returncode == 0, done.stderr
    check(sniffer, out, done.stdout + done.stderr, dispatched=True)


def test_fedasync_with_concurrency_charges_every_sniffed_release(mosquitto, tmp_path):
    job, out = f"audit-fa-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    profile = tmp_path / "two-speed.yaml"
    profile.write_text(TWO_SPEED)
    sniffer = Sniffer(mosquitto.url, job)
    common = ["--job", job, "--broker", mosquitto.url, *LAPLACE, "--devices", "8", "--rounds", "5"]
    common += ["--mode", "fedasync", "--concurrency", "3", "--profile", str(profile)]
    common += ["--time-scale", "0.5", "--dropout", "0.3", "--deadline", "5"]  # dropouts free slots
    aggregator = subprocess.Popen(
        [EDGE_FL, "aggregator", *common, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    fleet = subprocess.Popen(
        [EDGE_FL, "fleet", *common], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        console, _ = aggregator.communicate(timeout=600)
        fleet.wait(timeout=60)  # the fleet leaves on the done marker: nothing more is published
    finally:
        for proc in (aggregator, fleet):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    sniffer.flush_and_stop()
    assert aggregator.returncode == 0, console
    # FedAsync makes a version of every update, so a slot freed by an update goes out with the
    # next global message; dispatches come from slots freed otherwise (dropouts, timeouts), likely
    # here but not certain
    check(sniffer, out, console, dispatched=False)
