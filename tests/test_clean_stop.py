"""Clean stops and unwritable output, with real processes over a real Mosquitto.

SIGTERM (what systemd sends) and SIGINT stop `edge-fl aggregator` and `edge-fl simulate` cleanly:
the open round is decided, summary.json, model.onnx and the checkpoint are written, the done
marker reaches the devices (the fleet process exits by itself) and the exit status is 0, within
5 s. A full disk (a real, tiny tmpfs) or an unwritable --out gives one clear error line, no
traceback, and leaves checkpoint and metrics consistent: --resume finishes the job.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import records
from processes import stop_all, wait_for

pytestmark = pytest.mark.broker

EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def common(url: str, job: str, rounds: int = 30, devices: int = 4) -> list[str]:
    """A job whose rounds take ~1 s (modelled training time), so a signal lands mid-round."""
    return [
        "--broker", url, "--job", job, "--devices", str(devices), "--rounds", str(rounds),
        "--clients-per-round", str(devices), "--deadline", "60", "--model", "logreg",
        "--epochs", "1", "--time-scale", "0.3",
    ]  # fmt: skip


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("edge-fl: error")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_aggregator_stops_cleanly_on_a_signal(mosquitto, tmp_path, sig):
    job = f"stop-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "run"
    args = common(mosquitto.url, job)
    fleet = subprocess.Popen([EDGE_FL, "fleet", *args], stderr=subprocess.PIPE, text=True, env=ENV)
    agg = subprocess.Popen(
        [EDGE_FL, "aggregator", *args, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        wait_for(lambda: len(records(out)) >= 1, 60, "round 1", (agg, fleet))
        time.sleep(0.4)  # round 2 is open: devices are training
        t0 = time.monotonic()
        agg.send_signal(sig)
        stdout, stderr = agg.communicate(timeout=20)
        elapsed = time.monotonic() - t0
        _, fleet_err = fleet.communicate(timeout=20)  # it exits by itself: it saw the done marker
    finally:
        stop_all(agg, fleet)
    assert agg.returncode == 0, stderr
    assert elapsed < 5.0
    assert "Traceback" not in stderr
    assert f"stopped on {sig.name}" in stdout
    assert fleet.returncode == 0, fleet_err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == sig.name and summary["ended_early"] == f"stopped by {sig.name}"
    assert (out / "model.onnx").stat().st_size > 0
    recs = records(out)
    state = json.loads((out / "checkpoint.json").read_text())
    assert [r["round"] for r in recs] == list(range(1, len(recs) + 1))
    assert state["round_number"] == recs[-1]["round"] == summary["rounds"]
    assert recs[-1].get("stopped") == sig.name  # the open round was decided, not dropped
    assert recs[-1]["status"] in ("closed", "skipped")
    assert summary["rounds"] < 30
    # said as a stop, not as a finished job; and the same command again points at --resume
    assert stdout.splitlines()[-1].startswith(
        f"job stopped by {sig.name} at round {summary['rounds']} of 30: "
    ), stdout
    assert "--resume continues it" in stdout.splitlines()[-1]
    again = subprocess.run(
        [EDGE_FL, "aggregator", *args, "--out", str(out)], capture_output=True, text=True, env=ENV
    )
    assert again.returncode == 2
    assert f"holds a run stopped by {sig.name} at round {summary['rounds']} of 30" in again.stderr
    assert "--resume continues it, --overwrite replaces it" in again.stderr


def test_fleet_stops_cleanly_on_sigterm(mosquitto, tmp_path):
    """`edge-fl fleet` on SIGTERM mid-round: every session publishes its offline status and
    disconnects, the last line says it was stopped and how many updates went out, exit 0 (the
    default action killed it with 143 and no line); the aggregator lives on and stops cleanly."""
    import paho.mqtt.client as paho

    from edge_fl.protocol.codec import decode_status

    job = f"stop-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "run"
    args = common(mosquitto.url, job)
    fleet = subprocess.Popen([EDGE_FL, "fleet", *args], stderr=subprocess.PIPE, text=True, env=ENV)
    agg = subprocess.Popen([EDGE_FL, "aggregator", *args, "--out", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    try:
        wait_for(lambda: len(records(out)) >= 1, 60, "round 1", (agg, fleet))
        time.sleep(0.4)  # round 2 is open: devices are training
        t0 = time.monotonic()
        fleet.send_signal(signal.SIGTERM)
        _, fleet_err = fleet.communicate(timeout=20)
        elapsed = time.monotonic() - t0
        assert agg.poll() is None  # the aggregator is not told the job ended: it waits
        statuses: dict[str, bool] = {}
        client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"check-{job}")

        def on_message(_c, _u, msg):
            status = decode_status(msg.payload)
            statuses[status.device] = status.online

        client.on_message = on_message
        client.connect(mosquitto.host, mosquitto.port)
        client.subscribe(f"edgefl/{job}/status/+", qos=1)
        client.loop_start()
        try:
            wait_for(lambda: len(statuses) == 4, 10, "the four retained statuses")
        finally:
            client.loop_stop()
            client.disconnect()
        agg.send_signal(signal.SIGTERM)
        agg.communicate(timeout=20)
    finally:
        stop_all(agg, fleet)
    assert fleet.returncode == 0, fleet_err
    assert elapsed < 5.0
    assert "Traceback" not in fleet_err
    last = fleet_err.strip().splitlines()[-1]
    assert last.startswith("fleet shard 0/1: stopped by SIGTERM: ") and "updates published" in last
    assert int(last.split(": ")[-1].split()[0]) >= 4  # round 1's updates at least
    assert len(statuses) == 4 and set(statuses.values()) == {False}, statuses
    assert agg.returncode == 0


def test_simulate_stops_cleanly_on_sigterm(tmp_path):
    out = tmp_path / "sim"
    argv = [
        EDGE_FL, "simulate", "--devices", "4", "--rounds", "30", "--clients-per-round", "4",
        "--model", "logreg", "--epochs", "1", "--time-scale", "0.3", "--no-progress",
        "--out", str(out),
    ]  # fmt: skip
    sim = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        wait_for(lambda: len(records(out)) >= 1, 60, "round 1", (sim,))
        time.sleep(0.4)
        t0 = time.monotonic()
        sim.send_signal(signal.SIGTERM)
        stdout, stderr = sim.communicate(timeout=20)
        elapsed = time.monotonic() - t0
    finally:
        stop_all(sim)
    assert sim.returncode == 0, stderr
    assert elapsed < 5.0
    assert "Traceback" not in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "SIGTERM"
    assert (out / "model.onnx").stat().st_size > 0
    assert 1 <= summary["rounds"] < 30 and "rounds" in stdout


# ------------------------------------------------------------------ unwritable output


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A real tmpfs at ``path`` (root with CAP_SYS_ADMIN only; the test is skipped otherwise)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path) -> Path:
    """Fill the file system of ``directory`` to the last byte."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\0" * 65536
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        for size in (4096, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * size)
    return filler


