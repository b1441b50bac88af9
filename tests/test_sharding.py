"""Sharded ingest, pure: W workers folding random shares in random orders and a coordinator
merging their partials give bit-for-bit the model and ledger of one aggregator fed the same
updates (edge_fl/server/sharding.py). No broker: the runtime test is test_sharded_e2e.py."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.protocol import Reject, Status, decode_global, encode_global, encode_status
from edge_fl.server.journal import reopen_round, round_spec
from edge_fl.server.sharding import Coordinator, IngestWorker, ShardingError, pack, seal

MECHANISMS = {
    "none (robust auto norm bound)": {},
    "none, trimmed mean": {"robust.aggregator": "trimmed_mean"},
    "none, trimmed mean, no norm bound": {
        "robust.aggregator": "trimmed_mean",
        "robust.norm_bound": "off",
    },
    "none, max_samples, no norm bound": {"robust.max_samples": 60, "robust.norm_bound": "off"},
    "gaussian": {"privacy.mechanism": "gaussian", "privacy.epsilon": 30.0},
    "gaussian-central": {"privacy.mechanism": "gaussian-central", "privacy.noise_multiplier": 1.0},
    "signds": {
        "privacy.mechanism": "signds",
        "privacy.signds.sign_k": 0.1,
        "privacy.signds.sign_eps": 100,
        "training.lr": 0.05,
        "training.epochs": 1,
    },
}


def released(core) -> set[tuple[str, int]]:
    """(device, round) of every release in a core's ledger."""
    return {(d, int(r)) for d, r, _ in core.releases}


def make_job(overrides: dict):
    base = {
        "job": f"s-{uuid.uuid4().hex[:6]}",
        "data.devices": 16,
        "model.name": "logreg",
        "rounds.rounds": 4,
        "rounds.clients_per_round": 8,
        "rounds.over_selection": 1.5,  # 12 asked, 8 count: the rest are late
        "rounds.min_updates": 1,
        "reproducible": True,
    }
    return build_job(load_config(None, {**base, **overrides}))


def announce(core, agents) -> None:
    for agent in agents:
        core.on_status(
            agent.device_id, encode_status(Status(agent.device_id, True, agent.n_samples))
        )


def folded(strategy) -> object:
    """What a round's strategy has folded, independent of order where order is not part of it
    (a trimmed mean's rows, the robust wrapper's list of norms)."""
    inner = getattr(strategy, "inner", strategy)
    part = inner.partial()
    if "r" in part:
        rows = part["r"]
        return sorted(
            rows[i : i + 4 * inner.n_params] for i in range(0, len(rows), 4 * inner.n_params)
        )
    if "b" in part:
        part = {**part, "b": bytes(sorted(part["b"]))}
    return part


def ledger_view(core) -> list:
    return sorted((str(e.device), e.round, repr(e.event)) for e in core.privacy.ledger.entries)


