"""The README's secure deployment, run as written: its fenced commands, in order, with only these
substitutions (a test cannot own /etc, port 8883 or systemd):

- the fixed paths `/etc/mosquitto/edge-fl`, `/etc/mosquitto/mosquitto.conf`, `/etc/edge-fl` (and
  in the installed broker config `/run/mosquitto`, `/var/lib/mosquitto`, `/var/log/mosquitto`)
  move under a temporary directory; the host name `broker.example.org` becomes `localhost`;
  ports 8883 and 1883 become free ports;
- `apt-get install` is skipped (mosquitto, mosquitto_passwd and openssl must be installed);
  ownership changes (`install -o/-g`, `chgrp`, `user mosquitto` in the broker config) are dropped:
  the test's files belong to whoever runs it;
- `systemctl restart mosquitto` starts `mosquitto -c` on the installed config itself;
- the long-running commands (`edge-fl aggregator|fleet|device`) start in the background; each
  block's other commands run as one bash script (`set -e`), from a directory where `broker/` is
  the checkout's.

Then: every round of the job closes with an update from each of the 6 devices (2 single devices,
2 fleet shards with per-device credentials), and the broker's ACL refuses a device that publishes
with another device's credentials or under another job id (issue 24: the ACL is per job, so a
device cannot retain under invented job ids).

The second test runs the same deployment with sharded ingest as broker/README.md writes it
(workers minted with `mint-credentials.sh --ingest-workers 2`, `systemctl reload mosquitto`, the
aggregator with `--workers 2`): every round closes with both workers' shares, and a worker's
credentials cannot publish on another worker's topics (`systemctl reload` sends SIGHUP).
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiomqtt
import pytest

from edge_fl.transport import client_adapter
from edge_fl.transport.url import parse_broker_url

REPO = Path(__file__).resolve().parents[1]
BACKGROUND = re.compile(r"^edge-fl (aggregator|fleet|device)\b")


def readme_section(path: Path, start: str, end: str | None) -> str:
    text = path.read_text(encoding="utf-8")
    a = text.index(start)
    b = text.index(end, a) if end else len(text)
    return text[a:b]


def shell_blocks(markdown: str) -> list[list[str]]:
    """The fenced ```bash / ```sh blocks, each as a list of commands: continuation lines joined,
    a heredoc kept with its command, blank and comment-only lines dropped."""
    blocks = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", markdown, re.M | re.S):
        commands: list[str] = []
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            while line.endswith("\\") and i < len(lines):
                line = line[:-1] + " " + lines[i].strip()
                i += 1
            heredoc = re.search(r"<<-?\s*'?(\w+)'?", line)
            if heredoc:
                body = []
                while i < len(lines) and lines[i] != heredoc.group(1):
                    body.append(lines[i])
                    i += 1
                line = "\n".join([line, *body, heredoc.group(1)])
                i += 1
            commands.append(line)
        blocks.append(commands)
    return blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """Runs the README's commands with the documented substitutions; cleans up its processes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.work = root / "work"
        self.work.mkdir()
        (self.work / "broker").symlink_to(REPO / "broker")
        (self.work / "devices").symlink_to(REPO / "devices")
        self.tls_port, self.plain_port = _free_port(), _free_port()
        self.paths = {
            "/etc/mosquitto/edge-fl": root / "etc/mosquitto/edge-fl",
            "/etc/mosquitto/mosquitto.conf": root / "etc/mosquitto/mosquitto.conf",
            "/etc/edge-fl": root / "etc/edge-fl",
            "/run/mosquitto": root / "run/mosquitto",
            "/var/lib/mosquitto": root / "var/lib/mosquitto",
            "/var/log/mosquitto": root / "var/log/mosquitto",
        }
        for name in ("etc/mosquitto", "run/mosquitto", "var/lib/mosquitto", "var/log/mosquitto"):
            (root / name).mkdir(parents=True)  # what the Debian package creates
        self.env = dict(os.environ)
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env['PATH']}"
        self.background: dict[str, subprocess.Popen[str]] = {}
        self.broker: subprocess.Popen[bytes] | None = None

    def substitute(self, text: str) -> str:
        for fixed, local in self.paths.items():
            text = text.replace(fixed, str(local))
        text = text.replace("broker.example.org", "localhost")
        text = re.sub(r"\b8883\b", str(self.tls_port), text)
        return re.sub(r"\b1883\b", str(self.plain_port), text)

    def run(self, command: str) -> None:
        """One README command (already joined), as the module docstring says."""
        if command.startswith("apt-get "):
            return
        if command.startswith(("chgrp ", "chown ")):
            return
        if command.startswith("systemctl restart mosquitto"):
            self.start_broker()
            return
        if command.startswith("systemctl reload mosquitto"):
            self.reload_broker()
            return
        if command.startswith("install "):
            command = re.sub(r"\s-[og]\s+\S+", "", command)
        command = self.substitute(command)
        if BACKGROUND.match(command):
            name = " ".join(command.split()[:2]) + f" #{len(self.background)}"
            log = (self.root / f"bg{len(self.background)}.log").open("w")
            self.background[name] = subprocess.Popen(
                ["bash", "-c", command],
                cwd=self.work,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            self.background[name].log_path = log.name  # type: ignore[attr-defined]
            return
        self.script.append(command)

    def run_block(self, commands: list[str]) -> None:
        self.script: list[str] = []
        for command in commands:
            if BACKGROUND.match(command) or command.startswith("systemctl re"):
                self.flush()  # what came before it in the block has run
            self.run(command)
        self.flush()

    def flush(self) -> None:
        if not self.script:
            return
        script = "set -e -o pipefail\n" + "\n".join(self.script) + "\n"
        self.script = []
        done = subprocess.run(
            ["bash", "-c", script],
            cwd=self.work,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{script}\n---\n{done.stdout}\n{done.stderr}"

    def start_broker(self) -> None:
        conf = self.paths["/etc/mosquitto/mosquitto.conf"]
        text = self.substitute(conf.read_text())
        text = re.sub(r"^user mosquitto$", f"user {getpass.getuser()}", text, flags=re.M)
        conf.write_text(text)
        self.broker = subprocess.Popen(
            ["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.broker.poll() is None, self.broker.stderr.read().decode()  # type: ignore[union-attr]
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.tls_port), timeout=0.5),
            ):
                return
            time.sleep(0.1)
        raise AssertionError(f"mosquitto did not listen on {self.tls_port}")

    def reload_broker(self) -> None:
        """SIGHUP (what `systemctl reload mosquitto` sends): passwd and acl are read again. Waits
        for the broker's log line saying so."""
        assert self.broker is not None
        log = self.paths["/var/log/mosquitto"] / "mosquitto.log"
        before = log.read_text().count("Reloading config")
        self.broker.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while log.read_text().count("Reloading config") == before:
            assert time.monotonic() < deadline, "mosquitto did not reload"
            time.sleep(0.05)

    def log(self, name: str) -> str:
        return Path(self.background[name].log_path).read_text()  # type: ignore[attr-defined]

    def all_logs(self) -> str:
        return "\n".join(f"== {name}\n{self.log(name)}" for name in self.background)

    def close(self) -> None:
        for proc in self.background.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self.broker is not None and self.broker.poll() is None:
            self.broker.terminate()
            self.broker.wait(5)


def _require_tools() -> None:
    for tool in ("mosquitto", "mosquitto_passwd", "openssl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed")


def _wait_for_aggregator(deploy: Deployment, timeout: float = 150) -> dict[str, str]:
    """The aggregator's exit, then every other process's; all exit 0 without a traceback."""
    aggregator = next(n for n in deploy.background if n.startswith("edge-fl aggregator"))
    try:
        deploy.background[aggregator].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail("the aggregator did not finish:\n" + deploy.all_logs())
    if deploy.background[aggregator].returncode != 0:
        pytest.fail("the aggregator failed:\n" + deploy.all_logs())
    for name, proc in deploy.background.items():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not stop after the job:\n{deploy.all_logs()}")
    logs = {name: deploy.log(name) for name in deploy.background}
    for name, proc in deploy.background.items():
        assert proc.returncode == 0, f"{name}:\n{logs[name]}"
        assert "Traceback" not in logs[name], logs[name]
    return logs


def sharded_block() -> list[str]:
    """broker/README.md's sharded-ingest commands (a ```text block: run here, not by
    tests/test_readme_commands.py)."""
    text = readme_section(REPO / "broker/README.md", "## Sharded ingest", "## Beyond one broker")
    block = re.search(r"<!-- run as written[^\n]*-->\n```text\n(.*?)^```", text, re.M | re.S)
    assert block, "broker/README.md lost its sharded-ingest block"
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.broker
def test_readme_sharded_secure_deployment_runs_as_written(tmp_path: Path) -> None:
    """Issue 24 item 4: `--workers 2` on the shipped secure configuration: per-worker users
    minted from the aggregator's line, the shipped ACL's worker blocks, a reload."""
    _require_tools()
    section = readme_section(REPO / "README.md", "## Real deployment", "### Raspberry Pi agents")
    blocks = shell_blocks(section)
    sharded = sharded_block()
    assert any("--workers 2" in c and c.startswith("edge-fl aggregator") for c in sharded)
    deploy = Deployment(tmp_path)
    try:
        deploy.run_block(blocks[0])
        deploy.run_block(blocks[1])
        deploy.run_block(sharded)  # mint the workers, reload, the sharded aggregator
        deploy.run_block([c for c in blocks[2] if not c.startswith("edge-fl aggregator")])
        kinds = sorted(name.split(" #")[0] for name in deploy.background)
        assert kinds == ["edge-fl aggregator"] + ["edge-fl device"] * 2 + ["edge-fl fleet"] * 2
        logs = _wait_for_aggregator(deploy)
        records = [
            json.loads(line)
            for line in (deploy.work / "runs/prod/metrics.jsonl").read_text().splitlines()
        ]
        got = [(r["status"], r["received"], r["workers"], r["workers_missing"]) for r in records]
        assert got == [("closed", 6, 2, [])] * 3, (records, deploy.all_logs())
        assert all("ingest_refused" not in r for r in records), records
        aggregator = next(v for k, v in logs.items() if k.startswith("edge-fl aggregator"))
        assert "started 2 ingest workers" in aggregator, aggregator
        _acl_keeps_each_worker_to_its_own_topics(deploy)
    finally:
        deploy.close()


def _acl_keeps_each_worker_to_its_own_topics(deploy: Deployment) -> None:
    """aggregator-w0 may answer on ingest/*/w0, not on w1's topics nor the control topic: the
    broker drops such a publish and disconnects the worker."""
    users = dict(
        line.split("\t") for line in (deploy.work / "workers.tsv").read_text().splitlines()
    )
    w0 = parse_broker_url(users["aggregator-w0"].strip())
    base = "edgefl/digits-prod/ingest"

    async def publish(topic: str) -> bool:
        """Whether the worker is still connected after publishing on ``topic``."""
        async with aiomqtt.Client(**w0.aiomqtt_kwargs(), identifier="aggregator-w0") as worker:
            await worker.publish(topic, b"x", qos=1)
            for _ in range(200):
                if not client_adapter.is_connected(worker):
                    return False
                await asyncio.sleep(0.01)
            return True

    assert asyncio.run(publish(f"{base}/progress/w0"))
    for topic in (f"{base}/progress/w1", f"{base}/partial/w1", f"{base}/worker/w1", f"{base}/ctl"):
        assert not asyncio.run(publish(topic)), topic


@pytest.mark.broker
def test_readme_secure_deployment_runs_as_written(tmp_path: Path) -> None:
    _require_tools()
    section = readme_section(REPO / "README.md", "## Real deployment", "### Raspberry Pi agents")
    blocks = shell_blocks(section)
    assert len(blocks) == 3, "broker, aggregator host, processes"
    started = time.monotonic()
    deploy = Deployment(tmp_path)
    try:
        for block in blocks:
            deploy.run_block(block)
        kinds = sorted(name.split(" #")[0] for name in deploy.background)
        assert kinds == ["edge-fl aggregator"] + ["edge-fl device"] * 2 + ["edge-fl fleet"] * 2
        logs = _wait_for_aggregator(deploy, timeout=120)

        job = (tmp_path / "etc/edge-fl/job.yaml").read_text()
        assert "devices: 6" in job and "rounds: 3" in job
        records = [
            json.loads(line)
            for line in (deploy.work / "runs/prod/metrics.jsonl").read_text().splitlines()
        ]
        # clients_per_round = min_updates = 6 devices: a round closes only with all six
        # accepted, so each round holds both single devices' and both shards' updates.
        assert [(r["status"], r["received"], r["rejected"]) for r in records] == [
            ("closed", 6, 0)
        ] * 3, records
        for name, text in logs.items():
            if name.startswith("edge-fl fleet"):
                assert "6 updates published" in text, text  # 2 devices x 3 rounds
        summary = json.loads((deploy.work / "runs/prod/summary.json").read_text())
        assert summary.get("rounds_closed", 3) == 3

        _acl_refuses_a_borrowed_identity(deploy)
        _acl_refuses_another_job(deploy)
    finally:
        deploy.close()
    print(f"secure deployment: {time.monotonic() - started:.1f}s")


def _acl_refuses_a_borrowed_identity(deploy: Deployment) -> None:
    """d00000's credentials cannot publish as d00001: the broker drops the message and the
    connection; the same session's own update topic works."""
    users = dict(
        line.split("\t") for line in (deploy.work / "devices.tsv").read_text().splitlines()
    )
    # the files already hold the substituted host, port and CA path (minted by the test)
    aggregator = parse_broker_url(
        (deploy.work / "aggregator.tsv").read_text().split("\t")[1].strip()
    )
    d0 = parse_broker_url(users["d00000"])
    job = "digits-prod"  # the ACL's job (its aggregator has finished)

    async def check() -> list[str]:
        got: list[str] = []
        async with aiomqtt.Client(**aggregator.aiomqtt_kwargs(), identifier="x") as agg:
            await agg.subscribe(f"edgefl/{job}/up/#", qos=1)
            async with aiomqtt.Client(**d0.aiomqtt_kwargs(), identifier="d00000") as dev:
                await dev.publish(f"edgefl/{job}/up/d00000", b"own", qos=1)
                await dev.publish(f"edgefl/{job}/up/d00001", b"forged", qos=1)
                for _ in range(500):  # the broker drops the forger (wait up to 5 s)
                    if not client_adapter.is_connected(dev):
                        break
                    await asyncio.sleep(0.01)
                assert not client_adapter.is_connected(dev), "the broker kept the forger connected"

            async def collect() -> None:
                async for message in agg.messages:
                    got.append(message.topic.value)

            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(collect(), 1.0)
        return got

    assert asyncio.run(check()) == [f"edgefl/{job}/up/d00000"]


def _acl_refuses_another_job(deploy: Deployment) -> None:
    """Issue 24 item 6: d00001, with its own credentials, cannot retain a status under a job id
    of its invention (the red team's 400 x 1 MiB): the broker drops it and disconnects it; its
    own job's status topic still works."""
    users = dict(
        line.split("\t") for line in (deploy.work / "devices.tsv").read_text().splitlines()
    )
    d1 = parse_broker_url(users["d00001"].strip())

    async def retain(job: str) -> bool:
        """Whether d00001 is still connected after retaining 1 MiB on its status in ``job``."""
        async with aiomqtt.Client(**d1.aiomqtt_kwargs(), identifier="d00001") as dev:
            await dev.publish(f"edgefl/{job}/status/d00001", b"x" * (1 << 20), 1, retain=True)
            for _ in range(200):
                if not client_adapter.is_connected(dev):
                    return False
                await asyncio.sleep(0.01)
            await dev.publish(f"edgefl/{job}/status/d00001", b"", 1, retain=True)  # clear it
            return True

    assert not asyncio.run(retain("spam-0001")), "the broker let d00001 write under another job"
    assert asyncio.run(retain("digits-prod"))
