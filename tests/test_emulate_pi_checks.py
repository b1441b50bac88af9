"""tools/emulate_pi.py refuses before it builds anything, and its userns mode runs arm64 code
without touching the host's binfmt_misc table (issue 23: ``--mode proot`` failed after 34 s of
building, and the only working mode registered qemu in the host kernel's table until reboot).
Fast: no root is built here (tests/test_pi_emulated.py runs the whole Pi, slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "emulate_pi.py"
sys.path.insert(0, str(TOOL.parent))
import emulate_pi  # noqa: E402

needs_root = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="the tool runs as root on Linux"
)


def _host_binfmt() -> list[str]:
    return sorted(p.name for p in emulate_pi.BINFMT.glob("*"))


@needs_root
def test_a_mode_that_cannot_work_is_refused_first_with_one_reason(tmp_path):
    """--mode proot where proot is missing or too old: exit 3 in seconds, nothing built."""
    if emulate_pi.proot_problem() is None:
        pytest.skip("this machine's proot works: nothing to refuse")
    cache = tmp_path / "cache"
    done = subprocess.run(
        [sys.executable, str(TOOL), "--mode", "proot", "--cache", str(cache), "--out",
         str(tmp_path / "out"), "--json", str(tmp_path / "s.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert len(summary["problems"]) == 1 and "proot" in summary["problems"][0]
    assert "root" not in summary and not (cache / "root.partial").exists()


@needs_root
def test_the_userns_mode_runs_arm64_through_a_private_binfmt_entry():
    why = emulate_pi.userns_problem()
    if why is not None:
        pytest.skip(why)
    before = _host_binfmt()
    done = subprocess.run(
        [sys.executable, str(TOOL), "--userns-exec", "", "--", "sh", "-c",
         "head -1 /proc/sys/fs/binfmt_misc/qemu-aarch64; cat /proc/self/uid_map"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[0] == "enabled"  # inside: qemu runs aarch64 binaries
    assert lines[1:] == ["0", "0", "65536"]  # uids as on the host: dpkg can chown
    assert "qemu-aarch64" not in _host_binfmt() and _host_binfmt() == before  # host: untouched
