"""The aggregator core without a broker: selection, admission, FedAvg, deadlines, bad input."""

from __future__ import annotations

import msgpack
import numpy as np

from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import (
    DenseUpdate,
    Reject,
    Status,
    UpdateLimits,
    encode_status,
    encode_update,
)
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings
from edge_fl.server.rounds import Decision

D = 8


def core(**kw) -> AggregatorCore:
    settings = dict(job="j", rounds=3, target=3, min_updates=2, deadline_s=10.0)
    settings.update(kw)
    c = AggregatorCore(
        AggregatorSettings(**settings),
        np.zeros(D, np.float32),
        UpdateLimits(D),
        seeded_generator(1),
    )
    for i in range(5):
        c.on_status(f"d{i}", encode_status(Status(f"d{i}", True, 1000)))
    return c


def update(c: AggregatorCore, device: str, rnd: int, version: int, value: float, n: int) -> bytes:
    """An honest device's update: it echoes the nonce of the round it answers."""
    delta = np.full(D, value, np.float32)
    return encode_update(DenseUpdate(device, rnd, version, n, delta, nonce=c.nonce_of(rnd)))


def test_selection_respects_availability():
    c = core()
    c.on_status("d4", encode_status(Status("d4", False)))
    msg = c.open_round(0.0)
    assert msg is not None and len(msg.selected) == 3
    assert "d4" not in msg.selected
    assert set(msg.selected) <= {"d0", "d1", "d2", "d3"}


def test_no_round_without_enough_devices():
    c = core(min_updates=2)
    for i in range(4):
        c.on_status(f"d{i}", encode_status(Status(f"d{i}", False)))
    assert c.open_round(0.0) is None


def test_fedavg_is_sample_weighted_and_idempotent():
    c = core()
    msg = c.open_round(0.0)
    sel = list(msg.selected)
    values, ns = [1.0, 2.0, 4.0], [10, 30, 60]
    first = update(c, sel[0], 1, 0, values[0], ns[0])
    assert c.on_update(sel[0], first) is None
    assert c.on_update(sel[0], first) is Reject.DUPLICATE  # QoS 1 redelivery
    for dev, v, n in zip(sel[1:], values[1:], ns[1:], strict=True):
        assert c.on_update(dev, update(c, dev, 1, 0, v, n)) is None
    assert c.decide(1.0) is Decision.CLOSE
    record = c.close_round(1.0, 0.5)
    expected = (1 * 10 + 2 * 30 + 4 * 60) / 100
    np.testing.assert_allclose(c.params, np.full(D, expected), rtol=1e-6)
    assert record["received"] == 3 and record["rejected"] == 1
    assert record["rejected_by_reason"] == {"duplicate": 1}
    assert record["bytes_up"] == 4 * len(first)
    assert c.version == 1


def test_bad_input_never_touches_state():
    c = core()
    msg = c.open_round(0.0)
    dev = msg.selected[0]
    bad = [
        b"\x00\x01garbage",
        update(c, dev, 1, 0, float("nan"), 5),
        encode_update(DenseUpdate(dev, 1, 0, 5, np.zeros(D + 3, np.float32))),
        msgpack.packb(  # names another device than the topic it came on
            {**msgpack.unpackb(update(c, dev, 1, 0, 1.0, 5)), "dev": "d9"}, use_bin_type=True
        ),
    ]
    for payload in bad:
        assert c.on_update(dev, payload) is not None
    assert c.current.accepted == set()
    assert c.on_update(dev, update(c, dev, 1, 0, 3.0, 5)) is None  # the real one still counts
    record = c.close_round(20.0, 1.0)
    assert record["rejected"] == 4 and record["received"] == 1
    np.testing.assert_allclose(c.params, 3.0)


def test_late_and_not_selected_updates():
    c = core(target=2, min_updates=1)
    msg = c.open_round(0.0)
    outsider = next(d for d in ("d0", "d1", "d2", "d3", "d4") if d not in msg.selected)
    assert c.on_update(outsider, update(c, outsider, 1, 0, 1.0, 5)) is Reject.NOT_SELECTED
    a, b = msg.selected
    assert c.on_update(a, update(c, a, 1, 0, 1.0, 5)) is None
    assert c.decide(10.0) is Decision.CLOSE
    c.close_round(10.0, 1.0)
    c.open_round(11.0)
    assert c.on_update(b, update(c, b, 1, 0, 1.0, 5)) is Reject.LATE
    assert c.tally.late == 1


