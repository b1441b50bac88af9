"""Jobs that cannot do what they say are refused before they start, in one line: a run into a
directory that holds an earlier run, a budget nothing enforces, noise the decoder would refuse,
a round that can never close."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import edge_fl
from edge_fl.job import build_job
from edge_fl.simulation import RunDirError

EDGE_FL = [str(Path(sys.executable).parent / "edge-fl")]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGE_FL, *args], capture_output=True, text=True, timeout=timeout)


def one_line_error(done: subprocess.CompletedProcess, *expected: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("edge-fl: error:")]
    assert len(errors) == 1, done.stderr
    for text in expected:
        assert text in errors[0], done.stderr
    return errors[0]


def hashes(directory: Path) -> dict[str, str]:
    """Every file's content hash (and its modification time: rewritten with the same bytes is
    still rewritten)."""
    return {
        p.name: f"{hashlib.sha256(p.read_bytes()).hexdigest()}:{p.stat().st_mtime_ns}"
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def small(**overrides):
    base = {
        "job": f"refuse-{uuid.uuid4().hex[:8]}",
        "model.name": "logreg",
        "data.devices": 6,
        "rounds.rounds": 2,
        "rounds.clients_per_round": 6,
    }
    return edge_fl.load_config(None, {**base, **overrides})


# ------------------------------------------------------------------ an earlier run's directory


def test_simulate_into_a_finished_run_leaves_it_byte_identical(tmp_path):
    out = tmp_path / "run"
    common = ["--model", "logreg", "--devices", "4", "--clients-per-round", "4", "--no-progress"]
    first = run("simulate", *common, "--rounds", "2", "--out", str(out))
    assert first.returncode == 0, first.stderr
    before = hashes(out)
    assert {"metrics.jsonl", "summary.json", "model.onnx"} <= set(before)
    again = run("simulate", *common, "--rounds", "1", "--out", str(out))
    one_line_error(again, f"{out} holds a finished run", "metrics.jsonl", "summary.json", "--out")
    assert hashes(out) == before
    # what `edge-fl report` wrote of the earlier run goes with it; a file of the user's stays
    (out / "metrics.csv").write_text("round\n1\n2\n")
    (out / "accuracy.png").write_bytes(b"png")
    (out / "notes.txt").write_text("mine")
    fresh = run("simulate", *common, "--rounds", "1", "--out", str(out), "--overwrite")
    assert fresh.returncode == 0, fresh.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert not (out / "metrics.csv").exists() and not (out / "accuracy.png").exists()
    assert (out / "notes.txt").read_text() == "mine"


def test_resuming_with_other_settings_names_what_changed_and_touches_nothing(tmp_path):
    """`--resume` with settings the run was not started with (here the learning rate and the
    fleet's size) is one line naming each changed key with its old and new value, not two
    digests; the directory stays byte-identical, and the same settings then continue it."""
    out = tmp_path / "run"
    common = ["--model", "logreg", "--clients-per-round", "4", "--no-progress", "--out", str(out)]
    first = run("simulate", *common, "--devices", "4", "--rounds", "2")
    assert first.returncode == 0, first.stderr
    before = hashes(out)
    changed = run("simulate", *common, "--devices", "5", "--lr", "0.05", "--rounds", "3",
                  "--resume")  # fmt: skip
    line = one_line_error(changed, f"{out} holds a run with other settings",
                          "data.devices: 4 -> 5", "training.lr: 0.3 -> 0.05", "--resume", "--out")  # fmt: skip
    assert "rounds" not in line.split("(")[1].split(")")[0]  # more rounds are no other settings
    assert hashes(out) == before
    same = run("simulate", *common, "--devices", "4", "--rounds", "3", "--resume")
    assert same.returncode == 0, same.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_digest_changes_names_every_changed_key_the_digest_covers():
    """The digest's own sections, key by key; keys outside them (rounds, broker) never named."""
    earlier = small().model_dump(mode="json")
    now = small(**{"job": earlier["job"], "training.lr": 0.01, "privacy.mechanism": "gaussian",
                   "privacy.epsilon": 4.0, "rounds.rounds": 9})  # fmt: skip
    assert now.digest_changes(earlier) == [
        "privacy.epsilon: null -> 4.0",
        'privacy.mechanism: "none" -> "gaussian"',
        "training.lr: 0.3 -> 0.01",
    ]
    assert small(**{"job": earlier["job"], "rounds.rounds": 9}).digest_changes(earlier) == []
    # a section only the earlier run's digest covered is named as well
    secure = small(**{"job": earlier["job"], "secure_aggregation.enabled": True})
    changes = small(**{"job": earlier["job"]}).digest_changes(secure.model_dump(mode="json"))
    assert "secure_aggregation.enabled: true -> false" in changes, changes


@pytest.mark.broker
def test_the_api_refuses_a_finished_runs_directory_unless_asked_to_overwrite(mosquitto, tmp_path):
    cfg = small(**{"broker.url": mosquitto.url})
    edge_fl.run_simulation(cfg, tmp_path)
    before = hashes(tmp_path)
    with pytest.raises(RunDirError, match=r"holds a finished run .*summary\.json") as refused:
        edge_fl.run_simulation(small(**{"broker.url": mosquitto.url}), tmp_path)
    # in the caller's words: Python's arguments here, the command line's flags for edge-fl
    assert str(refused.value).endswith("use a new out_dir, or overwrite=True"), refused.value
    assert "--" not in str(refused.value)
    assert refused.value.cli.endswith("use a new --out, or --overwrite"), refused.value.cli
    assert hashes(tmp_path) == before
    again = edge_fl.run_simulation(
        small(**{"broker.url": mosquitto.url, "rounds.rounds": 1}), tmp_path, overwrite=True
    )
    assert again.summary["rounds_closed"] == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def _finished_or_interrupted(tmp_path: Path, kind: str) -> Path:
    out = tmp_path / kind
    out.mkdir()
    (out / "run.json").write_text('{"job": "earlier"}\n')
    (out / "metrics.jsonl").write_text('{"round": 1}\n')
    if kind == "finished":
        (out / "summary.json").write_text('{"rounds_closed": 1}\n')
        (out / "model.onnx").write_bytes(b"onnx")
    elif kind == "stopped":  # SIGTERM at round 11 of 40: summary, model and checkpoint
        (out / "run.json").write_text('{"job": "earlier", "config": {"rounds": {"rounds": 40}}}')
        (out / "summary.json").write_text(
            '{"rounds": 11, "rounds_closed": 10, "stopped": "SIGTERM"}'
        )
        (out / "model.onnx").write_bytes(b"onnx")
        (out / "checkpoint.json").write_text("{}\n")
    else:
        (out / "checkpoint.json").write_text("{}\n")
    return out


@pytest.mark.parametrize("kind", ["finished", "stopped", "interrupted"])
def test_aggregator_without_resume_refuses_an_earlier_run(tmp_path, kind):
    """A run stopped by a signal (it has a summary) is told from a completed one: the refusal
    says --resume continues it, as for a killed run; only a completed one is "finished"."""
    out = _finished_or_interrupted(tmp_path, kind)
    before = hashes(out)
    done = run(
        "aggregator",
        "--broker",
        "mqtt://127.0.0.1:9",  # refused before any connection
        "--model",
        "logreg",
        "--out",
        str(out),
    )
    line = one_line_error(done, str(out), "metrics.jsonl", "run.json", "--overwrite")
    assert ("finished run" in line) == (kind == "finished")
    assert ("--resume" in line) == (kind != "finished")
    if kind == "stopped":
        assert "a run stopped by SIGTERM at round 11 of 40" in line, line
    assert hashes(out) == before


UNREACHABLE = "mqtt://127.0.0.1:1"  # nothing listens on port 1: connection refused


def test_an_aggregator_that_never_reached_its_broker_does_not_block_the_retry(tmp_path):
    """No summary, model or run.json of a run that never started: the corrected command is not
    refused as an earlier run's (here it fails on the broker again, not on the directory)."""
    out = tmp_path / "unreach"
    for _ in range(2):
        done = run("aggregator", "--broker", UNREACHABLE, "--job", "x", "--out", str(out))
        one_line_error(done, "cannot reach the broker")
        assert not [p.name for p in out.iterdir() if not p.name.startswith(".")], done.stderr


@pytest.mark.broker
def test_a_simulation_that_never_reached_its_broker_leaves_an_earlier_run_alone(
    mosquitto, tmp_path
):
    """From Python too: a fresh run that never reached its broker leaves nothing; a resumed one
    that never reached it leaves the earlier run's files where they were."""
    fresh = tmp_path / "fresh"
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cannot reach the broker"):
            edge_fl.run_simulation(small(**{"broker.url": UNREACHABLE}), fresh)
        assert not [p.name for p in fresh.iterdir() if not p.name.startswith(".")]
    earlier = tmp_path / "earlier"
    job = {"job": f"earlier-{uuid.uuid4().hex[:8]}"}
    edge_fl.run_simulation(small(**job, **{"broker.url": mosquitto.url}), earlier)
    before = hashes(earlier)
    more = small(**job, **{"broker.url": UNREACHABLE, "rounds.rounds": 4})
    with pytest.raises(RuntimeError, match="cannot reach the broker"):
        edge_fl.run_simulation(more, earlier, resume=True)
    for name in ("run.json", "metrics.jsonl", "summary.json", "model.onnx"):
        assert before[name] == hashes(earlier)[name], name


def test_the_aggregator_refuses_resume_and_overwrite_together(tmp_path):
    done = run(
        "aggregator", "--broker", "mqtt://127.0.0.1:9", "--out", str(tmp_path), "--resume",
        "--overwrite",
    )  # fmt: skip
    one_line_error(done, "--resume and --overwrite")


# ------------------------------------------------------------------ jobs that cannot keep their word


def _build(**overrides):
    from edge_fl.job import build_job

    return build_job(edge_fl.load_config(None, overrides))


def test_a_budget_with_central_noise_is_refused_before_the_job_starts():
    """F2: a device enforces its budget from its own releases; central noise leaves it none."""
    from edge_fl.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"budget_epsilon = 2 cannot be enforced.*gaussian-central"
    ):
        _build(
            **{
                "privacy.mechanism": "gaussian-central",
                "privacy.noise_multiplier": 1.0,
                "privacy.budget_epsilon": 2,
                "data.devices": 10,
                "rounds.clients_per_round": 10,
            }
        )
    _build(**{"privacy.mechanism": "gaussian", "privacy.epsilon": 8, "privacy.budget_epsilon": 2})


