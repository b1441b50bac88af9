"""Norm clipping: the step that makes a sensitivity bound true.

Every mechanism's noise is calibrated to a sensitivity that holds only because each contribution
(a per-sample gradient, or a client's whole update) is scaled into a norm ball. Clipping runs
in float64 whatever the input dtype, and the scale factor is ``min(1, C / norm)`` so rows already
inside the ball are returned unchanged. The fraction of clipped rows is returned because it is
the metric that tells whether C is badly chosen (all clipped: signal lost; none: noise wasted).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = ["Clipped", "clip_l2", "clip_rows_l1", "clip_rows_l2"]


class Clipped(NamedTuple):
    """Clipped values plus the fraction of rows (or 0/1 for one vector) that were scaled down."""

    values: np.ndarray
    fraction_clipped: float


def _check_bound(name: str, value: float) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def _as_matrix(name: str, x: np.ndarray) -> np.ndarray:
    m = np.asarray(x, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"{name} must be a 2-d array (n, d), got shape {m.shape}")
    if not np.all(np.isfinite(m)):
        raise ValueError(f"{name} must contain only finite values (found NaN or inf)")
    return m


def _clip_rows(g: np.ndarray, norms: np.ndarray, bound: float) -> Clipped:
    over = norms > bound
    if g.shape[0] == 0:
        return Clipped(g.copy(), 0.0)
    factor = np.ones_like(norms)
    factor[over] = bound / norms[over]
    return Clipped(g * factor[:, None], float(np.count_nonzero(over)) / g.shape[0])


def clip_rows_l1(grads: np.ndarray, clip: float) -> Clipped:
    """Scale each row to L1 norm <= clip (Laplace mechanism A: L1 sensitivity)."""
    c = _check_bound("clip", clip)
    g = _as_matrix("grads", grads)
    return _clip_rows(g, np.abs(g).sum(axis=1), c)


def clip_rows_l2(grads: np.ndarray, clip: float) -> Clipped:
    """Scale each row to L2 norm <= clip (DP-SGD: per-sample gradient clipping)."""
    c = _check_bound("clip", clip)
    g = _as_matrix("grads", grads)
    return _clip_rows(g, np.sqrt(np.einsum("ij,ij->i", g, g)), c)


def clip_l2(vector: np.ndarray, clip: float) -> Clipped:
    """Scale one vector (a client update or parameter vector) to L2 norm <= clip."""
    c = _check_bound("clip", clip)
    v = np.asarray(vector, dtype=np.float64)
    if v.ndim != 1:
        raise ValueError(f"vector must be 1-d, got shape {v.shape}")
    if not np.all(np.isfinite(v)):
        raise ValueError("vector must contain only finite values (found NaN or inf)")
    out = _clip_rows(v[None, :], np.array([math.sqrt(float(v @ v))]), c)
    return Clipped(out.values[0], out.fraction_clipped)
