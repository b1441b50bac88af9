"""Aggregator checkpoints: a resumed core continues with the same model, round, MagRR state and
privacy ledger; a checkpoint from another configuration is refused."""

from __future__ import annotations

import numpy as np
import pytest

from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.protocol import SignDSUpdate, Status, encode_status, encode_update
from edge_fl.server.checkpoint import load_checkpoint, save_checkpoint

OVERRIDES = {
    "data.devices": 4,
    "rounds.clients_per_round": 4,
    "rounds.min_updates": 1,
    "privacy.mechanism": "signds",
    "reproducible": True,
}


def signds_core():
    job = build_job(load_config(None, OVERRIDES))
    core = job.aggregator_core()
    for i in range(4):
        dev = f"d{i:05d}"
        core.on_status(dev, encode_status(Status(dev, True, 30)))
    return job, core


def play_round(core, now):
    msg = core.open_round(now)
    d = len(core.params)
    for k, dev in enumerate(msg.selected):
        idx = np.sort(np.random.default_rng(k).choice(d, 10, replace=False)).astype(np.uint32)
        upd = SignDSUpdate(dev, msg.round, msg.version, 30, 1 if k % 2 else -1, idx, k % 2)
        assert core.on_update(dev, encode_update(upd, dim=d)) is None
    return core.close_round(now + 1, 1.0)


def test_resume_restores_model_round_magrr_and_ledger(tmp_path):
    _, core = signds_core()
    for r in range(3):
        play_round(core, float(r))
    save_checkpoint(core, tmp_path)
    _, resumed = signds_core()
    load_checkpoint(resumed, tmp_path)
    np.testing.assert_array_equal(resumed.params, core.params)
    assert (resumed.version, resumed.round_number) == (core.version, core.round_number)
    assert resumed.mechanism_state == core.mechanism_state
    assert resumed.privacy.metrics() == core.privacy.metrics()
    # and it carries on: the next round is round 4, on top of the restored model
    record = play_round(resumed, 10.0)
    assert record["round"] == 4 and resumed.version == 4


def test_checkpoint_of_another_config_is_refused(tmp_path):
    _, core = signds_core()
    play_round(core, 0.0)
    save_checkpoint(core, tmp_path)
    other = build_job(load_config(None, {**OVERRIDES, "privacy.signds.sign_k": 0.02}))
    with pytest.raises(ValueError, match="config digest"):
        load_checkpoint(other.aggregator_core(), tmp_path)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    _, core = signds_core()
    with pytest.raises(ValueError, match="cannot read the checkpoint"):
        load_checkpoint(core, tmp_path / "nowhere")
