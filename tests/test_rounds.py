"""The synchronous round state machine (pure, no broker)."""

from __future__ import annotations

import pytest

from edge_fl.protocol import Reject
from edge_fl.server.rounds import Decision, SyncRound


def make(**kw) -> SyncRound:
    base = dict(
        number=3,
        base_version=2,
        selected=frozenset({"a", "b", "c", "d"}),
        target=3,
        min_updates=2,
        opened_at=100.0,
        deadline_s=10.0,
    )
    base.update(kw)
    return SyncRound(**base)


def test_admission_reasons():
    r = make()
    assert r.admit("a", 3, 2) is None
    r.accept("a")
    assert r.admit("a", 3, 2) is Reject.DUPLICATE
    assert r.admit("b", 2, 2) is Reject.LATE
    assert r.admit("b", 4, 2) is Reject.FUTURE
    assert r.admit("z", 3, 2) is Reject.NOT_SELECTED
    assert r.admit("b", 3, 1) is Reject.STALE


def test_closes_on_target_before_deadline():
    r = make()
    for dev in "abc":
        assert r.decide(101.0) is Decision.WAIT
        r.accept(dev)
    assert r.decide(101.0) is Decision.CLOSE
    assert r.admit("d", 3, 2) is Reject.LATE  # over-selected device after the target


def test_deadline_closes_with_min_updates():
    r = make()
    r.accept("a")
    r.accept("b")
    assert r.decide(109.9) is Decision.WAIT
    assert r.decide(110.0) is Decision.CLOSE


def test_short_round_extends_once_then_skips():
    r = make()
    r.accept("a")
    assert r.decide(110.0) is Decision.EXTEND
    assert r.deadline == 120.0
    assert r.decide(115.0) is Decision.WAIT
    assert r.decide(120.0) is Decision.SKIP


def test_short_round_extension_can_close():
    r = make()
    r.accept("a")
    assert r.decide(110.0) is Decision.EXTEND
    r.accept("b")
    assert r.decide(120.0) is Decision.CLOSE


def test_skip_without_extension():
    r = make(extend_when_short=False)
    assert r.decide(110.0) is Decision.SKIP


@pytest.mark.parametrize(("target", "min_updates"), [(3, -1), (3, 4), (5, 1)])
def test_inconsistent_counts_rejected(target, min_updates):
    with pytest.raises(ValueError):
        make(target=target, min_updates=min_updates)
