#!/usr/bin/env python3
"""An emulated 64-bit Raspberry Pi (Debian bookworm arm64 under qemu) as a real check of the
device path: install with devices/raspberry-pi/install.sh, then serve 3 rounds of a SignDS job.

    sudo .venv/bin/python tools/emulate_pi.py [--cache DIR] [--mode auto|chroot|proot]
                                              [--system-numpy] [--json FILE]

Phases (each timed; sizes measured with du):

1. root: ``debootstrap --arch=arm64 --foreign`` (Debian's packages) and the second stage run under
   qemu user-mode emulation: python3, python3-venv, python3-numpy, systemd, ca-certificates.
   Built once and cached (default ~/.cache/edge-fl/pi-arm64/root); every run starts from a fresh
   copy of it, so install.sh always meets a clean system.
2. wheel: the edge-fl wheel built on the host from the source tree (or ``--wheel``).
3. install: ``install.sh --no-start`` as root in the emulated root. No systemd runs there, so it
   enables the unit without starting it, after ``systemd-analyze verify``. The installed size of
   /opt/edge-fl is measured.
4. job: a private Mosquitto on a free loopback port, ``edge-fl aggregator`` (signing key from
   ``edge-fl keygen``) and device d00000 on the host; in the emulated root (it shares the host's
   network) device d00001 runs the installed unit's own ExecStart= as user edge-fl, with the
   shipped device.yaml filled in as an operator would (broker URL, id, public key). The job is
   digits + logreg, 2 devices, 3 rounds, SignDS, acks for every update; the Pi learns it from the
   signed job document on the broker. Passes when all 3 rounds closed with both updates accepted
   and the aggregator acknowledged d00001's update 3 times.

How aarch64 code runs (``--mode``; every mode but ``--register-binfmt`` leaves the host as it was):

- ``userns`` (the default where the kernel allows it, Linux >= 6.7): every command in the root
  runs in its own user and mount namespace (uids 0-65535 mapped to themselves), which mounts a
  private binfmt_misc instance and registers qemu-aarch64-static there, then chroots. The entry
  exists only inside that namespace and vanishes with it: the host's binfmt table is untouched.
- ``chroot``: through the host's binfmt_misc, when an aarch64 entry is already registered there.
  ``--register-binfmt`` registers one (this changes the host kernel's table until reboot: asked
  for, never done by default).
- ``proot``: ``proot -q qemu-aarch64-static`` (slower: every system call is traced). Debian
  bookworm's proot 5.1.0 does not translate faccessat2, which bash and dash use for ``-x``
  tests, so debootstrap's second stage and install.sh see the host's files: the tool checks
  that FIRST (on the host, in a second) and stops with that reason.

Every check that can refuse the run (root, tools, the mode's own probe) runs before anything is
built. Needs (Debian): qemu-user-static, debootstrap, mosquitto (and proot for ``--mode proot``).
Exit status 0 only if every check passed (1: a check failed, 3: this machine cannot emulate the
Pi without changing the host; the reason is the summary's one problem); the summary (``--json``)
says which failed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
KIT = REPO / "devices" / "raspberry-pi"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ["python3", "python3-venv", "python3-numpy", "systemd", "ca-certificates"]
QEMU = "qemu-aarch64-static"
BINFMT = Path("/proc/sys/fs/binfmt_misc")
# The kernel's aarch64 ELF signature, as qemu-user-static's binfmt.d file registers it; flag F
# opens the interpreter now, so it need not exist inside the root.
AARCH64_MAGIC = r"\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00"
AARCH64_MASK = r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff"
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
PI_ID, HOST_ID = "d00001", "d00000"
ROUNDS = 3


class Failure(RuntimeError):
    """A phase that cannot continue, with what to do about it."""


class Unsupported(Failure):
    """This machine cannot emulate the Pi faithfully (exit status 3: the slow test skips)."""


def log(msg: str) -> None:
    print(f"[emulate_pi {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def missing_tools(mode: str) -> list[str]:
    """The host programs this mode needs and lacks (the slow test skips on these)."""
    need = [QEMU, "debootstrap", "mosquitto"]
    if mode == "proot":
        need.append("proot")
    return [t for t in need if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]


# --------------------------------------------------------------------------- running arm64 code


def binfmt_ready() -> bool:
    """True if the kernel runs aarch64 binaries through qemu (an enabled aarch64 entry)."""
    for entry in (BINFMT / "qemu-aarch64", BINFMT / "aarch64"):
        with contextlib.suppress(OSError):
            if entry.read_text().splitlines()[0] == "enabled":
                return True
    return False


def register_binfmt() -> str | None:
    """Register qemu for aarch64 with binfmt_misc; None on success, else why not."""
    if os.geteuid() != 0:
        return "not root"
    qemu = shutil.which(QEMU)
    if qemu is None:
        return f"{QEMU} not found"
    if not (BINFMT / "register").exists():
        done = subprocess.run(
            ["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], capture_output=True
        )
        if done.returncode != 0:
            return f"cannot mount binfmt_misc: {done.stderr.decode().strip()}"
    rule = f":qemu-aarch64:M::{AARCH64_MAGIC}:{AARCH64_MASK}:{qemu}:OCF"
    try:
        (BINFMT / "register").write_text(rule)
    except OSError as exc:
        return f"cannot register with binfmt_misc: {exc}"
    log(f"registered {qemu} for aarch64 ELF binaries in binfmt_misc (until reboot)")
    return None


def choose_mode(requested: str, register: bool) -> str:
    """The way to run arm64 code, decided before anything is built; Unsupported says why none.

    auto: chroot when the host already runs aarch64 binaries (nothing to change), else userns,
    else proot; the host's binfmt table is changed only with ``register``."""
    if requested in ("auto", "chroot"):
        if binfmt_ready():
            return "chroot"
        if register:
            why = register_binfmt()
            if why is None and binfmt_ready():
                return "chroot"
            raise Unsupported(f"--register-binfmt: binfmt_misc cannot run aarch64 binaries ({why})")
        if requested == "chroot":
            raise Unsupported(
                "--mode chroot: the host's binfmt_misc has no aarch64 entry; --register-binfmt "
                "adds one (changing the host kernel's table until reboot), or use --mode userns"
            )
    problems = []
    if requested in ("auto", "userns"):
        why = userns_problem()
        if why is None:
            return "userns"
        problems.append(f"userns: {why}")
        if requested == "userns":
            raise Unsupported(f"--mode userns: {why}")
    why = proot_problem()
    if why is None:
        return "proot"
    problems.append(f"proot: {why}")
    if requested == "proot":
        raise Unsupported(f"--mode proot: {why}")
    raise Unsupported(
        "no way to run arm64 code that leaves this host unchanged ("
        + "; ".join(problems)
        + "); --register-binfmt registers qemu in the host's binfmt_misc until reboot"
    )