@pytest.mark.parametrize("name", list(MECHANISMS))
@pytest.mark.parametrize("n_workers", [2, 3])
def test_merged_partials_are_bit_for_bit_one_aggregator(name, n_workers):
    job = make_job(MECHANISMS[name])
    agents = job.agents()
    single, coord = job.aggregator_core(), job.aggregator_core()
    names = [f"w{i}" for i in range(n_workers)]
    workers = {w: IngestWorker(w, job.aggregator_core()) for w in names}
    for core in (single, coord, *(w.core for w in workers.values())):
        announce(core, agents)
    coordinator = Coordinator(coord, names)
    for w in names:
        coordinator.worker_online(w)
    # central noise is drawn at the coordinator: the same draws on both sides compare the sums
    single.noise_rng, coord.noise_rng = np.random.default_rng(5), np.random.default_rng(5)
    deal = np.random.default_rng(len(name) * 7 + n_workers)
    late_seen = duplicates_seen = 0
    for rnd in range(1, 5):
        msg = coord.open_round(0.0)
        payload = encode_global(msg)
        reopen_round(single, round_spec(coord, payload))
        ctl = coordinator.open_message(payload)
        for w in workers.values():
            assert w.on_control(ctl) == []
        seen = decode_global(payload)
        sent = [(a.device_id, a.on_global(seen)) for a in agents if a.wants(seen)]
        sent = [(d, p) for d, p in sent if p is not None]
        sent.append(sent[0])  # a device's re-publish: the second copy lands on another worker
        order = deal.permutation(len(sent))
        twins = {0: len(sent) - 1, len(sent) - 1: 0}
        assigned: dict[int, str] = {}
        for k in order:
            device, data = sent[k]
            w = names[deal.integers(n_workers)]
            if assigned.get(twins.get(k, -1)) == w:  # the two copies go to different workers
                w = names[(names.index(w) + 1) % n_workers]
            assigned[k] = w
            # the single aggregator sees updates in the order the coordinator learns of them
            single.on_update(device, data)
            workers[w].on_update(device, data)
            progress = workers[w].progress()
            if progress is not None:
                coordinator.on_progress(progress)
        for w in workers.values():
            for kind, out in w.on_control(coordinator.freeze_message()):
                assert kind == "progress"
                coordinator.on_progress(out)
        assert not coordinator.round.unfrozen()
        for w in workers.values():
            for kind, out in w.on_control(coordinator.commit_message()):
                assert kind == "partial"
                coordinator.on_partial(out)
        info = coordinator.merge()
        assert info["workers_missing"] == []
        assert coord.current.accepted == single.current.accepted
        # the float64 sums themselves, not only the float32 model they round to
        assert folded(coord.strategy) == folded(single.strategy), f"round {rnd}"
        merged, alone = coord.close_round(1.0, 0.1), single.close_round(1.0, 0.1)
        assert coord.params.tobytes() == single.params.tobytes(), f"round {rnd}"
        for key in ("received", "late", "rejected_by_reason", "bytes_up", "messages_up",
                    "epsilon", "norm_bound", "norm_clipped", "device_updates"):  # fmt: skip
            assert merged.get(key) == alone.get(key), (rnd, key)
        late_seen += alone["late"]
        duplicates_seen += alone["rejected_by_reason"].get(str(Reject.DUPLICATE), 0)
        if coord.privacy is not None:
            assert ledger_view(coord) == ledger_view(single)
    assert coord.version == single.version == 4
    assert late_seen > 0 and duplicates_seen > 0  # both paths were exercised
    # MagRR state (SignDS), the robust norm reference: the state the next round starts from
    assert coord.mechanism.encode_state(coord.mechanism_state) == single.mechanism.encode_state(
        single.mechanism_state
    )
    ref_c = getattr(coord.mechanism, "reference", None)
    if ref_c is not None:
        assert list(ref_c.norms) == list(single.mechanism.reference.norms)


def gaussian_round_with_two_workers():
    """A gaussian job's coordinator and workers w0, w1 with round 1 open, and the first four
    selected devices' updates: (coord core, workers, coordinator, global seen, answers)."""
    job = make_job({"privacy.mechanism": "gaussian", "privacy.epsilon": 30.0})
    agents = job.agents()
    coord = job.aggregator_core()
    workers = {w: IngestWorker(w, job.aggregator_core()) for w in ("w0", "w1")}
    for core in (coord, *(w.core for w in workers.values())):
        announce(core, agents)
    coordinator = Coordinator(coord, list(workers))
    for w in workers:
        coordinator.worker_online(w)
    payload = encode_global(coord.open_round(0.0))
    for w in workers.values():
        w.on_control(coordinator.open_message(payload))
    seen = decode_global(payload)
    answers = [(a.device_id, a.on_global(seen)) for a in agents if a.wants(seen)][:4]
    return coord, workers, coordinator, seen, answers


def test_a_missing_partial_charges_every_selected_device_and_drops_its_share():
    coord, workers, coordinator, seen, answers = gaussian_round_with_two_workers()
    msg = seen
    for i, (device, data) in enumerate(answers):
        w = workers["w0" if i < 2 else "w1"]
        w.on_update(device, data)
        coordinator.on_progress(w.progress())
    assert coord.current.count == 4
    for w in workers.values():
        for _, out in w.on_control(coordinator.freeze_message()):
            coordinator.on_progress(out)
    _, partial = workers["w0"].on_control(coordinator.commit_message())[0]
    coordinator.on_partial(partial)  # w1 crashed before answering
    info = coordinator.merge()
    assert info["workers_missing"] == ["w1"]
    assert coord.current.count == 2 and coord.strategy.count == 2
    charged = {e.device for e in coord.privacy.ledger.entries}
    assert charged == set(msg.selected)  # all 12 asked: the lost share may have released
    record = coord.close_round(1.0, 0.1)
    assert record["received"] == 2 and record["status"] == "closed"


