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
    from edge_fl.storage import lock_run_dir

    held = lock_run_dir(tmp_path / "run")  # this process plays the first run
    done = run("simulate", "--rounds", "1", "--out", str(tmp_path / "run"), "--no-progress")
    one_line_error(done, "in use by another edge-fl run", f"pid {__import__('os').getpid()}")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    held.close()  # released: the directory can be used again
    again = run("simulate", "--rounds", "1", "--out", str(tmp_path / "run"), "--no-progress")
    assert again.returncode == 0, again.stderr


# ------------------------------------------------------------------ --help without imports


def test_help_lists_every_command_without_importing_them():
    """`edge-fl --help` must not import numpy, scipy or dp-accounting (2-3 s), nor any subcommand
    module: the device-only install cannot import `audit`'s (rich is part of the server extra)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *EDGE_FL, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "click" in imported and "edge_fl.cli" in imported  # the listing is complete
    heavy = {"numpy", "scipy", "dp_accounting", "rich", "torch", "aiomqtt", "paho", "pydantic"}
    assert not {m for m in imported if m.split(".")[0] in heavy}
    assert not {m for m in imported if m.startswith("edge_fl.cli.")}
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")]
    from edge_fl.cli import _LAZY, main

    expected = sorted([*main.commands, *_LAZY])
    assert [name for name in listed if name in expected] == expected


def test_the_help_summaries_are_the_commands_own():
    """The summaries `--help` lists without importing a command are its docstring's first line."""
    import click

    from edge_fl.cli import _LAZY, main

    ctx = click.Context(main)
    for name, (_, _, summary) in _LAZY.items():
        command = main.get_command(ctx, name)
        assert command is not None
        assert command.get_short_help_str(limit=1000) == summary, name


# ------------------------------------------------------------------ broker URL mistakes


@pytest.mark.parametrize("command", ["aggregator", "fleet", "device", "simulate"])
def test_a_broker_url_without_a_scheme(command):
    done = run(command, "--broker", "127.0.0.1:1883", *(["--id", "d00000"] * (command == "device")))
    one_line_error(done, "broker URL '127.0.0.1:1883' has no scheme", "mqtt://host[:port]")
    assert len(done.stderr.splitlines()) == 1, done.stderr  # nothing said before it


@pytest.mark.parametrize("command", ["aggregator", "fleet", "device"])
def test_a_missing_ca_file(command):
    url = "mqtts://d00000:hunter2@localhost:8883?ca=/nonexistent/ca.crt"
    done = run(command, "--broker", url, *(["--id", "d00000"] * (command == "device")))
    line = one_line_error(done, "ca='/nonexistent/ca.crt': file does not exist")
    assert "hunter2" not in done.stderr, line
    assert len(done.stderr.splitlines()) == 1, done.stderr  # nothing said before it


