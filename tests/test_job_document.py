"""The job document (edge_fl.protocol.jobdoc): a device needs only the broker, its id and its
data; everything about the job comes signed from the aggregator. And the device path stays light:
it runs a whole job without any module of the server extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import msgpack
import pytest
from processes import keygen, run_job

from edge_fl.config import ConfigError, load_config, validate_config
from edge_fl.device.join import Announcements, NoJob, device_config
from edge_fl.identity import device_id, device_index
from edge_fl.job import build_job
from edge_fl.protocol import PayloadRejected, Reject
from edge_fl.protocol.jobdoc import (
    JOB_CONTEXT,
    JobDocument,
    decode_job_document,
    encode_job_document,
)
from edge_fl.protocol.signing import Signer

EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))
SERVER_MODULES = [
    "dp_accounting",
    "scipy",
    "onnx",
    "onnxruntime",
    "sklearn",
    "matplotlib",
    "amqtt",
    "rich",
    "torch",
    "absl",
]


def _doc(**privacy) -> JobDocument:
    cfg = load_config(None, {"job": "jd", "privacy": privacy or {"mechanism": "none"}})
    return build_job(cfg).job_document()


def test_signed_document_round_trips_and_verifies():
    signer = Signer.generate()
    doc = _doc(mechanism="gaussian", epsilon=8.0)
    got = decode_job_document(encode_job_document(doc, signer), signer.verifier)
    assert got.signed and got.job == "jd" and got.digest == doc.digest
    assert got.config == doc.config and got.calibration == doc.calibration
    assert any(row[0] == "gaussian" for row in got.calibration)  # z travels with the job


@pytest.mark.parametrize("what", ["forged key", "tampered body", "unsigned"])
def test_a_device_with_the_key_refuses_anything_but_the_aggregators(what):
    signer, other = Signer.generate(), Signer.generate()
    doc = _doc()
    if what == "forged key":
        payload, reason = encode_job_document(doc, other), Reject.BAD_SIGNATURE
    elif what == "unsigned":
        payload, reason = encode_job_document(doc), Reject.UNSIGNED
    else:
        outer = msgpack.unpackb(encode_job_document(doc, signer))
        body = msgpack.unpackb(outer["b"])
        body["config"]["training"]["lr"] = 9.0  # a hostile broker changes the learning rate
        outer["b"] = msgpack.packb(body)
        payload, reason = msgpack.packb(outer), Reject.BAD_SIGNATURE
    with pytest.raises(PayloadRejected) as err:
        decode_job_document(payload, signer.verifier)
    assert err.value.reason == reason


def test_signature_covers_the_context_and_the_exact_body():
    signer = Signer.generate()
    outer = msgpack.unpackb(encode_job_document(_doc(), signer))
    assert signer.verifier.verify(JOB_CONTEXT + outer["b"], outer["sig"])
    assert not signer.verifier.verify(outer["b"], outer["sig"])  # no context: not ours


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"\xc1", Reject.MALFORMED),
        (msgpack.packb([1, 2]), Reject.MALFORMED),
        (msgpack.packb({"v": 2, "k": "j"}), Reject.WRONG_VERSION),
        (msgpack.packb({"v": 1, "k": "g"}), Reject.WRONG_KIND),
        (msgpack.packb({"v": 1, "k": "j", "job": "x"}), Reject.MALFORMED),
        (b"\x80" + b"\x00" * (1 << 20), Reject.OVERSIZED),
    ],
)
def test_malformed_documents_are_rejected_precisely(payload, reason):
    with pytest.raises(PayloadRejected) as err:
        decode_job_document(payload)
    assert err.value.reason == reason


def test_announcements_choose_one_job_or_ask():
    seen = Announcements()
    a, b = _doc(), JobDocument("other", "d", {"job": "other"})
    seen.add("edgefl/jd/job", encode_job_document(a))
    assert seen.choose(None).job == "jd"
    seen.add("edgefl/other/job", encode_job_document(b))
    with pytest.raises(NoJob, match="several jobs are announced"):
        seen.choose(None)
    assert seen.choose("other").job == "other"
    seen.add("edgefl/other/job", b"")  # the job ended: its retained document was cleared
    assert seen.choose(None).job == "jd"
    seen.add("edgefl/x/job", encode_job_document(a))  # a document on another job's topic
    assert seen.refused == 1 and seen.choose("x") is None


def test_device_config_is_the_jobs_plus_only_local_settings():
    doc = _doc(mechanism="signds")
    cfg = device_config(
        doc,
        {
            "broker": {"url": "mqtt://h:1", "prefix": "edgefl"},
            "device": {"id": "d00003", "index": 3},
            "security": {"public_key": None},
            "data_dir": "/data",
        },
    )
    assert cfg.digest() != "" and cfg.privacy.mechanism == "signds"
    assert cfg.data.data_dir == "/data" and cfg.device.index == 3
    assert cfg.model_dump(exclude={"broker", "device", "security", "fleet", "data"}) == (
        validate_config(doc.config).model_dump(
            exclude={"broker", "device", "security", "fleet", "data"}
        )
    )


def test_a_newer_aggregators_unknown_section_is_ignored_but_unknown_keys_are_not(caplog):
    """Upgrading the aggregator must not stop every deployed device: a section the device does
    not know is left out (with a warning); an unknown key inside a known section (say, privacy)
    could change what the device releases, so it stays an error that says to upgrade."""
    doc = _doc()
    local = {"device": {"id": "d00001"}}
    newer = JobDocument(doc.job, doc.digest, {**doc.config, "hologram": {"fps": 60}})
    with caplog.at_level("WARNING", logger="edge_fl.device"):
        cfg = device_config(newer, local)
    assert cfg.job == "jd" and "hologram" in caplog.text and "upgrade" in caplog.text
    privacy = {**doc.config["privacy"], "quantum": True}
    stricter = JobDocument(doc.job, doc.digest, {**doc.config, "privacy": privacy})
    with pytest.raises(ConfigError, match=r"privacy\.quantum: unknown key(.|\n)*upgrade edge-fl"):
        device_config(stricter, local)


def test_config_round_trips_through_its_json_form():
    """The job document is the config's JSON dump: validating it must give the same config."""
    for overrides in (
        {},
        {"privacy": {"mechanism": "dpsgd", "epsilon": 4.0}, "model": {"name": "logreg"}},
        {"rounds": {"mode": "fedbuff", "buffer_size": 5}},
    ):
        cfg = load_config(None, overrides)
        assert validate_config(cfg.model_dump(mode="json")) == cfg