def test_hostile_worker_messages_are_refused_precisely():
    job = make_job({})
    coord = job.aggregator_core()
    coordinator = Coordinator(coord, ["w0"])
    coordinator.worker_online("w0")
    with pytest.raises(ShardingError, match="not msgpack"):
        coordinator.on_progress(b"\xc1")
    with pytest.raises(ShardingError, match="kind"):
        coordinator.on_progress(pack("partial", w="w0", r=1))
    announce(coord, job.agents())
    coord.open_round(0.0)
    coordinator.open_message(b"")
    with pytest.raises(ShardingError, match="'a' must be a list of strings"):
        coordinator.on_progress(pack("progress", w="w0", r=1, a=[1, 2]))
    # a partial whose sum is the wrong size is refused at merge, counted as a lost share
    partial = {"s": b"x", "w": 0, "c": 0}
    with pytest.raises(ShardingError, match="not sealed"):  # anyone's: refused at once
        coordinator.on_partial(pack("partial", w="w0", r=1, s=partial, t={}))
    own = seal(coordinator.keys["w0"], coordinator.job, "partial", w="w0", r=1, s=partial, t={})
    coordinator.on_partial(own)  # w0's own (sealed with its key): refused at merge
    info = coordinator.merge()
    assert info["workers_missing"] == ["w0"] and coord.strategy.count == 0


def test_exact_sum_is_independent_of_order_and_grouping_and_equals_fsum():
    import math

    from edge_fl.mechanisms.exact_sum import ExactSum
    from edge_fl.protocol import PayloadRejected

    g = np.random.default_rng(3)
    terms = [g.standard_normal(40) * 10.0 ** g.integers(-9, 7) for _ in range(300)]
    whole = ExactSum(40)
    for t in terms:
        whole.add(t)
    floats = []
    for _trial in range(5):
        order = g.permutation(len(terms))
        cut = g.integers(1, len(terms))
        a, b = ExactSum(40), ExactSum(40)
        for i in order[:cut]:
            a.add(terms[i])
        for i in order[cut:]:
            b.add(terms[i])
        b = ExactSum.from_bytes(b.to_bytes(), 40)  # across the wire
        a.merge(b)
        assert a.to_bytes() == whole.to_bytes() and a.value().tobytes() == whole.value().tobytes()
        floats.append(sum(terms[i] for i in order).tobytes())
    assert len(set(floats)) > 1  # a float64 running sum does depend on the order here
    reference = np.array([math.fsum(t[j] for t in terms) for j in range(40)])
    np.testing.assert_allclose(whole.value(), reference, rtol=1e-15, atol=2.0**-41 * len(terms))
    # a term rounds to the same grid point whichever path takes it (the path depends on the
    # term's peak: the slow one splits off a 2^-5-grid part first)
    small = g.standard_normal(40) * 1e-3
    fast, slow = ExactSum(40), ExactSum(40)
    fast.add(small)
    slow.add(small, peak=2.0**30)  # an over-estimated peak sends it down the slow path
    assert fast.to_bytes() == slow.to_bytes()
    cancel = ExactSum(40)
    cancel.add(terms[0])
    cancel.add(-terms[0])
    assert not cancel.value().any()
    with pytest.raises(PayloadRejected, match="exact sum"):
        cancel.add(np.full(40, 2.0**47))
    with pytest.raises(PayloadRejected):
        cancel.add(np.full(40, np.nan))
    assert not cancel.value().any()  # nothing added by a refused term
    with pytest.raises(ValueError, match="bytes"):
        ExactSum.from_bytes(b"\0" * 7, 40)


