"""Every fenced shell command of README.md, broker/README.md and devices/raspberry-pi/README.md is
accounted for: run for real in a temp dir, checked by its option parser and config validation
(long runs), covered by tests/test_secure_deployment.py, or skipped for a stated reason. The table
below is keyed by a pattern; a new command that no entry matches fails the test, so a README edit
cannot add an untested command silently. Every example job config they ship validates.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_secure_deployment import Deployment, readme_section, shell_blocks
from test_shipped_configs import readme_job_yaml

from edge_fl.config import load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "broker/README.md", "devices/raspberry-pi/README.md")
EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))

RUN = "run"  # for real, in a temp dir (cheap)
PARSE = "parse"  # options parsed and the job config built, not run (minutes of training)
DEPLOYMENT = "deployment"  # run as written by tests/test_secure_deployment.py
BROKER_BLOCK = "broker-block"  # broker/README.md's block, run here with the deployment's rules
OPTIONS = "options"  # its options parse (the command needs a real broker and a running job)
SKIP = "skip"

# (document, pattern matched at the start of the command, action, why)
TABLE: list[tuple[str, str, str, str]] = [
    ("README.md", r"python3 -m venv \.venv && ", SKIP,
     "installs the package: what tools/test.sh does before every CI run"),
    ("README.md", r"tools/test\.sh$", SKIP, "the CI command itself (it runs this test)"),
    ("README.md", r"edge-fl simulate ", PARSE, "a full simulated job takes 10 s to minutes"),
    ("README.md", r"edge-fl (privacy|comm-cost|audit) ", RUN, "seconds"),
    ("README.md", r"edge-fl report ", PARSE, "needs the runs of the two simulate commands"),
    ("README.md", r"apt-get install ", DEPLOYMENT, "root; the test needs mosquitto installed"),
    ("README.md", r"(install|umask|chgrp|chmod|cp|cat) ", DEPLOYMENT, "the secure deployment"),
    ("README.md", r"broker/(make-certs|mint-credentials)\.sh ", DEPLOYMENT, "the deployment"),
    ("README.md", r"systemctl restart mosquitto$", DEPLOYMENT, "the test starts mosquitto -c"),
    ("README.md", r"edge-fl device --broker 'mqtts://d00007:PASSWORD@broker\.example\.org", OPTIONS,
     "the Pi form; run for real by tests/test_job_document.py and the deployment test"),
    ("README.md", r"edge-fl (aggregator|fleet) --broker mqtt://127\.0\.0\.1:1883 --job sharded", PARSE,
     "needs a broker on 1883; tests/test_sharded_e2e.py runs the same commands on its own"),
    ("README.md", r"edge-fl ingest --config job\.yaml ", PARSE,
     "needs site brokers; tests/test_sharded_e2e.py runs site aggregators behind two bridges"),
    ("README.md", r"edge-fl keygen keys --devices ", RUN, "seconds: device signing keys"),
    ("README.md", r"edge-fl (keygen|aggregator|fleet|device) ", DEPLOYMENT, "the deployment"),
    ("README.md", r"sudo devices/raspberry-pi/install\.sh ", SKIP,
     "root, a wheel and systemd: the emulated-Pi tool in tools/ runs it"),
    ("README.md", r"sudoedit ", SKIP, "an editor"),
    ("README.md", r"sudo systemctl ", SKIP, "root and systemd"),
    ("broker/README.md", r"apt-get install ", SKIP, "root; the test needs mosquitto installed"),
    ("broker/README.md", r"systemctl (edit|restart) mosquitto", SKIP,
     "root and systemd (the deployment test starts mosquitto -c on the same config)"),
    ("broker/README.md", r"(install|umask|chgrp|chmod|mv|cd) ", BROKER_BLOCK, "files only"),
    ("broker/README.md", r"broker/(make-certs|mint-credentials)\.sh ", BROKER_BLOCK, "cheap"),
    ("devices/raspberry-pi/README.md", r"sudo ", SKIP, "root on a Pi (emulated-Pi tool)"),
    ("devices/raspberry-pi/README.md", r"edge-fl device ", OPTIONS,
     "the Pi form; run for real by tests/test_job_document.py and the deployment test"),
    ("devices/raspberry-pi/README.md", r"broker/mint-credentials\.sh ", SKIP,
     "the same script and options run in broker/README.md's block"),
    ("devices/raspberry-pi/README.md", r"sudoedit ", SKIP, "an editor"),
]  # fmt: skip


def commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        path = REPO / doc
        if path.exists():
            for block in shell_blocks(path.read_text(encoding="utf-8")):
                found += [(doc, command) for command in block]
    return found


def action(doc: str, command: str) -> str:
    for where, pattern, what, _why in TABLE:
        if where == doc and re.match(pattern, command):
            return what
    raise AssertionError(f"{doc}: no entry in TABLE for {command!r}: decide how it is tested")


def test_every_command_has_an_entry() -> None:
    found = commands()
    assert len(found) > 20
    for doc, command in found:
        action(doc, command)
    deployment = readme_section(REPO / "README.md", "## Real deployment", "### Raspberry Pi agents")
    covered = {c for block in shell_blocks(deployment) for c in block}
    for doc, command in found:  # "covered by the deployment test" must be true
        if action(doc, command) == DEPLOYMENT:
            assert doc == "README.md" and command in covered, command


def _args(command: str) -> list[str]:
    import shlex

    return shlex.split(command, comments=True)


@pytest.mark.parametrize(
    ("doc", "command"),
    [c for c in commands() if action(*c) == RUN],
    ids=lambda v: v[:60] if isinstance(v, str) else v,
)
def test_cheap_commands_run(doc: str, command: str, tmp_path: Path) -> None:
    readme_job_yaml(tmp_path)
    args = _args(command)
    assert args[0] == "edge-fl"
    # no wall-time bound (under full CPU load a cheap command took 33 s): the timeout only
    # catches a hang; what these commands cost is measured in tools/, not asserted here
    done = subprocess.run(
        [EDGE_FL, *args[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("doc", "command"),
    [c for c in commands() if action(*c) == OPTIONS],
    ids=lambda v: v[:60] if isinstance(v, str) else v,
)
def test_device_commands_parse(doc: str, command: str) -> None:
    from edge_fl.cli import main

    args = _args(command)
    cmd = main.get_command(None, args[1])  # type: ignore[arg-type]
    ctx = cmd.make_context(args[1], args[2:])
    assert ctx.params["url"].startswith("mqtts://") and ctx.params["device_id"]


@pytest.mark.parametrize(
    ("doc", "command"),
    [c for c in commands() if action(*c) == PARSE],
    ids=lambda v: v[:60] if isinstance(v, str) else v,
)
def test_long_commands_parse(doc: str, command: str, tmp_path: Path, monkeypatch) -> None:
    """Option names and values parse, and the job they describe builds (dataset, model,
    calibrated mechanism): what fails first when a README flag goes stale."""
    from edge_fl.cli import job_overrides, load_job_config, main

    readme_job_yaml(tmp_path)  # the README's job.yaml, for commands that name it
    monkeypatch.chdir(tmp_path)

    args = _args(command)
    name = args[1]
    cmd = main.get_command(None, name)  # type: ignore[arg-type]
    ctx = cmd.make_context(name, args[2:])
    if name == "report":
        return  # the options parsed; the runs it reads come from the simulate commands
    cfg = load_job_config(ctx.params.get("config"), job_overrides(ctx.params))
    if cfg.data.data_dir is None:  # a user's dataset files (femnist) are not here to load
        from edge_fl.job import build_job

        build_job(cfg)


def test_broker_readme_block_runs(tmp_path: Path) -> None:
    """broker/README.md's deployment, with the secure-deployment test's substitutions (and
    /root under the temp dir): certificates, 1 + 50 users named like the job's devices, ACL,
    config, and the config it installs starts Mosquitto with them."""
    import shutil

    for tool in ("mosquitto", "mosquitto_passwd", "openssl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed")
    deploy = Deployment(tmp_path)
    deploy.paths["/root"] = tmp_path / "root"
    (tmp_path / "root").mkdir()
    text = (REPO / "broker/README.md").read_text()
    [block] = [b for b in shell_blocks(text) if any(c.startswith("systemctl restart") for c in b)]
    block = [c.replace("/path/to/broker/", "broker/") for c in block]
    block = [c for c in block if not c.startswith(("systemctl edit", "cd "))]
    try:
        deploy.run_block(block)
        devices = (tmp_path / "root/devices.tsv").read_text().splitlines()
        assert [line.split("\t")[0] for line in devices] == [f"d{i:05d}" for i in range(50)]
        assert deploy.broker is not None and deploy.broker.poll() is None
    finally:
        deploy.close()


def test_example_job_configs_validate(tmp_path: Path) -> None:
    load_config(readme_job_yaml(tmp_path))
    deployment = readme_section(REPO / "README.md", "## Real deployment", "### Raspberry Pi agents")
    heredoc = re.search(r"cat > (\S+job\.yaml) <<'EOF'\n(.*?)\nEOF", deployment, flags=re.S)
    assert heredoc, "the deployment writes its job.yaml"
    text = heredoc.group(2).replace("/etc/edge-fl/keys", str(tmp_path / "keys"))
    subprocess.run([EDGE_FL, "keygen", str(tmp_path / "keys")], check=True, capture_output=True)
    (tmp_path / "deploy.yaml").write_text(text)
    load_config(tmp_path / "deploy.yaml")
    shipped = [
        p
        for p in (*REPO.glob("docs/**/*.yaml"), *REPO.glob("docs/**/*.toml"))
        if "job" in p.read_text()
    ]
    for path in shipped:
        load_config(path)
