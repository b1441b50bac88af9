"""Hostile but decodable input against the aggregator core (no broker): admission comes before
accounting, so nothing a device sends outside what it was asked for costs privacy, crashes the
core, or grows its state."""

from __future__ import annotations

import numpy as np
import pytest

from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.protocol import DenseUpdate, Reject, Status, encode_status, encode_update

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def laplace_core(rounds: int = 4):
    cfg = load_config(
        None,
        {
            "data.devices": 10,
            "model.name": "logreg",
            "rounds.rounds": rounds,
            "rounds.clients_per_round": 5,
            "rounds.min_updates": 1,
            "privacy.mechanism": "laplace",
            "privacy.epsilon": 4.0,
            "reproducible": True,
        },
    )
    job = build_job(cfg)
    core = job.aggregator_core()
    for i in range(10):
        dev = f"d{i:05d}"
        core.on_status(dev, encode_status(Status(dev, True, 30)))
    return job, core


def dense(core, device: str, rnd: int, n: int = 30, scale: float = 0.0) -> bytes:
    delta = np.full(len(core.params), scale, np.float32)
    nonce = core.nonce_of(rnd)
    return encode_update(
        DenseUpdate(device, rnd, core.version, n, delta, mechanism="laplace", nonce=nonce)
    )


def test_future_rounds_and_strangers_cost_nothing_and_cannot_kill_the_core():
    _job, core = laplace_core(rounds=4)
    msg = core.open_round(0.0)
    insider = msg.selected[0]
    outsider = next(f"d{i:05d}" for i in range(10) if f"d{i:05d}" not in msg.selected)
    # a legitimate device floods future rounds (this killed a Laplace job at round 21)
    for r in range(2, 60):
        assert core.on_update(insider, dense(core, insider, r)) is Reject.FUTURE
    # a device that was not asked, and ids nobody has ever seen
    assert core.on_update(outsider, dense(core, outsider, 1)) is Reject.NOT_SELECTED
    for i in range(2000):
        fake = f"fake{i}"
        assert core.on_update(fake, dense(core, fake, 1)) is Reject.NOT_SELECTED
    assert core.privacy.ledger.entries == ()  # none of it was a release anyone asked for
    assert core.privacy.metrics()["epsilon"] == 0.0
    # the insider's real answer is charged once, however often it is redelivered
    assert core.on_update(insider, dense(core, insider, 1)) is None
    assert core.on_update(insider, dense(core, insider, 1)) is Reject.DUPLICATE
    assert len(core.privacy.ledger.entries) == 1
    record = core.close_round(1.0, 0.1)
    assert record["rejected_by_reason"]["future"] == 58
    assert record["rejected_by_reason"]["not_selected"] == 2001
    # between rounds: a late answer of a device selected in the round that just closed is a
    # release (charged); the same from anyone else is not
    late_dev = msg.selected[1]
    assert core.on_update(late_dev, dense(core, late_dev, 1)) is Reject.LATE
    assert core.on_update(outsider, dense(core, outsider, 1)) is Reject.NOT_SELECTED
    assert len(core.privacy.ledger.entries) == 2
    assert len({(d, r) for d, r, _n in core.releases}) <= 2  # bounded by real participation
    assert not core.is_released(outsider, 1)


def test_epsilon_after_a_hostile_flood_equals_a_clean_run():
    def run(hostile: bool) -> float:
        _job, core = laplace_core(rounds=3)
        for r in range(1, 4):
            msg = core.open_round(float(r))
            for dev in msg.selected:
                if hostile:
                    for future in range(r + 1, r + 40):
                        core.on_update(dev, dense(core, dev, future))
                    core.on_update(f"x{r}{dev}", dense(core, f"x{r}{dev}", r))
                assert core.on_update(dev, dense(core, dev, r)) is None
            core.close_round(float(r) + 0.5, 0.1)
        return core.privacy.report()["epsilon"], len(core.privacy.ledger.entries)

    assert run(hostile=True) == run(hostile=False)


def test_sample_count_is_capped_at_the_declared_one():
    _job, core = laplace_core()
    msg = core.open_round(0.0)
    a, b = msg.selected[:2]
    assert core.on_update(a, dense(core, a, 1, n=10_000_000, scale=100.0)) is None
    assert core.on_update(b, dense(core, b, 1, n=30, scale=1.0)) is None
    record = core.close_round(1.0, 0.1)
    assert record["capped_samples"] == 1
    # both weigh 30: the mean of 100 and 1, not ~100
    np.testing.assert_allclose(core.params, np.full(len(core.params), 50.5), rtol=1e-5)


