"""Dispatch messages end to end over a real Mosquitto (docs/protocol.md, "Dispatch message").

FedBuff with a concurrency limit, sniffed on the broker: each version's model goes out once on
``global`` and every later selection on ``dispatch``, bound to that version's nonce; the bytes the
aggregator sends down stay within 1.5x of versions x devices online x model size (they were ~11x
in the README's example when every selection re-published the model) and no update is a
duplicate. The minimal device (devices/minimal/device.py), written from the document alone, is
asked by dispatch messages of the real ``edge-fl aggregator`` and answers them."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import msgpack
import pytest
from mqtt_tap import UpdateTap
from test_async_e2e import PROFILE, records
from test_minimal_device import (
    EDGE_FL,
    config_digest,
    digits_share,
    minimal_device,
    stop,
)

from edge_fl.config import load_config
from edge_fl.protocol import GlobalModel, Topics, decode_global, encode_global
from edge_fl.protocol.dispatch import decode_dispatch
from edge_fl.protocol.messages import Dispatch
from edge_fl.simulation import simulate

pytestmark = pytest.mark.broker


def sniffed(tap: UpdateTap, topics: Topics) -> tuple[list[GlobalModel], list[Dispatch], list]:
    """The models, the dispatches and the updates' (device, round) the broker forwarded."""
    models, dispatches, answers = [], [], []
    for topic, payload in tap.payloads:
        if not payload:
            continue  # a cleared retained message
        if topic == topics.global_model:
            models.append(decode_global(payload))
        elif topic == topics.dispatch:
            dispatches.append(decode_dispatch(payload))
        elif (device := topics.device_of(topic, "up")) is not None:
            answers.append((device, int(msgpack.unpackb(payload)["r"])))
    return models, dispatches, answers


def test_fedbuff_sends_each_model_once_and_selections_as_dispatches(mosquitto, tmp_path):
    profile = tmp_path / "two-speed.yaml"
    profile.write_text(PROFILE)
    job = f"td-{uuid.uuid4().hex[:6]}"
    cfg = load_config(
        None,
        {
            "job": job,
            "seed": 5,
            "broker.url": mosquitto.url,
            "data.dataset": "digits",
            "data.devices": 12,
            "model.name": "logreg",
            "training.epochs": 2,
            "rounds.mode": "fedbuff",
            "rounds.rounds": 6,
            "rounds.buffer_size": 2,
            "rounds.concurrency": 4,
            "rounds.max_staleness": 50,
            "rounds.deadline_s": 10.0,
            "rounds.wait_for_devices_s": 20.0,
            "fleet.profile": str(profile),
            "fleet.time_scale": 0.5,
        },
    )
    topics = Topics(job)
    with UpdateTap(mosquitto.url, topics, identifier=f"tap-{job}", topic=f"{topics.base}/#") as tap:
        summary = simulate(cfg, tmp_path / "run")
        assert tap.wait_for_messages(1, 5)
    recs = records(tmp_path / "run")
    models, dispatches, answers = sniffed(tap, topics)
    rounds = [m for m in models if not m.done]
    assert summary["rounds_closed"] == len(recs) == 6
    assert all(r["status"] == "closed" for r in recs)  # no window reopened on its version
    # each version's model went out once; every later selection went out as a dispatch
    assert [m.version for m in rounds] == list(range(len(recs)))
    assert dispatches, "no dispatch message was published"
    nonce = {m.version: m.nonce for m in rounds}
    for d in dispatches:
        assert d.job == job and d.nonce == nonce[d.version]
        named_by_model = set(rounds[d.version].selected or ())
        assert not named_by_model & set(d.selected)  # a device is asked once per version
        for device in d.selected:  # and those it asked trained on that version
            assert (device, d.version) in answers, (device, d.version)
    # bytes down: within 1.5x of versions x devices online x model size
    model_bytes = max(len(p) for t, p in tap.payloads if t == topics.global_model and p)
    ideal = sum(r["online"] for r in recs) * model_bytes
    down = sum(r["bytes_down"] for r in recs)
    print(f"bytes down {down} / ideal {ideal} = {down / ideal:.3f}; {len(dispatches)} dispatches")
    assert down <= 1.5 * ideal
    # the aggregator counts what went down: every model and dispatch, once per device online
    online = min(r["online"] for r in recs)
    sent = [len(p) for t, p in tap.payloads if t in (topics.global_model, topics.dispatch) and p]
    assert down >= online * (sum(sent) - model_bytes)  # all but the done marker (not a round's)
    accepted = sum(r["received"] for r in recs)
    duplicates = sum(r["rejected_by_reason"].get("duplicate", 0) for r in recs)
    assert duplicates <= 0.01 * accepted
    assert recs[-1]["timeouts"] == 0  # every device a dispatch asked answered in time


#: the four minimal devices' rows of digits: 60 to 480, so their training times differ
SHARES = [slice(0, 60), slice(60, 180), slice(180, 420), slice(420, 900)]


