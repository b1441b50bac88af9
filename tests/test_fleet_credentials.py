"""`edge-fl fleet --credentials FILE` on a secured Mosquitto (TLS, password file, the shipped ACL,
one connection per username): each simulated device logs in as its own user, and every refusal
(bad password, missing line, wrong CA) is one line and exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edge_fl.identity import device_id
from edge_fl.transport.broker import EmbeddedBroker, ListenerTLS
from edge_fl.transport.credentials import CredentialsError, device_specs, read_credentials
from edge_fl.transport.url import parse_broker_url

BROKER_DIR = Path(__file__).resolve().parents[1] / "broker"
EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))
N = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Certificates and users made by the shipped scripts, as an operator would."""
    if shutil.which("openssl") is None or shutil.which("mosquitto_passwd") is None:
        pytest.skip("openssl and mosquitto_passwd needed")
    d = tmp_path_factory.mktemp("fleetcreds")
    run = {"check": True, "capture_output": True, "text": True, "timeout": 30}
    subprocess.run(["bash", str(BROKER_DIR / "make-certs.sh"), "-o", str(d), "localhost"], **run)
    mint = ["bash", str(BROKER_DIR / "mint-credentials.sh"), "-f", str(d / "passwd")]
    mint += ["-H", "localhost:1", "--ca", str(d / "ca.crt")]
    (d / "aggregator.tsv").write_text(subprocess.run([*mint, "aggregator"], **run).stdout)
    (d / "devices.tsv").write_text(subprocess.run([*mint, "-n", str(N)], **run).stdout)
    return {"dir": d, "ca": str(d / "ca.crt")}


@pytest.fixture
def broker(make_broker, files) -> EmbeddedBroker:
    d = files["dir"]
    return make_broker(
        allow_anonymous=False,
        password_file=str(d / "passwd"),
        acl_file=str(BROKER_DIR / "aclfile.example"),
        tls=ListenerTLS(files["ca"], str(d / "server.crt"), str(d / "server.key")),
        extra_config=["use_username_as_clientid true"],  # as in mosquitto-secure.conf
    )


def test_mint_names_devices_like_the_job(files) -> None:
    users = read_credentials(files["dir"] / "devices.tsv")
    assert (
        list(users) == [device_id(i) for i in range(N)] == ["d00000", "d00001", "d00002", "d00003"]
    )
    assert all(
        s.username == name and s.tls and s.ca_file == files["ca"] for name, s in users.items()
    )


def test_device_specs_take_the_user_from_the_line_and_the_rest_from_broker(tmp_path) -> None:
    creds = tmp_path / "c.tsv"
    creds.write_text("# comment\nd00000\tmqtts://d00000:pw0@far:8883?ca=/x.crt\n\n")
    users = read_credentials(creds)
    base = parse_broker_url("mqtts://localhost:9999?ca=/ca.crt")
    spec = device_specs(users, ["d00000"], base)["d00000"]
    assert (spec.host, spec.port, spec.ca_file) == ("localhost", 9999, "/ca.crt")
    assert (spec.username, spec.password) == ("d00000", "pw0")
    assert device_specs(users, ["d00000"])["d00000"].host == "far"
    with pytest.raises(CredentialsError, match=r"no line for 2 of 3 devices: d00001, d00002"):
        device_specs(users, ["d00000", "d00001", "d00002"])
    creds.write_text("d00000 mqtts://far:8883\n")
    with pytest.raises(CredentialsError, match="no username and password"):
        read_credentials(creds)


def _job(broker: EmbeddedBroker, job: str) -> list[str]:
    config = Path(broker.tls.cafile).with_name("job.yaml")  # fail fast when devices are missing
    config.write_text("rounds: {wait_for_devices_s: 15}\n")
    return [
        "--config", str(config), "--job", job, "--devices", str(N), "--rounds", "2", "--clients-per-round", str(N),
        "--min-updates", str(N), "--deadline", "20", "--epochs", "1",
    ]  # fmt: skip


def _url(broker: EmbeddedBroker) -> str:
    """The broker by the name its certificate carries."""
    return f"mqtts://localhost:{broker.port}?ca={broker.tls.cafile}"


