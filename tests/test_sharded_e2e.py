"""Sharded ingest over a real Mosquitto: `edge-fl aggregator --workers N` (worker processes sharing
the update stream) ends a job with the same model and ledger as one aggregator, and survives a
worker's kill -9 (edge_fl/server/sharding.py, edge_fl/server/ingest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from processes import EDGE_FL, run_job


def job_args(broker_url: str, job: str, *extra: str) -> list[str]:
    args = ["--broker", broker_url, "--job", job, "--devices", "24", "--rounds", "4"]
    args += ["--clients-per-round", "10", "--model", "logreg", "--reproducible"]
    args += ["--mechanism", "gaussian", "--epsilon", "40", "--deadline", "30"]
    return [*args, *extra]


def run(broker_url: str, out: Path, *workers: str) -> dict:
    job = f"sh-{uuid.uuid4().hex[:6]}"
    done = run_job(
        [EDGE_FL, "aggregator", *job_args(broker_url, job), "--out", str(out), *workers],
        [[EDGE_FL, "fleet", *job_args(broker_url, job)]],
        timeout=120,
        device_timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.device_codes == [0], done.device_errs
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {"records": records, "summary": summary, "model": (out / "model.onnx").read_bytes()}


def start_job(
    broker_url: str, job: str, out: Path, slow: list[str], *extra: str, own_session: bool = False
) -> tuple[subprocess.Popen, subprocess.Popen]:
    """The aggregator (its stdout and stderr piped) and a fleet for a slowed-down job."""
    agg = subprocess.Popen(
        [EDGE_FL, "aggregator", *job_args(broker_url, job, *slow), "--out", str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_session,
    )
    fleet = subprocess.Popen(
        [EDGE_FL, "fleet", *job_args(broker_url, job, *slow)], stderr=subprocess.DEVNULL
    )
    return agg, fleet


def until_round(agg: subprocess.Popen, number: int) -> list[str]:
    """The aggregator's stdout up to the line saying round ``number`` ended."""
    seen = []
    for line in agg.stdout:
        seen.append(line)
        if line.startswith(f"round {number} "):
            break
    return seen


@pytest.mark.parametrize("partition", ["shared", "hash"])
def test_workers_give_one_aggregators_model_and_ledger(mosquitto, tmp_path, partition):
    cfg = tmp_path / "ingest.yaml"
    cfg.write_text(f"ingest: {{partition: {partition}}}\n")
    alone = run(mosquitto.url, tmp_path / "alone")
    sharded = run(mosquitto.url, tmp_path / "sharded", "--workers", "2", "--config", str(cfg))
    assert sharded["model"] == alone["model"]  # the exported ONNX model, byte for byte
    assert [r["status"] for r in sharded["records"]] == ["closed"] * 4
    for mine, theirs in zip(sharded["records"], alone["records"], strict=True):
        assert mine["workers"] == 2 and mine["workers_missing"] == []
        for key in ("received", "bytes_up", "epsilon", "device_updates", "accuracy", "loss"):
            assert mine[key] == theirs[key], key
    assert sharded["summary"]["privacy"]["epsilon"] == alone["summary"]["privacy"]["epsilon"]


def read_records(metrics: Path) -> list[dict]:
    """The complete records of a metrics file that may be being written (a torn last line is
    left for the next read)."""
    if not metrics.exists():
        return []
    records = []
    for line in metrics.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def rejoined(records: list[dict]) -> bool:
    """A round that missed a worker, then a later round with both workers' shares. (A round a
    stop opened between rounds only to carry the last record was never handed to workers: its
    record has no worker fields.)"""
    hit = [r["round"] for r in records if r.get("workers_missing")]
    return bool(hit) and any(
        r["round"] > hit[-1] and r.get("workers") == 2 and r.get("workers_missing") == []
        for r in records
    )


