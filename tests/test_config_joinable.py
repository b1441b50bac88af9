"""A device accepts every job document its aggregator accepts (issue 23), refuses predictable
noise unless told otherwise, and the config digest covers ``data.data_dir`` by what it holds.

The aggregator's side is ``build_job`` on its config; the device's is ``edge-fl device``'s own
path from the published bytes (``join_job``: decode, merge the device's sections, the same
validation, the same build). Acceptance must be a function of the values alone: the job document
writes every default, so a rule that asked whether a key was *set* differed between the sides
(the default ``clients_per_round = 20`` with 4 devices ran on the aggregator and was refused by
its devices).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_fl import models
from edge_fl.cli.device_cmd import join_job
from edge_fl.config import ConfigError, load_config
from edge_fl.data.femnist import write_leaf_dir
from edge_fl.job import build_job
from edge_fl.protocol.jobdoc import decode_job_document, encode_job_document

LOCAL = {
    "broker": {"url": "mqtt://127.0.0.1:9", "prefix": "edgefl"},
    "security": {"public_key": None},
    "device": {"id": "d00000", "index": 0},
    "data_dir": None,
}


def _small(**overrides: Any) -> dict[str, Any]:
    return {
        "job": "joinable",
        "data.devices": 4,
        "rounds.rounds": 2,
        "model.name": "logreg",
        **overrides,
    }


def _published(overrides: dict[str, Any]) -> Any:
    """The aggregator's job (its own checks passed) and the document bytes it publishes."""
    job = build_job(load_config(None, overrides))
    return job, decode_job_document(encode_job_document(job.job_document()))


def _join(doc: Any, index: int = 0, **kw: Any) -> Any:
    return join_job(doc, {**LOCAL, "device": {"id": f"d{index:05d}", "index": index}}, index, **kw)


#: jobs the aggregator accepts, across the settings whose checks live in the config or the build
ACCEPTED: list[dict[str, Any]] = [
    _small(),  # the report: the default 20 per round, clamped to 4 devices
    _small(**{"rounds.min_updates": 3}),
    _small(**{"rounds.clients_per_round": 0.5}),
    _small(**{"rounds.clients_per_round": 20}),  # the default's value, written out
    _small(**{"model.name": "mlp", "model.hidden": 8}),
    _small(**{"privacy.mechanism": "laplace", "privacy.epsilon": 4}),
    _small(**{"privacy.mechanism": "gaussian", "privacy.epsilon": 8, "privacy.clip": 0.1}),
    _small(**{"privacy.mechanism": "gaussian-central", "privacy.epsilon": 8}),
    _small(**{"privacy.mechanism": "dpsgd", "privacy.epsilon": 8, "privacy.budget_epsilon": 6}),
    _small(**{"privacy.mechanism": "nbafl", "privacy.epsilon": 50, "privacy.clip": 10}),
    _small(**{"privacy.mechanism": "signds", "privacy.signds.sign_k": 0.1}),
    _small(**{"compression.uplink": "topk", "compression.topk_fraction": 0.1}),
    _small(**{"compression.uplink": "q8", "compression.downlink": "q8"}),
    _small(**{"compression.downlink": "f16"}),
    _small(**{"rounds.mode": "fedbuff", "rounds.buffer_size": 2, "rounds.concurrency": 0}),
    _small(**{"rounds.mode": "fedasync", "rounds.staleness": "hinge"}),
    _small(**{"robust.norm_bound": "off", "robust.aggregator": "median"}),
    _small(**{"robust.norm_bound": 5.0, "robust.on_excess": "reject"}),
    _small(**{"model.evaluate_with": "native", "training.epochs": 1, "training.lr": 0.1}),
    _small(**{"data.partition": "dirichlet", "data.alpha": 0.3}),
    _small(**{"data.dataset": "synthetic", "data.devices": 6, "model.name": "logreg"}),
    _small(
        **{
            "data.dataset": "synthetic",
            "data.devices": 1000,  # a modelled population, 10 of it online
            "population.online": 10,
            "rounds.clients_per_round": 5,
        }
    ),
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=lambda o: ",".join(sorted(o)[2:]) or "base")
def test_a_device_accepts_every_job_document_its_aggregator_accepts(overrides):
    agg, doc = _published(overrides)
    for index in (0, agg.cfg.data.devices - 1):
        dev = _join(doc, index)
        assert dev.cfg.model_dump(exclude={"broker", "security", "device", "data"}) == (
            agg.cfg.model_dump(exclude={"broker", "security", "device", "data"})
        )
        assert dev.model.n_params == agg.model.n_params
        assert dev.mechanism.name == agg.mechanism.name
        assert dev.agent(index).n_samples == agg.agent(index).n_samples


