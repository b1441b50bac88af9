"""A stop signal at any moment ends the job within 2 s with every release charged (issues 23, 24).

``edge-fl aggregator`` (with ``edge-fl fleet``) and ``edge-fl simulate`` run over a real Mosquitto
started here; a subscriber on that broker sees every global message, update and metrics record
as it is published and fires the signal from its callback at the moment under test, not after a
sleep: as round 2 opens (its global message), mid-round (the first update of round 2), and at a
close (round 1's record). Asserted: exit 0 within 2 s of the signal, the open round decided
(the last record says ``stopped``), and the ledger charged every update a device published
(every distinct (device, round) the subscriber saw on ``up/+``, until the last process exited).

Run them under load too (``python3 -c 'while True: pass' &`` twice on a 2-core machine): the 2 s
bar is meant to hold there.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import msgpack
import paho.mqtt.client as paho
import pytest
from helpers import UNBUFFERED as ENV
from helpers import start_fleet_and_aggregator
from processes import EDGE_FL

from edge_fl.protocol import Topics

pytestmark = pytest.mark.broker

STOP_BAR_S = 2.0
MOMENTS = ["round_opens", "mid_round", "round_closes"]


def round_of(payload: bytes) -> int | None:
    """The ``r`` an update names (what the ledger keys a release by, with the device)."""
    try:
        body = msgpack.unpackb(payload, raw=False)
    except Exception:
        return None
    return body.get("r") if isinstance(body, dict) else None


class Sniffer:
    """A subscriber on the job's topics that fires ``fire()`` once, at the chosen moment."""

    def __init__(self, url: str, topics: Topics, moment: str) -> None:
        self.topics = topics
        self.moment = moment
        self.updates: set[tuple[str, int | None]] = set()
        self.globals_seen = 0
        self.fired_at: float | None = None
        self.target: subprocess.Popen | None = None
        self.sig = signal.SIGTERM
        self.lock = threading.Lock()
        host, port = url.removeprefix("mqtt://").rsplit(":", 1)
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, f"sniff-{uuid.uuid4().hex[:6]}")
        self.client.on_message = self._on_message
        self.client.on_connect = self._on_connect
        self.subscribed = threading.Event()
        self.client.on_subscribe = lambda *_a: self.subscribed.set()
        self.client.connect(host, int(port))
        self.client.loop_start()
        assert self.subscribed.wait(10), "the subscriber never subscribed"

    def _on_connect(self, client, _userdata, _flags, _rc, _props=None) -> None:
        t = self.topics
        client.subscribe([(t.global_model, 1), (t.all_updates, 1), (t.metrics, 1)])

    def _on_message(self, _client, _userdata, msg) -> None:
        t = self.topics
        with self.lock:
            if (device := t.device_of(msg.topic, "up")) is not None:
                rnd = round_of(msg.payload)
                self.updates.add((device, rnd))
                # the first update of round (version) 2 or later: FedBuff's devices may train
                # on versions 1 and 3 only, and a job that never names 2 ran to its end unsignalled
                if self.moment == "mid_round" and isinstance(rnd, int) and rnd >= 2:
                    self._fire()
            elif msg.topic == t.global_model and msg.payload and not msg.retain:
                self.globals_seen += 1
                if self.moment == "round_opens" and self.globals_seen == 2:
                    self._fire()
            elif (
                msg.topic == t.metrics
                and self.moment == "round_closes"
                and json.loads(msg.payload)["round"] == 1
            ):
                self._fire()

    def _fire(self) -> None:
        if self.fired_at is None and self.target is not None:
            self.fired_at = time.monotonic()
            self.target.send_signal(self.sig)

    def wait_fired(self, timeout: float, *procs: subprocess.Popen) -> float:
        until = time.monotonic() + timeout
        while self.fired_at is None:
            for p in procs:
                assert p.poll() is None, f"{p.args[1]} exited before the signal: {p.poll()}"
            assert time.monotonic() < until, f"the moment {self.moment} never came"
            time.sleep(0.01)
        return self.fired_at

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def job_args(url: str, job: str) -> list[str]:
    """Six devices, rounds of about a second (modelled training), a privacy ledger."""
    return [
        "--broker", url, "--job", job, "--devices", "6", "--rounds", "30",
        "--clients-per-round", "6", "--deadline", "60", "--model", "logreg", "--epochs", "1",
        "--time-scale", "0.3", "--mechanism", "laplace", "--epsilon", "8",
    ]  # fmt: skip


def exited_within(proc: subprocess.Popen, fired_at: float, timeout: float = 60) -> float:
    proc.wait(timeout)
    return time.monotonic() - fired_at