def proot_problem() -> str | None:
    """Why proot cannot run the root here, or None; checked on the host before any root exists.

    proot 5.1.0 (Debian bookworm's) passes faccessat2 through untranslated, so an ``-x`` test in
    the root (bash's [[ -x ]], dash's [ -x ], glibc >= 2.33) looks at the host's file instead:
    debootstrap's second stage then cannot find its own functions and install.sh misjudges what
    it installed. Probe: a file bound at a path the host does not have."""
    if shutil.which("proot") is None:
        return "proot is not installed (apt-get install proot)"
    with tempfile.TemporaryDirectory(prefix="emulate-pi-probe-") as tmp:
        exe = Path(tmp, "probe")
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
        inside = f"/edge-fl-probe-{uuid.uuid4().hex}"
        test = f"[[ -x {inside}/probe ]]"
        done = subprocess.run(
            ["proot", "-b", f"{tmp}:{inside}", "bash", "-c", test], capture_output=True
        )
    if done.returncode != 0:
        return (
            "this proot does not translate faccessat2 (an -x test in the root sees the host's "
            "files; fixed after proot 5.1.0, proot-me/proot#338)"
        )
    return None


#: the binfmt_misc rule of the userns mode: flag F opens qemu now, so the root needs no copy
def _rule(qemu: str) -> str:
    return f":qemu-aarch64:M::{AARCH64_MAGIC}:{AARCH64_MASK}:{qemu}:OCF"


