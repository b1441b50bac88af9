"""A simulation's fleet over several processes (``fleet.processes``), with real processes over
the embedded Mosquitto: the same job gives the same model and the same MQTT byte totals as in
one process; Ctrl-C on the process group, a share killed with SIGKILL and the aggregator's
process killed with SIGKILL each end the way an operator needs (a clean stop, one error line
and a resumable run, no process left behind)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import records
from processes import stop_all, wait_for

from edge_fl import load_config
from edge_fl.fleet.counts import FleetTotals, RoundCounts, merge_totals, round_fields
from edge_fl.fleet.processes import usable_cores
from edge_fl.simulation import fleet_processes

EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
SMALL = ["--devices", "12", "--clients-per-round", "6", "--rounds", "4", "--no-progress"]
#: rounds of ~0.3 s (modelled training time), so a signal or a kill lands mid-job
SLOW = [
    "--devices", "6", "--clients-per-round", "6", "--rounds", "40", "--model", "logreg",
    "--epochs", "1", "--time-scale", "0.3", "--no-progress",
]  # fmt: skip


def simulate(out: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [EDGE_FL, "simulate", *args, "--out", str(out)]
    return subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=120)


def shares_of(proc: subprocess.Popen) -> list[psutil.Process]:
    """The fleet processes forked by ``edge-fl simulate`` (its Python children; the embedded
    broker is its mosquitto child)."""
    return [c for c in psutil.Process(proc.pid).children() if "mosquitto" not in c.name()]


# ------------------------------------------------------------------ pure parts


def test_round_fields_merge_shares_as_one_fleet():
    """Two shares' counts give the record one fleet with all their devices would give."""
    a = RoundCounts(ups=(10, 30), downs=(5, 5), up_ip=100, down_ip=50, failures=1, dropouts=2)
    b = RoundCounts(ups=(20,), downs=(7,), up_ip=40, down_ip=20, failures=0, dropouts=1)
    one = RoundCounts(ups=(10, 30, 20), downs=(5, 5, 7), up_ip=140, down_ip=70, failures=1,
                      dropouts=3)  # fmt: skip
    assert round_fields([a, b]) == round_fields([one])
    fields = round_fields([a, b])
    assert fields["wire_up"] == 60 and fields["wire_devices"] == 3
    assert (fields["wire_up_p50"], fields["wire_up_max"]) == (20, 30)
    assert (fields["dropouts"], fields["device_failures"]) == (3, 1)


def test_merge_totals_adds_every_share():
    a = FleetTotals(published=4, stopped_devices=1, device_failures=2,
                    failure_errors={"RuntimeError: boom": 2}, downlink_down=10)  # fmt: skip
    b = FleetTotals(published=3, publish_failures=1, device_failures=1,
                    failure_errors={"RuntimeError: boom": 1}, downlink_down=12)  # fmt: skip
    m = merge_totals([a, b])
    assert (m.published, m.publish_failures, m.stopped_devices) == (7, 1, 1)
    assert m.failure_errors == {"RuntimeError: boom": 3} and m.downlink_down == 22


def test_processes_resolve():
    """auto: one per usable core (at most 4) where forking is safe; 1 under virtual time, with
    secure aggregation, a fleet hook or a Job the caller built; an explicit count with a hook
    is refused."""
    cfg = load_config(None, {"data.devices": 50})
    in_fresh_process = fleet_processes(cfg)  # this test's worker may run other threads
    assert in_fresh_process in (1, min(usable_cores(), 4))
    virtual = load_config(None, {"fleet.profile": "phone-fleet"})
    assert fleet_processes(virtual) == 1
    assert fleet_processes(cfg, fleet_hook=lambda r, f: None) == 1
    assert fleet_processes(cfg, given_job=True) == 1  # the caller's objects may keep state
    # FedBuff, FedAsync and over-selected rounds depend on the order updates arrive in
    assert fleet_processes(load_config(None, {"data.devices": 50, "reproducible": True})) == 1
    two = load_config(None, {"fleet.processes": 2, "data.devices": 50})
    assert fleet_processes(two) == 2
    with pytest.raises(ValueError, match="fleet_hook"):
        fleet_processes(two, fleet_hook=lambda r, f: None)
    assert fleet_processes(load_config(None, {"fleet.processes": 8, "data.devices": 3})) == 3


