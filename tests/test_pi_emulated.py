"""The Raspberry Pi path on an emulated 64-bit Pi (slow: EDGE_FL_SLOW=1 tools/test.sh).

tools/emulate_pi.py builds (once, cached) a Debian bookworm arm64 root, installs the agent there
with devices/raspberry-pi/install.sh, and runs it under qemu against a Mosquitto on the host for
3 rounds of a SignDS job. Minutes of CPU: never in CI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.broker]

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "emulate_pi.py"
sys.path.insert(0, str(TOOL.parent))
import emulate_pi  # noqa: E402

# A first run builds the root (about 3 min of emulated dpkg) and installs (about 2-3 min); the
# job itself takes a minute or two under qemu.
TIMEOUT_S = 3600


def _why_not() -> str | None:
    """Why this machine cannot emulate the Pi, or None."""
    if sys.platform != "linux":
        return "needs Linux (qemu user-mode emulation, chroot)"
    if os.geteuid() != 0:
        return "needs root: debootstrap, chroot and install.sh create users, mounts and units"
    lacking = emulate_pi.missing_tools("chroot")
    if lacking:
        return (
            f"missing {', '.join(lacking)}: apt-get install qemu-user-static debootstrap mosquitto"
        )
    # chroot needs binfmt_misc (the tool registers qemu there when it can); proot needs nothing
    if not emulate_pi.BINFMT.exists() and shutil.which("proot") is None:
        return "no binfmt_misc in this kernel and no proot: apt-get install proot"
    return None


@pytest.mark.timeout(TIMEOUT_S)
def test_emulated_pi_installs_and_serves_three_signds_rounds(tmp_path: Path) -> None:
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    report = tmp_path / "summary.json"
    done = subprocess.run(
        [sys.executable, str(TOOL), "--out", str(tmp_path / "run"), "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S - 60,
    )
    assert report.exists(), done.stderr[-3000:]
    summary = json.loads(report.read_text())
    if done.returncode == 3:  # e.g. no binfmt_misc and a proot too old to run install.sh
        pytest.skip(f"cannot emulate an arm64 Pi here: {summary['problems']}")
    assert summary["problems"] == [], summary["problems"]
    assert done.returncode == 0, done.stderr[-3000:]

    install = summary["install"]
    assert install["unit_installed"] and install["unit_enabled"]
    assert install["not_started_without_systemd"]  # install.sh saw no systemd and only enabled
    assert install["systemd_analyze_verify_rc"] == 0, install["systemd_analyze_verify_output"]
    assert install["opt_edge_fl_bytes"] > 10_000_000  # a venv with numpy: not an empty shell

    job = summary["job"]
    records = job["records"]
    assert [r["round"] for r in records] == [1, 2, 3]
    for r in records:
        # 2 devices: the host's and the emulated Pi's; both selected, both accepted
        assert r["status"] == "closed" and r["selected"] == 2, r
        assert r["received"] == 2 and r["rejected"] == 0, r
    acks = job["pi_acks"]
    assert len(acks) == 3 and all(a["ok"] for a in acks), acks  # the aggregator said so to d00001
    assert job["pi_rounds_sent"] == [1, 2, 3]
    assert job["aggregator_rc"] == 0
