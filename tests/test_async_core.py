"""Asynchronous aggregation without a broker: staleness functions, the async window's admission and
decisions, and FedBuff / FedAsync applications on encoded updates, checked number by number."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

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
from edge_fl.server.asynchronous import AsyncWindow
from edge_fl.server.rounds import Decision
from edge_fl.server.staleness import Staleness

D = 6
DEVICES = [f"d{i}" for i in range(6)]

# ------------------------------------------------------------------ staleness functions


@pytest.mark.parametrize("s", [0, 1, 7, 1000])
def test_constant_ignores_staleness(s):
    assert Staleness("constant").weight(s) == 1.0


@pytest.mark.parametrize(
    ("a", "s", "expected"),
    [(0.5, 0, 1.0), (0.5, 3, 0.5), (0.5, 8, 1 / 3), (1.0, 4, 0.2), (2.0, 1, 0.25), (0.0, 9, 1.0)],
)
def test_polynomial_is_one_plus_s_to_minus_a(a, s, expected):
    assert Staleness("polynomial", a=a).weight(s) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("s", "expected"),
    # a = 0.5, b = 4: full weight up to b, then 1 / (a (s - b) + 1)
    [(0, 1.0), (4, 1.0), (5, 1 / 1.5), (6, 0.5), (14, 1 / 6)],
)
def test_hinge_full_weight_up_to_b_then_decays(s, expected):
    assert Staleness("hinge", a=0.5, b=4).weight(s) == pytest.approx(expected, rel=1e-12)


def test_hinge_with_b_zero_and_steep_slope():
    f = Staleness("hinge", a=10.0, b=0)
    assert f.weight(0) == 1.0
    assert f.weight(1) == pytest.approx(1 / 11)


@pytest.mark.parametrize("kind", ["constant", "polynomial", "hinge"])
def test_negative_staleness_is_an_error(kind):
    with pytest.raises(ValueError, match="from the future"):
        Staleness(kind).weight(-1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "linear"}, "constant, polynomial or hinge"),
        ({"a": -0.1}, "a = -0.1"),
        ({"a": math.nan}, "a = nan"),
        ({"kind": "hinge", "b": -1}, "b = -1"),
    ],
)
def test_bad_parameters_are_rejected_with_their_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Staleness(**kwargs)


@given(
    kind=st.sampled_from(["constant", "polynomial", "hinge"]),
    a=st.floats(0, 10),
    b=st.integers(0, 50),
    s=st.integers(0, 10_000),
)
def test_weights_are_in_unit_interval_and_non_increasing(kind, a, b, s):
    f = Staleness(kind, a=a, b=b)
    w, w_next = f.weight(s), f.weight(s + 1)
    assert 0.0 < w <= 1.0
    assert w_next <= w


# ------------------------------------------------------------------ the async window


def window(**kw) -> AsyncWindow:
    base = dict(
        number=4,
        version=5,
        target=3,
        opened_at=100.0,
        deadline_s=10.0,
        staleness=Staleness("polynomial", a=1.0),
        max_staleness=3,
    )
    base.update(kw)
    return AsyncWindow(**base)


def test_window_admission_by_staleness():
    w = window()
    assert w.admit("a", 6, base_version=6) is Reject.FUTURE  # computed on a version not yet issued
    assert w.admit("a", 1, base_version=1) is Reject.STALE  # s = 4 > max_staleness = 3
    assert w.admit("a", 2, base_version=2) is None  # s = 3: the oldest still admitted
    assert w.admit("a", 5, base_version=5) is None  # s = 0
    assert window(max_staleness=0).admit("a", 4, base_version=4) is Reject.STALE


def test_window_duplicate_is_per_device_and_base_version():
    w = window()
    w.accept("a", base_version=4)
    assert w.admit("a", 4, base_version=4) is Reject.DUPLICATE  # QoS 1 redelivery
    assert w.admit("a", 5, base_version=5) is None  # the same device's next update is new work
    assert w.admit("b", 4, base_version=4) is None
    w.earlier = {("c", 3)}  # applied by an earlier window
    assert w.admit("c", 3, base_version=3) is Reject.DUPLICATE
    assert w.admit("c", 4, base_version=4) is None


def test_window_weight_and_staleness_stats():
    w = window()
    assert w.weight(5) == 1.0
    assert w.weight(3) == pytest.approx(1 / 3)  # s = 2, (1 + s)^-1
    assert w.staleness_stats() == {
        "staleness_mean": None,
        "staleness_max": None,
        "staleness_hist": {},
    }
    for dev, base in [("a", 5), ("b", 3), ("c", 3), ("d", 2)]:
        w.accept(dev, base)
    assert w.count == 4
    assert w.staleness_stats() == {
        "staleness_mean": pytest.approx((0 + 2 + 2 + 3) / 4),
        "staleness_max": 3,
        "staleness_hist": {"0": 1, "2": 2, "3": 1},
    }


def test_window_decide():
    w = window(target=3)
    assert w.deadline == 110.0
    assert w.decide(100.0) is Decision.WAIT
    assert w.decide(110.0) is Decision.SKIP  # nothing arrived by the deadline
    w.accept("a", 5)
    assert w.decide(105.0) is Decision.WAIT
    assert w.decide(110.0) is Decision.CLOSE  # at the deadline one update is enough
    w.accept("b", 4)
    w.accept("c", 5)
    assert w.decide(100.5) is Decision.CLOSE  # K reached: close before the deadline


# ------------------------------------------------------------------ the async aggregator core


def async_core(mode: str = "fedbuff", **kw) -> AggregatorCore:
    settings = dict(
        job="j",
        rounds=50,
        target=2,
        min_updates=1,
        deadline_s=10.0,
        mode=mode,
        buffer_size=3,
        max_staleness=4,
        staleness=Staleness("polynomial", a=1.0),
    )
    settings.update(kw)
    c = AggregatorCore(
        AggregatorSettings(**settings),
        np.zeros(D, np.float32),
        UpdateLimits(D),
        seeded_generator(1),
        evaluate=lambda w: (float(w[0]), 0.0),  # "accuracy" = first parameter: visible in records
    )
    for dev in DEVICES:
        c.on_status(dev, encode_status(Status(dev, True, 1000)))
    return c


def update(c, device: str, base_version: int, value: float | np.ndarray, n: int) -> bytes:
    delta = np.broadcast_to(np.asarray(value, np.float32), (D,)).copy()
    # in async modes the round a device answers is the version it trained on
    nonce = c.nonce_of(base_version)
    return encode_update(DenseUpdate(device, base_version, base_version, n, delta, nonce=nonce))


def apply_window(c: AggregatorCore, now: float, updates: list[tuple[str, int, float, int]]):
    msg = c.open_round(now)
    assert msg is not None
    for dev, base, value, n in updates:
        assert c.on_update(dev, update(c, dev, base, value, n)) is None
    assert c.decide(now) is Decision.CLOSE
    return msg, c.close_round(now, 0.1)


def test_global_message_of_an_async_window_selects_nobody_and_names_the_version():
    c = async_core()
    msg = c.open_round(0.0)
    assert msg.selected is None and msg.selects("anyone")
    assert msg.round == msg.version == 0
    assert msg.mode == "fedbuff"
    assert c.on_update("d0", update(c, "d0", 0, 1.0, 10)) is None
    assert c.decide(0.0) is Decision.WAIT  # 1 of K = 3
    assert c.decide(10.0) is Decision.CLOSE  # deadline with >= 1
    c.close_round(10.0, 0.1)
    msg = c.open_round(11.0)
    assert msg.selected is None
    assert msg.round == msg.version == 1


def test_fedbuff_applies_the_staleness_weighted_mean_exactly():
    c = async_core(server_lr=0.5)
    # window 1 at version 0: three fresh updates -> the sample-weighted mean (times server_lr)
    _, rec1 = apply_window(c, 0.0, [("d0", 0, 1.0, 10), ("d1", 0, 2.0, 30), ("d2", 0, 4.0, 60)])
    mean1 = (1 * 10 + 2 * 30 + 4 * 60) / 100
    np.testing.assert_allclose(c.params, 0.5 * mean1, rtol=1e-6)
    assert c.version == 1 and rec1["version"] == 1 and rec1["round"] == 1
    assert rec1["received"] == 3
    assert rec1["staleness_mean"] == 0.0 and rec1["staleness_hist"] == {"0": 3}

    # window 2 at version 1: fresh (s = 0, f = 1), one behind (s = 1, f = 1/2), and a per-coordinate
    # delta from version 0; weights f(s) n, normalised by the plain sample count
    before = c.params.astype(np.float64)
    vec = np.arange(1, D + 1, dtype=np.float64)
    msg = c.open_round(1.0)
    assert msg.version == 1
    assert c.on_update("d3", update(c, "d3", 1, 2.0, 20)) is None
    assert c.on_update("d4", update(c, "d4", 0, 6.0, 40)) is None
    assert c.on_update("d5", update(c, "d5", 0, vec, 40)) is None
    assert c.decide(1.0) is Decision.CLOSE
    rec2 = c.close_round(1.0, 0.1)
    step = 0.5 * (1.0 * 20 * 2.0 + 0.5 * 40 * 6.0 + 0.5 * 40 * vec) / (20 + 40 + 40)
    np.testing.assert_allclose(c.params, before + step, rtol=1e-6)
    assert c.version == 2 and rec2["version"] == 2
    assert rec2["staleness_mean"] == pytest.approx(2 / 3)
    assert rec2["staleness_max"] == 1
    assert rec2["staleness_hist"] == {"0": 1, "1": 2}
    assert rec2["update_norm"] == pytest.approx(float(np.linalg.norm(step)), rel=1e-6)


def test_fedasync_applies_server_lr_times_f_of_s_times_delta():
    c = async_core("fedasync", server_lr=0.4, staleness=Staleness("polynomial", a=0.5), rounds=9)
    expected = np.zeros(D)
    # three applications to reach version 3, then one update computed on version 0 (s = 3)
    for v, value in enumerate([1.0, -2.0, 0.5]):
        msg, rec = apply_window(c, float(v), [(DEVICES[v], v, value, 7)])
        assert msg.round == msg.version == v and msg.selected is None
        expected += 0.4 * value  # s = 0: f = 1, and n cancels for a single update
        np.testing.assert_allclose(c.params, expected, rtol=1e-6)
        assert rec["version"] == v + 1 and rec["received"] == 1
    msg, rec = apply_window(c, 3.0, [("d5", 0, 3.0, 50)])
    expected += 0.4 * (1 + 3) ** -0.5 * 3.0  # server_lr * f(3) * delta
    np.testing.assert_allclose(c.params, expected, rtol=1e-6)
    assert c.version == 4
    assert rec["staleness_mean"] == 3.0 and rec["staleness_max"] == 3
    assert rec["staleness_hist"] == {"3": 1}
    assert [r["version"] for r in c.records] == [1, 2, 3, 4]
    assert [r["accuracy"] for r in c.records] == pytest.approx(
        [0.4, -0.4, -0.2, -0.2 + 0.6], rel=1e-6
    )


def test_fedasync_window_closes_on_the_first_update():
    c = async_core("fedasync", buffer_size=10)  # K is 1 in FedAsync whatever buffer_size says
    c.open_round(0.0)
    assert c.current.target == 1
    assert c.decide(0.0) is Decision.WAIT
    assert c.on_update("d0", update(c, "d0", 0, 1.0, 5)) is None
    assert c.decide(0.0) is Decision.CLOSE


def test_async_core_rejects_future_and_too_stale_updates():
    c = async_core(max_staleness=1)
    for v in range(3):  # advance to version 3
        apply_window(c, float(v), [(DEVICES[i], v, 1.0, 5) for i in range(3)])
    before = c.params.copy()
    c.open_round(10.0)
    assert c.on_update("d0", update(c, "d0", 4, 1.0, 5)) is Reject.FUTURE
    assert c.on_update("d1", update(c, "d1", 1, 1.0, 5)) is Reject.STALE  # s = 2 > 1
    assert c.on_update("d2", update(c, "d2", 2, 1.0, 5)) is Reject.DUPLICATE  # applied at version 2
    assert c.on_update("d3", update(c, "d3", 2, 1.0, 5)) is None  # s = 1
    rec = c.close_round(20.0, 0.1)
    assert rec["rejected_by_reason"] == {"duplicate": 1, "future": 1, "stale": 1}
    assert rec["received"] == 1 and rec["staleness_hist"] == {"1": 1}
    np.testing.assert_allclose(c.params, before + 1.0 * (1 + 1) ** -1.0, rtol=1e-6)


def test_duplicate_across_windows_is_rejected_while_it_could_still_be_admitted():
    c = async_core(max_staleness=2)
    apply_window(c, 0.0, [("d0", 0, 1.0, 10), ("d1", 0, 1.0, 10), ("d2", 0, 1.0, 10)])
    first = update(c, "d0", 0, 1.0, 10)  # the same bytes as the one applied
    params = c.params.copy()
    c.open_round(1.0)
    assert c.on_update("d0", first) is Reject.DUPLICATE  # QoS 1 redelivery after the close
    assert c.on_update("d0", update(c, "d0", 1, 1.0, 10)) is None  # its new work counts
    assert c.tally.rejected == {Reject.DUPLICATE: 1}
    c.close_round(20.0, 0.1)  # deadline close with one update
    assert c.version == 2
    assert not np.array_equal(c.params, params)


def test_empty_async_window_at_the_deadline_is_skipped_without_a_new_version():
    c = async_core()
    c.open_round(0.0)
    assert c.decide(9.99) is Decision.WAIT
    assert c.decide(10.0) is Decision.SKIP
    rec = c.close_round(10.0, 10.0, skipped=True)
    assert rec["status"] == "skipped" and rec["received"] == 0
    assert rec["staleness_mean"] is None and rec["staleness_hist"] == {}
    assert c.version == 0
    np.testing.assert_array_equal(c.params, 0.0)
    msg = c.open_round(11.0)
    assert msg.round == msg.version == 0  # the same model is offered again


def test_async_core_waits_for_an_available_device():
    c = async_core()
    for dev in DEVICES:
        c.on_status(dev, encode_status(Status(dev, False)))
    assert c.open_round(0.0) is None
    c.on_status("d3", encode_status(Status("d3", True, 10)))
    assert c.open_round(0.0) is not None


# ------------------------------------------------------------------ async delivery edge cases


def test_fedasync_applies_each_update_of_a_burst_separately():
    c = async_core("fedasync", server_lr=1.0, staleness=Staleness("constant"))
    c.open_round(0.0)
    # two updates reach the core before the service gets to run decide()
    c.on_update("d0", update(c, "d0", 0, 1.0, 10))
    c.on_update("d1", update(c, "d1", 0, 3.0, 10))
    c.close_round(0.0, 0.1)
    np.testing.assert_allclose(c.params, 1.0)  # only the first one: delta applied in full
    c.open_round(0.1)  # the second belongs to the next application
    assert c.current.count == 1
    c.close_round(0.1, 0.1)
    np.testing.assert_allclose(c.params, 4.0)


def test_async_update_between_windows_is_kept_for_the_next_window():
    c = async_core("fedasync")
    apply_window(c, 0.0, [("d0", 0, 1.0, 10)])
    assert c.on_update("d1", update(c, "d1", 0, 1.0, 10)) is None  # no window open right now
    c.open_round(1.0)
    assert c.current.count == 1


# ------------------------------------------------------------------ concurrency limit C

MANY = [f"e{i:02d}" for i in range(12)]


def limited_core(mode: str = "fedbuff", c: int = 4, timeout: float = 5.0, **kw) -> AggregatorCore:
    settings = dict(
        job="j",
        rounds=100,
        target=2,
        min_updates=1,
        deadline_s=30.0,
        mode=mode,
        buffer_size=2,
        max_staleness=10,
        staleness=Staleness("polynomial", a=0.5),
    )
    settings.update(kw)
    core = AggregatorCore(
        AggregatorSettings(**settings),
        np.zeros(D, np.float32),
        UpdateLimits(D),
        seeded_generator(7),
        concurrency=c,
        dispatch_timeout_s=timeout,
    )
    for dev in MANY:
        core.on_status(dev, encode_status(Status(dev, True, 100)))
    return core


def answer(c: AggregatorCore, device: str, version: int | None = None) -> Reject | None:
    v = c.policy.in_flight[device] if version is None else version
    return c.on_update(device, update(c, device, v, 0.5, 10))


def test_a_window_selects_c_devices_and_its_message_names_them():
    c = limited_core(c=4)
    msg = c.open_round(0.0)
    assert msg.selected is not None and len(msg.selected) == 4
    assert set(msg.selected) == set(c.policy.in_flight) == c.current.selected
    assert all(v == 0 for v in c.policy.in_flight.values())
    assert not msg.selects(next(d for d in MANY if d not in msg.selected))


def test_an_arrival_frees_its_slot_and_selects_one_replacement_sent_by_dispatch():
    c = limited_core(c=4)
    msg = c.open_round(0.0)
    first = msg.selected[0]
    assert answer(c, first) is None
    assert (
        len(c.policy.in_flight) == 4 and first not in c.policy.in_flight
    )  # replaced at once: C stay busy
    (new,) = set(c.policy.in_flight) - set(msg.selected)
    out = c.dispatch(1.0)
    assert out is not None and out.selected == (new,) and out.round == out.version == 0
    assert c.dispatch(1.0) is None  # nothing new to send
    assert c.policy.dispatched == 5


def test_in_flight_never_exceeds_c_and_nobody_is_selected_twice_while_in_flight():
    c = limited_core("fedbuff", c=5, timeout=3.0, buffer_size=3)
    rng = np.random.default_rng(0)
    now = 0.0
    for _ in range(40):  # windows with arrivals, timeouts and departures in random order
        msg = c.open_round(now)
        assert msg is not None
        sent = set(msg.selected)
        while c.current is not None:
            flight = dict(c.policy.in_flight)
            assert len(flight) <= 5
            event = rng.integers(3)
            if event == 0 and flight:  # an in-flight device answers
                answer(c, sorted(flight)[rng.integers(len(flight))])
            elif event == 1:  # time passes
                now += 1.0
            else:  # somebody goes offline, somebody comes back
                dev = MANY[rng.integers(len(MANY))]
                online = bool(rng.integers(2))
                c.on_status(dev, encode_status(Status(dev, online, 100)))
            training = c.policy.training
            out = c.dispatch(now)
            if out is not None:
                assert not (set(out.selected) & sent)  # never sent twice on this version
                assert not (set(out.selected) & training)  # nor while still training
                sent |= set(out.selected)
            assert len(c.policy.in_flight) <= 5
            decision = c.decide(now)
            if decision in (Decision.CLOSE, Decision.SKIP):
                c.close_round(now, 0.1, skipped=decision is Decision.SKIP)
    assert c.policy.dispatched > 40


def test_a_timeout_frees_the_slot_and_selects_a_replacement():
    c = limited_core(c=3, timeout=5.0)
    msg = c.open_round(0.0)
    assert c.deadline == 5.0  # the service wakes at the first timeout
    assert c.decide(4.9) is Decision.WAIT and set(c.policy.in_flight) == set(msg.selected)
    assert c.decide(5.0) in (Decision.SKIP, Decision.WAIT)
    assert c.policy.timeouts == 3 and not (set(c.policy.in_flight) & set(msg.selected))
    assert len(c.policy.in_flight) == 3  # three replacements, not yet sent
    # they go out mid-window (the service's dispatch), so the window waits for them instead of
    # closing short (a FedBuff window once applied 1 of K updates that way)
    assert c.decide(5.0) is Decision.WAIT
    out = c.dispatch(5.0)
    assert set(out.selected) == set(c.policy.in_flight) and not (
        set(out.selected) & set(msg.selected)
    )
    assert c.decide(5.1) is Decision.WAIT


def test_a_device_going_offline_or_stopping_is_replaced():
    c = limited_core(c=3)
    msg = c.open_round(0.0)
    gone, stopped = msg.selected[0], msg.selected[1]
    c.on_status(gone, encode_status(Status(gone, False)))
    c.on_status(stopped, encode_status(Status(stopped, True, 100, {"stopped": "budget_exhausted"})))
    assert gone not in c.policy.in_flight and stopped not in c.policy.in_flight
    assert len(c.policy.in_flight) == 3 and c.policy.departed == 2
    out = c.dispatch(1.0)
    assert len(out.selected) == 2 and gone not in out.selected and stopped not in out.selected


def test_only_selected_devices_are_admitted_and_charged():
    c = limited_core(c=2)
    msg = c.open_round(0.0)
    outsider = next(d for d in MANY if d not in msg.selected)
    assert c.on_update(outsider, update(c, outsider, 0, 1.0, 10)) is Reject.NOT_SELECTED
    assert c.releases == []  # admission before accounting: nothing charged
    assert answer(c, msg.selected[0]) is None
    assert [d for d, _, _ in c.releases] == [msg.selected[0]]


def test_device_work_counts_stale_and_discarded_updates():
    c = limited_core("fedasync", c=2, max_staleness=0)
    msg = c.open_round(0.0)
    slow, fast = msg.selected
    assert answer(c, fast) is None
    assert c.decide(0.0) is Decision.CLOSE
    rec = c.close_round(0.0, 0.1)
    assert rec["device_updates"] == 1 and rec["in_flight"] == 2 and rec["dispatched"] == 2
    c.open_round(0.1)
    assert answer(c, slow) is Reject.STALE  # trained on version 0, the model is at 1
    assert slow not in c.policy.in_flight  # it answered: its slot is free
    c.close_round(0.2, 0.1, skipped=True)
    assert c.records[-1]["device_updates"] == 2  # the discarded update was still computed
    assert c.after_last_round()["device_updates"] == 2


def test_fedasync_keeps_c_busy_across_windows():
    c = limited_core("fedasync", c=3)
    busy = []
    now = 0.0
    for _ in range(10):
        msg = c.open_round(now)
        busy.append(len(c.policy.in_flight))
        # the device answering is the one selected longest ago (the earliest version)
        dev = min(c.policy.in_flight, key=lambda d: (c.policy.in_flight[d], d))
        assert answer(c, dev) is None
        assert c.decide(now) is Decision.CLOSE
        c.close_round(now, 0.1)
        now += 1.0
        assert dev not in set(msg.selected) or msg.version == c.version - 1
    assert busy == [3] * 10
    assert c.version == 10


def test_no_limit_keeps_the_old_behaviour():
    c = limited_core(c=0)
    assert c.policy.concurrency is None
    msg = c.open_round(0.0)
    assert msg.selected is None and c.policy.in_flight == {}
    assert c.on_update("e05", update(c, "e05", 0, 1.0, 10)) is None


def test_checkpoint_and_journal_resume_keep_the_in_flight_set(tmp_path):
    from edge_fl.server.checkpoint import save_checkpoint
    from edge_fl.server.journal import Journal, resume, round_spec

    c = limited_core("fedbuff", c=4, buffer_size=2)
    c.open_round(0.0)
    for dev in sorted(c.policy.in_flight)[:2]:
        answer(c, dev)
    assert c.decide(0.0) is Decision.CLOSE
    rec = c.close_round(0.0, 0.1)
    save_checkpoint(c, tmp_path, journal_seq=0, last_record=rec)
    journal = Journal.start(tmp_path, job="j", digest="")
    msg = c.open_round(1.0)
    from edge_fl.protocol import encode_global

    journal.append("open", **round_spec(c, encode_global(msg)))
    dev = sorted(c.policy.in_flight)[0]
    payload = update(c, dev, c.policy.in_flight[dev], 0.5, 10)
    assert c.on_update(dev, payload) is None
    journal.append("accept", d=dev, p=payload, dn=100)
    journal.sync()
    expected = dict(c.policy.in_flight)
    unsent = set(c.policy.unsent)

    fresh = limited_core("fedbuff", c=4, buffer_size=2)
    fresh.devices = {}
    resume(fresh, tmp_path)
    for d in MANY:
        fresh.on_status(d, encode_status(Status(d, True, 100)))
    # what was sent and not answered is in flight again; the replacement chosen after the last
    # arrival was never sent, so the resumed core chooses again
    assert {d: v for d, v in expected.items() if d not in unsent} == fresh.policy.in_flight
    assert len(unsent) == 1
    assert fresh.current.selected == c.current.selected
    assert fresh.decide(2.0) is Decision.WAIT  # the rebuilt in-flight devices get a fresh clock
    assert fresh.deadline == 2.0 + 5.0
    assert fresh.policy.training == frozenset(expected) - unsent
    out = fresh.dispatch(2.0)  # topped up to C again
    assert out is not None and len(fresh.policy.in_flight) == 4


def _journal_a_window_to_its_dispatch(tmp_path):
    """A FedBuff window (C = 4, K = 3) journaled from its checkpoint through one accepted update
    to the mid-window selection it then makes: (the journal, the opened global, that selection);
    the caller journals the selection as its service would."""
    from edge_fl.protocol import encode_global
    from edge_fl.server.checkpoint import save_checkpoint
    from edge_fl.server.journal import Journal, round_spec

    c = limited_core("fedbuff", c=4, buffer_size=3)
    save_checkpoint(c, tmp_path, journal_seq=0, last_record=None)
    journal = Journal.start(tmp_path, job="j", digest="")
    opened = encode_global(c.open_round(0.0))
    journal.append("open", **round_spec(c, opened))
    first = sorted(c.policy.in_flight)[0]
    payload = update(c, first, c.policy.in_flight[first], 0.5, 10)
    assert c.on_update(first, payload) is None
    journal.append("accept", d=first, p=payload, dn=100)
    sent = c.dispatch(0.5)
    assert sent is not None and sent.selected
    return journal, opened, sent


def _resume_fedbuff(tmp_path):
    """A fresh core of the same job resumed from ``tmp_path``, its devices back online."""
    from edge_fl.server.journal import resume

    fresh = limited_core("fedbuff", c=4, buffer_size=3)
    fresh.devices = {}
    resumed = resume(fresh, tmp_path)
    for d in MANY:
        fresh.on_status(d, encode_status(Status(d, True, 100)))
    return fresh, resumed


def test_a_journaled_dispatch_survives_a_resume(tmp_path):
    """Replacements published mid-window are journaled before devices see them: a resumed core
    still counts them as selected (their updates are admitted, not refused as not selected)."""
    from edge_fl.protocol import encode_global

    journal, _, sent = _journal_a_window_to_its_dispatch(tmp_path)
    journal.append("dispatch", v=sent.version, sel=list(sent.selected), g=encode_global(sent))
    journal.sync()

    fresh, resumed = _resume_fedbuff(tmp_path)
    assert set(sent.selected) <= fresh.current.selected
    assert set(sent.selected) <= set(fresh.policy.in_flight)
    assert resumed.open_payload == encode_global(sent)
    late = sent.selected[0]
    assert fresh.on_update(late, update(fresh, late, fresh.version, 0.5, 10)) is None


def test_a_journaled_dispatch_message_survives_a_resume_and_leaves_the_model_retained(tmp_path):
    """The service journals a mid-window selection as the dispatch message it publishes (the
    model is not re-published): the resumed core counts the devices as selected, the retained
    model to re-publish is still the window's, and the dispatch is there to publish after it."""
    from edge_fl.protocol.dispatch import decode_dispatch, encode_dispatch
    from edge_fl.protocol.messages import Dispatch

    journal, opened, sent = _journal_a_window_to_its_dispatch(tmp_path)
    message = encode_dispatch(Dispatch.of(sent))
    journal.append("dispatch", v=sent.version, sel=list(sent.selected), d=message)
    journal.sync()

    fresh, resumed = _resume_fedbuff(tmp_path)
    assert set(sent.selected) <= fresh.current.selected
    assert resumed.open_payload == opened  # the model was published once, with the window
    assert resumed.dispatch_payload == message
    d = decode_dispatch(message)
    assert (d.version, d.nonce) == (fresh.version, fresh.nonce_of(fresh.version))
    late = sent.selected[0]
    assert fresh.on_update(late, update(fresh, late, fresh.version, 0.5, 10)) is None