@pytest.mark.parametrize("value", ["0", "abc", "true", "2.5", "65"])
def test_a_bad_process_count_is_one_line(tmp_path, value):
    done = simulate(tmp_path / "b", "--set", f"fleet.processes={value}", *SMALL)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "edge-fl: error: invalid configuration: fleet.processes: a number of processes from 1 "
        "to 64, or auto"
    ]


def test_virtual_time_with_processes_is_refused_in_one_line(tmp_path):
    done = simulate(tmp_path / "v", "--set", "fleet.processes=2", "--set", "fleet.clock=virtual",
                    *SMALL)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "lock-step" in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "v").exists()


# ------------------------------------------------------------------ real processes


@pytest.mark.broker
def test_two_processes_give_the_same_job_as_one(tmp_path):
    """--reproducible: the same global model to the bit, the same rounds, updates and bytes per
    round; the fleet's MQTT byte totals are the same too (a PUBACK may be counted a round later
    in one of them: each process takes its counts when the record is made)."""
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"p{n}"
        done = simulate(out, "--reproducible", "--set", f"fleet.processes={n}", *SMALL)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        runs[n] = (records(out), json.loads((out / "summary.json").read_text()), out)
    (r1, s1, o1), (r2, s2, o2) = runs[1], runs[2]
    assert (s1["fleet_processes"], s2["fleet_processes"]) == (1, 2)
    assert (o1 / "model.onnx").read_bytes() == (o2 / "model.onnx").read_bytes()
    same = ("round", "status", "selected", "received", "accuracy", "loss", "bytes_up",
            "bytes_down", "wire_devices")  # fmt: skip
    assert [{k: r.get(k) for k in same} for r in r1] == [{k: r.get(k) for k in same} for r in r2]
    for key in ("total_wire_up", "total_wire_down", "fleet_published", "total_bytes_up"):
        assert s1[key] == s2[key], key
    assert s2["fleet_published"] == 4 * 6
    # two shared downlink sessions (one per process), each receiving every global model
    assert s2["wire"]["shared_downlink"]["down"] > 1.9 * s1["wire"]["shared_downlink"]["down"]


@pytest.mark.broker
def test_ctrl_c_on_the_process_group_stops_cleanly(tmp_path):
    """Ctrl-C reaches every process of the group: the fleet processes ignore it, the aggregator's
    process decides the open round and tells the devices; exit 0, nothing left running."""
    out = tmp_path / "run"
    argv = [EDGE_FL, "simulate", *SLOW, "--set", "fleet.processes=2", "--out", str(out)]
    sim = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=ENV, start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: len(records(out)) >= 2, 60, "two rounds", (sim,))
        shares = shares_of(sim)
        assert len(shares) == 1
        os.killpg(sim.pid, signal.SIGINT)
        _stdout, stderr = sim.communicate(timeout=30)
        wait_for(lambda: not any(s.is_running() and s.status() != "zombie" for s in shares),
                 10, "the fleet process to exit")  # fmt: skip
    finally:
        stop_all(sim)
    assert sim.returncode == 0, stderr
    assert "Traceback" not in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "SIGINT" and summary["fleet_processes"] == 2
    assert 2 <= summary["rounds"] < 40


