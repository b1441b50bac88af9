"""A device whose training raises (a model's ``grad`` that raises or returns the wrong shape):
counted per round and in the summary, logged once per distinct error, and the device says it
stopped (``i.stopped = "training_failed"``) so no round waits out its deadline for it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import numpy as np
import pytest
from test_fleet_runtime_policy import fleet, gm, updates

import edge_fl
from edge_fl.fleet.runtime import TRAINING_FAILED
from edge_fl.models.logreg import LogisticRegression
from edge_fl.models.training import LocalTraining, local_sgd
from edge_fl.protocol import decode_status


class Boom(LogisticRegression):
    """A model of one's own whose gradient raises (no fused ``sgd``: ``grad`` is called)."""

    name = "boom"
    sgd = None  # type: ignore[assignment]

    def grad(self, params, X, y):
        raise RuntimeError("boom")


def tracebacks(caplog, text: str) -> int:
    return sum(1 for r in caplog.records if r.exc_info and text in r.getMessage())


def test_a_failed_training_is_counted_logged_once_and_the_device_says_it_stopped(caplog):
    async def scenario():
        f = fleet(4)
        for d in ("d0", "d1", "d2"):
            f.agents[d].on_global = _raises(RuntimeError("boom"))  # type: ignore[method-assign]
        f.agents["d3"].on_global = _raises(ValueError("bad shape"))  # type: ignore[method-assign]
        for v in (1, 2):  # the second round asks nothing of devices that stopped
            f.hand_out(gm(v, None), 100)
            await asyncio.wait_for(f.settled(), 10)
        return f

    with caplog.at_level(logging.DEBUG, logger="edge_fl.fleet"):
        f = asyncio.run(scenario())
        assert f.failures_round() == 4 and f.failures_round() == 0
    assert f.device_failures == 4
    assert f.failure_errors == {"RuntimeError: boom": 3, "ValueError: bad shape": 1}
    assert updates(f) == {"d0": 0, "d1": 0, "d2": 0, "d3": 0}
    # one traceback per distinct error, not one per device
    assert tracebacks(caplog, "RuntimeError: boom") == 1
    assert tracebacks(caplog, "ValueError: bad shape") == 1
    assert sum(1 for r in caplog.records if r.exc_info) == 2
    assert any("2 more devices (RuntimeError: boom x2)" in r.getMessage() for r in caplog.records)
    for d, session in f.clients.items():
        status = decode_status(session.statuses[-1], topic_device=d)  # type: ignore[attr-defined]
        assert status.online and status.info == {"stopped": TRAINING_FAILED}


def _raises(exc: Exception):
    def on_global(msg):
        raise exc

    return on_global


def test_a_gradient_of_the_wrong_shape_is_an_error_not_a_broadcast():
    class Scalar(LogisticRegression):
        sgd = None  # type: ignore[assignment]

        def grad(self, params, X, y):
            return np.float32(0.5)  # would broadcast over every parameter

    model = Scalar(2, 3)
    X = np.zeros((4, 2), np.float32)
    y = np.zeros(4, np.int64)
    params = model.init_params(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"Scalar\.grad returned shape \(\), not the parameters'"):
        local_sgd(model, params, X, y, LocalTraining(1, 2, 0.1), np.random.default_rng(0))


@pytest.mark.broker
def test_a_model_whose_grad_raises_ends_the_run_promptly_with_the_failures_counted(
    mosquitto, caplog
):
    """5 devices, 3 rounds of 5 s: before, every round waited out its deadline and an extension
    (about 35 s), logged 15 tracebacks and counted nothing; now round 1 is decided on the
    devices' statuses and the job ends, naming why."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, size=300)
    x = np.array([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])[y] + rng.normal(size=(300, 2))
    data = edge_fl.FederatedDataset.from_arrays(x[:240], y[:240], x[240:], y[240:], devices=5)
    cfg = edge_fl.load_config(
        None,
        {
            "job": f"fail-{uuid.uuid4().hex[:8]}",
            "broker.url": mosquitto.url,
            "rounds.rounds": 3,
            "rounds.clients_per_round": 5,
            "rounds.deadline_s": 5,
            "model.evaluate_with": "native",
        },
    )
    job = edge_fl.build_job(cfg, dataset=data, model=Boom(2, 3))
    started = time.perf_counter()
    with caplog.at_level(logging.INFO):
        result = edge_fl.run_simulation(job)  # no ONNX export for Boom: no out_dir
    elapsed = time.perf_counter() - started
    assert elapsed < 5, elapsed  # under one deadline; the three rounds' sum is 15 s
    records = result.records
    assert [r["status"] for r in records] == ["skipped"]
    assert records[0]["device_failures"] == 5
    summary = result.summary
    assert summary["device_failures"] == 5
    assert summary["device_failure_errors"] == {"RuntimeError: boom": 5}
    assert "5 training_failed" in summary["ended_early"]
    assert tracebacks(caplog, "RuntimeError: boom") == 1
    assert sum(1 for r in caplog.records if r.exc_info) == 1


@pytest.mark.parametrize(
    ("ended_early", "code"), [("only 0 devices can still contribute", 1), (None, 0)]
)
def test_simulate_names_the_errors_and_exits_1_when_failures_ended_the_job(
    monkeypatch, ended_early, code
):
    """``edge-fl simulate``: one line naming each error; exit 1 when the job ended early with
    trainings failed (its model is not a result), 0 when it ran its rounds despite them."""
    from click.testing import CliRunner

    import edge_fl.simulation
    from edge_fl.cli import main

    summary = {
        "rounds": 1,
        "rounds_closed": 0,
        "final_accuracy": 0.1,
        "total_bytes_up": 0,
        "total_bytes_down": 0,
        "timings": {"total_s": 1.0},
        "ended_early": ended_early,
        "device_failures": 5,
        "device_failure_errors": {"RuntimeError: boom": 5},
    }
    monkeypatch.setattr(edge_fl.simulation, "simulate", lambda *a, **k: summary)
    done = CliRunner().invoke(main, ["simulate", "--no-progress", "--rounds", "1"])
    assert done.exit_code == code, done.output
    assert "training failed on 5 devices: RuntimeError: boom x5" in done.output


@pytest.mark.broker
def test_the_other_devices_carry_on_when_one_devices_training_raises(mosquitto):
    """One device of six fails: it stops, the round closes on the five others' updates without
    waiting for it, and the later rounds do not select it."""

    def factory(job, index):
        agent = job.default_agent(index)
        if index == 0:
            agent.model = Boom(agent.model.n_features, agent.model.n_classes)
        return agent

    cfg = edge_fl.load_config(
        None,
        {
            "job": f"fail-{uuid.uuid4().hex[:8]}",
            "broker.url": mosquitto.url,
            "model.name": "logreg",
            "data.devices": 6,
            "rounds.rounds": 3,
            "rounds.clients_per_round": 6,
            "rounds.deadline_s": 5,
        },
    )
    started = time.perf_counter()
    result = edge_fl.run_simulation(edge_fl.build_job(cfg, device_factory=factory))
    assert time.perf_counter() - started < 5
    records = result.records
    assert [r["status"] for r in records] == ["closed"] * 3
    assert [r["device_failures"] for r in records] == [1, 0, 0]
    assert [r["received"] for r in records] == [5, 5, 5]
    assert [r["selected"] for r in records] == [6, 5, 5]
    assert result.summary["device_failures"] == 1 and result.summary["ended_early"] is None
