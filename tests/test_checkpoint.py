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


def h_of(core) -> int:
    """The index count h of the job's SignDS plan (what the aggregator admits)."""
    return getattr(core.limits, "signds_h", None) or 10


def play_round(core, now):
    msg = core.open_round(now)
    d = len(core.params)
    for k, dev in enumerate(msg.selected):
        idx = np.sort(np.random.default_rng(k).choice(d, h_of(core), replace=False))
        idx = idx.astype(np.uint32)
        sign = 1 if k % 2 else -1
        upd = SignDSUpdate(dev, msg.round, msg.version, 30, sign, idx, k % 2, nonce=msg.nonce)
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


def test_a_late_update_after_resume_is_charged_like_without_the_restart(tmp_path):
    """The round that closed last is part of the checkpoint: a late update for it that arrives
    after a restart is still a release (it was one), as it would have been without the restart."""
    _, core = signds_core()
    msg = core.open_round(0.0)
    d = len(core.params)
    late_dev = msg.selected[-1]
    for k, dev in enumerate(msg.selected[:-1]):
        idx = np.sort(np.random.default_rng(k).choice(d, h_of(core), replace=False))
        idx = idx.astype(np.uint32)
        assert (
            core.on_update(
                dev, encode_update(SignDSUpdate(dev, 1, 0, 30, 1, idx, 0, nonce=msg.nonce), dim=d)
            )
            is None
        )
    core.close_round(1.0, 1.0)
    save_checkpoint(core, tmp_path)
    _, resumed = signds_core()
    load_checkpoint(resumed, tmp_path)
    idx = np.arange(h_of(core), dtype=np.uint32)
    late = encode_update(SignDSUpdate(late_dev, 1, 0, 30, 1, idx, 0, nonce=msg.nonce), dim=d)
    assert core.on_update(late_dev, late) == resumed.on_update(late_dev, late) == "late"
    assert resumed.releases == core.releases and (late_dev, 1, 30) in resumed.releases
    assert resumed.privacy.metrics() == core.privacy.metrics()


def test_disk_full_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno
    import os

    from edge_fl.storage import OutputError

    _, core = signds_core()
    play_round(core, 0.0)
    save_checkpoint(core, tmp_path)
    play_round(core, 1.0)
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OutputError, match=r"cannot write .*checkpoint.*: No space left on device"):
        save_checkpoint(core, tmp_path)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert not list(tmp_path.glob("*.tmp"))  # no partial temp file holds the space
    _, resumed = signds_core()
    load_checkpoint(resumed, tmp_path)
    assert resumed.round_number == 1  # the previous, complete checkpoint


def test_a_crash_between_the_two_files_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    from edge_fl.server import checkpoint

    _, core = signds_core()
    play_round(core, 0.0)
    save_checkpoint(core, tmp_path)
    params_1 = core.params.copy()
    play_round(core, 1.0)
    real = checkpoint.atomic_write

    def crash_on_state(path, data):
        if path.name == "checkpoint.json":
            raise KeyboardInterrupt  # the process dies after the new parameters file
        real(path, data)

    monkeypatch.setattr(checkpoint, "atomic_write", crash_on_state)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(core, tmp_path)
    monkeypatch.undo()
    _, resumed = signds_core()
    load_checkpoint(resumed, tmp_path)
    assert resumed.round_number == 1
    np.testing.assert_array_equal(resumed.params, params_1)
    save_checkpoint(core, tmp_path)  # the next checkpoint removes the orphan
    assert len(list(tmp_path.glob("checkpoint*.npy"))) == 1


def test_generator_states_only_for_seeded_runs(tmp_path):
    """A resumed reproducible run selects as an uninterrupted one; the production CSPRNG's state
    is never written to disk (it would predict every later selection and noise draw)."""
    import json

    job = build_job(load_config(None, {**OVERRIDES, "rounds.clients_per_round": 2}))
    core = job.aggregator_core()
    for i in range(4):
        core.on_status(f"d{i:05d}", encode_status(Status(f"d{i:05d}", True, 30)))
    core.open_round(0.0)
    core.close_round(1.0, 1.0)
    save_checkpoint(core, tmp_path)
    resumed = job.aggregator_core()
    load_checkpoint(resumed, tmp_path)
    for c in (core, resumed):
        for i in range(4):
            c.on_status(f"d{i:05d}", encode_status(Status(f"d{i:05d}", True, 30)))
    assert resumed.open_round(2.0).selected == core.open_round(2.0).selected
    secure = build_job(load_config(None, {**OVERRIDES, "reproducible": False})).aggregator_core()
    save_checkpoint(secure, tmp_path / "secure")
    state = json.loads((tmp_path / "secure" / "checkpoint.json").read_text())
    assert state["rng"] is None and state["noise_rng"] is None


def test_records_with_inf_or_nan_are_written_as_strict_json():
    """The fast path (no walk) and the walk give the same line; inf/nan become null."""
    import json
    import math

    from edge_fl.storage import dumps_record

    plain = {"round": 3, "loss": 0.25, "per": [1.5, (2, 3)], "nested": {"a": np.float32(0.5)}}
    assert json.loads(dumps_record(plain)) == {
        "round": 3,
        "loss": 0.25,
        "per": [1.5, [2, 3]],
        "nested": {"a": 0.5},
    }
    bad = {"loss": math.inf, "per": [math.nan, 1.0], "nested": {"a": np.float64("nan")}}
    line = dumps_record(bad)
    assert json.loads(line) == {"loss": None, "per": [None, 1.0], "nested": {"a": None}}
    assert "NaN" not in line and "Infinity" not in line
