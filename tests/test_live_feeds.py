"""What a live dashboard reads from the broker, on a real Mosquitto: `edge-fl simulate` retains
the job document while it runs (rounds, budget) and clears it at the end; every global message's
``ts`` is the aggregator's Unix time; and `simulate` and `aggregator` write summaries that name
the job and its mechanism the same way."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
from mqtt_tap import UpdateTap
from processes import EDGE_FL, run_job

from edge_fl.config import load_config
from edge_fl.dashboard.sources import BrokerSource
from edge_fl.dashboard.state import DashboardState
from edge_fl.protocol import Topics
from edge_fl.protocol.codec import decode_global
from edge_fl.protocol.jobdoc import decode_job_document
from edge_fl.simulation import run_simulation_async

pytestmark = pytest.mark.broker

#: what every summary says of the job, whichever command ran it
JOB_FACTS = ("mechanism", "devices", "model", "n_params", "dataset")


def config(job: str, url: str) -> dict:
    return {
        "job": job,
        "broker.url": url,
        "data.devices": 6,
        "model.name": "logreg",
        "rounds.rounds": 2,
        "rounds.clients_per_round": 3,
        "rounds.deadline_s": 20,
        "privacy.mechanism": "gaussian",
        "privacy.epsilon": 8.0,
        "privacy.budget_epsilon": 20.0,
    }


def issued_between(payloads: list[tuple[str, bytes]], start: float, end: float) -> list[float]:
    """The ``ts`` of every round's global message (not the done marker, not a clearing)."""
    stamps = [decode_global(p) for _, p in payloads if p]
    rounds = [g.issued_at for g in stamps if not g.done]
    assert rounds, "no global message of a round was published"
    for ts in rounds:  # Unix seconds: within the run, not another clock's value (0 before)
        assert start - 1 <= ts <= end + 1, (ts, start, end)
    return rounds


def test_simulate_retains_the_job_document_and_stamps_unix_time(mosquitto, tmp_path: Path):
    job = f"feed-{uuid.uuid4().hex[:6]}"
    topics = Topics(job)
    cfg = load_config(None, config(job, mosquitto.url))

    async def scenario() -> tuple[DashboardState, float, float]:
        state = DashboardState()
        source = BrokerSource(state, mosquitto.url, job)
        done = asyncio.Event()
        source.on_change = lambda: done.set() if state.current.get("done") else None
        relay = asyncio.create_task(source.run())
        try:
            await asyncio.wait_for(source.connected.wait(), 20)
            start = time.time()
            await run_simulation_async(cfg, tmp_path / "run")
            end = time.time()
            await asyncio.wait_for(done.wait(), 20)  # the relay saw the done marker
        finally:
            relay.cancel()
        return state, start, end

    with (
        UpdateTap(mosquitto.url, topics, "tap-job", topics.job_document) as documents,
        UpdateTap(mosquitto.url, topics, "tap-global", topics.global_model) as globals_,
    ):
        state, start, end = asyncio.run(scenario())
        assert documents.wait_for_messages(2, timeout=20)  # the document, then its clearing
    # the job document while the job ran, for this run, cleared at its end
    payloads = [p for _, p in documents.payloads]
    assert payloads[-1] == b"" and payloads[0]
    doc = decode_job_document(payloads[0])
    run_id = json.loads((tmp_path / "run" / "run.json").read_text())["run"]
    assert doc.run is not None and doc.run.hex() == run_id
    assert doc.config["rounds"]["rounds"] == 2
    # the live page had the rounds and the budget line from it
    shown = state.view(operator=True)["job"]
    assert (shown["rounds"], shown["budget"], shown["mechanism"]) == (2, 20.0, "gaussian")
    issued_between(globals_.payloads, start, end)


def test_the_aggregator_stamps_unix_time_and_both_summaries_agree(mosquitto, tmp_path: Path):
    """`edge-fl aggregator` (with `edge-fl fleet`) and `edge-fl simulate` of the same job: the
    same job facts, the registered mechanism name in both summaries (top level and privacy
    block), in every record and in the global message."""
    job = f"agree-{uuid.uuid4().hex[:6]}"
    topics = Topics(job)
    common = [
        "--broker", mosquitto.url, "--job", job, "--devices", "6", "--rounds", "2",
        "--clients-per-round", "3", "--deadline", "20", "--model", "logreg",
        "--mechanism", "gaussian", "--epsilon", "8",
    ]  # fmt: skip
    out = tmp_path / "aggregator"
    with UpdateTap(mosquitto.url, topics, "tap-global", topics.global_model) as globals_:
        start = time.time()
        ran = run_job(
            [EDGE_FL, "aggregator", *common, "--out", str(out)],
            [[EDGE_FL, "fleet", *common]],
        )
        end = time.time()
    assert ran.returncode == 0, ran.stderr
    issued_between(globals_.payloads, start, end)
    published = [decode_global(p) for _, p in globals_.payloads if p]
    assert {(g.mechanism_params or {}).get("m") for g in published} == {"gaussian"}

    sim_cfg = load_config(None, config(f"agree-sim-{uuid.uuid4().hex[:6]}", mosquitto.url))
    asyncio.run(run_simulation_async(sim_cfg, tmp_path / "simulate"))
    summaries = {
        name: json.loads((tmp_path / name / "summary.json").read_text())
        for name in ("aggregator", "simulate")
    }
    agg, sim = summaries["aggregator"], summaries["simulate"]
    assert {k: agg[k] for k in JOB_FACTS} == {k: sim[k] for k in JOB_FACTS}
    assert agg["mechanism"] == "gaussian"
    assert agg["privacy"]["mechanisms"] == sim["privacy"]["mechanisms"] == ["gaussian"]
    assert set(agg["privacy"]) == set(sim["privacy"])
    for name in ("aggregator", "simulate"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        assert {json.loads(line)["mechanism"] for line in lines} == {"gaussian"}
