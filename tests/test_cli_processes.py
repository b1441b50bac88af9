"""The parts of a job as separate processes over a real Mosquitto: `edge-fl aggregator`, two
`edge-fl fleet` shards and one `edge-fl device`, as a deployment would run them."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from mqtt_tap import UpdateTap
from processes import keygen, run_job

from edge_fl.protocol import Topics

pytestmark = pytest.mark.broker

EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))


def test_aggregator_fleet_shards_and_a_device(mosquitto, tmp_path):
    job = f"proc-{uuid.uuid4().hex[:6]}"
    common = [
        "--broker", mosquitto.url, "--job", job, "--devices", "5", "--rounds", "3",
        "--clients-per-round", "5", "--deadline", "20",
    ]  # fmt: skip
    out = tmp_path / "run"
    agg = subprocess.Popen(
        [EDGE_FL, "aggregator", *common, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers = [
        subprocess.Popen([EDGE_FL, "fleet", *common, "--shard", "0/2"], stderr=subprocess.PIPE),
        subprocess.Popen([EDGE_FL, "fleet", *common, "--shard", "1/2"], stderr=subprocess.PIPE),
    ]
    try:
        stdout, stderr = agg.communicate(timeout=120)
        for w in workers:
            w.wait(timeout=30)
    finally:
        for p in (agg, *workers):
            if p.poll() is None:
                p.kill()
    assert agg.returncode == 0, stderr
    lines = [line for line in stdout.splitlines() if line.startswith("round")]
    assert len(lines) == 3 and all("closed" in line for line in lines)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["received"] for r in records] == [5, 5, 5]
    assert (out / "model.onnx").stat().st_size > 0
    assert all(w.returncode == 0 for w in workers)


def test_devices_join_from_the_job_document(mosquitto, tmp_path):
    """`edge-fl device --broker URL --id ID` is the whole device command: the job's settings come
    from the aggregator's signed, retained job document; a wrong key joins nothing."""
    job = f"dev-{uuid.uuid4().hex[:6]}"
    private, public = keygen(tmp_path / "keys")
    common = ["--broker", mosquitto.url, "--job", job, "--devices", "2", "--rounds", "2"]
    common += ["--clients-per-round", "2", "--deadline", "10", "--lr", "0.2"]
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"security: {{signing_key: {private}}}\n")
    device = [EDGE_FL, "device", "--broker", mosquitto.url, "--job", job, "--public-key", public]
    forged_key = "11" * 32
    wrong = [*device[:-1], forged_key, "--id", "d00005", "--wait", "3"]
    # The forged-key device gives up 3 s after it subscribed. It starts once the job document is
    # retained, and the honest devices (without which the job cannot end and clear that
    # document) once it has subscribed: however slowly each process starts on a loaded machine,
    # it is offered the document while the job runs (before, it gave up before the aggregator
    # had published, 3 runs of 3 with both cores busy).
    subscribed = "waiting for a job document"
    with UpdateTap(mosquitto.url, Topics(job), f"doc-{job}", Topics(job).job_document) as doc:
        done = run_job(
            [EDGE_FL, "aggregator", "--config", str(cfg), *common],
            [[*device, "--id", "d00000"], [*device, "--id", "d00001"]],
            when=lambda seconds: doc.wait_for_messages(1, seconds),
            first=[(wrong, subscribed)],
        )
    stdout, errs, wrong_err = done.stdout, done.device_errs[1:], done.device_errs[0]
    assert done.returncode == 0, done.stderr
    assert all("2 updates sent" in e for e in errs), errs
    assert "joined job" in errs[0] and "signed" in errs[0]
    rounds = [line for line in stdout.splitlines() if line.startswith("round")]
    assert len(rounds) == 2 and all("recv 2/2" in line for line in rounds)
    assert stdout.splitlines()[-1].startswith("job finished: 2/2 rounds closed")
    assert done.device_codes[0] == 2 and "Traceback" not in wrong_err
    assert "refused: is --public-key the aggregator's?" in wrong_err, wrong_err


def test_devices_sign_secure_rounds_with_the_keys_minted_for_them(mosquitto, tmp_path):
    """A deployment against a malicious operator: `edge-fl keygen DIR --devices 3` mints each
    device's key and the directory; the aggregator (security.device_keys) and every `edge-fl
    device --device-keys` check each other's SecAgg+ adverts. Every round sums all three."""
    job = f"sig-{uuid.uuid4().hex[:6]}"
    private, public = keygen(tmp_path / "agg")
    keys = tmp_path / "device-keys"
    subprocess.run([EDGE_FL, "keygen", str(keys), "--devices", "3"], check=True,
                   capture_output=True)  # fmt: skip
    directory = keys / "device-keys.json"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"security: {{signing_key: {private}, device_keys: {directory}}}\n")
    out = tmp_path / "run"
    common = ["--broker", mosquitto.url, "--job", job, "--devices", "3", "--rounds", "2",
              "--clients-per-round", "3", "--deadline", "20", "--secure-aggregation"]  # fmt: skip
    device = [EDGE_FL, "device", "--broker", mosquitto.url, "--job", job, "--public-key", public,
              "--secure-aggregation", "--device-keys", str(directory)]  # fmt: skip
    with UpdateTap(mosquitto.url, Topics(job), f"doc-{job}", Topics(job).job_document) as doc:
        done = run_job(
            [EDGE_FL, "aggregator", "--config", str(cfg), *common, "--out", str(out)],
            [[*device, "--id", f"d{i:05d}"] for i in range(3)],
            when=lambda seconds: doc.wait_for_messages(1, seconds),
        )
    assert done.returncode == 0, done.stderr
    assert all("2 updates sent" in e for e in done.device_errs), done.device_errs
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["secure"]["outcome"] for r in records] == ["summed", "summed"]
    assert all(r["received"] == 3 and not r["secure"]["rejected_by_reason"] for r in records)
