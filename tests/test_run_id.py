"""The run id (issue 24, item 9): every signed message names its aggregator run, and a device
refuses a message of another run; a recorded done marker of run 1 replayed in run 2 ends nothing.
Also the extreme-but-finite global model a device must not train from (item 10)."""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import numpy as np
import paho.mqtt.client as paho
import pytest

from edge_fl.config import load_config
from edge_fl.device.trust import MAX_GLOBAL_ABS, WRONG_RUN, Trust
from edge_fl.job import build_job
from edge_fl.protocol import (
    GlobalModel,
    GlobalWindow,
    Reject,
    Topics,
    decode_global,
    encode_global,
)
from edge_fl.protocol.codecs.quantised import n_blocks
from edge_fl.protocol.jobdoc import JobDocument, decode_job_document, encode_job_document
from edge_fl.protocol.signing import Signer
from edge_fl.server.service import AggregatorService
from edge_fl.transport.url import parse_broker_url

D = 8
TOPICS = Topics("job-r")
SIGNER = Signer.from_seed(bytes(range(32)))
RUN1, RUN2 = b"\x01" * 16, b"\x02" * 16


def msg(rnd: int, run: bytes | None, done: bool = False, params=None) -> bytes:
    g = GlobalModel(
        "job-r",
        rnd,
        rnd,
        np.zeros(D, np.float32) if params is None else params,
        nonce=None if done else bytes(16),
        done=done,
        run=run,
    )
    return encode_global(g, SIGNER)


def trust(run: bytes | None = None) -> Trust:
    t = Trust(verifier=SIGNER.verifier, window=GlobalWindow(max_round=20, max_version=20))
    t.bind_run(run)
    return t


def test_run_is_signed_and_round_trips():
    g = decode_global(msg(3, RUN2), verifier=SIGNER.verifier)
    assert g.run == RUN2
    assert decode_global(msg(3, None)).run is None  # optional: older aggregators send none
    doc = JobDocument("job-r", "abc", {"job": "job-r"}, [], run=RUN2)
    assert decode_job_document(encode_job_document(doc, SIGNER), SIGNER.verifier).run == RUN2


def test_a_device_bound_to_its_run_refuses_another_runs_done_marker_and_rounds():
    t = trust(RUN2)
    assert t.receive(msg(1, RUN2), TOPICS, D) is not None
    for payload in (msg(5, RUN1, done=True), msg(2, RUN1), msg(2, None, done=True)):
        assert t.receive(payload, TOPICS, D) is None  # live, signed, in the window: still no
    assert t.rejected[WRONG_RUN] == 3
    assert (t.window.last_round, t.window.last_version) == (1, 1)  # the window did not move
    assert type(t.receive(msg(2, RUN2, done=True), TOPICS, D)).__name__ == "JobEnded"


def test_a_device_without_a_document_learns_the_run_from_its_first_round():
    t = trust()
    assert t.receive(msg(5, RUN1, done=True), TOPICS, D, retained=True) is None  # not joined
    assert t.receive(msg(1, RUN2), TOPICS, D) is not None
    assert t.run == RUN2
    assert t.receive(msg(5, RUN1, done=True), TOPICS, D) is None
    assert t.rejected[WRONG_RUN] == 1
    # after a reconnect a learned run gives way to a new run of the job (its rounds restart)
    t.window.rejoin()
    assert t.receive(msg(1, RUN1), TOPICS, D) is not None and t.run == RUN1
    # one that never saw a run id (an older aggregator) behaves as before
    old = trust()
    assert old.receive(msg(1, None), TOPICS, D) is not None and old.run is None


def test_the_aggregator_core_names_its_run_everywhere_and_keeps_it_on_resume():
    cfg = load_config(None, {"job": "job-r", "data.devices": 4, "rounds.rounds": 2})
    job = build_job(cfg)
    core, other = job.aggregator_core(), job.aggregator_core()
    assert len(core.run_id) == 16 and core.run_id != other.run_id  # random per run
    assert core.global_message().run == core.global_message(done=True).run == core.run_id
    resumed = job.aggregator_core()
    resumed.restore(core.snapshot(), core.params)
    assert resumed.run_id == core.run_id