def test_a_killed_worker_is_restarted_its_round_is_charged_and_the_job_finishes(
    mosquitto, tmp_path
):
    """kill -9 of worker 1 while round 3 is open: the coordinator restarts it, charges every
    selected device of the round that lost its share, and takes the restarted worker's share
    again. The job is long (60 rounds at most) and stopped with Ctrl-C once the worker is back,
    so a slow restart on a loaded machine only makes it longer, never fails it."""
    job = f"shk-{uuid.uuid4().hex[:6]}"
    slow = ["--rounds", "60", "--time-scale", "0.2"]  # modelled training: ~0.75 s a round
    out = tmp_path / "out"
    metrics = out / "metrics.jsonl"
    agg, fleet = start_job(mosquitto.url, job, out, slow, "--workers", "2", own_session=True)
    watchdog = threading.Timer(600, agg.kill)  # a hung aggregator fails the test, not CI
    watchdog.start()
    try:
        seen = until_round(agg, 2)  # kill worker 1 once round 2 closed: round 3 is open then
        pids = subprocess.run(  # this aggregator's worker 1 (other jobs may run here too)
            ["pgrep", "-P", str(agg.pid), "-f", "ingest --config .* --worker 1"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(pids) == 1, (pids, seen)
        subprocess.run(["kill", "-9", pids[0]], check=True)
        assert agg.stdout is not None
        for line in agg.stdout:  # a line per closed round
            seen.append(line)
            if rejoined(read_records(metrics)):
                os.killpg(agg.pid, signal.SIGINT)  # Ctrl-C: the open round closes, the job ends
                break
        rest, stderr = agg.communicate(timeout=120)
        stdout = "".join(seen) + rest
        fleet.communicate(timeout=120)
    finally:
        watchdog.cancel()
        for proc in (agg, fleet):
            if proc.poll() is None:
                proc.kill()
    assert agg.returncode == 0, stderr[-3000:]
    assert "ingest worker w1 went offline" in stderr
    assert "restarting it (1/10)" in stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    # Ctrl-C decides the open round: closed with what came, or skipped if nothing had
    assert [r["status"] for r in records[:-1]] == ["closed"] * (len(records) - 1), stdout
    assert records[-1]["status"] in ("closed", "skipped"), stdout
    hit = [r for r in records if r.get("workers_missing")]
    assert hit and all(r["workers_missing"] == ["w1"] for r in hit), stdout + stderr[-5000:]
    # the round the worker died in: every selected device is charged (the lost share may have
    # held releases), so the ledger cannot under-count
    for r in hit:
        before = records[r["round"] - 2]["device_updates"] if r["round"] > 1 else 0
        assert r["device_updates"] - before >= r["selected"], r
    # the restarted worker took its share again
    assert rejoined(records), records


def test_ctrl_c_closes_the_open_round_with_every_workers_share(mosquitto, tmp_path):
    """SIGINT to the aggregator's whole process group (Ctrl-C at a terminal) while round 3 is
    open: the workers (in a session of their own) answer the freeze and commit, so the round
    closes with their shares, at once."""
    job = f"shc-{uuid.uuid4().hex[:6]}"
    slow = ["--rounds", "12", "--time-scale", "0.2"]
    out = tmp_path / "out"
    agg, fleet = start_job(mosquitto.url, job, out, slow, "--workers", "2", own_session=True)
    try:
        until_round(agg, 2)
        time.sleep(0.5)  # round 3 open, some of its updates in
        started = time.monotonic()
        os.killpg(agg.pid, signal.SIGINT)
        _, stderr = agg.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        for proc in (agg, fleet):
            if proc.poll() is None:
                proc.kill()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert agg.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert last["round"] == 3 and last["workers_missing"] == [], last
    assert "restarting it" not in stderr and took < 15, (took, stderr[-3000:])


def test_spawned_workers_take_the_aggregators_config_as_given(mosquitto, tmp_path):
    """A fleet of 8 with the default clients_per_round (20, clamped to the fleet): valid for the
    aggregator, so valid for the workers it starts (they once got every default written out,
    and refused a clamp they had not asked for)."""
    job = f"shd-{uuid.uuid4().hex[:6]}"
    common = ["--broker", mosquitto.url, "--job", job, "--devices", "8", "--rounds", "2"]
    common += ["--model", "logreg", "--reproducible"]
    out = tmp_path / "out"
    done = run_job(
        [EDGE_FL, "aggregator", *common, "--workers", "2", "--out", str(out)],
        [[EDGE_FL, "fleet", *common]],
        timeout=100,
        device_timeout=40,
    )
    assert done.returncode == 0 and "invalid config" not in done.stderr, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["status"], r["workers"], r["received"]) for r in records] == [("closed", 2, 8)] * 2