def test_one_device_id_convention():
    assert device_id(7) == "d00007" and device_index("d00007") == 7
    assert device_index("pi-kitchen") is None and device_index(device_id(12345)) == 12345


BLOCKER = textwrap.dedent(
    f"""
    import importlib.abc, sys
    HEAVY = set({SERVER_MODULES!r})
    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in HEAVY:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
    sys.meta_path.insert(0, Blocker())
    sys.argv[0] = "edge-fl"
    from edge_fl.cli import main
    main()
    """
)


@pytest.mark.broker
@pytest.mark.parametrize("mechanism", ["signds", "gaussian"])
def test_a_device_without_the_server_extra_runs_a_job(mosquitto, tmp_path, mechanism):
    """The base install's promise: `edge-fl device` imports no module of the server extra (here
    made unimportable), yet takes part in a signed job with a calibrated mechanism."""
    job = f"light-{mechanism}-{uuid.uuid4().hex[:6]}"
    private, public = keygen(tmp_path / "keys")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        f"job: {job}\nsecurity: {{signing_key: {private}}}\n"
        f"privacy: {{mechanism: {mechanism}, epsilon: 50}}\nmodel: {{name: logreg}}\n"
        "data: {devices: 2}\nrounds: {rounds: 2, clients_per_round: 2, deadline_s: 20}\n"
    )
    device = [sys.executable, "-c", BLOCKER, "device", "--broker", mosquitto.url]
    done = run_job(
        [EDGE_FL, "aggregator", "--config", str(cfg), "--broker", mosquitto.url],
        [[*device, "--id", f"d0000{i}", "--public-key", public] for i in (0, 1)],
    )
    errs = done.device_errs
    assert done.returncode == 0, done.stderr
    assert done.device_codes == [0, 0] and all("2 updates sent" in e for e in errs), errs
    assert all("blocked" not in e for e in errs)
    assert "recv 2/2" in done.stdout


def test_server_commands_on_a_base_install_say_which_extra(tmp_path):
    for args in (["simulate", "--rounds", "1"], ["privacy", "mechanisms"], ["aggregator"]):
        done = subprocess.run(
            [sys.executable, "-c", BLOCKER, *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "pip install 'edge-fl[server]'" in done.stderr.splitlines()[-1]
        assert "from a checkout: pip install -e '.[server]'" in done.stderr.splitlines()[-1]
