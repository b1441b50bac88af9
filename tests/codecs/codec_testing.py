"""Shared helpers for the codec tests: a proper unbiasedness test and hostile-field checks."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from edge_fl.protocol import PayloadRejected
from edge_fl.protocol.codecs import Codec

#: family-wise false-alarm probability of an unbiasedness test (seeded, so it is deterministic)
ALPHA = 1e-6


def hoeffding_unbiased(
    decodes: np.ndarray, x: np.ndarray, width: np.ndarray, alpha: float = ALPHA
) -> tuple[bool, float]:
    """Whether every coordinate's mean of ``n`` independent decodes is within the Hoeffding
    half-width of ``x`` (each decode of coordinate i lies in an interval of ``width[i]``), with a
    Bonferroni correction over the coordinates. Returns (passed, worst |mean - x| / half-width)."""
    n, d = decodes.shape
    half = width * math.sqrt(math.log(2 * d / alpha) / (2 * n))
    err = np.abs(decodes.mean(axis=0) - x)
    ratio = float(np.max(err / np.maximum(half, 1e-30)))
    return ratio <= 1.0, ratio


def decodes(codec: Codec, x: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([codec.decode(codec.encode(x, rng)[0], x.size) for _ in range(n)])


def rejects(fn: Callable[[], object]) -> PayloadRejected:
    try:
        fn()
    except PayloadRejected as exc:
        return exc
    raise AssertionError("expected PayloadRejected")