def test_a_left_out_update_no_longer_kept_makes_the_share_lost_but_keeps_its_releases(
    monkeypatch,
):
    """A worker keeps only its last RECENT updates to take back; asked to leave out an older one
    (here: a device another worker reported first), it reports its share lost. The coordinator
    still records every release the worker saw, drops the worker's devices from the round and
    charges the selection."""
    import edge_fl.server.sharding as sharding

    monkeypatch.setattr(sharding, "RECENT", 2)
    coord, workers, coordinator, seen, answers = gaussian_round_with_two_workers()
    first, data = answers[0]
    workers["w1"].on_update(first, data)  # w1 reports it first ...
    coordinator.on_progress(workers["w1"].progress())
    for device, update in answers:  # ... then w0 takes it and three more, reported later
        workers["w0"].on_update(device, update)
    coordinator.on_progress(workers["w0"].progress())
    for w in workers.values():
        for _, out in w.on_control(coordinator.freeze_message()):
            coordinator.on_progress(out)
    assert coordinator.round.left_out == {"w0": [(first, Reject.DUPLICATE)]}
    for w in workers.values():
        for _, out in w.on_control(coordinator.commit_message()):
            coordinator.on_partial(out)
    info = coordinator.merge()
    assert info["workers_missing"] == ["w0"]
    assert coord.current.accepted == {first} and coord.strategy.count == 1  # w1's share only
    released = {(e.device, e.round) for e in coord.privacy.ledger.entries}
    assert {(d, 1) for d, _ in answers} <= released  # w0's releases were kept
    assert {(d, 1) for d in seen.selected} <= released  # and the whole selection charged


def two_workers_and_one_aggregator(**overrides):
    """A gaussian job: (agents, single aggregator core, coordinator core, workers, coordinator);
    nothing open yet. The single aggregator is the reference the coordinator must match."""
    job = make_job({"privacy.mechanism": "gaussian", "privacy.epsilon": 30.0, **overrides})
    agents = job.agents()
    single, coord = job.aggregator_core(), job.aggregator_core()
    workers = {w: IngestWorker(w, job.aggregator_core()) for w in ("w0", "w1")}
    for core in (single, coord, *(w.core for w in workers.values())):
        announce(core, agents)
    coordinator = Coordinator(coord, list(workers))
    for w in workers:
        coordinator.worker_online(w)
    return job, agents, single, coord, workers, coordinator


def open_both(single, coord, coordinator, workers):
    """Open the next round on the coordinator (mirrored by the workers) and on the single one."""
    payload = encode_global(coord.open_round(0.0))
    reopen_round(single, round_spec(coord, payload))
    ctl = coordinator.open_message(payload)
    for w in workers.values():
        w.on_control(ctl)
    return decode_global(payload), ctl


def answers_to(agents, seen):
    out = [(a.device_id, a.on_global(seen)) for a in agents if a.wants(seen)]
    return [(d, p) for d, p in out if p is not None]


def feed(worker, coordinator, device, payload, single=None):
    """One update through a worker, then its progress (the service sends one after each burst,
    before it acknowledges the burst)."""
    if single is not None:
        single.on_update(device, payload)
    worker.on_update(device, payload)
    progress = worker.progress()
    if progress is not None:
        coordinator.on_progress(progress)


def collect(coordinator, workers, skip=()):
    for name, w in workers.items():
        if name not in skip:
            for _, out in w.on_control(coordinator.freeze_message()):
                coordinator.on_progress(out)
    for name, w in workers.items():
        if name not in skip:
            for _, out in w.on_control(coordinator.commit_message()):
                coordinator.on_partial(out)
    return coordinator.merge()


