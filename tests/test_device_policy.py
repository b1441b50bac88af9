"""The device state machine (edge_fl/device/policy.py) and the connection's checks
(edge_fl/device/trust.py), without a broker: events in, effects out.

The policy alone is driven with a stand-in for training (``train``: what ``DeviceAgent.on_global``
records when it releases an update); the last tests run a real agent through the same events."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import real_agent

from edge_fl.device.policy import (
    DevicePolicy,
    Disconnected,
    JobEnded,
    ModelArrived,
    PublishStatus,
    Resend,
    Stop,
    Train,
    Trained,
    Upload,
    Uploaded,
)
from edge_fl.device.trust import DIGEST_MISMATCH, Trust, digest_agrees
from edge_fl.protocol import GlobalModel, GlobalWindow, Reject, Topics, encode_global

D = 15
TOPICS = Topics("job")


def gm(round: int, version: int | None = None, **kw: Any) -> GlobalModel:
    return GlobalModel(
        "job", round if version is None else version, round, np.zeros(D, np.float32), **kw
    )


def said(effects: list) -> list[tuple]:
    """Effects as comparable tuples (a GlobalModel holds an array: compared by round/version)."""
    out = []
    for e in effects:
        if isinstance(e, Train):
            out.append(("train", e.msg.round, e.msg.version))
        else:
            out.append((type(e).__name__.lower(), *vars(e).values()))
    return out


def arrived(event: Any) -> tuple | None:
    """A Trust verdict as a comparable tuple."""
    if event is None:
        return None
    return (type(event).__name__, event.msg.round, event.msg.done)


def train(policy: DevicePolicy, msg: GlobalModel, payload: bytes | None = b"u") -> Trained:
    """What the agent's training records (a release is kept under its round), as its outcome."""
    state = policy.state
    state.answered_round = msg.round
    if payload is not None:
        state.last_release = (msg.round, payload + str(msg.round).encode())
        payload = state.last_release[1]
    return Trained(msg, payload)


def answer(policy: DevicePolicy, msg: GlobalModel) -> bytes:
    """Model in, update out: the whole exchange of a device that trains and uploads."""
    assert policy.handle(ModelArrived(msg)) == [Train(msg)]
    outcome = train(policy, msg)
    assert outcome.payload is not None
    assert policy.handle(outcome) == [Upload(msg.round, outcome.payload)]
    assert policy.handle(Uploaded(msg.round)) == []
    return outcome.payload


# ---------------------------------------------------------------------------------------------
# Selection before re-send


def test_a_fedbuff_dispatch_selecting_others_makes_no_answered_device_resend():
    """The README's fedbuff duplicates: the aggregator re-publishes version 7 to dispatch
    replacements (``sel`` = the replacements); the devices that already answered version 7 are
    not among them and send nothing (before: every one of them re-sent)."""
    answered = [DevicePolicy(f"d{i}") for i in range(3)]
    for p in answered:
        answer(p, gm(7, selected=("d0", "d1", "d2")))
    dispatch = gm(7, selected=("d5", "d6"))
    assert [p.handle(ModelArrived(dispatch)) for p in answered] == [[], [], []]
    newcomer = DevicePolicy("d5")
    assert newcomer.handle(ModelArrived(dispatch)) == [Train(dispatch)]


def test_a_rebroadcast_of_the_open_round_that_selects_the_device_resends_the_same_bytes():
    """After the aggregator lost the broker it re-publishes the open round: a PUBACK from the
    broker that died proves nothing, so a selected device publishes its update again, unchanged
    (tests/test_broker_loss.py needs this to lose no update)."""
    p = DevicePolicy("d0")
    sent = answer(p, gm(3, selected=("d0", "d1")))
    assert p.handle(ModelArrived(gm(3, selected=("d0", "d1")))) == [Resend(3, sent)]
    assert p.handle(ModelArrived(gm(3))) == [Resend(3, sent)]  # no sel: every device
    assert p.handle(ModelArrived(gm(3, selected=("d1",)))) == []
    assert p.state.answered_round == 3  # a re-send is no new answer


def test_a_newer_round_replaces_the_kept_update_and_an_older_one_is_ignored():
    p = DevicePolicy("d0")
    answer(p, gm(1))
    second = answer(p, gm(2))
    assert p.handle(ModelArrived(gm(1))) == []
    assert p.handle(ModelArrived(gm(2))) == [Resend(2, second)]


def test_a_device_not_selected_does_not_train_and_can_answer_later():
    p = DevicePolicy("d0")
    assert p.handle(ModelArrived(gm(1, selected=("d1",)))) == []
    assert p.state.answered_round == -1
    answer(p, gm(2, selected=("d0",)))


# ---------------------------------------------------------------------------------------------
# One model at a time


def test_models_arriving_while_training_wait_and_only_the_newest_is_trained_next():
    p = DevicePolicy("d0")
    first = gm(1)
    assert p.handle(ModelArrived(first)) == [Train(first)]
    assert p.handle(ModelArrived(first)) == []  # redelivered while training: nothing
    assert p.handle(ModelArrived(gm(2))) == []
    assert p.handle(ModelArrived(gm(3))) == []
    outcome = train(p, first)
    assert p.handle(outcome) == [Upload(1, outcome.payload)]
    assert p.handle(ModelArrived(gm(4, selected=("d9",)))) == []  # not for it: not queued
    assert said(p.handle(Uploaded(1))) == [("train", 3, 3)]


def test_a_round_not_trained_leaves_the_device_free_for_the_next():
    p = DevicePolicy("d0")
    first = gm(1)
    assert p.handle(ModelArrived(first)) == [Train(first)]
    assert p.handle(ModelArrived(gm(2))) == []
    assert said(p.handle(train(p, first, payload=None))) == [("train", 2, 2)]  # not sampled


