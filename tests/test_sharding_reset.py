"""A cleared retained control topic followed by the next ``open`` of the same coordinator
process (the same epoch ``e``) is not a new run: the worker keeps what it knows of the earlier
rounds (the epoch was read from the open's cap ``c``, so any clear made workers forget)."""

from __future__ import annotations

from test_sharding import collect, open_both, two_workers_and_one_aggregator


def test_a_clear_that_was_not_the_coordinators_does_not_make_a_worker_forget():
    _job, _agents, single, coord, workers, coordinator = two_workers_and_one_aggregator()
    open_both(single, coord, coordinator, workers)
    collect(coordinator, workers)
    coord.close_round(1.0, 0.1)
    assert all(w.core.round_facts(1) is not None for w in workers.values())
    for w in workers.values():
        w.reset()  # someone cleared the retained control topic; the coordinator lives on
    seen, _ = open_both(single, coord, coordinator, workers)
    assert seen.round == 2
    for w in workers.values():
        assert w.core.current.number == 2
        assert w.core.round_facts(1) is not None  # round 1 still known: not a new run