def test_a_worker_started_later_leaves_a_straggler_of_an_earlier_round_to_the_coordinator():
    """w1 was not running in round 1. In round 2 a straggler's round-1 answer is dealt to it: it
    knows nothing of round 1 (no nonce, no selection), so it defers the judgment; the coordinator
    charges the release and counts it late, as one aggregator does."""
    job, agents, single, coord, workers, coordinator = two_workers_and_one_aggregator()
    late_worker = workers.pop("w1")
    coordinator.worker_offline("w1")
    seen1, _ = open_both(single, coord, coordinator, workers)
    sent1 = answers_to(agents, seen1)
    for device, payload in sent1[:2]:
        feed(workers["w0"], coordinator, device, payload, single)
    collect(coordinator, workers)
    alone1, merged1 = single.close_round(1.0, 0.1), coord.close_round(1.0, 0.1)
    assert alone1["received"] == merged1["received"] == 2
    workers["w1"] = IngestWorker("w1", job.aggregator_core())  # a fresh process
    announce(workers["w1"].core, agents)
    del late_worker
    coordinator.worker_online("w1")
    seen2, _ = open_both(single, coord, coordinator, workers)
    straggler, late = next((d, p) for d, p in sent1[2:] if d not in seen2.selected)
    feed(workers["w1"], coordinator, straggler, late, single)
    assert workers["w1"].core.releases == []  # it could not judge it ...
    assert (straggler, 1) in released(coord)  # ... the coordinator did, at once
    for device, payload in answers_to(agents, seen2)[:2]:
        feed(workers["w0"], coordinator, device, payload, single)
    assert collect(coordinator, workers)["workers_missing"] == []
    alone, merged = single.close_round(1.0, 0.1), coord.close_round(1.0, 0.1)
    for key in ("received", "late", "rejected_by_reason", "epsilon"):
        assert merged.get(key) == alone.get(key), key
    assert ledger_view(coord) == ledger_view(single)


def test_a_late_release_reaches_the_ledger_even_if_its_workers_partial_never_comes():
    """A straggler's round-1 answer lands on w1 during round 2; w1 dies before its round-2
    partial. The release went out with w1's progress (before w1 acknowledged the update), so
    the ledger has it, beside round 2's selection charged for the lost share."""
    _job, agents, single, coord, workers, coordinator = two_workers_and_one_aggregator()
    seen1, _ = open_both(single, coord, coordinator, workers)
    sent1 = answers_to(agents, seen1)
    for device, payload in sent1[:2]:
        feed(workers["w0"], coordinator, device, payload, single)
    collect(coordinator, workers)
    single.close_round(1.0, 0.1), coord.close_round(1.0, 0.1)
    seen2, _ = open_both(single, coord, coordinator, workers)
    straggler, late = next((d, p) for d, p in sent1[2:] if d not in seen2.selected)
    feed(workers["w1"], coordinator, straggler, late, single)
    for device, payload in answers_to(agents, seen2)[:2]:
        feed(workers["w0"], coordinator, device, payload, single)
    info = collect(coordinator, workers, skip=("w1",))
    assert info["workers_missing"] == ["w1"]
    assert (straggler, 1) in released(coord) and (straggler, 1) in released(single)
    assert {(d, 2) for d in seen2.selected} <= released(coord)


def test_re_sent_open_freeze_and_commit_change_nothing():
    """After a coordinator's broker link drops mid-collection it re-publishes the round's
    retained open and runs freeze and commit again: the workers' shares and the merge are what
    one collection gives."""
    results = []
    for again in (False, True):
        _job, agents, single, coord, workers, coordinator = two_workers_and_one_aggregator()
        seen, ctl = open_both(single, coord, coordinator, workers)
        for i, (device, payload) in enumerate(answers_to(agents, seen)[:4]):
            feed(workers[f"w{i % 2}"], coordinator, device, payload, single)
        for w in workers.values():
            for _, out in w.on_control(coordinator.freeze_message()):
                coordinator.on_progress(out)
        if again:
            for w in workers.values():
                assert w.on_control(ctl) == []  # the retained open, re-delivered
        for w in workers.values():
            for _, out in w.on_control(coordinator.commit_message()):
                coordinator.on_partial(out)
        if again:  # the whole collection once more
            for w in workers.values():
                for _, out in w.on_control(coordinator.freeze_message()):
                    coordinator.on_progress(out)
                assert w.on_control(ctl) == []
            for w in workers.values():
                for _, out in w.on_control(coordinator.commit_message()):
                    coordinator.on_partial(out)
        info = coordinator.merge()
        assert info["workers_missing"] == [] and coord.strategy.count == 4
        assert folded(coord.strategy) == folded(single.strategy)
        results.append(coord.close_round(1.0, 0.1)["received"])
    assert results == [4, 4]


