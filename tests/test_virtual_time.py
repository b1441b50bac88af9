"""Virtual time end to end over a real Mosquitto: the same async job gives the same metrics
sequence twice, the second time beside a CPU-bound process; a stop ends it cleanly; resume is
refused with a reason."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import TWO_SPEED_PROFILE, records, run_quiet_then_loaded

from edge_fl.clocksync import first_difference
from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.simulation import RunDirError, open_run, refuse_resume, run_simulation

pytestmark = pytest.mark.broker

#: the fields of a record that measure the machine, not the simulation
WALL_FIELDS = ("wall_time_s", "elapsed_s")


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "two-speed.yaml"
    path.write_text(TWO_SPEED_PROFILE)
    return path


def config(profile_path, **overrides):
    base = {
        "job": f"vt-{uuid.uuid4().hex[:6]}",
        "seed": 5,
        "reproducible": True,
        "data.dataset": "digits",
        "data.devices": 12,
        "data.partition": "dirichlet",
        "model.name": "logreg",
        "training.epochs": 2,
        "rounds.mode": "fedbuff",
        "rounds.buffer_size": 3,
        "rounds.concurrency": 5,
        "rounds.dispatch_timeout_s": 3.0,
        "rounds.rounds": 8,
        "rounds.deadline_s": 30.0,  # simulated seconds
        "rounds.wait_for_devices_s": 30.0,
        "fleet.profile": str(profile_path),
        "fleet.clock": "virtual",
        "fleet.dropout": 0.2,
    }
    return load_config(None, {**base, **overrides})


def test_the_same_job_gives_the_same_records_with_and_without_a_cpu_hog(profile_path, tmp_path):
    cfg = config(profile_path)
    first, second, a, b = run_quiet_then_loaded(cfg, tmp_path)
    assert len(a) == 8 and first.summary["rounds_closed"] == 8
    assert first_difference(a, b, WALL_FIELDS) is None
    assert (first.params == second.params).all()
    vt = {k: v for k, v in first.summary["virtual_time"].items() if k != "train_wall_s"}
    assert vt["grants"] > 8
    assert vt == {k: v for k, v in second.summary["virtual_time"].items() if k != "train_wall_s"}
    # simulated time only from the profile: slow devices need >1 simulated s for a window
    sim = [r["sim_time_s"] for r in a]
    assert sim == sorted(sim) and sim[-1] > 1.0


def test_a_round_period_paces_sync_rounds_in_simulated_time(profile_path, tmp_path):
    """Rounds open every period_s simulated seconds; the idle time between them costs no wall
    time (virtual) and no round opens early."""
    period = 3600.0
    cfg = config(
        profile_path,
        **{
            "rounds.mode": "sync",
            "rounds.rounds": 4,
            "rounds.clients_per_round": 4,
            "rounds.concurrency": None,
            "rounds.dispatch_timeout_s": None,
            "rounds.period_s": period,
            "fleet.dropout": 0.0,
        },
    )
    result = run_simulation(cfg, tmp_path)
    recs = records(tmp_path)
    assert result.summary["rounds_closed"] == 4 and [r["received"] for r in recs] == [4] * 4
    sim = [r["sim_time_s"] for r in recs]
    deadline = cfg.rounds.deadline_s
    # round k (from 1) opens at (k - 1) x period after the first opening and closes within its
    # deadline: every record sits in its own period, none earlier
    first_open = sim[0] - deadline
    for k, t in enumerate(sim):
        assert first_open + k * period <= t <= sim[0] + k * period + deadline, (k, sim)
    # a simulated 3 hours of idle pacing took a small part of it in wall time
    assert recs[-1]["elapsed_s"] < 0.01 * (sim[-1] - sim[0])


def test_measured_compute_scales_the_real_trainings_cpu_time_by_the_profile(profile_path, tmp_path):
    """``fleet.machine_samples_per_s``: a device's compute time is its training's thread CPU
    seconds x machine speed / its profile speed. A machine declared 10^8 times faster turns the
    same milliseconds of training into a far longer simulated round."""
    base = {
        "rounds.mode": "sync", "rounds.rounds": 2, "rounds.clients_per_round": 4,
        "rounds.concurrency": None, "rounds.dispatch_timeout_s": None,
        "rounds.deadline_s": 1e6, "fleet.dropout": 0.0,
    }  # fmt: skip
    sim = {}
    for speed in (1.0, 1e8):
        out = tmp_path / f"speed-{speed:g}"
        cfg = config(profile_path, **base, **{"fleet.machine_samples_per_s": speed})
        run_simulation(cfg, out)
        recs = records(out)
        assert [r["received"] for r in recs] == [4, 4]
        sim[speed] = recs[-1]["sim_time_s"]
    assert sim[1e8] > 100 * sim[1.0], sim


def test_a_stop_under_virtual_time_decides_the_round_and_ends(profile_path, tmp_path):
    cfg = config(profile_path, **{"rounds.rounds": 50})

    def stop_after_two(record: dict) -> None:
        if record["round"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    result = run_simulation(cfg, tmp_path, handle_signals=True, on_record=stop_after_two)
    assert result.summary["stopped"] == "SIGTERM"
    recs = records(tmp_path)
    assert 2 <= len(recs) < 50
    assert (tmp_path / "summary.json").exists() and (tmp_path / "model.onnx").exists()


def test_resume_is_refused_under_virtual_time(profile_path, tmp_path):
    job = build_job(config(profile_path))
    with pytest.raises(RunDirError, match="not supported under virtual time"):
        open_run(job, tmp_path, resume=True)


def test_a_refused_resume_writes_nothing(profile_path, tmp_path):
    job = build_job(config(profile_path))
    with pytest.raises(RunDirError, match="not supported under virtual time"):
        open_run(job, tmp_path / "new", resume=True)
    assert not (tmp_path / "new").exists()  # else the next fresh run is refused as unfinished


def test_resume_refuses_a_finished_run_and_continues_a_stopped_one(profile_path, tmp_path):
    job = build_job(config(profile_path, **{"fleet.clock": "wall", "rounds.rounds": 3}))
    (tmp_path / "summary.json").write_text(json.dumps({"rounds": 3, "stopped": None}))
    before = (tmp_path / "summary.json").read_bytes()
    with pytest.raises(RunDirError, match=r"holds a finished run of 3 rounds .*nothing to resume"):
        open_run(job, tmp_path, resume=True)
    assert (tmp_path / "summary.json").read_bytes() == before
    (tmp_path / "summary.json").write_text(json.dumps({"rounds": 3, "stopped": "SIGTERM"}))
    refuse_resume(job.cfg, tmp_path)  # a job stopped by a signal can be continued
    (tmp_path / "summary.json").write_text(json.dumps({"rounds": 2, "stopped": None}))
    refuse_resume(job.cfg, tmp_path)  # and a finished one given more rounds


@contextlib.contextmanager
def aggregator_and_fleet(args: list[str], out: Path):
    """`edge-fl aggregator --out OUT` and `edge-fl fleet` with ``args``, both with stderr piped;
    yields them once the aggregator's first record is written; both are killed at the end if
    still running."""
    edge_fl = str(Path(sys.executable).with_name("edge-fl"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    agg = subprocess.Popen(
        [edge_fl, "aggregator", *args, "--out", str(out)], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    fleet = subprocess.Popen([edge_fl, "fleet", *args], env=env, text=True, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert agg.poll() is None and time.monotonic() < deadline, "no round closed"
            time.sleep(0.1)
        yield agg, fleet
    finally:
        for proc in (agg, fleet):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_the_aggregator_ends_the_job_when_the_simulated_fleet_leaves(mosquitto, tmp_path):
    """`edge-fl aggregator` + `edge-fl fleet` under virtual time; the fleet is stopped mid-job:
    the aggregator ends the job itself (summary written, exit 0) instead of waiting forever
    (it once spun in a loop that never yielded, deaf to SIGTERM)."""
    out = tmp_path / "agg"
    args = [
        "--broker", mosquitto.url, "--job", f"vtgone-{uuid.uuid4().hex[:6]}", "--mode",
        "fedasync", "--concurrency", "4", "--rounds", "100000", "--devices", "8", "--model",
        "logreg", "--epochs", "1", "--profile", "phone-fleet", "--clock", "virtual",
    ]  # fmt: skip
    with aggregator_and_fleet(args, out) as (agg, fleet):
        fleet.send_signal(signal.SIGTERM)
        fleet.communicate(timeout=60)
        _, stderr = agg.communicate(timeout=120)
    assert agg.returncode == 0, stderr[-2000:]
    assert "the simulated fleet left" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ended_early"] == "the simulated fleet left (virtual time)"


def test_a_sync_round_granted_through_its_deciding_arrival_keeps_every_record(
    profile_path, tmp_path, monkeypatch
):
    """The fleet's lookahead (when its pending uploads can land, its next status) lets a sync
    round be granted through the arrival that can decide it instead of one grant per upload
    time: the same records, fewer grants."""
    from edge_fl.server.aggregator import AggregatorCore

    cfg = config(
        profile_path,
        **{
            "rounds.mode": "sync",
            "rounds.clients_per_round": 6,
            "rounds.over_selection": 1.5,
            "rounds.rounds": 6,
        },
    )
    ahead = run_simulation(cfg, tmp_path / "ahead")
    monkeypatch.setattr(AggregatorCore, "arrivals_to_decide", lambda self: None)
    each = run_simulation(cfg, tmp_path / "each")
    a, b = records(tmp_path / "ahead"), records(tmp_path / "each")
    assert len(a) == 6 and ahead.summary["rounds_closed"] == 6
    assert first_difference(a, b, WALL_FIELDS) is None
    assert (ahead.params == each.params).all()
    assert ahead.summary["virtual_time"]["grants"] < each.summary["virtual_time"]["grants"]


def test_the_last_records_simulated_time_is_when_its_window_closed(profile_path, tmp_path):
    """After the last window the aggregator waits (up to a deadline) for uploads still on
    their way, to charge them; with no concurrency limit some devices never answer (their
    training dropped out), so that wait ran to the 30 s deadline and the last record said the
    window closed 30 s after the one before: every async run's time to its final accuracy was
    30 s too long."""
    from edge_fl.simulation import simulate

    cfg = config(profile_path, **{"rounds.concurrency": 0, "rounds.rounds": 4})
    summary = simulate(cfg, tmp_path / "run")
    sim = [r["sim_time_s"] for r in records(tmp_path / "run")]
    assert len(sim) == 4 and sim == sorted(sim)
    gaps = [b - a for a, b in itertools.pairwise(sim)]
    assert max(gaps) < 10.0, sim  # a window of 3 from 12 devices, not the 30 s deadline
    # the drain still ran: the simulated run ends later than the last close
    assert summary["virtual_time"]["sim_end_s"] >= sim[-1]


@pytest.mark.broker
def test_aggregator_and_fleet_processes_both_stop_when_the_broker_goes_under_virtual_time(
    make_broker, tmp_path
):
    """`edge-fl aggregator` + `edge-fl fleet` under virtual time, the broker SIGKILLed after the
    first record: the aggregator stops its job (its clock partner's session is gone), and the
    fleet, whose clock session went too, stops as well with one line instead of reconnecting
    its devices to a job that no longer runs (it waited there for ever, 2026-11-28)."""
    broker = make_broker()
    out = tmp_path / "agg"
    args = [
        "--broker", broker.url, "--job", f"vtkill-{uuid.uuid4().hex[:6]}", "--rounds", "1000",
        "--devices", "20", "--model", "logreg", "--epochs", "1", "--profile", "phone-fleet",
        "--clock", "virtual",
    ]  # fmt: skip
    with aggregator_and_fleet(args, out) as (agg, fleet):
        broker.stop()  # SIGKILL: every session drops at once
        _, agg_err = agg.communicate(timeout=120)
        _, fleet_err = fleet.communicate(timeout=120)
    assert agg.returncode == 0, agg_err[-2000:]
    assert "losing the broker under virtual time" in agg_err
    assert fleet.returncode == 0, fleet_err[-2000:]
    last = fleet_err.strip().splitlines()[-1]
    assert "stopped by losing the broker under virtual time" in last, fleet_err[-2000:]
    assert "Traceback" not in fleet_err
