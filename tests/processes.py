"""A job as separate processes (aggregator + device commands), for the tests that run the CLI as
a deployment would: start them, wait for all, never leave one behind."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str, procs: Sequence = ()
) -> None:
    """Poll ``predicate`` until it holds; AssertionError naming ``what`` after ``timeout`` s,
    or at once when one of ``procs`` exits first."""
    until = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process exited early ({p.args[1]}: {p.poll()})")
        if time.monotonic() > until:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def stop_all(*procs: subprocess.Popen) -> None:
    """Kill whatever of ``procs`` still runs (a failed test leaves none behind)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def keygen(directory: Path) -> tuple[Path, str]:
    """`edge-fl keygen DIR`: the private key file and the public key in hex."""
    made = subprocess.run(
        [EDGE_FL, "keygen", str(directory)], capture_output=True, text=True, check=True
    )
    return directory / "aggregator_ed25519.pem", made.stdout.strip().split()[-1]


@dataclass
class JobRun:
    stdout: str  # the aggregator's
    stderr: str  # the aggregator's
    returncode: int  # the aggregator's
    device_errs: list[str]  # ``first`` then ``devices``, in the order they started
    device_codes: list[int]


def _read_until(proc: subprocess.Popen, text: str) -> str:
    """What ``proc`` wrote on stderr up to and including the line holding ``text``."""
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"{proc.args!r} ended without printing {text!r}:\n{''.join(seen)}")


def _until(condition: Callable[[float], bool], agg: subprocess.Popen, timeout: float) -> None:
    """Wait until ``condition(seconds)`` holds; fail at once, with its stderr, if the aggregator
    exits first."""
    give_up = time.monotonic() + timeout
    while not condition(0.5):
        if agg.poll() is not None:
            _, stderr = agg.communicate()
            raise AssertionError(f"the aggregator exited ({agg.returncode}) first:\n{stderr}")
        if time.monotonic() > give_up:
            raise AssertionError(f"no job start within {timeout:.0f} s (is the machine that busy?)")


def run_job(
    aggregator: list[str],
    devices: list[list[str]],
    *,
    when: Callable[[float], bool] | None = None,
    first: Sequence[tuple[list[str], str]] = (),
    timeout: float = 120,
    device_timeout: float = 30,
) -> JobRun:
    """Start the aggregator command, then every device command; wait for all of them.

    Ordering by conditions, for commands with timeouts of their own on a loaded machine: with
    ``when`` (``when(seconds)``: whether, e.g., the job document is retained on the broker within
    that time; polled for up to ``timeout`` s) the device commands start once it holds; each
    ``(command, text)`` of ``first`` then starts, and the next one waits until it printed
    ``text`` on stderr; ``devices`` start last."""
    agg = subprocess.Popen(aggregator, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs: list[subprocess.Popen] = []
    early: list[str] = []  # stderr already read from each of ``first``
    try:
        if when is not None:
            _until(when, agg, timeout)
        for cmd, text in first:
            procs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
            early.append(_read_until(procs[-1], text))
        procs += [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for cmd in devices]
        stdout, stderr = agg.communicate(timeout=timeout)
        errs = [p.communicate(timeout=device_timeout)[1] for p in procs]
    finally:
        for p in (agg, *procs):
            if p.poll() is None:
                p.kill()
    errs = [head + tail for head, tail in zip([*early, *[""] * len(devices)], errs, strict=True)]
    return JobRun(stdout, stderr, agg.returncode, errs, [p.returncode for p in procs])


def secure_records_with_workers(
    broker_url: str, job_args: list[str], out: Path, *, timeout: float = 120
) -> list[tuple[str, str, int, int]]:
    """`edge-fl aggregator ... --secure-aggregation --workers 2 --out OUT` (workers spawned) and
    `edge-fl fleet` with the same ``job_args`` (after ``--broker URL``), as separate processes;
    each record's (status, secure outcome, received, workers)."""
    import json

    args = ["--broker", broker_url, *job_args, "--secure-aggregation"]
    done = run_job(
        [EDGE_FL, "aggregator", *args, "--out", str(out), "--workers", "2"],
        [[EDGE_FL, "fleet", *args]],
        timeout=timeout,
        device_timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.device_codes == [0], done.device_errs
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["status"], r["secure"]["outcome"], r["received"], r["workers"]) for r in records]