def test_a_dropped_upload_is_not_resent_and_not_trained_again():
    p = DevicePolicy("d0")
    msg = gm(1)
    p.handle(ModelArrived(msg))
    outcome = train(p, msg)
    assert p.handle(outcome) == [Upload(1, outcome.payload)]
    assert p.handle(Uploaded(1, dropped=True)) == []
    assert p.state.last_release is None
    assert p.handle(ModelArrived(msg)) == []


def test_a_session_lost_mid_upload_keeps_the_release_for_the_round_coming_again():
    p = DevicePolicy("d0")
    msg = gm(1)
    p.handle(ModelArrived(msg))
    outcome = train(p, msg)
    p.handle(outcome)  # Upload: the publish fails
    assert p.handle(Disconnected()) == []
    assert p.state.training is None
    assert p.handle(ModelArrived(msg)) == [Resend(1, outcome.payload)]  # retained, new session
    assert said(p.handle(ModelArrived(gm(2)))) == [("train", 2, 2)]


# ---------------------------------------------------------------------------------------------
# Stopping


def test_a_spent_budget_is_announced_once_and_ends_uploads():
    p = DevicePolicy("d0")
    p.handle(ModelArrived(gm(1)))
    p.state.stopped_reason = "budget_exhausted"  # what on_global records
    assert p.handle(train(p, gm(1), payload=None)) == [PublishStatus(online=True)]
    assert p.handle(ModelArrived(gm(2))) == []


def test_the_end_of_the_job_says_offline_and_stops():
    p = DevicePolicy("d0")
    assert p.handle(JobEnded(gm(5, done=True))) == [PublishStatus(online=False), Stop()]


def test_same_events_same_effects():
    def run() -> list:
        p = DevicePolicy("d0")
        out = []
        for r in range(1, 6):
            msg = gm(r, selected=("d0",) if r % 2 else ("d1",))
            effects = p.handle(ModelArrived(msg))
            out.append(said(effects))
            if effects and isinstance(effects[0], Train):
                out.append(said(p.handle(train(p, msg))))
                out.append(said(p.handle(Uploaded(r))))
            out.append(said(p.handle(ModelArrived(msg))))
        return out

    assert run() == run()


def test_an_unknown_event_is_refused():
    with pytest.raises(TypeError, match="not a device event"):
        DevicePolicy("d0").handle("model")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The connection's checks: one digest rule, done markers never move the window


def test_one_digest_rule_an_empty_side_is_not_checked():
    assert digest_agrees("", "abc") and digest_agrees("abc", "") and digest_agrees("abc", "abc")
    assert not digest_agrees("abc", "abd")
    trust = Trust()
    assert arrived(trust.receive(encode_global(gm(1)), TOPICS, D, digest="abc")) == (
        "ModelArrived",
        1,
        False,
    )
    other = gm(2, config_digest="abd")
    assert trust.receive(encode_global(other), TOPICS, D, digest="abc") is None
    assert trust.rejected[DIGEST_MISMATCH] == 1
    assert trust.window.last_round == 2  # the aggregator's message all the same


def test_a_previous_runs_retained_done_marker_never_moves_the_window():
    """Issue 24 item 3: a fleet connects before the new aggregator clears the broker; the
    retained done marker of the previous run (round 5) arrives first. Ignored, it must not make
    the new run's round 1 stale."""
    trust = Trust(window=GlobalWindow(max_round=5, max_version=5))
    trust.window.rejoin()  # connected
    old_end = encode_global(gm(5, done=True))
    assert trust.receive(old_end, TOPICS, D, retained=True) is None
    assert (trust.window.last_round, trust.window.rejoining) == (None, True)
    assert arrived(trust.receive(encode_global(gm(1)), TOPICS, D)) == ("ModelArrived", 1, False)
    assert trust.rejected[Reject.STALE] == 0


def test_this_runs_done_marker_ends_the_job_without_moving_the_window():
    trust = Trust()
    assert arrived(trust.receive(encode_global(gm(2)), TOPICS, D)) == ("ModelArrived", 2, False)
    end = encode_global(gm(4, done=True))
    assert arrived(trust.receive(end, TOPICS, D, retained=True)) == ("JobEnded", 4, True)  # joined
    assert arrived(trust.receive(end, TOPICS, D)) == ("JobEnded", 4, True)
    assert trust.window.last_round == 2
    stale = encode_global(gm(1, done=True))
    assert trust.receive(stale, TOPICS, D) is None  # an old marker cannot end a later round
    assert trust.rejected[Reject.STALE] == 1


def test_another_jobs_model_is_ignored():
    other = GlobalModel("other", 1, 1, np.zeros(D, np.float32))
    trust = Trust()
    assert trust.receive(encode_global(other), TOPICS, D) is None
    assert trust.window.last_round is None


# ---------------------------------------------------------------------------------------------
# A real agent through the same events


def test_an_agent_answers_trains_once_and_resends_only_when_selected():
    a = real_agent()
    msg = gm(1, selected=("d0", "d1"))
    [effect] = a.handle(ModelArrived(msg))
    assert effect == Train(msg)
    payload = a.on_global(msg)
    assert payload is not None
    assert a.handle(Trained(msg, payload)) == [Upload(1, payload)]
    assert a.handle(Uploaded(1)) == []
    assert a.handle(ModelArrived(gm(1, selected=("d2",)))) == []  # a dispatch for others
    assert a.handle(ModelArrived(msg)) == [Resend(1, payload)]
    assert (a.state.exposures, a.state.updates_sent) == (1, 1)