def test_the_cli_refuses_a_central_budget_in_one_line(tmp_path):
    done = run(
        "simulate", "--mechanism", "gaussian-central", "--noise-multiplier", "1.0", "--budget",
        "2", "--devices", "10", "--clients-per-round", "10", "--rounds", "8", "--no-progress",
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    one_line_error(done)
    assert "budget_epsilon = 2 cannot be enforced" in done.stderr
    assert not (tmp_path / "run").exists()


def test_local_noise_beyond_the_decoders_limit_is_refused_naming_both(tmp_path):
    """F4: eps 0.5 with clip 1000 makes sigma ~ 5e4, every update beyond |x| <= 1e4."""
    done = run(
        "simulate", "--mechanism", "gaussian", "--epsilon", "0.5", "--clip", "1000",
        "--no-progress", "--out", str(tmp_path / "run"),
    )  # fmt: skip
    one_line_error(done)
    assert "plausibility limit 10000" in done.stderr and "sigma = " in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("clip", "refused"), [(30.0, False), (36.0, False), (45.0, True)])
def test_the_noise_rule_matches_how_often_honest_updates_would_be_refused(clip, refused):
    """The rule (refuse when more than 1% of honest updates would carry a value beyond the
    limit) against the share measured on noise vectors drawn as the device draws them."""
    import numpy as np

    from edge_fl.config import ConfigError
    from edge_fl.protocol import UpdateLimits

    cfg = {"privacy.mechanism": "gaussian", "privacy.epsilon": 0.5, "privacy.clip": clip}
    try:
        job = _build(**cfg)
    except ConfigError:
        assert refused
        job = None
    else:
        assert not refused
    # z is calibrated from epsilon alone (clip 1 is far inside the limit): the same for every clip
    z = _build(**{**cfg, "privacy.clip": 1.0}).mechanism.describe()["noise_multiplier"]
    assert job is None or job.mechanism.describe()["noise_multiplier"] == z
    d, limit = 4810, UpdateLimits(4810).max_abs  # digits x logreg
    rng = np.random.default_rng(7)
    beyond = np.mean([np.abs(rng.normal(0.0, z * clip, size=d)).max() > limit for _ in range(2000)])
    assert (beyond > 0.01) == refused, beyond


