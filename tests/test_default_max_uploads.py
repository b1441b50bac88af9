"""L by default: the 99.9th percentile of how often uniform selection picks one device over T
rounds, against scipy's binomial quantile, from a few rounds to a million (a long paced job)."""

from __future__ import annotations

import pytest
from scipy.stats import binom

from edge_fl.job import default_max_uploads


@pytest.mark.parametrize(
    ("rounds", "target", "devices"),
    [
        (20, 20, 50),
        (20, 5, 50),
        (100, 3, 10),
        (1_000, 26, 1_000),
        (1_031, 20, 100),
        (100_000, 20, 1_000),
        (1_000_000, 26, 1_000),
    ],
)
def test_it_is_the_binomial_quantile(rounds, target, devices):
    expected = max(1, int(binom.ppf(0.999, rounds, target / devices)))
    assert default_max_uploads(rounds, target, devices, "sync") == expected


def test_full_participation_and_async_upload_every_round():
    assert default_max_uploads(7, 10, 10, "sync") == 7
    assert default_max_uploads(7, 3, 10, "fedbuff") == 7