def check_charged(out: Path, sniffed: set, sig: signal.Signals) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == sig.name
    assert summary["ended_early"] == f"stopped by {sig.name}"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    assert records[-1]["stopped"] == sig.name  # the open round was decided, not dropped
    assert records[-1]["status"] in ("closed", "skipped")
    charged = summary["after_last_round"]["device_updates"]
    assert charged == len(sniffed), (
        f"{len(sniffed)} updates published, {charged} charged: {sorted(sniffed)}"
    )
    # console, summary and the last metrics line carry the same total
    assert records[-1]["device_updates"] == charged
    assert records[-1]["epsilon"] == summary["privacy"]["epsilon"]
    return summary


def kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


@pytest.mark.parametrize("moment", MOMENTS)
def test_the_aggregator_stops_within_2s_with_every_release_charged(mosquitto, tmp_path, moment):
    job = f"sig-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "run"
    args = job_args(mosquitto.url, job)
    sniffer = Sniffer(mosquitto.url, Topics(job), moment)
    fleet, agg = start_fleet_and_aggregator(args, out)
    sniffer.target = agg
    try:
        fired_at = sniffer.wait_fired(180, agg, fleet)
        _, agg_err = agg.communicate(timeout=60)
        took = time.monotonic() - fired_at
        _, fleet_err = fleet.communicate(timeout=60)  # it leaves on the done marker
    finally:
        sniffer.close()
        kill(agg, fleet)
    print(f"aggregator, {moment}: exit {took:.2f} s after SIGTERM")
    assert agg.returncode == 0, agg_err
    assert fleet.returncode == 0, fleet_err
    assert "Traceback" not in agg_err
    assert took < STOP_BAR_S, f"{took:.2f} s"
    check_charged(out, sniffer.updates, signal.SIGTERM)


def _simulate_until_stopped(sniffer: Sniffer, argv: list[str]) -> tuple[int, str, str, float]:
    """Run `edge-fl simulate` (``argv``) until ``sniffer`` signals it: its exit code, stdout,
    stderr and the seconds from the signal to its exit."""
    sim = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    sniffer.target = sim
    try:
        fired_at = sniffer.wait_fired(180, sim)
        stdout, stderr = sim.communicate(timeout=60)
        took = time.monotonic() - fired_at
    finally:
        sniffer.close()
        kill(sim)
    return sim.returncode, stdout, stderr, took


@pytest.mark.parametrize("moment", MOMENTS)
def test_simulate_stops_within_2s_of_ctrl_c_with_every_release_charged(mosquitto, tmp_path, moment):
    job = f"sim-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "sim"
    sniffer = Sniffer(mosquitto.url, Topics(job), moment)
    sniffer.sig = signal.SIGINT
    argv = [EDGE_FL, "simulate", *job_args(mosquitto.url, job), "--no-progress", "--out", str(out)]
    returncode, stdout, stderr, took = _simulate_until_stopped(sniffer, argv)
    print(f"simulate, {moment}: exit {took:.2f} s after SIGINT")
    assert returncode == 0, stderr
    assert "Traceback" not in stderr
    assert took < STOP_BAR_S, f"{took:.2f} s"
    summary = check_charged(out, sniffer.updates, signal.SIGINT)
    # the fleet counts an update once its PUBACK came; one cancelled by the stop after it was
    # sent is on the broker (and charged) but not in that count
    assert summary["fleet_published"] <= len(sniffer.updates)
    assert "ended early: stopped by SIGINT" in stdout


@pytest.mark.parametrize("mode", ["fedbuff", "fedasync"])
def test_an_async_simulation_stops_within_2s_with_every_release_charged(mosquitto, tmp_path, mode):
    """The same stop mid-run of FedBuff (K = 3) and FedAsync: updates held for a window and
    those still on their way when the signal comes are charged too."""
    job = f"async-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "sim"
    sniffer = Sniffer(mosquitto.url, Topics(job), "mid_round")
    sniffer.sig = signal.SIGINT
    argv = [EDGE_FL, "simulate", *job_args(mosquitto.url, job), "--mode", mode,
            "--buffer-size", "3", "--no-progress", "--out", str(out)]  # fmt: skip
    returncode, _, stderr, took = _simulate_until_stopped(sniffer, argv)
    print(f"simulate {mode}: exit {took:.2f} s after SIGINT")
    assert returncode == 0, stderr
    assert took < STOP_BAR_S, f"{took:.2f} s"
    check_charged(out, sniffer.updates, signal.SIGINT)