def test_a_remote_worker_stopped_with_ctrl_c_is_offline_at_once(mosquitto, tmp_path, monkeypatch):
    """`edge-fl ingest` on SIGINT says it is offline before it leaves (a clean disconnect sends
    no last will): the coordinator stops waiting for it instead of 20 s every round."""
    job = f"shs-{uuid.uuid4().hex[:6]}"
    cfg = tmp_path / "remote.yaml"
    cfg.write_text("ingest: {spawn: false, workers: 2}\n")
    slow = ["--rounds", "6", "--time-scale", "0.2", "--config", str(cfg)]
    out = tmp_path / "out"
    keys = worker_keys(tmp_path, monkeypatch, 2)
    workers = [
        subprocess.Popen(
            [EDGE_FL, "ingest", *job_args(mosquitto.url, job, *slow), "--worker", str(i), *keys[i]],
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    agg, fleet = start_job(mosquitto.url, job, out, slow)
    try:
        until_round(agg, 1)
        workers[1].send_signal(signal.SIGINT)
        assert workers[1].wait(10) == 0
        _, stderr = agg.communicate(timeout=120)
        workers[0].communicate(timeout=30)
    finally:
        for proc in (agg, fleet, *workers):
            if proc.poll() is None:
                proc.kill()
    assert agg.returncode == 0, stderr[-3000:]
    assert "ingest worker w1 went offline" in stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records] == ["closed"] * 6
    assert all(r["wall_time_s"] < 10 for r in records[2:]), [r["wall_time_s"] for r in records]
    assert all(r["workers"] == 1 and r["workers_missing"] == [] for r in records[2:])


def worker_keys(tmp_path: Path, monkeypatch, count: int) -> list[list[str]]:
    """Keys for workers run by hand, as docs/scale.md says: the coordinator's secret (made by
    the first `edge-fl ingest --mint-key`), named to the aggregator by EDGE_FL_INGEST_SECRET_FILE
    (set here for every process the test starts), and each worker's `--key-file`."""
    secret = tmp_path / "ingest.secret"
    args = []
    for i in range(count):
        done = subprocess.run([EDGE_FL, "ingest", "--worker", str(i), "--mint-key", str(secret)],
                              capture_output=True, text=True, check=True)  # fmt: skip
        key = tmp_path / f"w{i}.key"
        key.write_text(done.stdout)
        args.append(["--key-file", str(key)])
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    monkeypatch.setenv("EDGE_FL_INGEST_SECRET_FILE", str(secret))
    return args


def site_bridge(root_port: int, job: str, site: int) -> list[str]:
    """broker/site-bridge.conf (the shipped template) for one site broker."""
    text = (Path(__file__).parents[1] / "broker" / "site-bridge.conf").read_text()
    text = text.replace("ROOT_HOST:ROOT_PORT", f"127.0.0.1:{root_port}").replace("JOB", job)
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return [line.replace("edgefl-site", f"edgefl-site{site}") for line in lines]


def test_site_aggregators_behind_bridged_brokers_give_one_aggregators_model(
    make_broker, mosquitto, tmp_path, monkeypatch
):
    """Hierarchical aggregation: two regional Mosquittos bridged to a root one, each with its
    half of the fleet and its site aggregator; the coordinator on the root merges one partial
    per site per round. Same model and ledger as one aggregator with every device on one broker."""
    alone = run(mosquitto.url, tmp_path / "alone")
    job = f"site-{uuid.uuid4().hex[:6]}"
    root = make_broker()
    sites = [make_broker(extra_config=site_bridge(root.port, job, i)) for i in range(2)]
    cfg = tmp_path / "site.yaml"
    cfg.write_text("ingest: {partition: site, spawn: false, workers: 2}\n")
    out = tmp_path / "tree"
    keys = worker_keys(tmp_path, monkeypatch, 2)
    ingest = [
        [
            EDGE_FL,
            "ingest",
            *job_args(site.url, job),
            "--config",
            str(cfg),
            "--worker",
            str(i),
            *keys[i],
        ]
        for i, site in enumerate(sites)
    ]
    fleets = [
        [EDGE_FL, "fleet", *job_args(site.url, job), "--shard", f"{i}/2"]
        for i, site in enumerate(sites)
    ]
    done = run_job(
        [EDGE_FL, "aggregator", *job_args(root.url, job), "--config", str(cfg), "--out", str(out)],
        [*ingest, *fleets],
        timeout=120,
        device_timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.device_codes == [0, 0, 0, 0], done.device_errs
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["workers"] == 2 and r["workers_missing"] == [] for r in records)
    assert (out / "model.onnx").read_bytes() == alone["model"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == alone["summary"]["privacy"]["epsilon"]
    assert all("updates folded" in err for err in done.device_errs[:2])


@pytest.mark.slow
def test_the_coordinator_killed_three_times_with_workers_resumes_with_the_same_ledger(
    mosquitto, tmp_path
):
    """tools/chaos_kill9.py --workers 2: the aggregator (and with it the workers it started) is
    killed with SIGKILL 3 times inside open rounds and resumed; the final ledger equals the uninterrupted run's,
    every published update is in it and every job finishes."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    try:
        import chaos_kill9
    finally:
        sys.path.pop(0)
    args = ["--rounds", "6", "--kills", "3", "--min-gap", "0.05", "--max-gap", "1.0"]
    args += ["--workers", "2", "--broker", mosquitto.url, "--work", str(tmp_path)]
    args += ["--json", str(tmp_path / "r.json")]
    rc = chaos_kill9.main(args)
    results = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0, results["compare"]["checks"]
    assert results["compare"]["missing"] == [] and results["compare"]["doubled"] == []
    assert len(results["run"]["kills"]) == 3
    assert results["run"]["landed"] == {"inside an open round": 3}, results["run"]["kills"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ingest", "--worker", "0"], "an ingest worker needs --broker"),
        (["ingest", "--broker", "mqtt://127.0.0.1:1", "--workers", "2", "--worker", "5"],
         "--worker 5: need ingest.workers = N >= 1 (here 2) and 0 <= I < N"),
        (["aggregator", "--broker", "mqtt://127.0.0.1:1", "--workers", "2", "--mode", "fedbuff"],
         "ingest.workers = 2 needs rounds.mode = 'sync'"),
        (["aggregator", "--broker", "mqtt://127.0.0.1:1", "--workers", "2", "--poisson-selection",
          "--mechanism", "gaussian-central", "--noise-multiplier", "1"],
         "with privacy.poisson_selection devices select themselves"),
    ],
)  # fmt: skip
def test_sharding_misuse_is_one_precise_line(argv, message, tmp_path):
    done = subprocess.run([EDGE_FL, *argv], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