def test_a_fedbuff_window_waits_for_the_replacements_it_has_yet_to_send():
    """K = 3, C = 1: the one training device answers; its replacement is chosen but not sent
    yet. The window must wait (the service sends it mid-window), not apply 1 of K updates."""
    c = limited_core(c=1, timeout=100.0, buffer_size=3)
    first = c.open_round(0.0).selected[0]
    assert answer(c, first) is None
    assert c.current.count == 1 and c.decide(1.0) is Decision.WAIT
    replacement = c.dispatch(1.0).selected
    assert len(replacement) == 1 and replacement[0] != first


def test_an_async_update_must_name_the_version_it_trained_on_as_its_base():
    """The nonce binds the round (the version trained on); a base version claimed apart from it
    would dodge max_staleness and the staleness discount, and count a device twice."""
    c = async_core(max_staleness=1, buffer_size=2)
    for now in range(3):  # versions 0, 1, 2 applied by other devices
        apply_window(c, float(now), [("d1", c.version, 0.1, 10), ("d2", c.version, 0.1, 10)])
    c.open_round(3.0)
    old = c.nonce_of(0)
    stale = DenseUpdate("d3", 0, 0, 10, np.full(D, 0.5, np.float32), nonce=old)
    assert c.on_update("d3", encode_update(stale)) is Reject.STALE
    for claimed in (2, 3):
        forged = DenseUpdate("d3", 0, claimed, 10, np.full(D, 0.5, np.float32), nonce=old)
        assert c.on_update("d3", encode_update(forged)) is Reject.WRONG_NONCE
    assert not any(d == "d3" for d, _ in c.current.accepted)