USERNS_SCRIPT = r"""echo ready >&3; exec 3>&-; read _ <&4; exec 4<&-
set -e
mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
printf '%s' "$EDGE_FL_BINFMT_RULE" > /proc/sys/fs/binfmt_misc/register
unset EDGE_FL_BINFMT_RULE
r="$1"; shift
if [ -n "$r" ]; then
  for d in proc dev sys; do mkdir -p "$r/$d"; mount --rbind "/$d" "$r/$d"; done
  while [ "$1" != "--" ]; do mkdir -p "$r$2"; mount --bind "$1" "$r$2"; shift 2; done
  shift
  exec chroot "$r" "$@"
fi
shift
exec "$@"
"""


def userns_run(root: str, binds: Sequence[tuple[str, str]], argv: Sequence[str]) -> int:
    """Run ``argv`` chrooted in ``root`` inside a new user + mount namespace whose own
    binfmt_misc instance runs aarch64 binaries through qemu; its exit status.

    The namespace maps uids and gids 0-65535 to themselves (written from here, as root in the
    host's namespace: what newuidmap would do), so dpkg and install.sh own files as on a Pi. The
    binfmt entry, the mounts and the namespace end with the process: the host is unchanged."""
    qemu = shutil.which(QEMU)
    if qemu is None:
        print(f"emulate_pi: {QEMU} not found", file=sys.stderr)
        return 127
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    # the child's ends as its fds 3 (it says "ready" once unshared) and 4 (it waits for "go")
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (ready_w, go_r)]

    def ends() -> None:
        os.dup2(high[0], 3)
        os.dup2(high[1], 4)

    bind_args = [a for pair in binds for a in pair]
    cmd = ["unshare", "--user", "--mount", "--propagation", "private", "sh", "-c",
           USERNS_SCRIPT, "sh", root, *bind_args, "--", *argv]  # fmt: skip
    env = {**os.environ, "EDGE_FL_BINFMT_RULE": _rule(qemu)}
    child = subprocess.Popen(cmd, env=env, preexec_fn=ends, pass_fds=(3, 4))
    for fd in (ready_w, go_r, *high):
        os.close(fd)
    # SIGTERM/SIGINT reach the child through the process group; wait for its status
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    with os.fdopen(ready_r, "rb") as ready:
        started = ready.readline() == b"ready\n"  # the child now lives in its namespace
    if started:
        for name in ("uid_map", "gid_map"):
            Path(f"/proc/{child.pid}/{name}").write_text("0 0 65536\n")
    os.write(go_w, b"go\n")
    os.close(go_w)
    return child.wait()


