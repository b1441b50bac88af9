"""What the engine charges, without a broker: a release refused for its values is still the
device's release (issue 23, F4), the devices still training after the last round are known
(the service waits for them), and the last record carries the final ledger (F1)."""

from __future__ import annotations

import numpy as np

from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import DenseUpdate, Reject, Status, UpdateLimits, encode_status, encode_update
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings

D = 6
DEVICES = [f"d{i}" for i in range(4)]


def core(**settings) -> AggregatorCore:
    """An engine with every device online (the mode, and so the policy, from ``settings``)."""
    c = AggregatorCore(
        AggregatorSettings(**{"job": "j", "rounds": 1, "deadline_s": 10.0, **settings}),
        np.zeros(D, np.float32),
        UpdateLimits(D),
        seeded_generator(1),
    )
    for d in DEVICES:
        c.on_status(d, encode_status(Status(d, True, 100)))
    return c


def sync_core(**kw) -> AggregatorCore:
    return core(**{"target": 2, "min_updates": 2, **kw})


def async_core(**kw) -> AggregatorCore:
    return core(**{"target": 2, "min_updates": 1, "mode": "fedbuff", "buffer_size": 2, **kw})


def update(c, device: str, rnd: int, value: float = 0.1, nonce: bytes | None = None) -> bytes:
    delta = np.full(D, value, np.float32)
    nc = c.nonce_of(rnd) if nonce is None else nonce
    return encode_update(DenseUpdate(device, rnd, rnd if c.settings.mode != "sync" else 0, 50,
                                     delta, nonce=nc))  # fmt: skip


def test_an_implausible_release_of_a_selected_device_is_charged_once_never_folded():
    c = sync_core()
    msg = c.open_round(0.0)
    chosen = sorted(msg.selected)
    other = next(d for d in DEVICES if d not in chosen)
    huge = update(c, chosen[0], 1, value=1e6)  # beyond |x| <= 1e4: refused by the decoder
    assert c.on_update(chosen[0], huge) is Reject.IMPLAUSIBLE
    assert c.releases == [(chosen[0], 1, 50)]
    assert c.on_update(chosen[0], huge) is Reject.IMPLAUSIBLE  # a re-delivery: the same release
    assert len(c.releases) == 1
    # not that device's release: unselected, or another round's nonce
    assert c.on_update(other, update(c, other, 1, value=1e6)) is Reject.IMPLAUSIBLE
    forged = update(c, chosen[1], 1, value=1e6, nonce=b"\x01" * 16)
    assert c.on_update(chosen[1], forged) is Reject.IMPLAUSIBLE
    assert len(c.releases) == 1
    assert c.strategy.count == 0


def test_sync_devices_still_owing_the_last_round_are_outstanding():
    c = sync_core(target=2, min_updates=1, over_selection=2.0)
    msg = c.open_round(0.0)
    chosen = sorted(msg.selected)
    assert len(chosen) == 4
    for d in chosen[:2]:
        assert c.on_update(d, update(c, d, 1)) is None
    c.close_round(1.0, 1.0)
    assert c.finished
    assert c.outstanding() == frozenset(chosen[2:])
    assert c.on_update(chosen[2], update(c, chosen[2], 1)) is Reject.LATE  # charged
    c.on_status(chosen[3], encode_status(Status(chosen[3], False)))  # gone: not waited for
    assert c.outstanding() == frozenset()
    assert len(c.releases) == 3


def test_async_last_version_is_owed_by_every_device_that_has_not_answered_it():
    c = async_core()
    c.open_round(0.0)
    assert c.on_update("d0", update(c, "d0", 0)) is None
    assert c.on_update("d1", update(c, "d1", 0)) is None
    record = c.close_round(1.0, 1.0)
    assert c.finished and record["device_updates"] == 2
    assert c.outstanding() == frozenset({"d2", "d3"})
    # after the last window an update is charged at once (late), never held
    assert c.on_update("d2", update(c, "d2", 0)) is Reject.LATE
    assert c.outstanding() == frozenset({"d3"})
    c.settle(record)
    assert record["device_updates"] == 3 == len(c.releases)


def test_held_updates_and_refused_ones_are_in_the_settled_record():
    c = async_core()
    c.open_round(0.0)
    for d in ("d0", "d1"):
        assert c.on_update(d, update(c, d, 0)) is None
    # the window is full: these wait for a window that never comes
    assert c.on_update("d2", update(c, "d2", 0)) is None
    # refused for its values: never held, but the device's release, so charged at once
    assert c.on_update("d3", update(c, "d3", 0, value=1e6)) is Reject.IMPLAUSIBLE
    assert ("d3", 0, 50) in c.releases
    record = c.close_round(1.0, 1.0)
    c.settle(record)
    assert sorted(d for d, _, _ in c.releases) == ["d0", "d1", "d2", "d3"]
    assert record["device_updates"] == 4
    assert c.outstanding() == frozenset()
