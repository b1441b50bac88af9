"""Hardened noise and sampling primitives over an injected ``np.random.Generator``.

Why not ``rng.laplace`` / ``rng.normal``: textbook floating-point samplers leave input-dependent
gaps in the set of reachable outputs, so the low-order bits of a noisy release can reveal the
input (Mironov, CCS 2012; Jin et al., IEEE S&P 2022; ``docs/specs/privacy.md`` pitfalls 1-2). The
samplers here follow Holohan & Braghin (Secure Random Sampling in DP, ESORICS 2021):

* Laplace: ``b * (log(1-U1) cos(pi U2) + log(1-U3) cos(pi U4))`` with four independent 53-bit
  uniforms (the sampler IBM diffprivlib uses). ``-log(1-U)`` is Exp(1) and ``E cos(pi U)`` has
  characteristic function ``1/sqrt(1+t^2)``, so the sum of two such terms has ``1/(1+t^2)``:
  exactly Laplace(0, 1) in real arithmetic. In floating point the output mixes two products of
  transcendental functions of four independent uniforms, so the set of reachable outputs is far
  denser and less structured than the inverse-CDF sampler's, which is what Mironov's attack reads.
* Gaussian: the sum of ``2n`` draws of N(0, s^2) divided by ``sqrt(2n)`` (n = 2 by default, as
  Opacus' ``secure_mode``); the distribution is unchanged and the floating-point attack cost grows
  to about ``2^(p(2n-1))``.

Limits (documented, not hidden): both are *hardened* float samplers, not proofs. A formal guarantee
on doubles needs the snapping mechanism (clamp, add Laplace, round to a power-of-two grid, clamp;
Mironov 2012) or integer mechanisms (discrete Laplace / Gaussian) over fixed-point data; neither is
implemented here. Timing side channels are out of scope. The samplers are only as good as the
generator: production passes ``edge_fl.privacy.rng.secure_generator()`` (ChaCha20 from os.urandom).
"""

from __future__ import annotations

import math
from typing import SupportsIndex

import numpy as np

Size = SupportsIndex | tuple[SupportsIndex, ...]

__all__ = ["gaussian_noise", "laplace_noise", "poisson_mask"]


def _check_scale(name: str, value: float) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite real number >= 0, got {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite real number >= 0, got {value!r}")
    return v


def _check_rng(rng: object) -> None:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")


def _shape(size: Size) -> tuple[int, ...]:
    shape = (int(size),) if isinstance(size, SupportsIndex) else tuple(int(s) for s in size)
    if any(s < 0 for s in shape):
        raise ValueError(f"size must have non-negative dimensions, got {size!r}")
    return shape


def laplace_noise(rng: np.random.Generator, scale: float, size: Size) -> np.ndarray:
    """Laplace(0, scale) noise, float64, via the Holohan-Braghin four-uniform sampler."""
    _check_rng(rng)
    b = _check_scale("scale", scale)
    shape = _shape(size)
    if b == 0.0:
        return np.zeros(shape)
    u = rng.random((4, *shape))  # 53-bit uniforms in [0, 1): log1p(-u) is always finite
    # Work in place on the uniform buffer to keep a 1M-dim draw cheap.
    np.log1p(np.negative(u[0], out=u[0]), out=u[0])
    np.log1p(np.negative(u[2], out=u[2]), out=u[2])
    np.cos(np.multiply(u[1], np.pi, out=u[1]), out=u[1])
    np.cos(np.multiply(u[3], np.pi, out=u[3]), out=u[3])
    out = u[0] * u[1]
    out += u[2] * u[3]
    out *= b
    return out


def gaussian_noise(rng: np.random.Generator, std: float, size: Size, n: int = 2) -> np.ndarray:
    """N(0, std^2) noise, float64, as the sum of ``2n`` standard normals over ``sqrt(2n)``."""
    _check_rng(rng)
    s = _check_scale("std", std)
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"n must be an integer >= 1 (2n draws per value), got {n!r}")
    shape = _shape(size)
    if s == 0.0:
        return np.zeros(shape)
    out = rng.standard_normal(shape)
    for _ in range(2 * int(n) - 1):
        out += rng.standard_normal(shape)
    out *= s / math.sqrt(2 * int(n))
    return out


def poisson_mask(rng: np.random.Generator, size: int, q: float) -> np.ndarray:
    """Bernoulli(q) inclusion mask: Poisson sampling, the assumption behind amplification by q.

    The mask must come from the CSPRNG and stay secret (docs/specs/privacy.md pitfall 8): shuffled fixed-size batches or
    observable selection void the PoissonSampled accounting.
    """
    _check_rng(rng)
    qf = _check_scale("q", q)
    if qf > 1:
        raise ValueError(f"q must be a probability in [0, 1], got {q!r}")
    n = int(size)
    if n < 0:
        raise ValueError(f"size must be >= 0, got {size!r}")
    return rng.random(n) < qf
