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
from edge_fl.server.sharding import Coordinator, IngestWorker, ShardingError, pack

MECHANISMS = {
    "none (robust auto norm bound)": {},
    "none, trimmed mean": {"robust.aggregator": "trimmed_mean"},
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
    coordinator.on_partial(
        pack("partial", w="w0", r=1, s={"s": b"x", "w": 0, "c": 0}, rel=[], t={})
    )
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
