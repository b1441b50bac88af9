"""Issue 24, item 1: forged sharded-ingest messages, rerun as the red team ran them.

The README's sharded example uses an anonymous broker, so anyone can publish on
``edgefl/<job>/ingest/#``. The red team's client reads each round's ``open`` on ``ingest/ctl``
(retained, readable by anyone there) and forges, in the project's own message format:

- ``partial``: a ``progress`` claiming every selected device for ``w0`` plus a ``partial`` of
  -3x the model (old: accuracy 0.94 -> 0.18, every record "closed", no log line);
- ``impersonation``: the same on ``ingest/*/w1`` with ``w: "w0"``;
- ``rel``: one ``progress`` with 500 release entries (old: epsilon 8 -> 143);
- ``offline``: a retained ``ingest/worker/w0 = offline`` (old: half of every round dropped);
- ``end``: a live ``end`` on ``ingest/ctl`` (old: a round lost).

Each must fail for the attacker: the model (``model.onnx``, byte for byte) and the ledger (each
record's ``device_updates`` and epsilon) equal an undisturbed run's, every forgery is counted in
the records (``ingest_refused``) or, sent to the workers, refused by each, and each refusal is
one log line. The in-process tests below check the same refusals without a broker.

Measured on the README's default job with ``--rounds 8`` (EDGE_FL_ATTACK_ARGS="--rounds 8"),
before (main at 6a5ffdb) -> after: partial 0.100 -> 0.916 and impersonation 0.100 -> 0.916
(undisturbed 0.916); offline: the job did not finish 8 rounds in 180 s -> 0.916; end: 0.908 ->
0.916; rel (``--mechanism gaussian --epsilon 8``): epsilon 15.37 -> 8.00 (undisturbed 8.00).
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path

import msgpack
import numpy as np
import pytest
from processes import EDGE_FL, run_job

from edge_fl.mechanisms.exact_sum import ExactSum
from edge_fl.protocol import decode_global

ATTACKS = ("partial", "impersonation", "rel", "offline", "end")


def job_args(broker_url: str, job: str) -> list[str]:
    """A small job; EDGE_FL_ATTACK_ARGS replaces its options (e.g. "" for the README's default
    job, as the red team ran it, or "--mechanism gaussian --epsilon 8")."""
    custom = os.environ.get("EDGE_FL_ATTACK_ARGS")
    if custom is not None:
        return ["--broker", broker_url, "--job", job, "--reproducible", *custom.split()]
    args = ["--broker", broker_url, "--job", job, "--devices", "24", "--rounds", "4"]
    args += ["--clients-per-round", "10", "--model", "logreg", "--reproducible"]
    args += ["--mechanism", "gaussian", "--epsilon", "40", "--deadline", "30"]
    return args


def epsilon(summary: dict) -> float | None:
    return (summary.get("privacy") or {}).get("epsilon")


def packed(**fields) -> bytes:
    return msgpack.packb({"v": 1, **fields}, use_bin_type=True)


def forge(attack: str, job: str, opened: dict, sent_rel: bool) -> list[tuple[str, bytes, bool]]:
    """(topic, payload, retain) the red team publishes when round ``opened['r']`` opens."""
    base = f"edgefl/{job}/ingest"
    rnd = opened["r"]
    g = decode_global(opened["g"])
    selected = list(g.selected or ())
    if attack in ("partial", "impersonation"):
        total = ExactSum(len(g.params))
        total.add(-3.0 * g.params.astype(np.float64), 1.0)
        inner = {"s": total.to_bytes(), "w": 1, "c": len(selected)}
        partial = {"i": inner, "h": [] if opened.get("h") else None,
                   "n": [1e6] * len(selected), "k": [0, 0, 0]}  # fmt: skip
        on = "w1" if attack == "impersonation" else "w0"
        progress = packed(k="progress", w="w0", r=rnd, a=selected, f=[], z=True, rel=[], d=[])
        forged = packed(k="partial", w="w0", r=rnd, s=partial, a=selected, t={})
        return [(f"{base}/progress/{on}", progress, False), (f"{base}/partial/{on}", forged, False)]
    if attack == "rel":
        if sent_rel:
            return []
        rel = [[f"d{i:05d}", r, 1000] for r in range(1, 21) for i in range(25)]
        return [(f"{base}/progress/w0", packed(k="progress", w="w0", r=rnd, a=[], f=[], z=False,
                                               rel=rel, d=[]), False)]  # fmt: skip
    if attack == "offline":
        return [(f"{base}/worker/w0", b"offline", True)]
    if attack == "end":
        return [(f"{base}/ctl", packed(k="end", r=0), False)] if rnd == 2 else []
    raise AssertionError(attack)


class RedTeam:
    """An anonymous MQTT client on the job's broker that forges at every round's open."""

    def __init__(self, host: str, port: int, job: str, attack: str) -> None:
        import paho.mqtt.client as mqtt

        self.job, self.attack = job, attack
        self.sent: list[str] = []  # topics of the forged messages
        self.rounds: set[int] = set()
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"red-{job}")
        self.client.on_message = self._on_message
        self.client.on_connect = lambda c, *_: c.subscribe(f"edgefl/{job}/ingest/ctl", qos=1)
        self.client.connect(host, port)
        self.client.loop_start()

    def _on_message(self, client, _userdata, message) -> None:
        try:
            opened = msgpack.unpackb(message.payload, raw=False)
        except Exception:
            return
        if not isinstance(opened, dict) or opened.get("k") != "open":
            return
        with self.lock:
            if opened["r"] in self.rounds:
                return
            self.rounds.add(opened["r"])
            forged = forge(self.attack, self.job, opened, sent_rel=len(self.rounds) > 1)
            for topic, payload, retain in forged:
                client.publish(topic, payload, qos=1, retain=retain)
                self.sent.append(topic)

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def run(broker, out: Path, attack: str | None, job: str) -> dict:
    red = RedTeam("127.0.0.1", broker.port, job, attack) if attack else None
    try:
        done = run_job(
            [
                EDGE_FL,
                "aggregator",
                *job_args(broker.url, job),
                "--workers",
                "2",
                "--out",
                str(out),
            ],
            [[EDGE_FL, "fleet", *job_args(broker.url, job)]],
            timeout=180,
            device_timeout=120,
        )
    finally:
        if red is not None:
            red.stop()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "done": done,
        "records": records,
        "summary": summary,
        "model": (out / "model.onnx").read_bytes(),
        "sent": list(red.sent) if red else [],
    }


@pytest.fixture(scope="module")
def honest(mosquitto, tmp_path_factory):
    out = tmp_path_factory.mktemp("honest")
    result = run(mosquitto, out / "run", None, f"atk-{uuid.uuid4().hex[:6]}")
    assert result["done"].returncode == 0, result["done"].stderr[-3000:]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("attack", ATTACKS)
def test_forged_ingest_messages_change_neither_model_nor_ledger(
    attack, honest, mosquitto, tmp_path
):
    got = run(mosquitto, tmp_path / "run", attack, f"atk-{uuid.uuid4().hex[:6]}")
    done, records = got["done"], got["records"]
    acc = [r["accuracy"] for r in records]
    eps = epsilon(got["summary"])
    print(f"\nattack {attack}: final accuracy {acc[-1]} (undisturbed {honest['records'][-1]['accuracy']}),"
          f" min {min((a for a in acc if a is not None), default=None)}, epsilon {eps} (undisturbed {epsilon(honest['summary'])}),"
          f" forged {len(got['sent'])}, refused in records "
          f"{sum(r.get('ingest_refused', 0) for r in records)}")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert got["sent"], "the red team never saw a round open"
    assert got["model"] == honest["model"]
    assert eps == epsilon(honest["summary"])
    for mine, theirs in zip(records, honest["records"], strict=True):
        for key in ("status", "received", "device_updates", "epsilon", "accuracy"):
            assert mine[key] == theirs[key], (key, mine, theirs)
        assert mine["workers_missing"] == [], mine
    stderr = done.stderr
    if attack == "end":  # control messages go to the workers: each refuses it, one line each
        assert stderr.count("control message refused: not sealed") == 2 * len(got["sent"])
        assert stderr.count("the aggregator ended the job") == 2  # the genuine end, once each
    else:  # worker messages go to the coordinator: counted in the round's record
        assert sum(r.get("ingest_refused", 0) for r in records) == len(got["sent"]), records
        lines = [line for line in stderr.splitlines() if " on the topic of worker " in line]
        assert len(lines) == len(got["sent"]) and all("refused" in x for x in lines), lines


# ------------------------------------------------------------------ in process, no broker


def _coordinator_and_workers():
    from edge_fl.config import load_config
    from edge_fl.job import build_job
    from edge_fl.protocol import Status, encode_global, encode_status
    from edge_fl.server.sharding import Coordinator, IngestWorker

    base = {"job": f"u-{uuid.uuid4().hex[:6]}", "data.devices": 8, "model.name": "logreg",
            "rounds.rounds": 3, "rounds.clients_per_round": 8, "reproducible": True}  # fmt: skip
    job = build_job(load_config(None, base))
    coord = job.aggregator_core()
    workers = {w: IngestWorker(w, job.aggregator_core()) for w in ("w0", "w1")}
    for core in (coord, *(w.core for w in workers.values())):
        for a in job.agents():
            core.on_status(a.device_id, encode_status(Status(a.device_id, True, a.n_samples)))
    coordinator = Coordinator(coord, list(workers))
    for name, w in workers.items():
        coordinator.on_message("worker", name, w.connection_liveness()[0])
    payload = encode_global(coord.open_round(0.0))
    ctl = coordinator.open_message(payload)
    for w in workers.values():
        w.on_control(ctl)
    return coord, coordinator, workers, ctl


def test_unsealed_or_misrouted_worker_messages_change_nothing_and_are_counted(caplog):
    coord, coordinator, workers, ctl = _coordinator_and_workers()
    opened = msgpack.unpackb(ctl, raw=False)
    job = coord.settings.job
    before_releases, before_accepted = list(coord.releases), set(coord.current.accepted)
    sent = 0
    for attack in ("partial", "impersonation", "rel", "offline"):
        for topic, payload, _ in forge(attack, job, opened, sent_rel=False):
            kind, worker = topic.split("/")[-2:]
            coordinator.on_message(kind, worker, payload)
            sent += 1
    # a genuine worker's message on another worker's topic: its key is not that topic's
    real = workers["w0"].progress(final=True)
    coordinator.on_message("progress", "w1", real)
    sent += 1
    assert coord.releases == before_releases and set(coord.current.accepted) == before_accepted
    assert coordinator.online == {"w0", "w1"} and coordinator.round.partials == {}
    assert sum(coordinator.refused.values()) == sent
    lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == sent


def test_a_replayed_liveness_or_a_forged_or_replayed_control_message_is_refused():
    from edge_fl.server.sharding import ShardingError

    _coord, coordinator, workers, ctl = _coordinator_and_workers()
    online, offline = workers["w0"].connection_liveness()
    coordinator.on_message("worker", "w0", online)
    coordinator.on_message("worker", "w0", offline)  # the will of that connection: taken
    assert "w0" not in coordinator.online
    fresh, _ = workers["w0"].connection_liveness()
    coordinator.on_message("worker", "w0", fresh)
    coordinator.on_message("worker", "w0", offline)  # replayed: older than the last one taken
    assert "w0" in coordinator.online and coordinator.refused["worker"] == 1
    w1 = workers["w1"]
    older, newer = coordinator.freeze_message(), coordinator.freeze_message()
    w1.on_control(newer)
    assert w1.on_control(ctl) == []  # the round's open, re-sent on a reconnect: passes
    with pytest.raises(ShardingError, match="a replay"):
        w1.on_control(older)
    with pytest.raises(ShardingError, match="not sealed"):
        w1.verify_control(packed(k="end", r=0))
    # another worker's key cannot speak for the coordinator: w0's MAC is not w1's
    from edge_fl.server.sharding import seal

    forged = seal({"w1": workers["w0"].key}, w1.job, "end", r=0, q=2**62)
    with pytest.raises(ShardingError, match="does not verify"):
        w1.verify_control(forged)


def test_partials_beyond_the_bounds_their_updates_passed_are_refused():
    from edge_fl.server.sharding import check_partial

    coord, *_ = _coordinator_and_workers()
    d = len(coord.params)
    devices = sorted(coord.current.selected)[:2]
    honest = ExactSum(d)
    honest.add(np.full(d, 0.01), 2.0)
    good = {"s": honest.to_bytes(), "w": 2, "c": 2}
    check_partial(coord, good, devices)  # passes
    huge = ExactSum(d)
    huge.add(np.full(d, 3e4), 2.0)  # beyond 2 x the plausibility bound 1e4 per value
    with pytest.raises(ValueError, match="exceeds"):
        check_partial(coord, {"s": huge.to_bytes(), "w": 2, "c": 2}, devices)
    with pytest.raises(ValueError, match="updates for"):
        check_partial(coord, {"s": honest.to_bytes(), "w": 2, "c": 9}, devices)
    declared = sum(coord.devices[x].n_samples for x in devices)
    with pytest.raises(ValueError, match="samples its devices declared"):
        check_partial(coord, {"s": honest.to_bytes(), "w": declared + 1, "c": 2}, devices)