def test_the_fleet_size_rules_agree_on_every_small_fleet():
    """Every (devices, clients_per_round, min_updates, mode) the aggregator accepts, the device
    accepts; what the aggregator refuses never reaches a device."""
    accepted = 0
    counts = (None, 1, 2, 3, 4, 5, 20, 0.25, 0.5)
    for n, k, need, mode in itertools.product((1, 3, 4), counts, (None, 1, 2, 4), ("sync",)):
        overrides = _small(**{"data.devices": n, "rounds.mode": mode})
        if k is not None:
            overrides["rounds.clients_per_round"] = k
        if need is not None:
            overrides["rounds.min_updates"] = need
        try:
            _, doc = _published(overrides)
        except ConfigError:
            continue
        _join(doc, n - 1)
        accepted += 1
    assert accepted >= 40, accepted


def test_a_model_without_onnx_export_is_the_aggregators_business_not_the_devices():
    """The aggregator evaluates natively (a warning); a device never evaluates, so the document's
    ``model.evaluate_with = 'onnxruntime'`` (every default written out) must not refuse it."""
    from edge_fl.models.logreg import LogisticRegression

    class Plain:  # the Model protocol by delegation: nothing edge-fl can export
        def __init__(self, n_features: int, n_classes: int, **_: Any) -> None:
            self.inner = LogisticRegression(n_features, n_classes)
            self.name, self.n_features, self.n_classes = "plain-joinable", n_features, n_classes
            self.n_params = self.inner.n_params

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    models.register_model("plain-joinable", Plain)
    agg, doc = _published(_small(**{"model.name": "plain-joinable"}))
    assert any("no ONNX export" in w for w in agg.warnings)
    assert doc.config["model"]["evaluate_with"] == "onnxruntime"
    assert _join(doc).model.name == "plain-joinable"


def test_a_device_refuses_reproducible_noise_unless_started_with_reproducible():
    _, doc = _published(
        _small(**{"reproducible": True, "privacy.mechanism": "laplace", "privacy.epsilon": 4})
    )
    with pytest.raises(RuntimeError) as refused:
        _join(doc)
    message = str(refused.value)
    assert "\n" not in message
    assert "reproducible" in message and "--reproducible" in message
    job = _join(doc, reproducible=True)
    assert job.cfg.reproducible is True
    _, honest = _published(_small(**{"privacy.mechanism": "laplace", "privacy.epsilon": 4}))
    assert _join(honest).cfg.reproducible is False


def test_the_device_command_refuses_reproducible_in_one_line(tmp_path):
    """The flag exists on the command and its help says what it permits."""
    from click.testing import CliRunner

    from edge_fl.cli.device_cmd import device

    result = CliRunner().invoke(device, ["--help"])
    assert result.exit_code == 0 and "--reproducible" in result.output


# ------------------------------------------------------------------------------ digest, data_dir


def _leaf(root: Path, seed: int) -> Path:
    """A LEAF FEMNIST directory of 4 writers (9 training and 3 test rows each)."""
    rng = np.random.default_rng(seed)
    train, test = {}, {}
    for u in range(4):
        x, y = rng.random((12, 784)).astype(np.float32), rng.integers(0, 62, 12)
        train[f"w{u}"], test[f"w{u}"] = (x[:9], y[:9]), (x[9:], y[9:])
    return write_leaf_dir(root, train, test)


def _femnist_digest(data_dir: Path) -> str:
    cfg = load_config(
        None,
        {
            "job": "files",
            "data.dataset": "femnist",
            "data.devices": 4,
            "data.data_dir": str(data_dir),
            "model.name": "logreg",
            "rounds.clients_per_round": 4,
        },
    )
    return build_job(cfg).cfg.digest()


def test_the_digest_covers_what_data_dir_holds_not_its_path(tmp_path):
    """Same files at two paths (a fleet on another machine): one digest. Other files at the same
    path: another digest, so a fleet training on other data is refused."""
    a = _femnist_digest(_leaf(tmp_path / "a", seed=1))
    b = _femnist_digest(_leaf(tmp_path / "b", seed=1))
    assert a == b
    import shutil

    shutil.rmtree(tmp_path / "a")
    changed = _femnist_digest(_leaf(tmp_path / "a", seed=2))
    assert changed != a


def test_data_dir_changes_no_digest_where_it_changes_no_data(tmp_path):
    """digits is bundled: a stray data_dir is not a different job (and the digest is the one a
    job without it has, so every published digest of such jobs is unchanged)."""
    plain = build_job(load_config(None, _small())).cfg.digest()
    stray = build_job(load_config(None, _small(**{"data.data_dir": str(tmp_path)}))).cfg.digest()
    assert plain == stray
    assert plain == load_config(None, _small()).digest()