def userns_problem() -> str | None:
    """Why the userns mode cannot run here, or None: a private binfmt_misc instance in a user
    namespace needs Linux >= 6.7, user namespaces enabled and unshare (util-linux)."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    done = subprocess.run(
        [sys.executable, __file__, "--userns-exec", "", "--", "true"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return (
            "no private binfmt_misc in a user namespace here (needs Linux >= 6.7 with user "
            f"namespaces; this is {os.uname().release}): {tail}"
        )
    return None


def in_root(
    mode: str,
    root: Path,
    argv: Sequence[str],
    env: dict[str, str] | None = None,
    binds: Sequence[tuple[Path, str]] = (),
) -> list[str]:
    """A host command line that runs ``argv`` inside ``root`` with a clean environment.

    chroot: in a private mount namespace (unshare -m), so /proc, /dev, /sys and the binds vanish
    with the process; proot: the same binds, fake root (-0), qemu for every arm64 binary."""
    env_args = [f"PATH={ROOT_PATH}", "HOME=/root", "LANG=C.UTF-8", f"PIP_CERT={CA_BUNDLE}"]
    env_args += [f"{k}={v}" for k, v in (env or {}).items()]
    inner = ["/usr/bin/env", "-i", *env_args, *argv]
    if mode == "userns":
        pairs = [a for host, inside in binds for a in (str(host), inside)]
        return [sys.executable, __file__, "--userns-exec", str(root), *pairs, "--", *inner]
    if mode == "proot":
        cmd = ["proot", "-0", "-q", shutil.which(QEMU) or QEMU, "-r", str(root), "-w", "/"]
        for b in ("/proc", "/dev", "/sys"):
            cmd += ["-b", b]
        for host, inside in binds:
            cmd += ["-b", f"{host}:{inside}"]
        return cmd + inner
    script = [
        'set -e; r="$1"; shift',
        'mount -t proc proc "$r/proc"',
        'mount --rbind /dev "$r/dev"',
        'mount --rbind /sys "$r/sys"',
    ]
    for host, inside in binds:
        script.append(f'mkdir -p "$r{inside}"; mount --bind "{host}" "$r{inside}"')
    script.append('exec chroot "$r" "$@"')
    unshare = ["unshare", "-m", "--propagation", "private"]
    return [*unshare, "sh", "-c", "; ".join(script), "sh", str(root), *inner]


def run(cmd: Sequence[str], log_file: Path, timeout: float) -> float:
    """Run ``cmd`` with its output in ``log_file``; its wall time, or Failure with the tail."""
    t0 = time.perf_counter()
    with log_file.open("ab") as out:
        out.write(f"$ {' '.join(map(str, cmd))}\n".encode())
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-15:])
        raise Failure(f"{cmd[0]} ... exited {done.returncode} (log {log_file}):\n{tail}")
    return time.perf_counter() - t0


def du_bytes(path: Path) -> int:
    """Disk usage (du -sb: apparent bytes) of a tree."""
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


# --------------------------------------------------------------------------- phase 1: the root


def build_root(cache: Path, mode: str, logs: Path, rebuild: bool) -> dict[str, Any]:
    """The cached pristine arm64 root (built when missing): {path, reused, times}."""
    root = cache / "root"
    stamp = root / ".edge-fl-root"
    spec = f"{SUITE} arm64 {' '.join(PACKAGES)}"
    if rebuild and root.exists():
        shutil.rmtree(root)
    if stamp.exists() and stamp.read_text().strip() == spec:
        log(f"reusing the cached arm64 root {root}")
        return {"path": str(root), "reused": True}
    if root.exists():
        shutil.rmtree(root)
    work = cache / "root.partial"
    if work.exists():
        shutil.rmtree(work)
    cache.mkdir(parents=True, exist_ok=True)
    log(f"debootstrap stage 1 (download, unpack): {SUITE} arm64 -> {work}")
    first = run(
        [
            "debootstrap", "--arch=arm64", "--foreign", "--variant=minbase",
            f"--include={','.join(PACKAGES)}", SUITE, str(work), MIRROR,
        ],
        logs / "debootstrap.log",
        timeout=1800,
    )  # fmt: skip
    log(f"debootstrap stage 2 under qemu ({mode}): configuring packages")
    second_argv = ["/debootstrap/debootstrap", "--second-stage"]
    if mode == "chroot":  # debootstrap mounts /proc itself: only a private namespace around it
        cmd = ["unshare", "-m", "--propagation", "private", "chroot", str(work), *second_argv]
    else:  # named, not found by an -x test (proot 5.1.0 answers those from the host's files)
        env = {"DEBOOTSTRAP_DIR": "/debootstrap"}
        if mode == "userns":  # no device nodes in a user namespace: /dev is the host's, bound
            env["container"] = "lxc"  # debootstrap's name for such a root
        cmd = in_root(mode, work, second_argv, env=env)
    second = run(cmd, logs / "debootstrap.log", timeout=3600)
    # Trust the host's local CAs too (a TLS-intercepting proxy between here and PyPI), as a Pi
    # on such a network would have to; then resolve names like the host.
    local_cas = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    for ca in local_cas:
        shutil.copy2(ca, work / "usr/local/share/ca-certificates" / ca.name)
    if local_cas:
        run(in_root(mode, work, ["update-ca-certificates"]), logs / "debootstrap.log", 600)
    stamp_tmp = work / ".edge-fl-root"
    stamp_tmp.write_text(spec + "\n")
    work.rename(root)
    return {
        "path": str(root),
        "reused": False,
        "debootstrap_stage1_s": round(first, 1),
        "debootstrap_stage2_s": round(second, 1),
        "root_bytes": du_bytes(root),
    }


def fresh_copy(pristine: Path, dest: Path) -> float:
    """A throw-away copy of the pristine root for one run (install.sh changes it)."""
    if dest.exists():
        shutil.rmtree(dest)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-a", "--reflink=auto", str(pristine), str(dest)], check=True)
    shutil.copy2("/etc/resolv.conf", dest / "etc/resolv.conf")
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- phase 2: the wheel


def build_wheel(source: Path, out: Path, logs: Path) -> Path:
    """The edge-fl wheel of ``source``, built from a copy (no build/ left in the source tree)."""
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
        ".ruff_cache", ".hypothesis",
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="edge-fl-src-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(source, src, ignore=ignore)
        run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
             "-w", str(out), str(src)],
            logs / "wheel.log",
            timeout=600,
        )  # fmt: skip
    wheels = sorted(out.glob("edge_fl-*.whl"))
    if not wheels:
        raise Failure(f"no edge_fl wheel in {out}")
    return wheels[-1]


# --------------------------------------------------------------------------- phase 3: install


def install(
    mode: str, root: Path, wheel: Path, cache: Path, logs: Path, system_numpy: bool
) -> dict[str, Any]:
    """install.sh in the root: its time, the verified unit, the size of /opt/edge-fl."""
    kit = root / "tmp/edge-fl-kit"
    shutil.copytree(KIT, kit / "raspberry-pi")
    shutil.copy2(wheel, kit / wheel.name)
    pip_cache = cache / "pip-cache"  # downloads survive between runs (the root copy does not)
    pip_cache.mkdir(parents=True, exist_ok=True)
    argv = ["/tmp/edge-fl-kit/raspberry-pi/install.sh", "--no-start"]
    if system_numpy:
        argv.append("--system-site-packages")
    argv.append(f"/tmp/edge-fl-kit/{wheel.name}")
    warm = any(pip_cache.rglob("*"))
    log(f"install.sh in the emulated root ({'warm' if warm else 'cold'} pip cache)")
    took = run(
        in_root(mode, root, argv, binds=[(pip_cache, "/root/.cache/pip")]),
        logs / "install.log",
        timeout=3600,
    )
    text = (logs / "install.log").read_text(errors="replace")
    unit = root / "etc/systemd/system/edge-fl-device.service"
    wants = root / "etc/systemd/system/multi-user.target.wants/edge-fl-device.service"
    t0 = time.perf_counter()
    verify = subprocess.run(
        in_root(mode, root, ["systemd-analyze", "verify", "/etc/systemd/system/" + unit.name]),
        capture_output=True,
        text=True,
    )
    verify_s = time.perf_counter() - t0
    site = next((root / "opt/edge-fl/lib").glob("python3*/site-packages"))
    sizes = [(du_bytes(p), p.name) for p in site.iterdir() if p.is_dir()]
    biggest = sorted(sizes, reverse=True)[:8]
    numpy_version = subprocess.run(
        in_root(mode, root, ["/opt/edge-fl/bin/python", "-c",
                             "import numpy; print(numpy.__version__, numpy.__file__)"]),
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return {
        "install_s": round(took, 1),
        "pip_cache": "warm" if warm else "cold",
        "system_site_packages": system_numpy,
        "opt_edge_fl_bytes": du_bytes(root / "opt/edge-fl"),
        "site_packages_biggest": [{"name": n, "bytes": b} for b, n in biggest],
        "numpy": numpy_version,
        "unit_installed": unit.exists(),
        "unit_enabled": wants.is_symlink(),
        "not_started_without_systemd": "systemd is not running here" in text,
        "systemd_analyze_verify_rc": verify.returncode,
        "systemd_analyze_verify_output": (verify.stdout + verify.stderr).strip(),
        "systemd_analyze_verify_s": round(verify_s, 1),
    }


# --------------------------------------------------------------------------- phase 4: the job


JOB_YAML = """\
job: {job}
data: {{dataset: digits, devices: 2, partition: iid}}
model: {{name: logreg}}
training: {{epochs: 1, batch_size: 16, lr: 0.1}}
rounds: {{rounds: {rounds}, clients_per_round: 2, min_updates: 2, deadline_s: 900,
         wait_for_devices_s: 900}}
