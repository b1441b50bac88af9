"""Job-document vectors (``tests/vectors/jobdoc.json``) and docs/protocol.md's "Job document" and
"A device's data and |D|" sections, checked against the code.

A device that discovers its job from the broker reads the aggregator's job document; these tests
prove that the vectors are what ``edge-fl aggregator`` publishes (byte for byte), that the real
decoder reads them back, that what the document says a device derives from them (model size,
|D| per device, the test split, ``mp``, the ``cal`` row a DP-SGD device picks) is what the real
device builds, and that the document's table of ``config`` keys (types, domains, defaults) and its
ACL are the code's and the shipped broker files'. Regenerate after a deliberate change with::

    .venv/bin/python tests/test_jobdoc_vectors.py --write
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import msgpack
import pytest

from edge_fl.config import ConfigError, JobConfig, load_config, validate_config
from edge_fl.device.join import device_config
from edge_fl.job import DEVICE_LOCAL_SECTIONS, OPTIONAL_KEYS, OPTIONAL_SECTIONS, build_job
from edge_fl.protocol.jobdoc import (
    JOB_CONTEXT,
    JobDocument,
    decode_job_document,
    encode_job_document,
)
from edge_fl.protocol.signing import Signer, Verifier

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "tests" / "vectors" / "jobdoc.json"
DOC = ROOT / "docs" / "protocol.md"
BROKER = ROOT / "broker"
SEED = bytes(range(32))  # the vectors' public Ed25519 test seed (as in messages.json): never real
#: the run ids of the documents that carry one (the same test run id as messages.json)
RUNS = {"jobdoc_logreg_run_signed": bytes.fromhex("0f1e2d3c4b5a69788796a5b4c3d2e1f0")}

#: (name, note, config overrides, signed): what `edge-fl aggregator` publishes for these jobs. The
#: document's ``cal`` is every value calibrated in the aggregator's process, so the vectors are built
#: in a fresh process, and the job that calibrates nothing comes first.
JOBS: list[tuple[str, str, dict[str, Any], bool]] = [
    (
        "jobdoc_logreg_run_signed",
        "digits, logreg, 4 devices, no privacy; the aggregator run's id in `run` (docs/protocol.md, "
        "Run id); signed",
        {
            "job": "demo-run",
            "data.devices": 4,
            "rounds.rounds": 3,
            "rounds.clients_per_round": 4,
            "model.name": "logreg",
        },
        True,
    ),
    (
        "jobdoc_nbafl",
        "digits, logreg, 4 devices, NbAFL (mmin = the smallest device's |D|); unsigned",
        {
            "job": "demo-nbafl",
            "data.devices": 4,
            "rounds.rounds": 3,
            "rounds.clients_per_round": 4,
            "model.name": "logreg",
            "privacy.mechanism": "nbafl",
            "privacy.epsilon": 0.5,
        },
        False,
    ),
    (
        "jobdoc_dpsgd_signed",
        "digits, mlp, 4 devices, DP-SGD calibrated to epsilon 8 over L = 3 uploads (one cal row "
        "per distinct (q, steps)); signed",
        {
            "job": "demo",
            "data.devices": 4,
            "rounds.rounds": 3,
            "rounds.clients_per_round": 4,
            "model.name": "mlp",
            "privacy.mechanism": "dpsgd",
            "privacy.epsilon": 8.0,
        },
        True,
    ),
]


# ---------------------------------------------------------------- building the vectors


def device_facts(cfg: JobConfig, doc: JobDocument) -> dict[str, Any]:
    """What a device derives from the document, as the reference device builds it."""
    job = build_job(cfg)
    sizes = [len(ix) for ix in job.dataset.device_indices]
    facts: dict[str, Any] = {
        "n_features": job.dataset.n_features,
        "n_classes": job.dataset.n_classes,
        "n_params": job.model.n_params,
        "train_rows": len(job.dataset.y_train),
        "test_rows": len(job.dataset.y_test),
        "train_sizes": sizes,
        "mp": job.mechanism.public_params(),
    }
    if cfg.privacy.mechanism == "dpsgd":
        mech = job.mechanism
        facts["dpsgd"] = [
            {
                "n": n,
                "q": mech.rate(n),
                "steps_per_upload": mech.steps(n),
                "sigma": mech.params(n).noise_multiplier,
            }
            for n in sorted(set(sizes))
        ]
    return facts


def build_vectors() -> dict[str, Any]:
    signer = Signer.from_seed(SEED)
    out = []
    for name, note, overrides, signed in JOBS:
        job = build_job(load_config(None, overrides))
        doc = dataclasses.replace(job.job_document(), run=RUNS.get(name))
        payload = encode_job_document(doc, signer if signed else None)
        body = encode_job_document(doc)
        entry: dict[str, Any] = {
            "name": name,
            "note": note,
            "topic": f"edgefl/{doc.job}/job",
            "signed": signed,
            "hex": payload.hex(),
        }
        if signed:
            entry["body_hex"] = body.hex()
        entry["document"] = msgpack.unpackb(body, raw=False)
        if doc.run is not None:  # JSON has no bytes: the run id as hex
            entry["document"]["run"] = doc.run.hex()
        entry["device"] = device_facts(job.cfg, doc)
        out.append(entry)
    return {
        "format": "edge-fl job documents (v1); see docs/protocol.md, Job document",
        "signing_key": {
            "seed": SEED.hex(),
            "public_key": signer.verifier.hex(),
            "context": JOB_CONTEXT.hex(),
        },
        "vectors": out,
    }


def dump(content: Any) -> str:
    return json.dumps(content, indent=1, ensure_ascii=True) + "\n"


def vectors() -> list[dict[str, Any]]:
    return json.loads(VECTORS.read_text())["vectors"] if VECTORS.exists() else []


def verifier() -> Verifier:
    return Verifier.from_hex(json.loads(VECTORS.read_text())["signing_key"]["public_key"])


# ---------------------------------------------------------------- the vectors are the code's


def test_vector_file_is_what_the_aggregator_publishes():
    fresh = subprocess.run(
        [sys.executable, __file__, "--print"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    assert VECTORS.read_text() == fresh, (
        "tests/vectors/jobdoc.json is out of date: run `.venv/bin/python "
        "tests/test_jobdoc_vectors.py --write` and update docs/protocol.md (Job document)"
    )


@pytest.mark.parametrize("vector", vectors(), ids=lambda v: v["name"])
def test_decode_and_encode(vector):
    payload = bytes.fromhex(vector["hex"])
    key = verifier() if vector["signed"] else None
    doc = decode_job_document(payload, key)
    body = vector["document"]
    assert (doc.job, doc.digest, doc.config, doc.calibration, doc.signed, doc.run) == (
        body["job"],
        body["digest"],
        body["config"],
        body["cal"],
        vector["signed"],
        bytes.fromhex(body["run"]) if "run" in body else None,
    )
    assert vector["topic"] == f"edgefl/{doc.job}/job"
    signer = Signer.from_seed(bytes.fromhex(json.loads(VECTORS.read_text())["signing_key"]["seed"]))
    assert encode_job_document(doc, signer if vector["signed"] else None) == payload
    if vector["signed"]:
        envelope = msgpack.unpackb(payload, raw=False)
        assert list(envelope) == ["v", "k", "b", "sig"] and envelope["k"] == "js"
        assert envelope["b"].hex() == vector["body_hex"]
        assert key.verify(JOB_CONTEXT + envelope["b"], envelope["sig"])
        wire = msgpack.unpackb(envelope["b"], raw=False)
    else:
        wire = msgpack.unpackb(payload, raw=False)
    # the key order the document states for the body and for config's sections
    run = ["run"] if "run" in body else []
    assert list(wire) == ["v", "k", "job", "digest", "config", "cal", *run]
    expected_sections = [
        s
        for s in JobConfig.model_fields
        if s not in DEVICE_LOCAL_SECTIONS and (s not in OPTIONAL_SECTIONS or s in wire["config"])
    ]
    assert list(wire["config"]) == expected_sections
    assert wire["config"]["data"]["data_dir"] is None


@pytest.mark.parametrize("vector", vectors(), ids=lambda v: v["name"])
def test_a_device_derives_what_the_vector_says(vector):
    """``edge-fl device``'s path: the document's config plus local settings, then the job."""
    doc = decode_job_document(
        bytes.fromhex(vector["hex"]), verifier() if vector["signed"] else None
    )
    cfg = device_config(doc, {"data_dir": None})
    facts = device_facts(cfg, doc)
    assert json.loads(json.dumps(facts)) == vector["device"]
    assert cfg.digest() == doc.digest
    sizes = facts["train_sizes"]
    if cfg.privacy.mechanism == "nbafl":
        assert facts["mp"]["mmin"] == min(sizes)
    if cfg.privacy.mechanism == "dpsgd":  # one cal row per (q, steps): steps = per upload x L
        rows = {tuple(r[:-1]): r[-1] for r in doc.calibration}
        p = cfg.privacy
        for entry in facts["dpsgd"]:
            n, q = entry["n"], entry["q"]
            assert q == min(1.0, cfg.training.batch_size / n)
            assert entry["steps_per_upload"] == max(1, round(cfg.training.epochs / q))
            key = ("dpsgd", p.epsilon, p.delta, q, entry["steps_per_upload"] * facts["mp"]["L"])
            assert rows[(*key, p.accountant)] == entry["sigma"]


def test_digits_split_is_what_the_document_says():
    """docs/protocol.md, "A device's data and |D|": 1797 rows, 359 test, 1438 train, equal iid
    shares in device-index order (the first 1438 mod N one larger)."""
    facts = vectors()[0]["device"]
    assert (facts["train_rows"], facts["test_rows"]) == (1438, 359)
    n = len(facts["train_sizes"])
    q, r = divmod(facts["train_rows"], n)
    assert facts["train_sizes"] == [q + 1] * r + [q] * (n - r)
    text = _section("## A device's data and |D|")
    for number in ("1797", "1438", "359", "360, 360, 359, 359"):
        assert number in text, number


# ---------------------------------------------------------------- the document's config table


def _section(heading: str) -> str:
    text = DOC.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def config_table() -> dict[str, dict[str, str]]:
    """The rows of the table after ``<!-- jobdoc-config -->``: key -> type, domain, default."""
    text = DOC.read_text()
    start = text.index("<!-- jobdoc-config -->")
    rows: dict[str, dict[str, str]] = {}
    for line in text[start:].splitlines()[3:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        key, kind, domain, default = cells[0].strip("`"), cells[1], cells[2], cells[3]
        rows[key] = {"type": kind, "domain": domain, "default": default}
    return rows


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and key != "options":
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "nil": type(None), "map": dict}


def test_config_table_lists_every_key_with_its_type_and_default():
    rows = config_table()
    # (a section written only when enabled, e.g. secure_aggregation, has its own table)
    local = DEVICE_LOCAL_SECTIONS | OPTIONAL_SECTIONS
    default = _flatten(JobConfig().model_dump(mode="json", exclude=local))
    default["data.data_dir"] = None
    assert set(rows) == set(default), set(rows) ^ set(default)
    for vector in vectors():
        values = _flatten(vector["document"]["config"])
        written = [k for k in rows if k in values or k not in OPTIONAL_KEYS]
        assert list(values) == written, "the table's order is the encoder's"
        for key, value in values.items():
            allowed = {_TYPES[t] for t in rows[key]["type"].split(" or ")}
            assert type(value) in allowed, (key, value, rows[key]["type"])
    for key, row in rows.items():
        assert json.loads(row["default"].strip("`")) == default[key], key


def _interval(domain: str) -> tuple[str, float, float, str] | None:
    m = re.fullmatch(r"([\[(])(-?[\d.e+-]+|-inf), (-?[\d.e+-]+|inf)([\])])", domain)
    if m is None:
        return None
    return m.group(1), float(m.group(2)), float(m.group(3)), m.group(4)


def _accepts(key: str, value: Any) -> bool:
    data: dict[str, Any] = {}
    node = data
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    if key.startswith("compression.topk") or key == "compression.error_feedback":
        data["compression"]["uplink"] = "topk"  # these apply to the topk codec only
    try:
        validate_config(data)
    except ConfigError:
        return False
    # names in a registry are checked when the job is built (docs/api.md), against the registry
    registry = _REGISTRIES.get(key)
    return registry is None or value is None or value in registry()


def _names(module: str, function: str) -> Any:
    import importlib

    return lambda: getattr(importlib.import_module(module), function)()


#: config keys whose domain is a registry's names: validated at build_job, not by the config
_REGISTRIES: dict[str, Any] = {
    "data.dataset": _names("edge_fl.data", "known_datasets"),
    "model.name": _names("edge_fl.models", "known_models"),
    "privacy.mechanism": _names("edge_fl.mechanisms", "mechanism_names"),
    "compression.downlink": _names("edge_fl.protocol.codecs", "downlink_names"),
    "compression.uplink": _names("edge_fl.protocol.codecs", "codec_names"),
}


def _below(x: float, integer: bool) -> float:
    return x - 1 if integer else math.nextafter(x, -math.inf)


def _above(x: float, integer: bool) -> float:
    return x + 1 if integer else math.nextafter(x, math.inf)


def test_config_table_domains_are_the_validators():
    """Every interval and every list of choices the table states is what validation accepts."""
    checked = 0
    for key, row in config_table().items():
        domain, kinds = row["domain"], row["type"].split(" or ")
        interval = _interval(domain)
        if interval is not None:
            left, lo, hi, right = interval
            integer = "int" in kinds and "float" not in kinds
            cast = int if integer else float
            if math.isfinite(lo):
                assert _accepts(key, cast(lo)) == (left == "["), (key, lo)
                assert not _accepts(key, cast(_below(lo, integer))), (key, "below", lo)
                assert hi <= lo or _accepts(key, cast(_above(lo, integer))), (key, "above", lo)
            if math.isfinite(hi):
                assert _accepts(key, cast(hi)) == (right == "]"), (key, hi)
                assert not _accepts(key, cast(_above(hi, integer))), (key, "above", hi)
            checked += 1
        elif domain.startswith('`"'):
            choices = re.findall(r'`"([^"`]*)"`', domain)
            for choice in choices:
                assert _accepts(key, choice), (key, choice)
            assert not _accepts(key, "no-such-choice"), key
            assert ("`null`" in domain) == _accepts(key, None), key
            annotation = _field(key).annotation
            literal = [a for a in _flat_args(annotation) if isinstance(a, str)]
            if literal:
                assert sorted(literal) == sorted(choices), (key, literal, choices)
            checked += 1
    assert checked >= 60, checked  # every key but the few with a free-text domain


def _field(key: str) -> Any:
    model: Any = JobConfig
    *parents, last = key.split(".")
    for part in parents:
        model = model.model_fields[part].annotation
    return model.model_fields[last]


def _flat_args(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if not args:
        return [annotation]
    return [a for arg in args for a in _flat_args(arg)]


# ---------------------------------------------------------------- the documented ACL


def _acl_lines(text: str) -> list[str]:
    return [
        " ".join(line.split())
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_documented_acl_is_the_shipped_one():
    """Topics section: the ACL a broker needs (with the job topic and the aggregator's user) is
    broker/aclfile.example, which is broker/acl.template rendered as its header says."""
    text = _section("## Topics")
    block = re.search(r"<!-- acl -->\n```text\n(.*?)```", text, re.S)
    assert block, "docs/protocol.md lost its ACL block"
    shipped = _acl_lines((BROKER / "aclfile.example").read_text())
    job = "digits-prod"  # the job the shipped file is rendered for (the README's)
    documented = _acl_lines(block.group(1).replace("<job>", job).replace("<prefix>", "edgefl"))
    assert documented == shipped
    template = (BROKER / "acl.template").read_text()
    rendered = template.replace("@PREFIX@", "edgefl").replace("@JOB@", job)
    assert _acl_lines(rendered.replace("@AGGREGATOR@", "aggregator")) == shipped
    assert (
        f"pattern read edgefl/{job}/job" in shipped
        and f"topic readwrite edgefl/{job}/job" in shipped
    )


if __name__ == "__main__":
    if sys.argv[1:] not in (["--write"], ["--print"]):
        sys.exit("usage: python tests/test_jobdoc_vectors.py --write | --print")
    built = dump(build_vectors())
    if sys.argv[1] == "--print":
        sys.stdout.write(built)
    else:
        VECTORS.write_text(built)
        print(f"wrote {VECTORS}")