def test_a_lost_worker_that_returns_takes_no_place_in_the_round():
    """w1 went offline (its share is lost) and came back in the same round: what it reports
    is not admitted, so a healthy worker's answers are not pushed out as late."""
    _job, agents, single, coord, workers, coordinator = two_workers_and_one_aggregator()
    seen, _ = open_both(single, coord, coordinator, workers)
    sent = answers_to(agents, seen)
    target = coord.current.target
    coordinator.worker_offline("w1")
    coordinator.worker_online("w1")
    for device, payload in sent[:target]:
        feed(workers["w1"], coordinator, device, payload)
    for device, payload in sent[target : target + 2]:
        feed(workers["w0"], coordinator, device, payload)
    assert coordinator.round.left_out.get("w0") is None
    info = collect(coordinator, workers)
    assert info["workers_missing"] == ["w1"] and coord.strategy.count == 2
    charged = {(d, 1) for d, _ in sent[: target + 2]}
    assert charged <= released(coord)  # w1's releases still count


def test_malformed_worker_messages_are_sharding_errors_and_leave_the_round_intact():
    _job, agents, single, coord, workers, coordinator = two_workers_and_one_aggregator()
    seen, _ = open_both(single, coord, coordinator, workers)
    with pytest.raises(ShardingError, match="'w' must be a string"):
        coordinator.on_progress(pack("progress", w=[1], r=1, a=[]))
    with pytest.raises(ShardingError, match="'w' must be a string"):
        coordinator.on_partial(pack("partial", w={"a": 1}, r=1))
    with pytest.raises(ShardingError, match="not a worker of this job"):
        coordinator.on_progress(pack("progress", w="w9", r=1, a=[]))
    with pytest.raises(ShardingError, match="release is"):
        coordinator.on_progress(pack("progress", w="w0", r=1, rel=[["d00001", "1", 3]]))
    with pytest.raises(ShardingError, match="deferred update is"):
        coordinator.on_progress(pack("progress", w="w0", r=1, d=[["d00001", 1, 0, 3]]))
    # a device that was never selected is left out (the worker takes it back), not counted
    ghost = seal(coordinator.keys["w0"], coordinator.job, "progress", w="w0", r=1,
                 a=["ghost0", "ghost1"], f=[], z=False)  # fmt: skip
    coordinator.on_progress(ghost)
    assert coord.current.count == 0
    assert [d for d, _ in coordinator.round.left_out["w0"]] == ["ghost0", "ghost1"]
    del coordinator.round.left_out["w0"]
    # a partial with a malformed tally is refused at merge: a lost share, and the round closes
    device, payload = answers_to(agents, seen)[0]
    feed(workers["w0"], coordinator, device, payload)
    for w in workers.values():
        for _, out in w.on_control(coordinator.freeze_message()):
            coordinator.on_progress(out)
    bad_tally = seal(coordinator.keys["w1"], coordinator.job, "partial", w="w1", r=1, s=None,
                     a=[], t={"rej": [1]})  # fmt: skip
    coordinator.on_partial(bad_tally)
    coordinator.on_partial(workers["w0"].on_control(coordinator.commit_message())[0][1])
    info = coordinator.merge()
    assert info["workers_missing"] == ["w1"] and coordinator.round is None
    assert coord.strategy.count == 1


def test_a_cleared_control_topic_makes_a_worker_forget_an_earlier_run():
    """A worker that mirrored round 3 of an earlier run of the job (its retained open, left by a
    coordinator that was killed) takes part in the new run's round 1 once the new coordinator
    clears the retained control topic, and judges its updates with the new run's nonces."""
    job, agents, single, coord, workers, coordinator = two_workers_and_one_aggregator()
    for _ in range(3):  # the earlier run: three rounds
        open_both(single, coord, coordinator, workers)
        collect(coordinator, workers)
        coord.close_round(1.0, 0.1)
    assert workers["w0"].core.round_number == 3
    fresh, coord2 = job.aggregator_core(), job.aggregator_core()  # the new run, same job id
    announce(fresh, agents)
    announce(coord2, agents)
    coordinator2 = Coordinator(coord2, ["w0", "w1"])
    for w in workers:
        coordinator2.worker_online(w)
    for w in workers.values():
        w.reset()  # what the ingest service does on the cleared (empty, retained) control topic
        announce(w.core, agents)
    seen, _ = open_both(fresh, coord2, coordinator2, workers)
    assert seen.round == 1 and workers["w0"].core.current.number == 1
    sent = answers_to(agents, seen)[:4]
    for i, (device, payload) in enumerate(sent):
        assert workers[f"w{i % 2}"].on_update(device, payload) is None
        coordinator2.on_progress(workers[f"w{i % 2}"].progress())
    assert collect(coordinator2, workers)["workers_missing"] == []
    assert coord2.strategy.count == 4