privacy:
  mechanism: signds
  signds: {{sign_k: 0.1, sign_eps: 10}}
security: {{acks: all{signing}}}
"""


class AckTap:
    """Every ack the aggregator sends the emulated Pi, decoded (an independent MQTT subscriber)."""

    def __init__(self, url: str, topic: str) -> None:
        import paho.mqtt.client as mqtt

        from edge_fl.transport.url import parse_broker_url

        spec = parse_broker_url(url)
        self.acks: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"tap-{uuid.uuid4()}")
        self.client.on_connect = lambda c, *_a: c.subscribe(topic, qos=1)
        self.client.on_subscribe = lambda *_a: self.ready.set()
        self.client.on_message = self._on_message
        self.client.connect(spec.host, spec.port)
        self.client.loop_start()
        if not self.ready.wait(10):
            raise Failure(f"the ack tap could not subscribe to {topic} at {url}")

    def _on_message(self, _c: object, _u: object, msg: Any) -> None:
        from edge_fl.protocol import decode_ack

        try:
            ack = decode_ack(msg.payload)
            self.acks.append({"ok": ack.ok, "round": ack.round, "reason": ack.reason})
        except Exception as exc:  # a malformed ack is a finding, not a crash of the tap
            self.acks.append({"ok": False, "error": str(exc)})

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen]]:
    """Started processes (each in its own session), stopped and reaped on the way out."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def unit_exec_start(root: Path) -> list[str]:
    """The agent's command line exactly as the installed unit starts it (ExecStart=)."""
    unit = (root / "etc/systemd/system/edge-fl-device.service").read_text()
    found = re.search(r"^ExecStart=(.+)$", unit, re.M)
    if found is None:
        raise Failure("the installed unit has no ExecStart=")
    return shlex.split(found.group(1))