def test_the_minimal_device_answers_the_real_aggregators_dispatches(mosquitto, tmp_path):
    """Four minimal devices, FedBuff K = 2, C = 2: whenever an update arrives the aggregator asks
    the next device with a dispatch message; the minimal device trains on the model it holds
    for that version and nonce, and every update is admitted."""
    job, out = f"mini-d-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    topics = Topics(job)
    cmd = [EDGE_FL, "aggregator", "--broker", mosquitto.url, "--job", job, "--devices", "4"]
    # 8 windows, devices of different sizes: some window must take its updates apart (one,
    # a dispatch, the next); with 4 of equal size, under two CPU hogs every window's pair
    # once arrived together, closing it before any replacement was asked (1 run of 5)
    cmd += ["--rounds", "8", "--clients-per-round", "2", "--deadline", "30", "--mode", "fedbuff"]
    cmd += ["--buffer-size", "2", "--concurrency", "2", "--max-staleness", "10"]
    with UpdateTap(mosquitto.url, topics, identifier=f"tap-{job}", topic=f"{topics.base}/#") as tap:
        agg = subprocess.Popen(
            [*cmd, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        procs = [agg]
        try:
            digest = config_digest(out / "run.json", agg)
            minis = {
                f"m{i}": minimal_device(
                    mosquitto.url,
                    job,
                    f"m{i}",
                    digits_share(tmp_path / f"m{i}.npz", SHARES[i]),
                    "--digest",
                    digest,
                )
                for i in range(4)
            }
            procs += list(minis.values())
            _, stderr = agg.communicate(timeout=180)
            logs = {name: p.communicate(timeout=30)[1] for name, p in minis.items()}
        finally:
            stop(*procs)
    assert agg.returncode == 0, stderr
    recs = [json.loads(line) for line in Path(out / "metrics.jsonl").read_text().splitlines()]
    print([(r["round"], r["received"], r["dispatched"], r["timeouts"]) for r in recs])
    assert [r["status"] for r in recs] == ["closed"] * 8
    assert all(r["rejected"] == 0 for r in recs), recs
    _, dispatches, answers = sniffed(tap, topics)
    assert dispatches, "the aggregator published no dispatch message"
    asked = {(device, d.version) for d in dispatches for device in d.selected}
    answered_by_dispatch = asked & set(answers)
    assert answered_by_dispatch, (asked, answers, logs)
    assert len(answers) == len(set(answers))  # no update was sent twice
    for name, p in minis.items():
        assert p.returncode == 0, logs[name]


def test_a_device_joining_late_is_asked_by_the_retained_dispatch_and_resends_only_on_the_model(
    mosquitto,
):
    """`edge-fl device`'s runtime on its own session. Before it connects, version 3 is retained
    selecting another device and a retained dispatch names it: it subscribes to ``dispatch`` once
    it sees the asynchronous model, trains on version 3 and answers with its nonce. The model
    re-broadcast (the aggregator lost the broker) makes it re-send the same bytes; a dispatch
    naming it again does not; a live done marker ends it."""
    import asyncio

    import numpy as np
    from test_device_policy_dispatch import real_agent

    from edge_fl.device.runtime import run_device
    from edge_fl.protocol.dispatch import encode_dispatch
    from edge_fl.protocol.signing import Signer
    from edge_fl.transport.url import parse_broker_url

    job = f"late-{uuid.uuid4().hex[:6]}"
    topics, key, nonce = Topics(job), Signer.generate(), bytes(range(16))
    model = GlobalModel(
        job, 3, 3, np.zeros(15, np.float32), mode="fedbuff", selected=("other",), nonce=nonce,
        mechanism_params={"m": "none", "lr": 0.1, "ep": 1, "bs": 4},
    )  # fmt: skip
    dispatch = encode_dispatch(Dispatch(job, 3, nonce, ("d5",)), key)
    agent = real_agent("d5")
    spec = parse_broker_url(mosquitto.url)
    from edge_fl.device.trust import Trust

    async def scenario(tap: UpdateTap) -> int:
        import aiomqtt

        async with aiomqtt.Client(**spec.aiomqtt_kwargs(), identifier=f"agg-{job}") as agg:
            await agg.publish(topics.global_model, encode_global(model, key), qos=1, retain=True)
            await agg.publish(topics.dispatch, dispatch, qos=1, retain=True)
            device = asyncio.create_task(
                run_device(agent, spec, topics, trust=Trust(verifier=key.verifier))
            )
            assert await asyncio.to_thread(tap.wait_for_messages, 1, 30)
            await agg.publish(topics.dispatch, dispatch, qos=1, retain=True)  # again: no re-send
            await agg.publish(topics.global_model, encode_global(model, key), qos=1, retain=True)
            assert await asyncio.to_thread(tap.wait_for_messages, 2, 30)
            done = GlobalModel(job, 3, 3, model.params, mode="fedbuff", done=True)
            await agg.publish(topics.global_model, encode_global(done, key), qos=1, retain=True)
            sent = await asyncio.wait_for(device, 30)
            for topic in (topics.global_model, topics.dispatch):
                await agg.publish(topic, b"", qos=1, retain=True)
            return sent

    with UpdateTap(mosquitto.url, topics, identifier=f"tap-{job}") as tap:
        assert asyncio.run(scenario(tap)) == 1
    [(_, first), (_, again)] = tap.payloads  # the update, and its re-send: nothing else
    assert first == again
    update = msgpack.unpackb(first)
    assert (update["r"], update["bv"], update["nc"]) == (3, 3, nonce)