def test_without_a_limit_what_is_admitted_before_the_statuses_return_is_charged():
    """A resumed aggregator admits queued updates before the retained statuses arrive (its
    fleet view is empty): each one it folds is a release in the ledger."""
    c = async_core(buffer_size=2)
    apply_window(c, 1.0, [("d1", 0, 0.1, 10), ("d2", 0, 0.1, 10)])
    c.open_round(2.0)
    c.devices = {}  # as on resume, before the statuses
    assert c.on_update("d3", update(c, "d3", 1, 0.5, 10)) is None
    assert ("d3", 1, 10) in c.releases


def test_a_resumed_core_rebuilds_at_most_c_in_flight_without_the_departed(tmp_path):
    """Resume rebuilds the in-flight set from selections and releases: a device freed by its
    timeout comes back beside its replacement, and one that left before the rebuild stayed in;
    the rebuilt set holds at most C devices, none of them offline."""
    from edge_fl.protocol import encode_global
    from edge_fl.server.checkpoint import save_checkpoint
    from edge_fl.server.journal import Journal, resume, round_spec

    def resumed(out):
        core = limited_core(c=2, timeout=5.0, buffer_size=3)
        core.devices = {}
        resume(core, out)
        return core

    live = limited_core(c=2, timeout=5.0, buffer_size=3)
    live.open_round(0.0)
    decision = live.decide(5.0)  # both time out; their replacements wait for the next window
    record = live.close_round(5.0, 5.0, skipped=decision is Decision.SKIP)
    save_checkpoint(live, tmp_path / "a", journal_seq=0, last_record=record)
    journal = Journal.start(tmp_path / "a", job="j", digest="")
    msg = live.open_round(5.1)
    journal.append("open", **round_spec(live, encode_global(msg)))
    journal.sync()
    back = resumed(tmp_path / "a")
    for dev in MANY:
        back.on_status(dev, encode_status(Status(dev, True, 100)))
    assert len(live.policy.in_flight) == 2 and len(back.policy.in_flight) == 2

    live = limited_core(c=2, timeout=5.0, buffer_size=3)
    save_checkpoint(live, tmp_path / "b", journal_seq=0, last_record=None)
    journal = Journal.start(tmp_path / "b", job="j", digest="")
    msg = live.open_round(0.0)
    journal.append("open", **round_spec(live, encode_global(msg)))
    gone = msg.selected[0]
    live.on_status(gone, encode_status(Status(gone, False)))
    out = live.dispatch(1.0)
    journal.append("dispatch", v=out.version, sel=list(out.selected), g=encode_global(out))
    journal.sync()
    back = resumed(tmp_path / "b")
    back.on_status(gone, encode_status(Status(gone, False)))  # statuses come back, his offline
    for dev in (d for d in MANY if d != gone):
        back.on_status(dev, encode_status(Status(dev, True, 100)))
    assert gone not in back.policy.in_flight and len(back.policy.in_flight) == 2


def test_updates_still_held_when_the_job_ends_are_charged():
    """FedAsync, one window: the window is full after its first update, so a second selected
    device's update is held for a window that never comes. Released all the same: charged when
    the last window closes, as a sync round charges a late answer."""
    c = limited_core(mode="fedasync", c=3, rounds=1)
    first, second, _ = c.open_round(0.0).selected
    assert answer(c, first) is None and answer(c, second) is None  # the second one is held
    assert c.decide(0.0) is Decision.CLOSE
    record = c.close_round(0.0, 0.1)
    assert c.finished and (second, 0, 10) in c.releases
    assert record["device_updates"] == 2 == len(c.releases)
