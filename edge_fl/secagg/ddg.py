"""The distributed discrete Gaussian (Kairouz, Liu, Steinke, ICML 2021) on top of SecAgg+:
pure functions, not wired into any engine yet (docs/specs/secagg.md section 12).

Device: clip the delta to L2 norm c, rotate it (randomised Walsh-Hadamard, public seed), scale by
1/gamma, round each coordinate stochastically to an integer, again until the L2 norm is at most
``rounded_bound`` (conditional rounding: the norm bound is then certain), add discrete Gaussian
noise N_Z(0, sigma^2) per coordinate from the exact sampler of Canonne, Kamath and Steinke
(NeurIPS 2020), and submit the integers to SecAgg+ (modulo 2^b: the sum mod 2^b is a function of
the true sum, so wrapping costs accuracy, never privacy). Aggregator: the secure sum, times gamma,
rotated back.

Accounting: the sum of n discrete Gaussians is close to N_Z(0, n sigma^2); Proposition 14 of the
paper bounds its Renyi divergence by three (xi, rho)-zCDP curves (tau: the distance term). Each
is one ``dp_accounting.ZCDpEvent``; :func:`epsilon` takes the smallest epsilon any of them
proves. Dropouts remove noise shares: the calibration assumes only ``n_min`` devices' noise.
Relation: device level, zero-out (the device's update replaced by zero; its noise stays).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from randomgen import ChaCha

from edge_fl.secagg.primitives import RandBytes

# ------------------------------------------------------------------ exact sampling (CKS 2020)


class Exact:
    """Exact Bernoulli, discrete Laplace and discrete Gaussian draws from a byte source: only
    integer comparisons and rational arithmetic, no floating point."""

    def __init__(self, randbytes: RandBytes) -> None:
        self._rand = randbytes

    def below(self, n: int) -> int:
        """Uniform in [0, n) (rejection on whole bytes)."""
        nbytes = (n.bit_length() + 7) // 8 + 1
        span = 1 << (8 * nbytes)
        limit = span - span % n
        while True:
            v = int.from_bytes(self._rand(nbytes), "little")
            if v < limit:
                return v % n

    def bernoulli(self, p: Fraction) -> bool:
        return self.below(p.denominator) < p.numerator

    def bernoulli_exp(self, gamma: Fraction) -> bool:
        """Bernoulli(exp(-gamma)), gamma >= 0."""
        while gamma > 1:
            if not self._bernoulli_exp_small(Fraction(1)):
                return False
            gamma -= 1
        return self._bernoulli_exp_small(gamma)

    def _bernoulli_exp_small(self, gamma: Fraction) -> bool:
        k = 1
        while self.bernoulli(gamma / k):
            k += 1
        return k % 2 == 1

    def discrete_laplace(self, t: int) -> int:
        """P[x] proportional to exp(-|x| / t), t >= 1 an integer."""
        while True:
            u = self.below(t)
            if not self.bernoulli_exp(Fraction(u, t)):
                continue
            v = 0
            while self.bernoulli_exp(Fraction(1)):
                v += 1
            x = u + t * v
            negative = self.bernoulli(Fraction(1, 2))
            if negative and x == 0:
                continue
            return -x if negative else x

    def discrete_gaussian(self, sigma2: Fraction) -> int:
        """P[x] proportional to exp(-x^2 / (2 sigma2)), sigma2 > 0 rational."""
        t = math.isqrt(sigma2.numerator // sigma2.denominator) + 1
        while True:
            y = self.discrete_laplace(t)
            gamma = (abs(y) - sigma2 / t) ** 2 / (2 * sigma2)
            if self.bernoulli_exp(gamma):
                return y

    def discrete_gaussians(self, sigma2: Fraction, size: int) -> np.ndarray:
        """``size`` draws; an integer sigma2 in [1, 10^8] takes the vectorised path (same
        algorithm, same exactness, numpy's unbiased bounded integers over ChaCha20)."""
        if sigma2.denominator == 1 and 1 <= sigma2 <= VECTOR_MAX_SIGMA2:
            key = int.from_bytes(self._rand(32), "little")
            rng = np.random.Generator(ChaCha(key=key, counter=0, rounds=20))
            return _VectorExact(rng).discrete_gaussians(int(sigma2), size)
        return np.array([self.discrete_gaussian(sigma2) for _ in range(size)], dtype=np.int64)


#: the vectorised sampler's int64 arithmetic holds for integer variances up to this
VECTOR_MAX_SIGMA2 = 10**8
_SAFE = 2**62


class _VectorExact:
    """CKS 2020 over arrays: every Bernoulli(a / b) is ``integers(0, b) < a`` on int64, every
    product checked against 2^62 first; the rare entries that would overflow (far tails) are
    decided by the scalar exact path."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self._scalar = Exact(lambda n: rng.bytes(n))

    def _exp_small(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Bernoulli(exp(-a/b)) for 0 <= a <= b, elementwise (alternating series)."""
        k = np.ones(a.size, dtype=np.int64)
        active = np.arange(a.size)
        while active.size:
            if bool((b[active] > _SAFE // k[active]).any()):  # b <= 2e16: k would pass 230
                raise OverflowError("Bernoulli series beyond int64 (probability below 1/229!)")
            bound = b[active] * k[active]
            hit = self._rng.integers(0, bound) < a[active]
            k[active[hit]] += 1
            active = active[hit]
        return k % 2 == 1

    def bernoulli_exp(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Bernoulli(exp(-a/b)) for a >= 0, b >= 1 (int64 arrays)."""
        whole, rest = np.divmod(a, b)
        out = np.ones(a.size, dtype=bool)
        ones = np.ones(a.size, dtype=np.int64)
        for j in range(int(whole.max(initial=0))):
            idx = np.flatnonzero(out & (whole > j))
            if not idx.size:
                break
            out[idx] = self._exp_small(ones[idx], ones[idx])
        idx = np.flatnonzero(out)
        out[idx] = self._exp_small(rest[idx], b[idx])
        return out

    def discrete_laplace(self, t: int, size: int) -> np.ndarray:
        out = np.zeros(size, dtype=np.int64)
        todo = np.arange(size)
        tt = np.full(size, t, dtype=np.int64)
        while todo.size:
            m = todo.size
            u = self._rng.integers(0, t, m)
            d = self.bernoulli_exp(u, tt[:m])
            v = np.zeros(m, dtype=np.int64)
            going = np.flatnonzero(d)
            while going.size:
                s = self.bernoulli_exp(np.ones(going.size, np.int64), np.ones(going.size, np.int64))
                v[going[s]] += 1
                going = going[s]
            x = u + t * v
            neg = self._rng.integers(0, 2, m) == 1
            ok = d & ~(neg & (x == 0))
            out[todo[ok]] = np.where(neg, -x, x)[ok]
            todo = todo[~ok]
        return out

    def discrete_gaussians(self, sigma2: int, size: int) -> np.ndarray:
        t = math.isqrt(sigma2) + 1
        out = np.zeros(size, dtype=np.int64)
        todo = np.arange(size)
        while todo.size:
            y = self.discrete_laplace(t, todo.size)
            gap = np.abs(y) * t - sigma2  # gamma = gap^2 / (2 sigma2 t^2)
            b = np.full(y.size, 2 * sigma2 * t * t, dtype=np.int64)
            fits = np.abs(gap) < 2**31
            accept = np.zeros(y.size, dtype=bool)
            idx = np.flatnonzero(fits)
            accept[idx] = self.bernoulli_exp(gap[idx] ** 2, b[idx])
            for i in np.flatnonzero(~fits):  # far tails: exact rational arithmetic
                gamma = Fraction(int(gap[i]) ** 2, 2 * sigma2 * t * t)
                accept[i] = self._scalar.bernoulli_exp(gamma)
            out[todo[accept]] = y[accept]
            todo = todo[~accept]
        return out


# ------------------------------------------------------------------ rotation and rounding


def padded(dim: int) -> int:
    return 1 << max(0, (dim - 1).bit_length())


def signs(seed: bytes, n: int) -> np.ndarray:
    """The rotation's n signs: bit i of the ChaCha20 keystream keyed by ``seed`` (zero nonce,
    counter 0), least significant bit of each byte first; 1 -> +1, 0 -> -1."""
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    bits = np.unpackbits(
        np.frombuffer(stream.update(bytes((n + 7) // 8)), dtype=np.uint8), bitorder="little"
    )
    return np.where(bits[:n] == 1, 1.0, -1.0)


def _hadamard(x: np.ndarray) -> np.ndarray:
    y = x.astype(np.float64).copy()
    h = 1
    while h < y.size:
        y = y.reshape(-1, 2, h)
        y = np.stack((y[:, 0] + y[:, 1], y[:, 0] - y[:, 1]), axis=1).reshape(-1)
        h *= 2
    return y / math.sqrt(y.size)


def rotate(x: np.ndarray, seed: bytes) -> np.ndarray:
    """H D x / sqrt(D') on x padded to a power of two: orthogonal, flattens the coordinates."""
    n = padded(x.size)
    v = np.zeros(n)
    v[: x.size] = x
    return _hadamard(v * signs(seed, n))


def unrotate(y: np.ndarray, seed: bytes, dim: int) -> np.ndarray:
    return (_hadamard(y) * signs(seed, y.size))[:dim]


def rounded_bound(norm: float, dim: int, beta: float) -> float:
    """The L2 norm conditional rounding guarantees for a vector of norm ``norm`` in ``dim``
    coordinates (Kairouz et al., Theorem 1): each attempt exceeds it with probability <= beta."""
    plain = norm + math.sqrt(dim)
    if beta == 0:
        return plain
    squared = norm**2 + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (norm + math.sqrt(dim) / 2)
    return min(plain, math.sqrt(squared))


def conditional_round(
    x: np.ndarray, bound: float, rng: np.random.Generator, tries: int = 1000
) -> np.ndarray:
    """Unbiased stochastic rounding to integers, repeated until the L2 norm is <= bound."""
    floor = np.floor(x)
    frac = x - floor
    for _ in range(tries):
        out = floor + (rng.random(x.size) < frac)
        if float(np.linalg.norm(out)) <= bound:
            return out.astype(np.int64)
    raise ValueError(f"no rounding within L2 {bound:g} in {tries} attempts: is the input clipped?")


# ------------------------------------------------------------------ the mechanism


@dataclass(frozen=True)
class DdgParams:
    """Public parameters: L2 clip c, granularity gamma (the integer grid's step), the per-device
    noise variance ``sigma2`` in grid units, beta, the model dimension and the noise-share count
    ``n_min`` the guarantee assumes."""

    clip: float
    gamma: float
    sigma2: Fraction
    beta: float
    dim: int
    n_min: int

    @property
    def padded(self) -> int:
        return padded(self.dim)

    @property
    def l2(self) -> float:
        """L2 sensitivity of one device's integer vector."""
        return rounded_bound(self.clip / self.gamma, self.padded, self.beta)

    @property
    def l1(self) -> float:
        return self.l2 * min(math.sqrt(self.padded), self.l2)


def device_encode(
    delta: np.ndarray, p: DdgParams, rotation_seed: bytes, randbytes: RandBytes
) -> np.ndarray:
    """A device's integer vector: clipped, rotated, scaled, rounded, noised."""
    rounded, noise = device_parts(delta, p, rotation_seed, randbytes)
    return rounded + noise


def device_parts(
    delta: np.ndarray, p: DdgParams, rotation_seed: bytes, randbytes: RandBytes
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`device_encode`'s two terms: the rounded integers and the noise added to them (a
    device beyond the survivors floor reveals its noise: docs/specs/secagg.md section 12)."""
    norm = float(np.linalg.norm(delta))
    x = delta * (min(1.0, p.clip / norm) if norm > 0 else 1.0)
    scaled = rotate(x, rotation_seed) / p.gamma
    rng = np.random.Generator(
        ChaCha(key=int.from_bytes(randbytes(32), "little"), counter=0, rounds=20)
    )
    rounded = conditional_round(scaled, p.l2, rng)
    return rounded, Exact(randbytes).discrete_gaussians(p.sigma2, rounded.size)


def server_decode(total: np.ndarray, p: DdgParams, rotation_seed: bytes) -> np.ndarray:
    """The sum of the devices' clipped deltas plus the summed noise, in model coordinates."""
    return unrotate(np.asarray(total, dtype=np.float64) * p.gamma, rotation_seed, p.dim)


def ring_bits(p: DdgParams, n: int, sds: float = 7.0) -> int:
    """The SecAgg+ bit width for n devices: room for the signal in the worst case (each device's
    integer coordinate is at most its L2 bound) plus ``sds`` standard deviations of the summed
    noise. Beyond it the sum wraps: an accuracy loss, never a privacy one (module docstring)."""
    reach = n * p.l2 + sds * math.sqrt(n * float(p.sigma2))
    return math.ceil(reach).bit_length() + 1


def tau(sigma2: float, n: int) -> float:
    """Kairouz et al.'s tau for n discrete Gaussians of variance sigma2 each."""
    return 10 * sum(math.exp(-2 * math.pi**2 * sigma2 * k / (k + 1)) for k in range(1, n))


def zcdp_curves(p: DdgParams) -> list[tuple[float, float]]:
    """(xi, rho) of the three bounds of Proposition 14 for the sum of ``n_min`` shares: each
    RDP(alpha) <= xi + rho alpha is a valid bound for every alpha."""
    sigma = math.sqrt(p.n_min * float(p.sigma2))
    t = tau(float(p.sigma2), p.n_min)
    l2, l1, d = p.l2 / sigma, p.l1 / sigma, p.padded
    return [
        (t * d, l2**2 / 2),
        (0.0, (l2**2 + 2 * l1 * t + t**2 * d) / 2),
        (0.0, (l2 + math.sqrt(d) * t) ** 2 / 2),
    ]


def events(p: DdgParams) -> list[Any]:
    """The curves as dp-accounting events (needs the ``accounting`` extra)."""
    from dp_accounting import dp_event

    return [dp_event.ZCDpEvent(rho=rho, xi=xi) for xi, rho in zcdp_curves(p)]


def epsilon(
    p: DdgParams, rounds: int, delta: float, orders: Sequence[float] | None = None
) -> float:
    """The epsilon of ``rounds`` releases through dp-accounting's RDP accountant: the smallest
    any curve proves."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    best = math.inf
    for event in events(p):
        acc = rdp.RdpAccountant(orders) if orders is not None else rdp.RdpAccountant()
        acc.compose(dp_event.SelfComposedDpEvent(event, rounds))
        best = min(best, acc.get_epsilon(delta))
    return best


def calibrate(
    target_epsilon: float,
    delta: float,
    rounds: int,
    clip: float,
    gamma: float,
    dim: int,
    n_min: int,
    beta: float = math.exp(-0.5),
) -> DdgParams:
    """The smallest per-device variance (to 1/1000 of a grid unit squared, rounded up) whose
    ``rounds`` releases with only ``n_min`` noise shares stay within ``target_epsilon``."""
    if not (
        target_epsilon > 0
        and 0 < delta < 1
        and rounds >= 1
        and n_min >= 1
        and clip > 0
        and gamma > 0
    ):
        raise ValueError("epsilon, clip and gamma > 0, delta in (0, 1), rounds and n_min >= 1")

    def params(var: Fraction) -> DdgParams:
        return DdgParams(clip, gamma, var, beta, dim, n_min)

    lo, hi = Fraction(1, 1000), Fraction(1)
    while epsilon(params(hi), rounds, delta) > target_epsilon:
        lo, hi = hi, hi * 4
        if hi > 10**15:
            raise ValueError("no noise level reaches that epsilon")
    while hi - lo > Fraction(1, 1000) * max(Fraction(1), lo):
        mid = (lo + hi) / 2
        if epsilon(params(mid), rounds, delta) > target_epsilon:
            lo = mid
        else:
            hi = mid
    if hi >= 1:  # an integer variance: the vectorised exact sampler applies
        return params(Fraction(math.ceil(hi)))
    return params(Fraction(math.ceil(hi * 1000), 1000))
