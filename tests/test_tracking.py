"""--track mlflow[:URI] and --tensorboard DIR against real stores, read back with each library's
own reader: an MLflow directory store through MlflowClient / mlflow.get_run, TensorBoard event
files through EventAccumulator. Runs are real simulations on an embedded Mosquitto."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from edge_fl.config import load_config
from edge_fl.simulation import run_simulation
from edge_fl.tracking import (
    EXTRA_HINT,
    TrackingTargets,
    numeric_fields,
    open_tracker,
    tracked,
)

if os.environ.get("CI"):  # the dev extra holds the tracking extra: in CI a missing one fails
    import mlflow  # noqa: F401
    import tensorboard  # noqa: F401
else:
    pytest.importorskip("mlflow", reason="the tracking extra: pip install -e '.[dev]'")
    pytest.importorskip("tensorboard", reason="the tracking extra: pip install -e '.[dev]'")

pytestmark = pytest.mark.broker


@pytest.fixture(autouse=True)
def _no_leaked_mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a directory store sets MLFLOW_ALLOW_FILE_STORE: undone after each test."""
    for name in ("MLFLOW_ALLOW_FILE_STORE", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


def _edge_fl(
    args: list[str], *, cwd: Path | None = None, without: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """The command line in its own process (its logging set-up stays out of this one), with
    ``without`` unimportable, as on an install that lacks it."""
    block = f"sys.modules[{without!r}] = None\n" if without else ""
    code = f"import sys\n{block}from edge_fl.cli import main\nmain(prog_name='edge-fl')\n"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _only_run(uri: str, experiment: str, monkeypatch: pytest.MonkeyPatch):
    """The one run of ``experiment``, read by MLflow's own client (the reader, too, must opt in
    to MLflow 3's directory store)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r} in {uri}"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    return client, runs[0].info.run_id


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _texts(logdir: Path) -> dict[str, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return {
        tag: acc.Tensors(tag)[-1].tensor_proto.string_val[0].decode()
        for tag in acc.Tags()["tensors"]
    }


def test_simulate_tracks_every_round_in_mlflow_and_tensorboard(tmp_path, monkeypatch) -> None:
    import mlflow

    out, store, tb = tmp_path / "run", tmp_path / "mlruns", tmp_path / "tb"
    job = f"track-{uuid.uuid4().hex[:6]}"
    args = [
        "simulate", "--job", job, "--devices", "6", "--rounds", "3", "--clients-per-round", "6",
        "--model", "logreg", "--mechanism", "dpsgd", "--epsilon", "8", "--no-progress",
        "--out", str(out), "--track", f"mlflow:{store}", "--tensorboard", str(tb),
    ]  # fmt: skip
    done = _edge_fl(args, timeout=300)
    assert done.returncode == 0, done.stderr
    records = _records(out)
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in records] == [1, 2, 3]

    uri = store.resolve().as_uri()
    client, run_id = _only_run(uri, job, monkeypatch)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run = mlflow.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run"  # the --out directory's name
    # params: the validated config
    params = run.data.params
    assert params["rounds.rounds"] == "3"
    assert params["privacy.mechanism"] == "dpsgd"
    assert params["privacy.epsilon"] == "8.0"
    assert params["config_digest"] == json.loads((out / "run.json").read_text())["config_digest"]
    # tags: mechanism, mode and the reported (not the target) epsilon
    tags = run.data.tags
    assert tags["edge_fl.mechanism"] == "dpsgd"
    assert tags["edge_fl.mode"] == "sync"
    assert tags["edge_fl.target_epsilon"] == "8.0"
    assert float(tags["edge_fl.epsilon"]) == summary["privacy"]["epsilon"]
    assert tags["edge_fl.accountant"] == summary["privacy"]["accountant"]
    # metrics: every numeric field of every round, step = round, values as in metrics.jsonl
    expected = [numeric_fields(r) for r in records]
    keys = set().union(*expected)
    assert {"accuracy", "loss", "epsilon", "bytes_up", "wire_up_p95", "received"} <= keys
    for key in keys:
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        want = [(r["round"], e[key]) for r, e in zip(records, expected, strict=True) if key in e]
        assert sorted(history) == want, key
    # artifacts: the run's files and the plots
    top = {a.path for a in client.list_artifacts(run_id)}
    assert {"model.onnx", "summary.json", "metrics.jsonl", "run.json", "plots"} <= top
    plots = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert {"plots/accuracy.png", "plots/bytes.png", "plots/epsilon.png"} <= plots
    got = Path(client.download_artifacts(run_id, "summary.json", str(tmp_path / "dl")))
    assert json.loads(got.read_text()) == summary
    onnx = Path(client.download_artifacts(run_id, "model.onnx", str(tmp_path / "dl")))
    assert onnx.read_bytes() == (out / "model.onnx").read_bytes()

    # TensorBoard: every round's scalars, nested fields grouped by "/"
    scalars = _scalars(tb)
    for key in keys:
        tag = key.replace(".", "/")
        want = [(r["round"], e[key]) for r, e in zip(records, expected, strict=True) if key in e]
        got_tb = scalars[tag]
        assert [s for s, _ in got_tb] == [s for s, _ in want], tag
        for (_, a), (_, b) in zip(got_tb, want, strict=True):
            assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6), (tag, a, b)
    # and the config and the final tags as text (TensorBoard's Text tab)
    texts = _texts(tb)
    assert "| privacy.mechanism | dpsgd |" in texts["config"]
    assert f"| edge_fl.epsilon | {tags['edge_fl.epsilon']} |" in texts["run"]


def test_records_reach_the_store_while_the_run_goes_on_and_async_steps_are_versions(
    tmp_path, monkeypatch
) -> None:
    """Live: when round N's record is committed, MLflow and TensorBoard hold rounds 1..N and the
    MLflow run is still running. In fedbuff the step is the model version."""
    store, tb = tmp_path / "mlruns", tmp_path / "tb"
    job = f"live-{uuid.uuid4().hex[:6]}"
    cfg = load_config(
        None,
        {
            "job": job,
            "data.devices": 6,
            "model.name": "logreg",
            "rounds.rounds": 4,
            "rounds.mode": "fedbuff",
            "rounds.buffer_size": 2,
            "rounds.clients_per_round": 4,
        },
    )
    tracker = open_tracker(cfg, TrackingTargets(str(store), tb), out_dir=tmp_path / "run")
    assert tracker is not None
    uri = store.resolve().as_uri()
    client, run_id = _only_run(uri, job, monkeypatch)
    seen: list[dict] = []

    def check(record: dict) -> None:
        seen.append(record)
        tracker.flush()
        history = client.get_metric_history(run_id, "version")
        assert sorted(int(m.step) for m in history) == [r["version"] for r in seen]
        assert client.get_run(run_id).info.status == "RUNNING"
        assert [s for s, _ in _scalars(tb)["received"]] == [r["version"] for r in seen]

    with tracked(tracker):
        result = run_simulation(cfg, tmp_path / "run", on_record=check)
    tracker.finish(result.summary, tmp_path / "run")
    assert len(seen) == 4
    assert client.get_run(run_id).data.tags["edge_fl.mode"] == "fedbuff"
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_failed_run_is_marked_failed(tmp_path, monkeypatch) -> None:
    store = tmp_path / "mlruns"
    cfg = load_config(None, {"job": "fails", "data.devices": 4})
    tracker = open_tracker(cfg, TrackingTargets(str(store), None))
    assert tracker is not None
    with pytest.raises(RuntimeError, match="boom"), tracked(tracker):
        raise RuntimeError("boom")
    client, run_id = _only_run(store.resolve().as_uri(), "fails", monkeypatch)
    assert client.get_run(run_id).info.status == "FAILED"


@pytest.mark.parametrize(
    ("module", "flags", "message"),
    [
        ("mlflow", ["--track", "mlflow"], "--track mlflow"),
        ("tensorboard", ["--tensorboard", "TB"], "--tensorboard"),
    ],
)
def test_a_missing_extra_is_one_line_before_the_job_starts(
    tmp_path, monkeypatch, module, flags, message
) -> None:
    out = tmp_path / "run"
    for command in ("simulate", "aggregator"):
        extra = ["--broker", "mqtt://127.0.0.1:9"] if command == "aggregator" else []
        done = _edge_fl([command, *extra, *flags, "--out", str(out)], cwd=tmp_path, without=module)
        assert done.returncode == 2, done.stderr
        assert done.stderr == f"edge-fl: error: {message} needs the tracking extra: {EXTRA_HINT}\n"
        # right for an installed package and for the README's checkout alike
        assert "pip install 'edge-fl[tracking]'" in done.stderr
        assert "pip install -e '.[server,tracking]'" in done.stderr
        assert not out.exists() and not (tmp_path / "TB").exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_track_values_and_stores_are_one_line(tmp_path) -> None:
    (tmp_path / "afile").write_text("")
    server = f"http://127.0.0.1:{_closed_port()}"
    cases = [
        (["--track", "wandb"], "--track 'wandb': expected mlflow or mlflow:URI"),
        (["--track", "mlflow:"], "--track 'mlflow:': give a URI after 'mlflow:'"),
        (["--track", f"mlflow:{tmp_path / 'afile'}"], "Not a directory"),
        # nobody listening: one line within seconds, not after MLflow's minutes of retries
        (
            ["--track", f"mlflow:{server}"],
            f"--track mlflow:{server}: the tracking server did not answer (Connection refused)",
        ),
    ]
    for flags, fragment in cases:
        done = _edge_fl(["simulate", *flags, "--out", str(tmp_path / "r")])
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and fragment in done.stderr, done.stderr
        assert done.stderr.startswith("edge-fl: error: ")
        assert not (tmp_path / "r").exists()


def test_help_imports_neither_mlflow_nor_tensorboard() -> None:
    code = (
        "import sys\n"
        "from edge_fl.cli import main\n"
        "for args in (['--help'], ['simulate', '--help'], ['aggregator', '--help']):\n"
        "    try:\n"
        "        main(args, standalone_mode=False)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('mlflow', 'tensorboard'))\n"
        "print('HEAVY', heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--track mlflow[:URI]" in done.stdout and "--tensorboard" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "HEAVY []"


def test_aggregator_tracks_its_rounds_without_the_broker_password(
    mosquitto, tmp_path, monkeypatch
) -> None:
    """`edge-fl aggregator --track --tensorboard` with devices in another process; the broker
    URL's password reaches neither the params nor the logged run.json."""
    store, tb, out = tmp_path / "mlruns", tmp_path / "tb", tmp_path / "run"
    job = f"agg-{uuid.uuid4().hex[:6]}"
    host_port = mosquitto.url.split("://", 1)[1]
    secret = f"pw{uuid.uuid4().hex[:8]}"
    common = [
        "--broker", f"mqtt://alice:{secret}@{host_port}", "--job", job, "--devices", "4",
        "--rounds", "3", "--clients-per-round", "4", "--deadline", "20", "--model", "logreg",
    ]  # fmt: skip
    tracking = ["--track", f"mlflow:{store}", "--tensorboard", str(tb)]
    _aggregator_and_fleet(common, ["--out", str(out), *tracking])
    records = _records(out)
    assert [r["round"] for r in records] == [1, 2, 3]
    client, run_id = _only_run(store.resolve().as_uri(), job, monkeypatch)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["broker.url"] == f"mqtt://alice:***@{host_port}"
    assert all(secret not in v for v in run.data.params.values())
    logged = Path(client.download_artifacts(run_id, "run.json", str(tmp_path / "dl")))
    assert secret not in logged.read_text()
    assert (
        json.loads(logged.read_text())["config_digest"]
        == json.loads((out / "run.json").read_text())["config_digest"]
    )
    for key in ("accuracy", "received", "bytes_up"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(r["round"], float(r[key])) for r in records], key
    assert {a.path for a in client.list_artifacts(run_id)} >= {"model.onnx", "summary.json"}
    assert [s for s, _ in _scalars(tb)["accuracy"]] == [1, 2, 3]


def _aggregator_and_fleet(common: list[str], aggregator_flags: list[str]) -> None:
    from processes import EDGE_FL

    agg = subprocess.Popen(
        [EDGE_FL, "aggregator", *common, *aggregator_flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    fleet = subprocess.Popen([EDGE_FL, "fleet", *common], stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = agg.communicate(timeout=180)
        fleet.communicate(timeout=30)
    finally:
        for p in (agg, fleet):
            if p.poll() is None:
                p.kill()
    assert agg.returncode == 0, stderr


@pytest.mark.slow
def test_a_resumed_aggregator_run_holds_every_round(mosquitto, tmp_path, monkeypatch) -> None:
    """Rounds 1-2 untracked, then `--resume` to round 3 with --track: the new MLflow run gets the
    two earlier rounds first, then the new one, and says it was resumed."""
    store, out = tmp_path / "mlruns", tmp_path / "run"
    job = f"res-{uuid.uuid4().hex[:6]}"
    common = [
        "--broker", mosquitto.url, "--job", job, "--devices", "4", "--clients-per-round", "4",
        "--deadline", "20", "--model", "logreg",
    ]  # fmt: skip
    _aggregator_and_fleet([*common, "--rounds", "2"], ["--out", str(out)])
    assert [r["round"] for r in _records(out)] == [1, 2]
    _aggregator_and_fleet(
        [*common, "--rounds", "3"], ["--out", str(out), "--resume", "--track", f"mlflow:{store}"]
    )
    records = _records(out)
    assert [r["round"] for r in records] == [1, 2, 3]
    client, run_id = _only_run(store.resolve().as_uri(), job, monkeypatch)
    run = client.get_run(run_id)
    assert run.data.tags["edge_fl.resumed"] == "true"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "accuracy"))
    assert history == [(r["round"], r["accuracy"]) for r in records]