def test_a_round_reopened_from_the_journal_keeps_the_run_it_was_published_in():
    """A resume without a checkpoint (a crash in round 1) rebuilds the open round from its
    journaled ``open`` record, whose global message names the run: the run id comes back."""
    from edge_fl.protocol import Status, encode_status

    cfg = load_config(None, {"job": "job-r", "data.devices": 4, "rounds.rounds": 2})
    job = build_job(cfg)
    live = job.aggregator_core()
    for i in range(4):
        dev = f"d{i:05d}"
        live.on_status(dev, encode_status(Status(dev, True, 30)))
    opened = live.open_round(0.0)
    assert opened is not None
    spec = live.round_spec(encode_global(opened, SIGNER))
    resumed = job.aggregator_core()
    assert resumed.run_id != live.run_id
    resumed.reopen(spec)
    assert resumed.run_id == live.run_id == resumed.open_message().run


def test_an_extreme_but_finite_q8_global_is_refused_not_trained_on():
    cfg = load_config(None, {"job": "job-r", "data.devices": 4, "rounds.rounds": 3})
    job = build_job(cfg)
    agent = job.agent(0)
    d = agent.model.n_params
    body = msgpack.unpackb(
        encode_global(
            GlobalModel("job-r", 0, 1, np.zeros(d, np.float32), wire_dtype="q8", nonce=bytes(16))
        ),
        raw=False,
    )
    body["qp"] = np.array([3e38, 0.0] * n_blocks(d), "<f4").tobytes()  # every value 3e38
    payload = msgpack.packb(body, use_bin_type=True)
    g = decode_global(payload, expected_dim=d)
    assert np.isfinite(g.params).all() and float(abs(g.params).max()) > MAX_GLOBAL_ABS
    with np.errstate(all="ignore"):  # what training from it makes: not finite
        update = msgpack.unpackb(job.agent(0).on_global(g), raw=False)
    assert not np.isfinite(np.frombuffer(update["x"], "<f4")).all()
    t = Trust(window=GlobalWindow(max_round=3, max_version=3))
    assert t.receive(payload, Topics("job-r"), d) is None
    assert t.rejected[Reject.IMPLAUSIBLE] == 1 and t.window.last_round is None


@pytest.mark.broker
def test_run_ones_done_marker_replayed_in_run_two_changes_nothing(mosquitto):
    rounds = 3
    cfg = load_config(
        None,
        {
            "job": f"replay-{uuid.uuid4().hex[:6]}",
            "broker.url": mosquitto.url,
            "data.devices": 4,
            "rounds.rounds": rounds,
            "rounds.clients_per_round": 4,
            "rounds.min_updates": 4,
            "rounds.deadline_s": 20.0,
        },
    )
    job = build_job(cfg)
    signer = Signer.generate()  # one key for every run, as the README's production layout
    run1 = job.aggregator_core()
    run1.round_number = run1.version = rounds  # run 1 finished: its marker names the last round
    replay = encode_global(run1.global_message(done=True), signer)  # what run 1 published last
    spec = parse_broker_url(mosquitto.url)
    records: list[dict] = []

    def publish_live(payload: bytes) -> None:
        host, port = mosquitto.url.removeprefix("mqtt://").split(":")
        c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"rp-{uuid.uuid4().hex[:6]}")
        c.connect(host, int(port))
        c.loop_start()
        c.publish(job.topics.global_model, payload, qos=1).wait_for_publish(10)
        c.loop_stop()
        c.disconnect()

    async def scenario():
        fleet = job.fleet_runtime(spec, trust=job.trust(signer.verifier))
        run = asyncio.create_task(fleet.run())
        core = job.aggregator_core()
        service = AggregatorService(
            core, spec, job.topics, wait_for_devices_s=20, expected_devices=4,
            on_record=records.append, signer=signer,
        )  # fmt: skip
        serve = asyncio.create_task(service.run())
        while not records:  # run 2's first round closed: replay run 1's end, live
            assert not serve.done() and not run.done()
            await asyncio.sleep(0.02)
        await asyncio.to_thread(publish_live, replay)
        await asyncio.wait_for(serve, 120)
        await asyncio.wait_for(run, 30)
        return fleet

    fleet = asyncio.run(scenario())
    assert [r["status"] for r in records] == ["closed"] * rounds, records
    assert [r["received"] for r in records] == [4] * rounds
    assert fleet.trust.rejected[WRONG_RUN] == 1
    assert fleet.published == 4 * rounds
