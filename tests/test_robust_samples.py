"""The default robust settings against a device that lies about n in its status and its update
(issue 24, item 8): with ``norm_bound: auto`` a sample count is also capped at ``norm_multiplier``
x the median count of the reference, so one claim of 10^7 cannot carry the weighted mean."""

from __future__ import annotations

import numpy as np
import pytest

from edge_fl.mechanisms.base import FedAvg
from edge_fl.protocol import DenseUpdate
from edge_fl.server.robust import NormReference, RobustSettings, RobustStrategy

D = 6
HONEST = np.full(D, 0.1, np.float32)
EVIL = np.full(D, -0.1, np.float32)  # the same norm, the other way: the norm bound cannot see it


def auto() -> tuple[RobustSettings, NormReference]:
    s = RobustSettings(norm_bound="auto")
    return s, NormReference(s.norm_window, s.norm_multiplier, s.norm_min_updates)


def a_round(s, ref, liar_n: int, honest: int = 19) -> tuple[np.ndarray, dict]:
    st = RobustStrategy(FedAvg(D), s, ref)
    st.add(DenseUpdate("liar", 1, 0, liar_n, EVIL), 1.0)
    for i in range(honest):
        st.add(DenseUpdate(f"d{i}", 1, 0, 30, HONEST), 1.0)
    return st.finish(np.zeros(D, np.float32))


def test_a_claim_of_ten_million_is_capped_at_three_median_counts():
    s, ref = auto()
    for _ in range(3):  # the first round is held and capped by its own median, the next by the
        new, info = a_round(s, ref, 10_000_000)  # reference
        assert info["sample_cap"] == 90
        assert info["max_samples_capped"] == 1
        # weight 90 against 19 x 30: the honest direction wins (without the cap: -0.1)
        assert new[0] == pytest.approx((19 * 30 * 0.1 - 90 * 0.1) / (19 * 30 + 90), rel=1e-5)


def test_honest_counts_under_the_cap_weigh_as_before():
    s, ref = auto()
    new, info = a_round(s, ref, 60)
    assert info["max_samples_capped"] == 0
    assert new[0] == pytest.approx((19 * 30 * 0.1 - 60 * 0.1) / (19 * 30 + 60), rel=1e-5)


def test_the_cap_does_not_depend_on_arrival_order_and_merges():
    s, ref = auto()
    whole = RobustStrategy(FedAvg(D), s, ref)
    parts = [RobustStrategy(FedAvg(D), s, ref) for _ in range(2)]
    updates = [DenseUpdate("liar", 1, 0, 10_000_000, EVIL)] + [
        DenseUpdate(f"d{i}", 1, 0, 20 + i, HONEST) for i in range(9)
    ]
    for i, u in enumerate(updates):
        whole.add(u, 1.0)
        parts[i % 2].add(u, 1.0)
    parts[0].merge(parts[1].partial())
    a, _ = whole.finish(np.zeros(D, np.float32))
    b, _ = parts[0].finish(np.zeros(D, np.float32))
    assert a.tobytes() == b.tobytes()