def test_disk_full_is_one_line_and_resume_finishes_the_job(mosquitto, tmp_path):
    job = f"full-{uuid.uuid4().hex[:6]}"
    with tmpfs(tmp_path / "mnt", "size=4m") as mnt:
        out = mnt / "run"
        args = common(mosquitto.url, job, rounds=8)
        fleet = subprocess.Popen(
            [EDGE_FL, "fleet", *args], stderr=subprocess.PIPE, text=True, env=ENV
        )
        agg = subprocess.Popen(
            [EDGE_FL, "aggregator", *args, "--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        try:
            wait_for(lambda: len(records(out)) >= 2, 60, "round 2", (agg, fleet))
            filler = fill(mnt)
            _, stderr = agg.communicate(timeout=30)
            assert agg.returncode == 2
            assert "Traceback" not in stderr
            lines = error_lines(stderr)
            assert len(lines) == 1 and "No space left on device" in lines[0], stderr
            assert lines[0].startswith(f"edge-fl: error: cannot write {out}")
            # consistent on disk: the checkpoint claims no round metrics.jsonl lacks beyond the
            # one it carries itself (restored on resume), and no half line
            state = json.loads((out / "checkpoint.json").read_text())
            have = [r["round"] for r in records(out)]
            assert have == list(range(1, len(have) + 1))
            assert state["round_number"] in (have[-1], have[-1] + 1)
            assert state["last_record"]["round"] == state["round_number"]
            assert fleet.poll() is None  # devices wait for the job to continue
            filler.unlink()
            again = subprocess.run(
                [EDGE_FL, "aggregator", *args, "--out", str(out), "--resume"],
                capture_output=True,
                text=True,
                timeout=120,
                env=ENV,
            )
            _, fleet_err = fleet.communicate(timeout=30)
        finally:
            stop_all(agg, fleet)
        assert again.returncode == 0, again.stderr
        assert "resumed after round" in again.stdout
        assert fleet.returncode == 0, fleet_err
        assert [r["round"] for r in records(out)] == list(range(1, 9))
        assert json.loads((out / "checkpoint.json").read_text())["round_number"] == 8
        assert json.loads((out / "summary.json").read_text())["rounds"] == 8


def run_aggregator(url: str, out: Path) -> subprocess.CompletedProcess:
    args = common(url, f"ro-{uuid.uuid4().hex[:6]}", rounds=1)
    return subprocess.run(
        [EDGE_FL, "aggregator", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )


def test_read_only_output_directory_is_one_line(mosquitto, tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits: use a read-only file system
        ctx = tmpfs(tmp_path / "ro", "ro,size=1m")
        reason = "Read-only file system"
    else:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        ctx = contextlib.nullcontext(tmp_path / "ro")
        reason = "Permission denied"
    with ctx as ro:
        done = run_aggregator(mosquitto.url, ro / "run")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = error_lines(done.stderr)
    assert lines == [f"edge-fl: error: cannot write {ro / 'run'}: {reason}"], done.stderr


def test_output_under_a_file_is_one_line(mosquitto, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    done = run_aggregator(mosquitto.url, tmp_path / "file" / "run")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert error_lines(done.stderr) == [
        f"edge-fl: error: cannot write {tmp_path / 'file' / 'run'}: Not a directory"
    ], done.stderr