# ------------------------------------------------------------------ settings a round cannot meet


def test_more_min_updates_than_a_round_selects_is_refused():
    from edge_fl.config import ConfigError

    with pytest.raises(ConfigError, match=r"rounds\.min_updates = 100 exceeds the 20 updates"):
        edge_fl.load_config(None, {"rounds.min_updates": 100})
    assert edge_fl.load_config(None, {"rounds.min_updates": 20}).rounds.min_updates == 20
    done = run("simulate", "--min-updates", "100", "--no-progress")
    one_line_error(done)
    assert "rounds.min_updates = 100" in done.stderr


def test_more_devices_than_samples_is_one_line_in_the_configs_words():
    done = run("simulate", "--devices", "5000", "--clients-per-round", "20", "--no-progress")
    one_line_error(done)
    assert "data.devices = 5000 exceeds the 1438 training samples of digits" in done.stderr


def test_a_job_meant_to_show_refused_releases_charged_can_still_be_built():
    """noise_must_fit=False skips only the noise rule (tests/test_ledger_charges.py's F4 job)."""
    from edge_fl.config import ConfigError

    cfg = {"privacy.mechanism": "gaussian", "privacy.epsilon": 0.5, "privacy.clip": 1000.0}
    with pytest.raises(ConfigError, match="plausibility limit"):
        _build(**cfg)
    job = build_job(edge_fl.load_config(None, cfg), noise_must_fit=False)
    assert job.mechanism.describe()["clip_l2"] == 1000.0
    central = {
        "privacy.mechanism": "gaussian-central",
        "privacy.noise_multiplier": 1.0,
        "privacy.budget_epsilon": 2,
    }
    with pytest.raises(ConfigError, match="cannot be enforced"):
        build_job(edge_fl.load_config(None, central), noise_must_fit=False)