def test_a_broker_url_from_the_config_file_is_checked_as_the_flag_is(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("broker: {url: 'mqtts://localhost:8883?ca=/nonexistent/ca.crt'}\n")
    for command in ("aggregator", "fleet"):
        done = run(command, "--config", str(cfg))
        one_line_error(done, "ca='/nonexistent/ca.crt': file does not exist")


def test_a_ca_file_that_is_not_a_certificate(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("not a certificate\n")
    done = run("device", "--broker", f"mqtts://localhost:8883?ca={ca}", "--id", "d00000")
    one_line_error(done, f"ca='{ca}': not a readable PEM CA certificate")


@pytest.mark.parametrize("command", ["simulate", "fleet"])
def test_an_unknown_fleet_profile_is_named_as_the_user_wrote_it(command):
    extra = ["--no-progress"] if command == "simulate" else ["--broker", "mqtt://127.0.0.1:9"]
    done = run(command, "--profile", "nosuch", *extra)
    line = one_line_error(done, "fleet profile 'nosuch' is neither a YAML file nor a packaged")
    assert "load_profile" not in line and "name_or_path" not in line, line
    assert "phone-fleet" in line


def test_operator_errors_are_one_line_from_any_subcommand_even_inside_a_task_group():
    """The group, not each command, turns an operator's mistake into its one error line; other
    exceptions (bugs) keep their traceback."""
    import click
    from click.testing import CliRunner

    from edge_fl.cli import _LazyGroup
    from edge_fl.config import ConfigError
    from edge_fl.fleet.profiles import UnknownProfileError
    from edge_fl.transport.url import BrokerUrlError

    raised: list[BaseException] = [
        BrokerUrlError("broker URL 'x' has no scheme"),
        ExceptionGroup("tasks", [RuntimeError("cancelled"), UnknownProfileError("nosuch")]),
        ConfigError("invalid configuration:\n  data.devices: must be >= 1"),
        ValueError("a bug"),
    ]

    @click.group(cls=_LazyGroup)
    def group() -> None:
        pass

    @group.command()
    @click.argument("i", type=int)
    def fail(i: int) -> None:
        raise raised[i]

    runner = CliRunner()
    outputs = [runner.invoke(group, ["fail", str(i)]) for i in range(len(raised))]
    assert [o.exit_code for o in outputs[:3]] == [2, 2, 2]
    assert outputs[0].stderr == "edge-fl: error: broker URL 'x' has no scheme\n"
    assert outputs[1].stderr.startswith("edge-fl: error: fleet profile 'nosuch' is neither")
    # one problem, one line
    assert (
        outputs[2].stderr == "edge-fl: error: invalid configuration: data.devices: must be >= 1\n"
    )
    assert isinstance(outputs[3].exception, ValueError)  # not an operator error: raised as is


def test_a_dataset_of_files_without_a_directory_names_the_flag_and_the_key():
    """Not the loader's Python argument (`data_dir=`): the command line's --data-dir and the
    config's data.data_dir."""
    line = one_line_error(run("simulate", "--dataset", "mnist", "--rounds", "1", "--no-progress"))
    assert "--data-dir DIR" in line and "data.data_dir" in line and "data_dir=" not in line


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--indices", "2:8", "--indices '2:8': need 0 <= FROM < TO <= data.devices = 4"),
        ("--indices", "2-8", "--indices '2-8': use FROM:TO, e.g. 2:50"),
        ("--shard", "3/2", "--shard '3/2': need N >= 1 and 0 <= I < N"),
    ],
)
def test_fleet_ranges_out_of_domain_are_the_usual_error_line(flag, value, expected):
    done = run("fleet", "--broker", "mqtt://127.0.0.1:9", "--devices", "4", flag, value)
    assert one_line_error(done, expected) == f"edge-fl: error: {expected}"
    assert "Invalid value" not in done.stderr and "Try 'edge-fl" not in done.stderr


def test_privacy_mechanisms_shows_every_name_whole_at_80_columns():
    import os
    import sys

    # the names a fresh process registers (another test may have registered its own here)
    code = "from edge_fl.mechanisms import mechanism_names; print(*mechanism_names())"
    built_in = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run(
        [*EDGE_FL, "privacy", "mechanisms"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout, done.stdout
    names = {line.split("│")[1].strip() for line in done.stdout.splitlines() if "│" in line}
    assert built_in and set(built_in) <= names, names


@pytest.mark.parametrize(
    ("pair", "expected"),
    [
        ("nope", "--set 'nope': expected KEY=VALUE"),
        ("rounds.nope=3", "rounds.nope: unknown key"),
        ("rounds.rounds=[", "--set 'rounds.rounds=[': the value is not YAML"),
        ("rounds.rounds=abc", "rounds.rounds = 'abc'"),
    ],
)
def test_a_bad_set_pair_is_one_line(pair, expected, tmp_path):
    done = run("simulate", "--set", pair, "--out", str(tmp_path / "run"))
    one_line_error(done, expected)
    assert not (tmp_path / "run").exists()


@pytest.mark.broker
@pytest.mark.skipif(find_mosquitto() is None, reason="needs mosquitto")
def test_set_reaches_keys_without_a_flag_and_wins_over_the_flags(tmp_path):
    """`--set key=value` for what has no flag (robust.aggregator, rounds.server_lr) without a
    config file, as docs/config.md says (an outside user found the option missing)."""
    import json

    out = tmp_path / "run"
    done = run(
        "simulate", "--rounds", "5", "--set", "rounds.rounds=2", "--set",
        "robust.aggregator=trimmed_mean", "--set", "rounds.server_lr=0.5", "--devices", "10",
        "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-1500:]
    cfg = json.loads((out / "run.json").read_text())["config"]
    assert (cfg["rounds"]["rounds"], cfg["robust"]["aggregator"]) == (2, "trimmed_mean")
    assert cfg["rounds"]["server_lr"] == 0.5
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
