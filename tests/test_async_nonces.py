"""Every asynchronous version's nonce lives in the engine's history (the checkpoint's ledger
file), not in ``checkpoint.json``: a long FedAsync job's commit stays the same size, and a
resumed aggregator still checks and charges a straggler's answer on any published version."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import DenseUpdate, Reject, Status, UpdateLimits, encode_status, encode_update
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings
from edge_fl.server.checkpoint import load_checkpoint, save_checkpoint

D = 4
DEVICES = [f"d{i}" for i in range(4)]


def engine(mode: str, max_staleness: int = 2) -> AggregatorCore:
    settings = AggregatorSettings(
        job="j", rounds=500, target=2, min_updates=1, deadline_s=10.0, mode=mode,
        buffer_size=2, max_staleness=max_staleness,
    )  # fmt: skip
    core = AggregatorCore(settings, np.zeros(D, np.float32), UpdateLimits(D), seeded_generator(5))
    for d in DEVICES:
        core.on_status(d, encode_status(Status(d, True, 100)))
    return core


def answer(core: AggregatorCore, device: str, version: int, nonce: bytes | None) -> Reject | None:
    delta = np.full(D, 0.01, np.float32)
    update = DenseUpdate(device, version, version, 40, delta, nonce=nonce)
    return core.on_update(device, encode_update(update))


def run_versions(core: AggregatorCore, n: int, out) -> None:
    for _ in range(n):
        msg = core.open_round(0.0)
        assert msg is not None
        for device in DEVICES[:2]:
            assert answer(core, device, msg.round, core.nonce_of(msg.round)) is None
        core.close_round(1.0, 0.1)
        save_checkpoint(core, out)


@pytest.mark.parametrize("mode", ["fedasync", "fedbuff"])
def test_the_checkpoint_json_does_not_grow_with_the_versions(tmp_path, mode):
    core = engine(mode)
    sizes = []
    for _ in range(30):
        run_versions(core, 1, tmp_path)
        state = json.loads((tmp_path / "checkpoint.json").read_text())
        assert "nonces" not in state
        sizes.append(len((tmp_path / "checkpoint.json").read_bytes()))
    assert sizes[-1] - sizes[5] < 40, sizes  # counters' digits only; 16 B a version before
    assert sorted(core.history) == list(range(core.version))  # one per published version


def test_a_resumed_core_checks_and_charges_a_straggler_on_an_old_version(tmp_path):
    live = engine("fedasync", max_staleness=2)
    run_versions(live, 8, tmp_path)
    again = engine("fedasync", max_staleness=2)
    load_checkpoint(again, tmp_path)
    assert again.open_round(0.0) is not None
    for version in range(live.version):  # every version live published
        assert again.nonce_of(version) == live.nonce_of(version) is not None
    # d3 answers version 1 now, far beyond max_staleness: refused as stale, and charged, since
    # the nonce shows it trained on the model published as version 1
    before = len(again.releases)
    assert answer(again, "d3", 1, live.nonce_of(1)) is Reject.STALE
    assert [tuple(r) for r in again.releases[before:]] == [("d3", 1, 40)]
    # another nonce is no release of version 1: refused, never charged
    assert answer(again, "d2", 1, bytes(16)) is Reject.WRONG_NONCE
    assert len(again.releases) == before + 1
