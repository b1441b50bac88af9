"""A job as separate processes (aggregator + device commands), for the tests that run the CLI as
a deployment would: start them, wait for all, never leave one behind."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))


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
    device_errs: list[str]
    device_codes: list[int]


def run_job(
    aggregator: list[str],
    devices: list[list[str]],
    *,
    timeout: float = 120,
    device_timeout: float = 30,
) -> JobRun:
    """Start the aggregator command, then every device command; wait for all of them."""
    agg = subprocess.Popen(aggregator, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for cmd in devices]
    try:
        stdout, stderr = agg.communicate(timeout=timeout)
        errs = [p.communicate(timeout=device_timeout)[1] for p in procs]
    finally:
        for p in (agg, *procs):
            if p.poll() is None:
                p.kill()
    return JobRun(stdout, stderr, agg.returncode, errs, [p.returncode for p in procs])
