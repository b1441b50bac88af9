"""Operator mistakes end in one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_fl.transport.broker import find_mosquitto, free_port

EDGE_FL = [str(Path(sys.executable).parent / "edge-fl")]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGE_FL, *args], capture_output=True, text=True, timeout=timeout)


def one_line_error(done: subprocess.CompletedProcess, *expected: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("edge-fl: error:")]
    assert len(errors) == 1, done.stderr  # one error (a config error lists its keys below it)
    for text in expected:
        assert text in done.stderr, done.stderr
    return errors[0]


def test_fleet_against_an_unreachable_broker():
    port = free_port()  # nothing listens here
    done = run("fleet", "--broker", f"mqtt://127.0.0.1:{port}", "--devices", "3")
    one_line_error(done, f"127.0.0.1:{port}", "refused", "reachable")


def test_simulate_against_an_unreachable_broker_fails_within_seconds():
    port = free_port()  # nothing listens here
    started = time.monotonic()
    done = run("simulate", "--broker", f"mqtt://127.0.0.1:{port}", "--rounds", "1", "--no-progress")
    one_line_error(done, f"cannot reach the broker at mqtt://127.0.0.1:{port}", "running")
    assert time.monotonic() - started < 20  # three quick attempts, not a minute of retries


@pytest.mark.skipif(find_mosquitto() is None, reason="needs mosquitto")
def test_broker_on_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run("broker", "--port", str(port), "--kind", "mosquitto")
    one_line_error(done, f"port {port}", "already in use")


def test_more_clients_per_round_than_devices():
    done = run("simulate", "--devices", "50", "--clients-per-round", "500", "--no-progress")
    one_line_error(done, "clients_per_round = 500 exceeds data.devices = 50")


def test_an_unknown_mechanism():
    done = run("simulate", "--mechanism", "bogus", "--no-progress")
    one_line_error(done, "unknown privacy mechanism 'bogus'")


def test_a_closed_loop_in_an_abandoned_clients_destructor_is_not_a_traceback():
    """A fleet that fails leaves clients paho collects after asyncio.run closed the loop; their
    "Event loop is closed" must not print a traceback under the one-line error, anything else
    must."""
    from types import SimpleNamespace

    from edge_fl.cli import _quiet_closed_loop

    seen = []
    for exc in (RuntimeError("Event loop is closed"), RuntimeError("other"), ValueError("x")):
        _quiet_closed_loop(SimpleNamespace(exc_value=exc), default=seen.append)
    assert [str(u.exc_value) for u in seen] == ["other", "x"]


def test_a_run_directory_in_use_by_another_run_is_refused(tmp_path):
    """Two runs writing one --out interleave metrics.jsonl into garbage: the second is refused."""
    from edge_fl.metrics import lock_run_dir

    held = lock_run_dir(tmp_path / "run")  # this process plays the first run
    done = run("simulate", "--rounds", "1", "--out", str(tmp_path / "run"), "--no-progress")
    one_line_error(done, "in use by another edge-fl run", f"pid {__import__('os').getpid()}")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    held.close()  # released: the directory can be used again
    again = run("simulate", "--rounds", "1", "--out", str(tmp_path / "run"), "--no-progress")
    assert again.returncode == 0, again.stderr