def test_broken_statuses_are_counted_and_change_nothing(caplog):
    _job, core = laplace_core()
    before = dict(core.devices)
    for junk in (b"\x00", b"\xc1", encode_status(Status("someone-else", True, 5))):
        core.on_status("d00001", junk)
    assert core.devices.keys() == before.keys() and core.devices["d00001"].n_samples == 30
    assert sum(core.tally.bad_status.values()) == 3
    assert "status of 'd00001' rejected" in caplog.text


def test_an_internal_error_is_counted_not_raised(monkeypatch):
    _job, core = laplace_core()
    msg = core.open_round(0.0)
    dev = msg.selected[0]

    def broken(*_a, **_k):
        raise RuntimeError("bug")

    monkeypatch.setattr(core.strategy, "add", broken)
    assert core.on_update(dev, dense(core, dev, 1)) == "internal_error"
    assert core.tally.rejected["internal_error"] == 1


def test_an_update_must_echo_its_rounds_nonce():
    """An old update re-stamped with the new round number, or one without the nonce of the
    signed global message, is no release of this round: rejected before the ledger sees it."""
    _job, core = laplace_core(rounds=3)
    msg = core.open_round(0.0)
    dev = msg.selected[0]
    assert msg.nonce is not None and len(msg.nonce) == 16
    old = core.nonce_of(1)
    core.on_update(dev, dense(core, dev, 1))
    core.close_round(1.0, 0.1)
    msg2 = core.open_round(2.0)
    assert msg2.nonce != old
    delta = np.zeros(len(core.params), np.float32)
    dev2 = msg2.selected[0]
    for nonce in (old, None, b"\x00" * 16):
        forged = DenseUpdate(dev2, 2, core.version, 30, delta, mechanism="laplace", nonce=nonce)
        assert core.on_update(dev2, encode_update(forged)) is Reject.WRONG_NONCE
    assert len(core.privacy.ledger.entries) == 1
    assert core.on_update(dev2, dense(core, dev2, 2)) is None  # the real answer still counts


def test_the_first_rejection_of_each_reason_is_explained(caplog):
    import logging

    _job, core = laplace_core()
    msg = core.open_round(0.0)
    dev = msg.selected[0]
    caplog.set_level(logging.INFO, logger="edge_fl.aggregator")
    core.on_update(dev, b"\x81\xa1v\x01")  # a map with only the version
    core.on_update(dev, b"\x81\xa1v\x01")
    core.on_update("stranger", dense(core, "stranger", 1))
    record = core.close_round(1.0, 0.1)
    samples = record["rejection_samples"]
    assert set(samples) == {"wrong_kind", "not_selected"}
    assert samples["wrong_kind"].startswith(f"{dev}: ") and "'k'" in samples["wrong_kind"]
    assert caplog.text.count("rejected (wrong_kind)") == 1  # once per reason and round
    assert "rejection_samples" not in core.public_record(record)


def test_what_arrives_after_the_last_round_is_kept_for_the_summary():
    _job, core = laplace_core(rounds=1)
    msg = core.open_round(0.0)
    first, late = msg.selected[:2]
    assert core.on_update(first, dense(core, first, 1)) is None
    core.close_round(1.0, 0.1)
    assert core.on_update(late, dense(core, late, 1)) is Reject.LATE  # still a release
    core.on_update("stranger", b"junk")
    tail = core.after_last_round()
    assert tail["late"] == 1 and tail["messages_up"] == 2
    assert tail["rejected_by_reason"] == {"not_selected": 1}
    assert len(core.privacy.ledger.entries) == 2  # the late release is in the ledger too


def test_a_stragglers_answer_rounds_later_is_still_charged_once():
    """Selected in round 1, its update arrives after round 2 closed: no longer admissible, but it
    was released, so the ledger charges it (once, however often it is redelivered)."""
    _job, core = laplace_core(rounds=4)
    msg1 = core.open_round(0.0)
    slow, fast = msg1.selected[0], msg1.selected[1]
    late = dense(core, slow, 1)  # computed on round 1's model, with round 1's nonce
    core.on_update(fast, dense(core, fast, 1))
    core.close_round(1.0, 0.1)
    msg2 = core.open_round(2.0)
    core.on_update(msg2.selected[0], dense(core, msg2.selected[0], 2))
    core.close_round(3.0, 0.1)
    before = len(core.privacy.ledger.entries)
    assert core.on_update(slow, late) is Reject.LATE
    assert core.on_update(slow, late) is Reject.LATE  # redelivered: not charged again
    assert len(core.privacy.ledger.entries) == before + 1
    assert (slow, 1, 30) in core.releases


def test_a_laplace_release_past_the_schedule_is_charged_not_fatal():
    _job, core = laplace_core(rounds=2)
    mech = core.privacy.mechanism
    top = max(mech.params.epsilon_schedule())
    events = mech.release_events(30, mech.params.rounds + 5)
    assert events[0].pure_epsilon == pytest.approx(top)
