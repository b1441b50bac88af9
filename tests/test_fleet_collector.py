"""The fleet opens and closes its sessions without the cyclic collector and, from
FREEZE_SESSIONS on, freezes what it holds once connected (docs/bench/profile-10k.md)."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest

from edge_fl.fleet import runtime


@pytest.fixture
def collector():
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.enable()


@pytest.mark.parametrize("freeze", [True, False])
def test_the_block_runs_without_the_collector_and_restores_it(collector, freeze):
    gc.enable()
    with runtime.without_collector(freeze=freeze):
        assert not gc.isenabled()
        kept = [[] for _ in range(100)]
        for a, b in itertools.pairwise(kept):
            a.append(b)  # a chain the collector tracks
    assert gc.isenabled()
    assert (gc.get_freeze_count() > 0) is freeze
    del kept


def test_the_block_leaves_a_disabled_collector_disabled(collector):
    gc.disable()
    with runtime.without_collector(freeze=True):
        pass
    assert not gc.isenabled()


def test_garbage_made_in_the_block_is_collected_before_freezing(collector):
    class Node:
        pass

    gc.enable()
    gc.collect()
    with runtime.without_collector(freeze=True):
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle that dies inside the block
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None  # nothing collects it while the block runs
    assert gone() is None  # frozen, it would have stayed for good