def _fleet(broker: EmbeddedBroker, job: str, creds: Path, *extra: str) -> subprocess.Popen[str]:
    args = ["--broker", _url(broker), "--credentials", str(creds), *extra]
    return subprocess.Popen(
        [EDGE_FL, "fleet", *_job(broker, job), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.broker
def test_fleet_shards_log_in_as_their_devices(broker, files, tmp_path) -> None:
    """Two shards, four users, the ACL in force: every update arrives (a device publishing as
    another user would be disconnected and its update dropped)."""
    d = files["dir"]
    job = "digits-prod"  # the job broker/aclfile.example is rendered for
    agg_url = (d / "aggregator.tsv").read_text().split("\t")[1].strip()
    agg_spec = parse_broker_url(agg_url)
    agg_url = f"mqtts://aggregator:{agg_spec.password}@localhost:{broker.port}?ca={files['ca']}"
    out = tmp_path / "run"
    agg = subprocess.Popen(
        [EDGE_FL, "aggregator", *_job(broker, job), "--broker", agg_url, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    shards = [_fleet(broker, job, d / "devices.tsv", "--shard", f"{i}/2") for i in range(2)]
    try:
        _, stderr = agg.communicate(timeout=90)
        results = [s.communicate(timeout=30) for s in shards]
    finally:
        for p in (agg, *shards):
            if p.poll() is None:
                p.kill()
    assert agg.returncode == 0, (stderr, [err for _, err in results])
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["received"] for r in records] == [N, N], records
    assert all(r["rejected"] == 0 for r in records)
    for shard, (_, err) in zip(shards, results, strict=True):
        assert shard.returncode == 0, err
        assert "4 updates published" in err  # 2 devices x 2 rounds per shard


def _one_line_error(proc: subprocess.Popen[str]) -> str:
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("edge-fl: error: ")
    return lines[0]


@pytest.mark.broker
def test_refused_password_names_the_device(broker, files, tmp_path) -> None:
    lines = (files["dir"] / "devices.tsv").read_text().splitlines()
    name, url = lines[1].split("\t")
    spec = parse_broker_url(url)
    lines[1] = f"{name}\t{url.replace(spec.password, 'wrong-password')}"
    creds = tmp_path / "bad.tsv"
    creds.write_text("\n".join(lines) + "\n")
    line = _one_line_error(_fleet(broker, "refused", creds))
    assert "device d00001" in line and "Not authorized" in line, line
    assert "wrong-password" not in line and "check the username and password" in line


@pytest.mark.broker
def test_missing_lines_are_named(broker, files, tmp_path) -> None:
    creds = tmp_path / "short.tsv"
    creds.write_text("".join((files["dir"] / "devices.tsv").read_text().splitlines(True)[:2]))
    line = _one_line_error(_fleet(broker, "short", creds))
    assert "no line for 2 of 4 devices: d00002, d00003" in line, line


@pytest.mark.broker
def test_wrong_ca_is_one_line(broker, files, tmp_path) -> None:
    other = tmp_path / "other"
    subprocess.run(
        ["bash", str(BROKER_DIR / "make-certs.sh"), "-o", str(other), "localhost"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    wrong = f"mqtts://localhost:{broker.port}?ca={other / 'ca.crt'}"
    creds = str(files["dir"] / "devices.tsv")
    proc = subprocess.Popen(
        [EDGE_FL, "fleet", *_job(broker, "wrongca"), "--broker", wrong, "--credentials", creds],
        stderr=subprocess.PIPE,
        text=True,
    )
    line = _one_line_error(proc)
    assert "certificate verify failed" in line and "check the CA file" in line, line


def test_fleets_split_by_indices_take_distinct_client_ids():
    """A red team ran two fleets with --indices 0:4 and 4:12 and the default shard: both used the
    downlink client id edgefl-<job>-s0of1-downlink, and the broker kept closing one of them."""
    from edge_fl.cli.runtime_cmds import client_prefix

    assert client_prefix("j", "0/1", None) == "edgefl-j-s0of1"  # unchanged without --indices
    first, second = client_prefix("j", "0/1", "0:4"), client_prefix("j", "0/1", "4:12")
    assert first != second and first.startswith("edgefl-j-s0of1")