@pytest.mark.broker
def test_a_killed_fleet_process_stops_the_job_resumably(tmp_path):
    """SIGKILL to a fleet process: the job stops cleanly at once (not at the next deadlines),
    one error line naming it, exit 2; --resume finishes the job."""
    out = tmp_path / "run"
    argv = [EDGE_FL, "simulate", *SLOW, "--set", "fleet.processes=2", "--out", str(out)]
    sim = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=ENV)  # fmt: skip
    try:
        wait_for(lambda: len(records(out)) >= 2, 60, "two rounds", (sim,))
        (share,) = shares_of(sim)
        share.kill()
        _stdout, stderr = sim.communicate(timeout=60)
    finally:
        stop_all(sim)
    assert sim.returncode == 2, stderr
    assert "Traceback" not in stderr
    errors = [x for x in stderr.splitlines() if x.startswith("edge-fl: error")]
    assert len(errors) == 1 and "fleet process 1/2" in errors[0], stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "fleet process 1/2 failing"
    closed = summary["rounds"]
    assert closed < 40
    done = subprocess.run([EDGE_FL, "simulate", *SLOW, "--set", "fleet.processes=2", "--out",
                           str(out), "--resume"], capture_output=True, text=True, env=ENV,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    final = records(out)
    assert [r["round"] for r in final] == list(range(1, 41))
    assert all(r["status"] == "closed" for r in final[closed:])  # after the resume
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["rounds"] == 40 and resumed["fleet_processes"] == 2


@pytest.mark.broker
def test_a_killed_aggregator_process_leaves_no_fleet_process(tmp_path):
    """kill -9 of `edge-fl simulate`: its fleet process sees the pipe close and exits at once
    (the broker publishes its devices' last wills), in one line, rather than waiting for a done
    marker that cannot come or printing each session's lost connection (an outside review saw
    25 such lines over 10 s)."""
    out = tmp_path / "run"
    argv = [EDGE_FL, "simulate", *SLOW, "--set", "fleet.processes=2", "--out", str(out)]
    sim = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env=ENV)  # fmt: skip
    broker = None
    try:
        wait_for(lambda: len(records(out)) >= 1, 60, "round 1", (sim,))
        (share,) = shares_of(sim)
        broker = [c for c in psutil.Process(sim.pid).children() if "mosquitto" in c.name()]
        sim.kill()
        sim.wait(10)
        wait_for(lambda: not share.is_running() or share.status() == "zombie", 15,
                 "the fleet process to exit")  # fmt: skip
        err = sim.stderr.read() if sim.stderr else ""
        assert "failed to receive" not in err and "Traceback" not in err, err
        assert err.count("the aggregator's process closed its pipe") == 1, err
    finally:
        stop_all(sim)
        for b in broker or []:
            if b.is_running():
                b.kill()


@pytest.mark.broker
def test_a_share_that_raises_stops_the_job_naming_its_error(tmp_path):
    """A share whose fleet cannot be built (here: its first call raises) is reported with its
    error; the job stops at once rather than waiting for devices that never come, and a
    directory that never saw a round is left free for the corrected command."""
    from edge_fl import build_job, run_simulation
    from edge_fl.fleet.processes import FleetProcessError

    job = build_job(load_config(None, {"data.devices": 6, "rounds.rounds": 3,
                                       "rounds.clients_per_round": 6, "fleet.processes": 2}))  # fmt: skip
    build = job.fleet_runtime

    def fleet_runtime(spec, indices=None, **kw):
        if indices is not None and indices.start == 1:  # share 1, in its own process
            raise RuntimeError("boom in share 1")
        return build(spec, indices, **kw)

    job.fleet_runtime = fleet_runtime  # inherited by the forked process
    out = tmp_path / "run"
    with pytest.raises(
        FleetProcessError, match=r"fleet process 1/2: RuntimeError: boom in share 1"
    ):
        run_simulation(job, out, handle_signals=False)
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.broker
@pytest.mark.parametrize("n", [1, 2])
def test_ctrl_c_before_the_first_round_does_not_wait_out_the_fleets(tmp_path, n):
    """Ctrl-C while devices are still connecting: a fleet that missed the done marker is told
    to leave after a grace (1 s), not waited for 10 s (20 s with a forked share)."""
    out = tmp_path / "run"
    argv = [EDGE_FL, "simulate", *SLOW, "--set", f"fleet.processes={n}", "--out", str(out)]
    sim = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=ENV, start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: (out / "run.json").exists(), 60, "the run to open", (sim,))
        os.killpg(sim.pid, signal.SIGINT)
        _stdout, stderr = sim.communicate(timeout=8)  # 10-20 s before
    finally:
        stop_all(sim)
    assert sim.returncode == 0, stderr
    assert "Traceback" not in stderr


@pytest.mark.broker
def test_a_run_leaves_no_thread_behind(tmp_path):
    """A run with an output directory used to leave its journal's fsync thread, so every later
    run_simulation in the same script fell back to one process (auto forks only from a process
    running no other thread)."""
    import threading

    from edge_fl import run_simulation

    before = {t.ident for t in threading.enumerate()}
    cfg = load_config(None, {"data.devices": 4, "rounds.rounds": 2,
                             "rounds.clients_per_round": 4, "fleet.processes": 1})  # fmt: skip
    run_simulation(cfg, tmp_path / "run", handle_signals=False)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == []
