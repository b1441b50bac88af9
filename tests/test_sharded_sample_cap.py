"""The relative sample cap (robust ``auto``) holds with sharded ingest: the coordinator's ``open``
carries it (``c``), workers fold at most that many samples per update, and the coordinator refuses
a partial whose weight exceeds the capped counts. A device lying about its sample count in status
and update (n = 10^7, tools/bench_poisoning.py ``liar``) cannot take over a worker's share."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_sharding import collect, make_job, open_both

from edge_fl.protocol import Status, encode_status
from edge_fl.server import sharding
from edge_fl.server.sharding import Coordinator, FixedReference, IngestWorker

CLAIM = 10_000_000
SCALE = 100.0


class FirstSelectedLies:
    """A device's mechanism: as the first of the selection, x100 its delta and claim n = 10^7."""

    def __init__(self, honest) -> None:
        self.honest = honest

    def __getattr__(self, name):
        return getattr(self.honest, name)

    def device_update(self, device, msg, exposure):
        update = self.honest.device_update(device, msg, exposure)
        if not (msg.selected and device.device_id == min(msg.selected)):
            return update
        delta = (update.delta.astype(np.float64) * SCALE).astype(np.float32)
        return dataclasses.replace(update, delta=delta, n_samples=CLAIM)


def run(rounds: int = 4):
    """A sharded run (2 workers) and a single aggregator on the same updates, every device
    declaring n = 10^7 in its status: (single core, coordinator core, per round (the merge's
    info, the sharded record, the single record))."""
    job = make_job({"rounds.rounds": rounds, "rounds.over_selection": 1.0})
    agents = job.agents()
    for a in agents:
        a.mechanism = FirstSelectedLies(a.mechanism)
    single, coord = job.aggregator_core(), job.aggregator_core()
    workers = {w: IngestWorker(w, job.aggregator_core()) for w in ("w0", "w1")}
    for core in (single, coord, *(w.core for w in workers.values())):
        for a in agents:
            core.on_status(a.device_id, encode_status(Status(a.device_id, True, CLAIM)))
    coordinator = Coordinator(coord, list(workers))
    for w in workers:
        coordinator.worker_online(w)
    names = sorted(workers)
    out = []
    for _ in range(rounds):
        seen, _ = open_both(single, coord, coordinator, workers)
        answers = [(a.device_id, a.on_global(seen)) for a in agents if a.wants(seen)]
        # round-robin from a worker that alternates per round: the first answer (the liar, the first
        # of the selection in id order) lands on each worker in turn
        for i, (device, payload) in enumerate(answers):
            if payload is None:
                continue
            single.on_update(device, payload)
            w = workers[names[(i + seen.round) % 2]]
            w.on_update(device, payload)
            progress = w.progress()
            if progress is not None:
                coordinator.on_progress(progress)
        info = collect(coordinator, workers)
        merged, alone = coord.close_round(1.0, 0.1), single.close_round(1.0, 0.1)
        out.append((info, merged, alone))
    return single, coord, out


def test_a_lying_device_is_capped_on_the_workers_as_on_one_aggregator():
    single, coord, rounds = run()
    for number, (info, merged, alone) in enumerate(rounds, 1):
        assert info["workers_missing"] == [], number
        assert merged.get("sample_cap") == alone.get("sample_cap"), number
        assert merged.get("max_samples_capped") == alone.get("max_samples_capped"), number
    # the cap bit in every round after the first (the first is held and capped at its close)
    assert all(alone.get("sample_cap") and alone["max_samples_capped"] >= 1
               for _, _, alone in rounds)  # fmt: skip
    assert coord.params.tobytes() == single.params.tobytes()
    assert list(coord.mechanism.reference.samples) == list(single.mechanism.reference.samples)


def test_an_uncapped_worker_fold_is_refused_and_the_model_differs(monkeypatch):
    """What workers did before the cap was sent: their partials weigh the lie in full. The
    coordinator's check (capped weights) refuses them, so the model is not the single one's."""
    monkeypatch.setattr(FixedReference, "sample_cap", lambda self, pending=(): None)
    single, coord, rounds = run()
    refused = [n for n, (info, _, _) in enumerate(rounds, 1) if info["workers_missing"]]
    assert refused and refused[0] == 2  # round 1 is held: folded at the coordinator
    assert coord.params.tobytes() != single.params.tobytes()
    # merged without the check, the uncapped fold is another model too (the lie weighs in)
    monkeypatch.setattr(sharding, "check_partial", lambda core, data, devices: None)
    single, coord, rounds = run()
    assert all(not info["workers_missing"] for info, _, _ in rounds)
    assert coord.params.tobytes() != single.params.tobytes()


@pytest.mark.parametrize("cap", [0, -3, 2.5, "9", True])
def test_an_open_with_a_malformed_cap_is_refused(cap):
    from edge_fl.server.sharding import ShardingError, open_sample_cap

    with pytest.raises(ShardingError, match="sample cap"):
        open_sample_cap({"c": cap})