def test_a_re_delivered_progress_changes_nothing():
    _job, agents, single, coord, workers, coordinator = two_workers_and_one_aggregator()
    seen, _ = open_both(single, coord, coordinator, workers)
    sent = answers_to(agents, seen)[:2]
    for device, payload in sent:
        workers["w0"].on_update(device, payload)
    progress = workers["w0"].progress()
    coordinator.on_progress(progress)
    coordinator.on_progress(progress)  # QoS 1: at least once
    assert coordinator.round.left_out == {}
    info = collect(coordinator, workers)
    assert info["workers_missing"] == [] and coord.strategy.count == 2


def test_a_worker_that_outlives_its_coordinator_reports_its_updates_to_the_resumed_one():
    """kill -9 of the coordinator, --resume: the new one re-opens the round with the same global
    message. The worker holding updates of it sees a new coordinator (another epoch), re-folds
    them and reports them again, so they count; the resumed round is still charged in full."""
    job, agents, _single, coord, workers, coordinator = two_workers_and_one_aggregator()
    payload = encode_global(coord.open_round(0.0))
    for w in workers.values():
        w.on_control(coordinator.open_message(payload))
    sent = answers_to(agents, decode_global(payload))
    for device, data in sent[:3]:
        feed(workers["w0"], coordinator, device, data)
    resumed = job.aggregator_core()
    announce(resumed, agents)
    reopen_round(resumed, round_spec(coord, payload))
    successor = Coordinator(resumed, ["w0", "w1"])
    successor.lost_before_resume = True
    for w in ("w0", "w1"):
        successor.worker_online(w)
    for w in workers.values():
        w.on_control(successor.open_message(payload))  # the same global message, re-broadcast
    for device, data in sent[:3]:  # devices re-send: the worker holds them already
        feed(workers["w0"], successor, device, data)
    for device, data in sent[3:5]:
        feed(workers["w1"], successor, device, data)
    info = collect(successor, workers)
    assert info["workers_missing"] == ["before-restart"]
    assert resumed.current.count == 5 and resumed.strategy.count == 5
    assert {(d, 1) for d in decode_global(payload).selected} <= released(resumed)


def test_who_the_round_waits_for():
    """A worker that comes online after the freeze has no share to wait for; with a hash
    partition a worker offline at the open is lost from the start (its devices go unseen)."""
    job, agents, single, coord, workers, coordinator = two_workers_and_one_aggregator()
    coordinator.worker_offline("w1")
    open_both(single, coord, coordinator, {"w0": workers["w0"]})
    coordinator.freeze_message()
    coordinator.worker_online("w1")
    assert coordinator.round.workers == {"w0"}
    hashed = Coordinator(job.aggregator_core(), ["w0", "w1"], dealt=False)
    announce(hashed.core, agents)
    hashed.worker_online("w0")
    hashed.core.open_round(0.0)
    hashed.open_message(b"")
    assert hashed.round.lost == {"w1"} and hashed.round.unfrozen() == {"w0"}


def test_a_resumed_round_stopped_before_its_workers_took_it_up_is_charged():
    _job, _agents, _single, coord, _workers, coordinator = two_workers_and_one_aggregator()
    selected = coord.open_round(0.0).selected
    coordinator.lost_before_resume = True  # and no open was published (stopped while waiting)
    assert coordinator.charge_lost_before_resume() == {
        "workers": 0,
        "workers_missing": ["before-restart"],
    }
    assert {(d, 1) for d in selected} <= released(coord)
    assert coordinator.charge_lost_before_resume() == {}  # once