def test_privacy_plan_says_a_central_budget_is_refused_and_a_local_one_enforced():
    """issue 19: `privacy plan` says which: enforced (local mechanisms) or refused (central)."""
    import json

    central = run(
        "privacy", "plan", "--set", "privacy.mechanism=gaussian-central", "--set",
        "privacy.epsilon=8", "--json",
    )  # fmt: skip
    assert central.returncode == 0, central.stderr
    budget = json.loads(central.stdout)["budget"]
    assert budget["per_device_budget"] == "refused"
    assert "cannot be enforced with privacy.mechanism = 'gaussian-central'" in budget["why"]
    local = run(
        "privacy", "plan", "--set", "privacy.mechanism=laplace", "--set", "privacy.epsilon=8",
        "--set", "privacy.budget_epsilon=2", "--json",
    )  # fmt: skip
    assert json.loads(local.stdout)["budget"] == {
        "budget_epsilon": 2.0,
        "per_device_budget": "enforced",
        "why": json.loads(local.stdout)["budget"]["why"],
    }
    asked = run(
        "privacy", "plan", "--set", "privacy.mechanism=gaussian-central", "--set",
        "privacy.epsilon=8", "--set", "privacy.budget_epsilon=2",
    )  # fmt: skip
    one_line_error(asked)
    assert "budget_epsilon = 2 cannot be enforced" in asked.stderr
    assert "--budget" in run("privacy", "plan", "--help").stdout


def test_the_downlink_codec_is_a_registered_name_checked_when_the_job_is_built():
    """compression.downlink takes the codecs that declare they carry the global model (the codec
    registry), not a list written in the config."""
    from edge_fl.config import ConfigError
    from edge_fl.protocol.codecs import downlink_names

    assert {"f32", "f16", "q8"} <= set(downlink_names())
    for name in downlink_names():
        assert _build(**{"compression.downlink": name}).global_dtype
    with pytest.raises(
        ConfigError, match=r"compression\.downlink = 'topk': unknown downlink codec"
    ):
        _build(**{"compression.downlink": "topk"})  # an uplink codec only
    assert edge_fl.load_config(None, {"compression.downlink": "my-codec"})  # a name: for later


def test_run_json_never_holds_the_broker_password():
    """run.json (and what trackers log from it) shows the broker URL with the password redacted."""
    import edge_fl

    cfg = edge_fl.load_config(None, {"broker.url": "mqtts://aggregator:s3cret-pw@broker.lan:8883"})
    meta = edge_fl.build_job(cfg).metadata()
    text = json.dumps(meta)
    assert "s3cret-pw" not in text
    assert meta["config"]["broker"]["url"].startswith("mqtts://aggregator:")


def test_simulate_resume_continues_a_killed_run(tmp_path):
    """The refusal of an unfinished run says `--resume`: `edge-fl simulate --resume` takes it,
    keeps the rounds closed before the kill and runs the rest."""
    import os
    import signal
    import time

    out = tmp_path / "run"
    args = ["simulate", "--devices", "6", "--clients-per-round", "6", "--rounds", "8",
            "--model", "logreg", "--out", str(out), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen([*EDGE_FL, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    closed_before = len(metrics.read_text().splitlines())
    assert not (out / "summary.json").exists()
    one_line_error(run(*args), "unfinished job", "--resume")
    done = run(*args, "--resume", timeout=180)
    assert done.returncode == 0, done.stderr
    rounds = [json.loads(line)["round"] for line in metrics.read_text().splitlines()]
    assert rounds == list(range(1, 9)) and closed_before >= 2
    statuses = [json.loads(line)["status"] for line in metrics.read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_closed"] == statuses.count("closed") >= 7, (statuses, summary)
    one_line_error(run(*args, "--resume", "--overwrite"), "--resume")