def test_deadline_skip_leaves_model_unchanged():
    c = core(min_updates=2)
    msg = c.open_round(0.0)
    dev = msg.selected[0]
    c.on_update(dev, update(c, dev, 1, 0, 5.0, 5))
    assert c.decide(10.0) is Decision.EXTEND
    assert c.decide(20.0) is Decision.SKIP
    record = c.close_round(20.0, 20.0, skipped=True)
    assert record["status"] == "skipped" and c.version == 0
    np.testing.assert_array_equal(c.params, 0.0)


def test_over_selection_closes_on_target():
    c = core(target=2, min_updates=2, over_selection=1.5)
    msg = c.open_round(0.0)
    assert len(msg.selected) == 3
    devs = list(msg.selected)
    for dev in devs[:2]:
        assert c.on_update(dev, update(c, dev, 1, 0, 1.0, 5)) is None
    assert c.decide(0.1) is Decision.CLOSE
    assert c.on_update(devs[2], update(c, devs[2], 1, 0, 1.0, 5)) is Reject.LATE


def test_bad_status_is_ignored_and_cleared_status_forgets():
    c = core()
    c.on_status("d7", b"junk")
    c.on_status("d8", encode_status(Status("d9", True)))  # someone else's status on d8's topic
    assert "d7" not in c.available() and "d8" not in c.available()
    c.on_status("d0", b"")  # cleared retained status
    assert "d0" not in c.available()


def test_non_finite_aggregate_leaves_the_model_unchanged():
    c = core(server_lr=1e36, min_updates=1)  # a deliberately absurd server step
    msg = c.open_round(0.0)
    dev = msg.selected[0]
    assert c.on_update(dev, update(c, dev, 1, 0, 1e3, 5)) is None  # finite; x1e36 overflows f32
    record = c.close_round(20.0, 1.0)
    assert record["status"] == "skipped" and record["diverged"] is True
    assert c.version == 0
    np.testing.assert_array_equal(c.params, 0.0)


def test_an_update_beyond_the_exact_sum_is_refused_as_implausible_and_changes_nothing():
    c = core(min_updates=1)
    c.limits = UpdateLimits(D, max_abs=None)  # past the decoder's plausibility bound
    msg = c.open_round(0.0)
    dev = msg.selected[0]
    assert c.on_update(dev, update(c, dev, 1, 0, 3e38, 5)) is Reject.IMPLAUSIBLE
    assert c.strategy.count == 0 and c.current.count == 0


def test_a_round_period_paces_openings_from_the_previous_opening():
    c = core(period_s=100.0)
    assert c.opens_at() == -np.inf  # the first round opens at once
    msg = c.open_round(5.0)
    assert msg is not None
    for dev in msg.selected:
        assert c.on_update(dev, update(c, dev, 1, 0, 1.0, 10)) is None
    c.close_round(6.0, 0.5)
    assert c.opens_at() == 105.0
    assert c.open_round(104.9) is None and c.current is None  # not yet: nothing drawn
    assert c.open_round(105.0) is not None and c.round_number == 2
    # a round that ran past its period: the next one opens as soon as it closes
    c.close_round(300.0, 0.5)
    assert c.opens_at() == 205.0 and c.open_round(300.0) is not None


def test_without_a_period_rounds_open_back_to_back():
    c = core()
    assert c.open_round(0.0) is not None
    c.close_round(0.1, 0.5)
    assert c.opens_at() == -np.inf and c.open_round(0.1) is not None


def test_a_stop_may_open_the_record_round_before_the_period():
    c = core(period_s=100.0)
    assert c.open_round(0.0) is not None
    c.close_round(1.0, 0.5)
    assert c.open_round(2.0) is None
    assert c.open_round(2.0, paced=False) is not None  # carries the final record