def write_device_config(mode: str, root: Path, url: str, public_key: str, logs: Path) -> str:
    """/etc/edge-fl/device.yaml from the shipped example, as an operator fills it in: this broker,
    id d00001, the aggregator's key; mode 640 root:edge-fl as install.sh makes it."""
    import yaml

    cfg = yaml.safe_load((KIT / "device.yaml").read_text())
    cfg["broker"]["url"] = url
    cfg.setdefault("device", {})["id"] = PI_ID
    cfg.setdefault("security", {})["public_key"] = public_key
    text = yaml.safe_dump(cfg, sort_keys=False)
    (root / "tmp/device.yaml").write_text(text)
    argv = ["install", "-m", "640", "-o", "root", "-g", "edge-fl", "/tmp/device.yaml",
            "/etc/edge-fl/device.yaml"]  # fmt: skip
    run(in_root(mode, root, argv), logs / "install.log", timeout=600)
    return text


def as_service(mode: str, root: Path, argv: Sequence[str]) -> list[str]:
    """``argv`` in the root as the unit runs it: user edge-fl, its state directory as the working
    directory and HOME (systemd's StateDirectory=), unbuffered output."""
    env = {"HOME": "/var/lib/edge-fl", "PYTHONUNBUFFERED": "1"}
    state = "install -d -m 700 -o edge-fl -g edge-fl /var/lib/edge-fl && cd /var/lib/edge-fl"
    switch = "exec setpriv --reuid=edge-fl --regid=edge-fl --init-groups"
    if mode == "proot":  # proot only fakes root: there is no real user to switch to
        switch = "exec"
    script = f"{state} && {switch} {shlex.join(argv)}"
    return in_root(mode, root, ["sh", "-c", script], env=env)


