"""Configuration: files (YAML, TOML), overrides, and errors that name key, value and domain."""

from __future__ import annotations

import logging

import pytest

from edge_fl.config import ConfigError, load_config


def errors(**overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return str(info.value)


def test_defaults_are_valid_and_digest_is_stable():
    a, b = load_config(), load_config()
    assert a.digest() == b.digest()
    assert load_config(None, {"training.lr": 0.1}).digest() != a.digest()
    # broker URL and device identity do not change what devices must agree on
    assert load_config(None, {"broker.url": "mqtt://h:1", "device.id": "x"}).digest() == a.digest()


def test_yaml_and_toml_files_and_flag_overrides(tmp_path):
    y = tmp_path / "job.yaml"
    y.write_text("job: demo\nrounds: {rounds: 7, clients_per_round: 0.5}\nmodel: {name: logreg}\n")
    cfg = load_config(y, {"rounds.rounds": 9})
    assert (cfg.job, cfg.rounds.rounds, cfg.model.name) == ("demo", 9, "logreg")
    assert cfg.rounds.target(50) == 25
    t = tmp_path / "job.toml"
    t.write_text('job = "t1"\n[privacy]\nmechanism = "dpsgd"\nnoise_multiplier = 1.1\n')
    assert load_config(t).privacy.noise_multiplier == 1.1


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"rounds.rounds": 0}, "rounds.rounds = 0: Input should be greater than or equal to 1"),
        ({"data.bogus": 1}, "data.bogus: unknown key"),
        (
            {"robust.agregator": "median"},
            "robust.agregator: unknown key (value 'median'); did you mean robust.aggregator?",
        ),
        ({"privacy.signds.sign_kk": 0.1}, "did you mean privacy.signds.sign_k?"),
        ({"robus.aggregator": "median"}, "did you mean robust?"),
        ({"model.name": "res net"}, "model.name = 'res net'"),
        ({"training.lr": -1}, "training.lr = -1"),
        ({"rounds.clients_per_round": 2.5}, "use an integer count >= 1 or a fraction"),
        ({"job": "a/b"}, "job = 'a/b'"),
        ({"privacy.mechanism": "Lap lace"}, "privacy.mechanism = 'Lap lace'"),
        (
            {"rounds.clients_per_round": 500, "data.devices": 50},
            "rounds.clients_per_round = 500 exceeds data.devices = 50",
        ),
        ({"rounds.period_s": 0}, "rounds.period_s = 0: Input should be greater than 0"),
        ({"fleet.machine_samples_per_s": 50}, "machine_samples_per_s models devices' compute"),
        (
            {"rounds.period_s": 60, "rounds.mode": "fedbuff"},
            "rounds.period_s = 60 paces sync rounds; rounds.mode = fedbuff",
        ),
    ],
)
def test_errors_name_key_value_and_domain(overrides, expected):
    assert expected in errors(**overrides)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"privacy.mechanism": "laplace"}, "needs privacy.epsilon"),
        ({"privacy.mechanism": "gaussian"}, "needs privacy.noise_multiplier or privacy.epsilon"),
        ({"privacy.mechanism": "bogus"}, "unknown privacy mechanism 'bogus'; one of: none,"),
        ({"model.name": "resnet"}, "model.name = 'resnet': unknown model 'resnet'; one of: "),
        ({"data.dataset": "cifar"}, "data.dataset = 'cifar': unknown dataset 'cifar'; one of:"),
        (
            {"compression.uplink": "q2"},
            "compression.uplink = 'q2': unknown codec 'q2'; one of: f32, f16, q8",
        ),
        (
            {"compression.uplink": "f32", "privacy.mechanism": "signds"},
            "compression.uplink = 'f32' is not sound with privacy.mechanism = 'signds': signds "
            "defines its own wire format",
        ),
        (
            {"compression.uplink": "q8", "privacy.mechanism": "gaussian-central"},
            "is not sound with privacy.mechanism = 'gaussian-central'",
        ),
        (
            {"compression.uplink": "topk", "privacy.mechanism": "gaussian-central"},
            "topk changes the delta's norm",
        ),
        (
            {
                "rounds.mode": "fedbuff",
                "privacy.mechanism": "gaussian-central",
                "privacy.epsilon": 1,
            },
            "needs rounds.mode = 'sync'",
        ),
    ],
)
def test_mechanism_needs_fail_when_the_job_is_built(overrides, expected):
    """A mechanism checks its own needs (the registry owns them), and every registry name and the
    codec's soundness are checked against the registries; still before anything runs."""
    from edge_fl.job import build_job

    cfg = load_config(None, {"data.devices": 5, "model.name": "logreg", **overrides})
    with pytest.raises(ConfigError, match="invalid configuration") as info:
        build_job(cfg)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("key", "value", "domain"),
    [
        ("sign_k", 0.3, "(0, 0.25]"),
        ("sign_k", 0.0, "(0, 0.25]"),
        ("sign_eps", 101.0, "(0, 100]"),
        ("sign_thr_ratio", 0.4, "[0.5, 1]"),
        ("sign_global_lr", 0.0, "(0, inf)"),
        ("sign_dim_out", 51, "integer [0, 50]"),
    ],
)
def test_signds_domains_as_the_reference(key, value, domain):
    msg = errors(**{f"privacy.signds.{key}": value})
    assert f"signds.{key} = {value!r} is out of domain {domain}" in msg


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top)


def test_signds_small_topk_warning(caplog):
    from edge_fl.job import build_job

    cfg = load_config(None, {"privacy.mechanism": "signds", "model.name": "logreg"})
    with caplog.at_level(logging.WARNING):
        job = build_job(cfg)  # 650 params x 0.01 = 6 top-k coordinates
    assert job.warnings and "50" in job.warnings[0]


# ---------------------------------------------------------------------------------------------
# compression: the uplink codec, refused where the mechanism says it is not sound


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"compression.topk_fraction": 0.1}, "topk_fraction only apply to uplink = 'topk'"),
        (
            {"compression.uplink": "topk", "compression.topk_fraction": 0.9},
            "compression.topk_fraction = 0.9",
        ),
        ({"compression.uplink": "q 2"}, "compression.uplink = 'q 2'"),
    ],
)
def test_malformed_compression_is_refused_at_load(overrides, expected):
    assert expected in errors(**overrides)


@pytest.mark.parametrize(
    ("mechanism", "codec"),
    [("none", "q4"), ("laplace", "topk"), ("gaussian", "rot1"), ("gaussian-central", "f16")],
)
def test_sound_compression_builds_its_codec(mechanism, codec):
    cfg = load_config(None, {"privacy.mechanism": mechanism, "compression.uplink": codec})
    built = cfg.compression.build()
    assert built.name == codec
    assert load_config().compression.build() is None  # default: model.wire_dtype as before
    topk = load_config(None, {"compression.uplink": "topk", "compression.topk_fraction": 0.05})
    assert topk.compression.build().fraction == 0.05
    # the codec is a device's choice the aggregator checks per update: not in the digest
    assert cfg.digest() == load_config(None, {"privacy.mechanism": mechanism}).digest()
