"""An async aggregator's memory stays bounded whatever one device sends while no window has room
(issue 24, item 2: 1,000 x 1 MiB from one device during the wait for devices took RSS from 155 to
1,159 MB). Held updates are decoded when they arrive and kept once per (device, version)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import DenseUpdate, Reject, Status, UpdateLimits, encode_status, encode_update
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings

D = 7850  # the logreg model on 28 x 28 images: max_bytes = 4 D + 4096 = 35,496
MIB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def full_window(mode: str) -> AggregatorCore:
    """A window that has all it applies: whatever comes next waits for the next window."""
    settings = AggregatorSettings(job="j", rounds=5, target=2, min_updates=1, deadline_s=10.0,
                                  mode=mode, buffer_size=2)  # fmt: skip
    core = AggregatorCore(settings, np.zeros(D, np.float32), UpdateLimits(D), seeded_generator(1))
    for d in ("d0", "d1", "d2"):
        core.on_status(d, encode_status(Status(d, True, 100)))
    msg = core.open_round(0.0)
    for d in ("d0", "d1")[: core.current.target]:
        assert core.on_update(d, honest(core, d, msg.version)) is None
    assert core.policy.holds()
    return core


def honest(core: AggregatorCore, device: str, version: int) -> bytes:
    delta = np.full(D, 0.01, np.float32)
    update = DenseUpdate(device, version, version, 50, delta, nonce=core.nonce_of(version))
    return encode_update(update)


@pytest.mark.parametrize("mode", ["fedbuff", "fedasync"])
def test_a_flood_from_one_device_is_not_kept(mode):
    core = full_window(mode)
    before = rss_bytes()
    for i in range(300):  # 300 MiB sent: each refused as it comes
        junk = i.to_bytes(4, "little") * (MIB // 4)
        assert core.on_update("d2", junk) is not None
    grown = rss_bytes() - before
    assert grown < 50 * MIB, f"RSS grew by {grown / MIB:.0f} MiB for 300 MiB sent"
    assert core.policy.snapshot()["held"] == []
    # a valid update is held once; copies of it and forgeries are not kept
    first = honest(core, "d2", 0)
    assert core.on_update("d2", first) is None
    for _ in range(100):
        assert core.on_update("d2", first) is Reject.DUPLICATE
    forged = encode_update(DenseUpdate("d2", 0, 0, 50, np.zeros(D, np.float32), nonce=b"\x07" * 16))
    assert core.on_update("d2", forged) is Reject.WRONG_NONCE
    for version in range(1, 50):  # versions never published cannot be held either
        assert core.on_update("d2", honest(core, "d2", version)) is Reject.FUTURE
    assert len(core.policy.snapshot()["held"]) == 1
    # the held one is applied in the next window, and charged once
    core.close_round(1.0, 0.1)
    core.open_round(2.0)
    assert core.current.count == 1 and [d for d, _, _ in core.releases].count("d2") == 1