def run_job(mode: str, root: Path, out: Path, logs: Path, timeout: float) -> dict[str, Any]:
    """Aggregator + host device on the host, the Pi's service command in the root, one private
    Mosquitto on a free loopback port."""
    from edge_fl.transport.broker import EmbeddedBroker

    edge_fl = str(Path(sys.executable).with_name("edge-fl"))
    job = f"pi-{uuid.uuid4().hex[:6]}"
    keys = out / "keys"
    gen = subprocess.run([edge_fl, "keygen", str(keys)], capture_output=True, text=True)
    if gen.returncode != 0:
        raise Failure(f"edge-fl keygen failed: {gen.stderr.strip()}")
    public_key = (keys / "aggregator_ed25519.pub").read_text().strip()
    signing = f", signing_key: {keys / 'aggregator_ed25519.pem'}"
    job_yaml = out / "job.yaml"
    job_yaml.write_text(JOB_YAML.format(job=job, rounds=ROUNDS, signing=signing))
    records_dir = out / "aggregator"
    exec_start = unit_exec_start(root)
    t0 = time.perf_counter()
    subprocess.run(
        in_root(mode, root, [exec_start[0], "device", "--help"]),
        capture_output=True, timeout=600,
    )  # fmt: skip
    result: dict[str, Any] = {"job": job, "signed": True}
    result["pi_device_help_s"] = round(time.perf_counter() - t0, 1)  # CLI start-up under qemu
    with EmbeddedBroker(kind="mosquitto") as broker, processes() as procs:
        url = broker.url
        result["broker"] = url
        result["device_yaml"] = write_device_config(mode, root, url, public_key, logs)
        result["pi_command"] = f"(user edge-fl, in /var/lib/edge-fl) {shlex.join(exec_start)}"
        tap = AckTap(url, f"edgefl/{job}/ack/{PI_ID}")
        t0 = time.perf_counter()
        agg_log = (logs / "aggregator.log").open("w")
        procs.append(
            subprocess.Popen(
                [edge_fl, "aggregator", "--config", str(job_yaml), "--broker", url,
                 "--out", str(records_dir)],
                stdout=agg_log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        )  # fmt: skip
        host_argv = [
            edge_fl,
            "device",
            "--broker",
            url,
            "--id",
            HOST_ID,
            "--public-key",
            public_key,
        ]
        procs.append(
            subprocess.Popen(
                host_argv, stdout=(logs / "device-host.log").open("w"), stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )  # fmt: skip
        log(f"job {job} at {url}: aggregator + {HOST_ID} on the host, {PI_ID} emulated")
        procs.append(
            subprocess.Popen(
                as_service(mode, root, exec_start), stdout=(logs / "device-pi.log").open("w"),
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        )  # fmt: skip
        agg, pi = procs[0], procs[2]
        deadline = time.monotonic() + timeout
        while agg.poll() is None:
            if pi.poll() not in (None, 0):  # the Pi gave up: waiting for the aggregator is vain
                result["error"] = f"{PI_ID} exited with status {pi.returncode} mid-job"
                break
            # (status 0: the Pi saw the job end; the aggregator is writing its files)
            if time.monotonic() > deadline:
                result["error"] = f"the aggregator did not finish within {timeout:.0f}s"
                break
            time.sleep(1)
        result["job_s"] = round(time.perf_counter() - t0, 1)
        result["aggregator_rc"] = agg.poll()
        for p in procs[1:]:  # the job ended: the devices stop by themselves
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=60)
        result["pi_rc"] = procs[2].poll()
        time.sleep(0.5)
        tap.close()
        result["pi_acks"] = tap.acks
    metrics = records_dir / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    keep = ("round", "status", "selected", "received", "rejected", "accuracy", "epsilon",
            "wall_time_s", "bytes_up")  # fmt: skip
    result["records"] = [{k: r.get(k) for k in keep} for r in records]
    pi_log = (logs / "device-pi.log").read_text(errors="replace")
    result["pi_rounds_sent"] = sorted(
        {int(m) for m in re.findall(r"round (\d+): (?:re-)?sent \d+ bytes", pi_log)}
    )
    result["pi_log_excerpt"] = pi_log.splitlines()[-12:]
    result["aggregator_log_excerpt"] = [
        line
        for line in (logs / "aggregator.log").read_text(errors="replace").splitlines()
        if line.startswith(("round ", "job finished"))
    ]
    return result


def check(job: dict[str, Any]) -> list[str]:
    """What the job result fails to show (empty: the Pi's update was accepted in every round)."""
    problems = [job["error"]] if job.get("error") else []
    records = job.get("records", [])
    if job.get("aggregator_rc") != 0:
        problems.append(f"aggregator exit status {job.get('aggregator_rc')}")
    if [r["round"] for r in records] != list(range(1, ROUNDS + 1)):
        problems.append(f"rounds recorded: {[r['round'] for r in records]}")
    for r in records:
        if r["status"] != "closed" or r["received"] != 2 or r["rejected"] != 0:
            problems.append(f"round {r['round']}: {r['status']}, received {r['received']}/2, "
                            f"rejected {r['rejected']}")  # fmt: skip
    acks = job.get("pi_acks", [])
    if sum(1 for a in acks if a.get("ok")) != ROUNDS or any(not a.get("ok") for a in acks):
        problems.append(f"acks to {PI_ID}: {acks}")
    if job.get("pi_rounds_sent") != list(range(1, ROUNDS + 1)):
        problems.append(f"{PI_ID} sent updates for rounds {job.get('pi_rounds_sent')}")
    return problems


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/edge-fl/pi-arm64",
                    help="where the arm64 root and pip downloads are kept between runs")  # fmt: skip
    ap.add_argument("--mode", choices=["auto", "userns", "chroot", "proot"], default="auto")
    ap.add_argument("--register-binfmt", action="store_true",
                    help="chroot mode: register qemu in the HOST's binfmt_misc (until reboot)")  # fmt: skip
    ap.add_argument("--rebuild", action="store_true", help="rebuild the cached root")
    ap.add_argument("--wheel", type=Path, help="install this wheel instead of building one")
    ap.add_argument("--source", type=Path, default=REPO, help="source tree to build the wheel of")
    ap.add_argument("--system-numpy", action="store_true",
                    help="venv with --system-site-packages (Debian's python3-numpy visible)")  # fmt: skip
    ap.add_argument("--out", type=Path, help="logs and records (default: a temp dir, kept)")
    ap.add_argument("--json", type=Path, help="write the summary here too")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the job phase")
    ap.add_argument("--keep-root", action="store_true", help="keep this run's root copy")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--userns-exec"]:  # internal: in_root's userns command line
        root, rest = argv[1], argv[2:]
        split = rest.index("--")
        pairs = rest[:split]
        return userns_run(root, list(zip(pairs[::2], pairs[1::2], strict=True)), rest[split + 1 :])
    args = ap.parse_args(argv)

    if os.geteuid() != 0:
        print(
            "emulate_pi: run as root (debootstrap, chroot and install.sh need it)", file=sys.stderr
        )
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="emulate-pi-"))
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    summary: dict[str, Any] = {"out": str(out), "host": os.uname().machine}
    run_root = args.cache / "run-root"
    status = 1
    try:
        if lacking := missing_tools("proot" if args.mode == "proot" else "chroot"):
            raise Unsupported(f"missing: {', '.join(lacking)} (apt-get install "
                              "qemu-user-static debootstrap mosquitto)")  # fmt: skip
        t0 = time.perf_counter()
        mode = choose_mode(args.mode, args.register_binfmt)  # every refusal before any build
        summary["mode"] = mode
        summary["mode_check_s"] = round(time.perf_counter() - t0, 2)
        log(f"running arm64 code by {mode}")
        t0 = time.perf_counter()
        summary["root"] = build_root(args.cache, mode, logs, args.rebuild)
        summary["root"]["phase_s"] = round(time.perf_counter() - t0, 1)
        summary["root"]["copy_s"] = round(fresh_copy(Path(summary["root"]["path"]), run_root), 1)
        t0 = time.perf_counter()
        wheel = args.wheel or build_wheel(args.source, out / "wheel", logs)
        summary["wheel"] = {"path": str(wheel), "bytes": wheel.stat().st_size,
                            "build_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
        summary["install"] = install(mode, run_root, wheel, args.cache, logs, args.system_numpy)
        summary["job"] = run_job(mode, run_root, out, logs, args.timeout)
        summary["problems"] = check(summary["job"])
        status = 0 if not summary["problems"] else 1
    except Unsupported as exc:
        summary["problems"] = [str(exc)]
        status = 3
    except (Failure, subprocess.TimeoutExpired) as exc:
        summary["problems"] = [str(exc)]
    except KeyboardInterrupt:
        summary["problems"] = ["interrupted"]
    finally:
        if not args.keep_root and run_root.exists():
            shutil.rmtree(run_root, ignore_errors=True)
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    (out / "summary.json").write_text(text)
    if args.json:
        args.json.write_text(text)
    log("PASS" if status == 0 else f"FAIL: {summary['problems']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
