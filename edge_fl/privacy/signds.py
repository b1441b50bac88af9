"""SignDS: sign-based dimension selection, a pure eps-LDP exponential mechanism.

Spec: ``docs/specs/signds.md``. A client releases only a random sign s and h coordinate indices J; the
aggregator moves every selected coordinate by a common step in direction s. Privacy comes from the
exponential mechanism over h-subsets J with utility ``1(|J ∩ S_topk| >= nu_th)``: the number nu
of top-k members in J has ``P(nu = tau) ∝ C(K, tau) C(d-K, h-tau) e^{eps 1(tau >= nu_th)}``, and
J is uniform given nu.

Decisions on top of the MindSpore reference client (``SecureProtocol.java``):

- **Exact combinatorics.** Everything is computed in log space (prefix sums of logs, log-sum-exp),
  so the Java client's double overflow (which silently caps h, e.g. 65 for d=266084, k=0.2,
  eps=100) is *not* reproduced. Instead h is capped explicitly at ``max_dim_out`` (default 100,
  the reference server's per-upload limit) and the plan says whether the cap bound.
- **Exact threshold scan.** ``calcOptThr`` keeps t while E[nu] strictly increases. Since
  E_{t+1} > E_t exactly when t < E_t, the scan is decided by that comparison; comparing two
  doubles E_{t+1} > E_t instead stops at t = 1 once the mass below t is under 1e-16, and ends the
  h search early (149 instead of 238 for d=266084, k=0.2, eps=100; the spec's "exact 146" is
  presumably such an artefact; 238 was checked with 400-digit arithmetic). The cap binds anyway.
- **Top-k size.** ``K = floor(k * d)`` with k taken as the decimal the user wrote (the shortest repr
  of the float), computed exactly. The Java client evaluates ``(int)(k * d)`` in float32, which
  differs in rare cases (k=0.13, d=900: Java 116, here 117); ``topk_size(..., java_float32=True)``
  reproduces the Java value when bit-compatibility is needed.
- **rho and eps** are used as given (doubles); Java widens float32 values (0.6f = 0.6000000238),
  which only matters at exact ties of the expected ratio.
- **Sampling nu** uses U in (0, 1] and the smallest nu with CDF >= U, with the CDF set to exactly 1
  from the last supported value on, so a zero-probability nu is never drawn (the Java loop returns
  0 for U = 0 and never stops if rounding leaves the CDF below U).
- **Indices** are returned ascending and unique (uint32); the aggregator relies on it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np

from edge_fl.protocol.params import ParamSpec, int_param, number_param

__all__ = [
    "PureDpRelease",
    "SignDSBatch",
    "SignDSParams",
    "SignDSPlan",
    "SignDSSelection",
    "audit_signds",
    "check_dimension",
    "expected_topk",
    "nu_log_pmf",
    "nu_pmf",
    "optimal_output_dim",
    "optimal_threshold",
    "plan",
    "plan_from_counts",
    "select",
    "select_batch",
    "signds_dp_events",
    "signds_global_update",
    "signds_vote",
    "topk_indices",
    "topk_size",
]

_MAX_D = 2**32 - 1  # indices travel as uint32
# Populations up to this size are sampled with random keys (vectorised over runs); larger ones with
# Generator.choice per run (Floyd / partial Fisher-Yates inside numpy). Both are uniform subsets.
_SMALL_POPULATION = 256
_KEYS_CHUNK = 1 << 22  # max random keys per vectorised chunk


# ---------------------------------------------------------------------------------------------
# Parameters


def _is_real(x: Any) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _domain_error(key: str, value: Any, domain: str) -> ValueError:
    return ValueError(f"signds.{key} = {value!r} is out of domain {domain}")


#: The SignDS settings' domains, written once (as the reference server checks them, spec section
#: 6): :class:`SignDSParams` checks them, and the mechanism's public parameters (``mp``: ``k``,
#: ``eps``, ``rho``, ``hout``, ``glr``) are these very keys. Keyed by the setting's config name.
SETTINGS: dict[str, ParamSpec] = {
    "sign_k": number_param("k", True, "sign_k: top-k fraction", 0, 0.25),
    "sign_eps": number_param("eps", True, "sign_eps: exponential-mechanism epsilon", 0, 100),
    "sign_thr_ratio": number_param(
        "rho", True, "sign_thr_ratio: target top-k fraction of the outputs", 0.5, 1, lo_open=False
    ),
    "sign_global_lr": number_param(
        "glr", False, "sign_global_lr: the server step on MagRR fallback (informational)", 0
    ),
    "sign_dim_out": int_param(
        "hout", True, "sign_dim_out as configured (0: h was optimised)", 0, 50
    ),
}


def setting_domain(name: str) -> str:
    """The domain of SignDS setting ``name`` as error messages and help texts write it."""
    spec = SETTINGS[name]
    return ("integer " if spec.kind == "int" else "") + spec.domain()


@dataclass(frozen=True)
class SignDSParams:
    """Job-level SignDS settings; domains as the reference server checks them (spec section 6)."""

    k: float = 0.01  # sign_k, fraction of coordinates in the top-k set
    eps: float = 100.0  # sign_eps, exponential-mechanism epsilon per round
    thr_ratio: float = 0.6  # sign_thr_ratio (rho), only used to search h when dim_out == 0
    global_lr: float = 0.1  # sign_global_lr, the step when MagRR falls back
    dim_out: int = 0  # sign_dim_out, h; 0 = optimise
    max_dim_out: int = 100  # explicit cap on h (reference server rejects > 100 indices)

    def __post_init__(self) -> None:
        reals = (
            ("sign_k", "k"),
            ("sign_eps", "eps"),
            ("sign_thr_ratio", "thr_ratio"),
            ("sign_global_lr", "global_lr"),
        )
        for key, attr in reals:
            v = getattr(self, attr)
            if not _is_real(v) or not SETTINGS[key].admits(v):
                raise _domain_error(key, v, setting_domain(key))
            object.__setattr__(self, attr, float(v))
        if not _is_int(self.dim_out) or not SETTINGS["sign_dim_out"].admits(self.dim_out):
            raise _domain_error("sign_dim_out", self.dim_out, setting_domain("sign_dim_out"))
        if not _is_int(self.max_dim_out) or self.max_dim_out < 1:
            raise _domain_error("max_dim_out", self.max_dim_out, "integer [1, inf)")
        object.__setattr__(self, "dim_out", int(self.dim_out))
        object.__setattr__(self, "max_dim_out", int(self.max_dim_out))
        if self.dim_out > self.max_dim_out:
            raise ValueError(
                f"signds.sign_dim_out = {self.dim_out} exceeds signds.max_dim_out = "
                f"{self.max_dim_out}; domain [0, max_dim_out]"
            )


def _check_d(d: Any) -> int:
    if not _is_int(d) or not 1 <= d <= _MAX_D:
        raise ValueError(f"model dimension d = {d!r} is out of domain integer [1, 2**32 - 1]")
    return int(d)


def topk_size(k: float, d: int, *, java_float32: bool = False) -> int:
    """K = floor(k * d), exact for the decimal k as written; or Java's float32 ``(int)(k*d)``."""
    d = _check_d(d)
    if not _is_real(k) or not 0 < float(k) <= 1:
        raise ValueError(f"signds.sign_k = {k!r} is out of domain (0, 1]")
    if java_float32:
        return int(np.float32(np.float32(k) * np.float32(d)))
    dec = Decimal(repr(float(k)))  # the shortest decimal that round-trips, i.e. what was written
    return int((dec * d).to_integral_value(rounding="ROUND_FLOOR"))


def check_dimension(params: SignDSParams, d: int) -> list[str]:
    """Recommended (non-fatal) checks for a model size; the MindSpore docs ask for k*d > 50."""
    d = _check_d(d)
    warnings: list[str] = []
    K = topk_size(params.k, d)
    if params.k * d <= 50:
        warnings.append(
            f"signds.sign_k * d = {params.k} * {d} = {params.k * d:g} <= 50: the top-k set "
            f"({K} coordinates) is too small for SignDS to carry useful signal "
            "(recommended k*d > 50)"
        )
    if params.dim_out > d:
        warnings.append(
            f"signds.sign_dim_out = {params.dim_out} exceeds the model dimension d = {d}"
        )
    return warnings


# ---------------------------------------------------------------------------------------------
# Exact log-space combinatorics


def _log_comb_prefix(n: int, r_max: int) -> np.ndarray:
    """log C(n, r) for r = 0..r_max (-inf for r > n), as prefix sums of log((n+1-i)/i)."""
    out = np.full(r_max + 1, -np.inf)
    top = min(r_max, n)
    out[0] = 0.0
    if top >= 1:
        i = np.arange(1, top + 1, dtype=np.float64)
        out[1 : top + 1] = np.cumsum(np.log(n + 1.0 - i) - np.log(i))
    return out


def _log_omega(K: int, d: int, h: int) -> np.ndarray:
    """log(C(K, tau) C(d-K, h-tau)), tau = 0..h: how many h-subsets have tau top-k members."""
    lk = _log_comb_prefix(K, h)
    lm = _log_comb_prefix(d - K, h)
    return lk + lm[::-1]


def _check_counts(K: int, d: int, h: int) -> None:
    d = _check_d(d)
    if not _is_int(K) or not 0 <= K <= d:
        raise ValueError(f"top-k size K = {K!r} is out of domain integer [0, d={d}]")
    if not _is_int(h) or not 1 <= h <= d:
        raise ValueError(f"output dimension h = {h!r} is out of domain integer [1, d={d}]")


def _check_eps(eps: float) -> float:
    if not _is_real(eps) or not 0 < float(eps) < math.inf:
        raise ValueError(f"signds.sign_eps = {eps!r} is out of domain (0, inf)")
    return float(eps)


def _log_pmf_from_omega(log_omega: np.ndarray, eps: float, nu_th: int) -> np.ndarray:
    lw = log_omega.copy()
    lw[nu_th:] += eps
    return lw - np.logaddexp.reduce(lw)


def nu_log_pmf(K: int, d: int, h: int, eps: float, nu_th: int) -> np.ndarray:
    """log P(nu = tau), tau = 0..h, under the exponential mechanism with threshold nu_th."""
    _check_counts(K, d, h)
    eps = _check_eps(eps)
    if not _is_int(nu_th) or not 0 <= nu_th <= h:
        raise ValueError(f"threshold nu_th = {nu_th!r} is out of domain integer [0, h={h}]")
    return _log_pmf_from_omega(_log_omega(K, d, h), eps, int(nu_th))


def nu_pmf(K: int, d: int, h: int, eps: float, nu_th: int) -> np.ndarray:
    """P(nu = tau), tau = 0..h (see ``nu_log_pmf``)."""
    return np.exp(nu_log_pmf(K, d, h, eps, nu_th))


def _expectations(log_omega: np.ndarray, eps: float) -> np.ndarray:
    """E[nu] under threshold t, for every t = 1..h at once (log-space prefix / suffix sums)."""
    h = log_omega.size - 1
    tau = np.arange(h + 1, dtype=np.float64)
    with np.errstate(divide="ignore"):
        log_tau_w = np.log(tau) + log_omega
    # lo[t] = log sum_{tau < t}, hi[t] = log sum_{tau >= t}, for t = 1..h
    lo_a = np.logaddexp.accumulate(log_omega)[:-1]
    hi_a = np.logaddexp.accumulate(log_omega[::-1])[::-1][1:]
    lo_b = np.logaddexp.accumulate(log_tau_w)[:-1]
    hi_b = np.logaddexp.accumulate(log_tau_w[::-1])[::-1][1:]
    log_z = np.logaddexp(lo_a, eps + hi_a)
    log_num = np.logaddexp(lo_b, eps + hi_b)
    with np.errstate(invalid="ignore"):
        return np.exp(log_num - log_z)


def _greedy_threshold(expect: np.ndarray) -> int:
    """``calcOptThr``'s greedy scan, decided exactly.

    Java keeps t while E_t strictly increases. Moving tau = t from the boosted to the plain side
    gives E_{t+1} > E_t  <=>  t < E_t, so the scan stops at the first t with t >= E_t (E_t <= 0 at
    t = 1 gives 1). Comparing E_t with t instead of E_{t+1} with E_t matters: when the mass below t
    is tiny, consecutive E_t agree to all 53 bits and a float comparison stops the scan at t = 1.
    """
    t = np.arange(1, expect.size + 1, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        stop = np.flatnonzero(~(t < expect))  # NaN counts as a stop
    return int(stop[0]) + 1 if stop.size else expect.size


def optimal_threshold(K: int, d: int, h: int, eps: float) -> int:
    """The threshold nu_th in [1, h] the reference picks: greedy scan for the largest E[nu]."""
    _check_counts(K, d, h)
    return _greedy_threshold(_expectations(_log_omega(K, d, h), _check_eps(eps)))


def expected_topk(K: int, d: int, h: int, eps: float, nu_th: int) -> float:
    """E[nu] for the given threshold."""
    p = nu_pmf(K, d, h, eps, nu_th)
    return float(np.dot(np.arange(h + 1), p))


def optimal_output_dim(rho: float, K: int, d: int, eps: float) -> int:
    """``findOptOutputDim`` without overflow: the largest h with E[nu]/h >= rho (at least 1).

    Uncapped: the caller applies ``max_dim_out``. Terminates because E[nu] <= K, so the ratio drops
    below rho once h > K/rho, and h never exceeds d.
    """
    _check_counts(K, d, 1)
    eps = _check_eps(eps)
    if not _is_real(rho) or not 0 < float(rho) <= 1:
        raise ValueError(f"signds.sign_thr_ratio = {rho!r} is out of domain (0, 1]")
    rho = float(rho)
    cap = 64
    lk = _log_comb_prefix(K, cap)
    lm = _log_comb_prefix(d - K, cap)
    h = 1
    while h <= d:
        if h > cap:
            cap *= 2
            lk = _log_comb_prefix(K, cap)
            lm = _log_comb_prefix(d - K, cap)
        log_omega = lk[: h + 1] + lm[h::-1]
        expect = _expectations(log_omega, eps)
        t = _greedy_threshold(expect)
        ratio = expect[t - 1] / h
        if not ratio >= rho:  # also stops on NaN
            break
        h += 1
    return max(1, h - 1)


# ---------------------------------------------------------------------------------------------
# Plans


@dataclass(frozen=True, eq=False)
class SignDSPlan:
    """Everything a round needs for one (params, d): sizes, threshold, the nu distribution."""

    d: int
    topk: int  # K
    h: int  # output dimension actually used (after the cap)
    nu_th: int
    eps: float
    p_topk_threshold: float  # P(nu >= nu_th)
    expected_topk_fraction: float  # E[nu] / h
    capped: bool  # True when the optimal h exceeded max_dim_out and was cut to it
    h_uncapped: int  # the exact optimum (or the configured dim_out)
    log_pmf: np.ndarray  # log P(nu = tau), tau = 0..h (read-only)
    cdf: np.ndarray  # CDF of nu, exactly 1.0 from the last supported value on (read-only)

    def describe(self) -> dict[str, Any]:
        """A plain dict for round metrics and logs."""
        return {
            "d": self.d,
            "topk": self.topk,
            "h": self.h,
            "nu_th": self.nu_th,
            "eps": self.eps,
            "p_topk_threshold": self.p_topk_threshold,
            "expected_topk_fraction": self.expected_topk_fraction,
            "capped": self.capped,
            "h_uncapped": self.h_uncapped,
        }


def _build_plan(
    K: int, d: int, h: int, eps: float, nu_th: int, capped: bool, h_uncapped: int
) -> SignDSPlan:
    log_pmf = nu_log_pmf(K, d, h, eps, nu_th)
    pmf = np.exp(log_pmf)
    cdf = np.cumsum(pmf)
    last = int(np.flatnonzero(pmf > 0)[-1])
    cdf[last:] = 1.0
    log_pmf.setflags(write=False)
    cdf.setflags(write=False)
    return SignDSPlan(
        d=d,
        topk=K,
        h=h,
        nu_th=nu_th,
        eps=eps,
        p_topk_threshold=float(np.exp(np.logaddexp.reduce(log_pmf[nu_th:]))),
        expected_topk_fraction=float(np.dot(np.arange(h + 1), pmf)) / h,
        capped=capped,
        h_uncapped=h_uncapped,
        log_pmf=log_pmf,
        cdf=cdf,
    )


@functools.lru_cache(maxsize=256)
def plan_from_counts(
    K: int, d: int, eps: float, rho: float = 0.6, dim_out: int = 0, max_dim_out: int = 100
) -> SignDSPlan:
    """A plan from an explicit top-k count (``plan`` derives K from sign_k); cached."""
    _check_counts(K, d, 1)
    eps = _check_eps(eps)
    if not _is_int(max_dim_out) or max_dim_out < 1:
        raise _domain_error("max_dim_out", max_dim_out, "integer [1, inf)")
    if not _is_int(dim_out) or dim_out < 0:
        raise _domain_error("sign_dim_out", dim_out, "integer [0, inf)")
    if dim_out > d:
        raise ValueError(f"signds.sign_dim_out = {dim_out} exceeds the model dimension d = {d}")
    h_uncapped = dim_out if dim_out > 0 else optimal_output_dim(rho, K, d, eps)
    h = min(h_uncapped, max_dim_out)
    nu_th = optimal_threshold(K, d, h, eps)
    return _build_plan(K, d, h, eps, nu_th, h_uncapped > max_dim_out, h_uncapped)


def plan(params: SignDSParams, d: int) -> SignDSPlan:
    """The plan for a model of dimension d. Cached: the h search is the expensive part."""
    d = _check_d(d)
    return plan_from_counts(
        topk_size(params.k, d), d, params.eps, params.thr_ratio, params.dim_out, params.max_dim_out
    )


# ---------------------------------------------------------------------------------------------
# Client selection


@dataclass(frozen=True, eq=False)
class SignDSSelection:
    """One client's SignDS output. Only ``sign`` and ``indices`` are released; ``nu`` stays."""

    sign: int  # +1 or -1
    indices: np.ndarray  # uint32, strictly ascending, length h
    nu: int  # how many indices came from the top-k set


@dataclass(frozen=True, eq=False)
class SignDSBatch:
    """n independent selections on the same update with the same sign (audits, statistics)."""

    sign: int
    indices: np.ndarray  # (n, h) uint32, each row strictly ascending
    nu: np.ndarray  # (n,)


def _flat_update(update: np.ndarray, d: int) -> np.ndarray:
    u = np.asarray(update).reshape(-1)
    if u.size != d:
        raise ValueError(f"update has {u.size} elements but the plan is for d = {d}")
    if not np.issubdtype(u.dtype, np.floating) and not np.issubdtype(u.dtype, np.integer):
        raise ValueError(f"update dtype {u.dtype} is not numeric")
    if not np.isfinite(u).all():
        raise ValueError("update contains non-finite values (NaN or inf)")
    return u


def _check_sign(sign: Any) -> int:
    if not _is_int(sign) or sign not in (1, -1):
        raise ValueError(f"sign = {sign!r} is out of domain {{+1, -1}}")
    return int(sign)


def _split(u: np.ndarray, K: int, sign: int) -> tuple[np.ndarray, np.ndarray]:
    """(top-k set, the rest) by signed value: K largest for +1, K smallest for -1. O(d)."""
    d = u.size
    if K == 0:
        return np.empty(0, dtype=np.intp), np.arange(d)
    if sign > 0:
        part = np.argpartition(u, d - K)
        return part[d - K :], part[: d - K]
    part = np.argpartition(u, K - 1)
    return part[:K], part[K:]


def topk_indices(update: np.ndarray, K: int, sign: int) -> np.ndarray:
    """The top-k set for a sign (ties broken arbitrarily, as in the reference)."""
    u = np.asarray(update).reshape(-1)
    if not _is_int(K) or not 0 <= K <= u.size:
        raise ValueError(f"top-k size K = {K!r} is out of domain integer [0, d={u.size}]")
    return _split(u, int(K), _check_sign(sign))[0]


def _sample_nu(cdf: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Inverse-CDF draws: the smallest tau with CDF(tau) >= U, U uniform on (0, 1]."""
    u = 1.0 - rng.random(n)
    return np.searchsorted(cdf, u, side="left")


def _first_of_permutations(pop: int, counts: np.ndarray, width: int, rng) -> np.ndarray:
    """Row i starts with counts[i] distinct uniform draws from range(pop); the rest is 0 padding.

    Small populations use random keys (argsort of iid uniforms = a uniform permutation), which
    vectorises over rows; large ones use ``Generator.choice`` without replacement per row.
    """
    n = counts.size
    out = np.zeros((n, width), dtype=np.int64)
    if pop == 0 or not counts.any():
        return out
    if pop <= _SMALL_POPULATION:
        cols = min(width, pop)
        rows = max(1, _KEYS_CHUNK // pop)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            keys = rng.random((stop - start, pop))
            out[start:stop, :cols] = np.argsort(keys, axis=1)[:, :cols]
    else:
        for i in np.flatnonzero(counts):
            m = int(counts[i])
            out[i, :m] = rng.choice(pop, m, replace=False, shuffle=False)
    return out


def _draw_indices(
    top: np.ndarray, rest: np.ndarray, nu: np.ndarray, h: int, rng: np.random.Generator
) -> np.ndarray:
    """Row i: nu[i] distinct uniform members of ``top`` and h - nu[i] of ``rest``, sorted."""
    n_rest = h - nu
    if (nu < 0).any() or (nu > top.size).any() or (n_rest > rest.size).any():
        raise RuntimeError("internal: nu outside the support of the plan")
    pos_top = _first_of_permutations(top.size, nu, h, rng)
    pos_rest = _first_of_permutations(rest.size, n_rest, h, rng)
    col = np.arange(h)[None, :]
    from_top = col < nu[:, None]
    rest_col = np.clip(col - nu[:, None], 0, h - 1)
    picked_rest = np.take_along_axis(pos_rest, rest_col, axis=1)
    if top.size:
        idx = np.where(from_top, top[pos_top], rest[picked_rest] if rest.size else 0)
    else:
        idx = rest[picked_rest]
    idx.sort(axis=1)
    return idx.astype(np.uint32)


def _draw_sign(rng: np.random.Generator) -> int:
    return 1 if rng.integers(2) == 1 else -1


def select(
    update: np.ndarray, plan: SignDSPlan, rng: np.random.Generator, sign: int | None = None
) -> SignDSSelection:
    """Spec section 1, steps 1-8: random sign, top-k by signed value, nu, uniform picks, sort.

    ``sign`` is for tests and audits only; production leaves it None (a fair coin from ``rng``).
    """
    u = _flat_update(update, plan.d)
    s = _draw_sign(rng) if sign is None else _check_sign(sign)
    top, rest = _split(u, plan.topk, s)
    nu = _sample_nu(plan.cdf, 1, rng)
    idx = _draw_indices(top, rest, nu, plan.h, rng)[0]
    return SignDSSelection(sign=s, indices=idx, nu=int(nu[0]))


def select_batch(
    update: np.ndarray, plan: SignDSPlan, rng: np.random.Generator, n: int, sign: int
) -> SignDSBatch:
    """n independent selections of one update with a fixed sign; the same code as ``select``."""
    if not _is_int(n) or n < 1:
        raise ValueError(f"n = {n!r} is out of domain integer [1, inf)")
    u = _flat_update(update, plan.d)
    s = _check_sign(sign)
    top, rest = _split(u, plan.topk, s)
    nu = _sample_nu(plan.cdf, int(n), rng)
    return SignDSBatch(sign=s, indices=_draw_indices(top, rest, nu, plan.h, rng), nu=nu)


# ---------------------------------------------------------------------------------------------
# Aggregator reconstruction


def add_vote(votes: np.ndarray, sign: int, indices: np.ndarray, weight: float) -> None:
    """votes += weight * sign * 1_J in place: one client's contribution to the vote vector.

    Re-checks the indices cheaply (the decoder validated them): a duplicate would silently
    double a vote, an out-of-range one would corrupt another coordinate.
    """
    idx, value = vote_parts(votes.shape[0], sign, indices, weight)
    votes[idx] += value


def vote_parts(d: int, sign: int, indices: np.ndarray, weight: float) -> tuple[np.ndarray, float]:
    """(indices as int64, weight x sign) of one vote, checked: what :func:`add_vote` adds."""
    s = _check_sign(sign)
    if not _is_real(weight) or not 0 <= float(weight) < math.inf:
        raise ValueError(f"weight = {weight!r} is out of domain [0, inf)")
    idx = np.asarray(indices)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError("indices must be a 1-D integer array")
    idx = idx.astype(np.int64)  # unsigned differences would wrap and hide a descending pair
    if idx.size and (int(idx[0]) < 0 or int(idx[-1]) >= d or (np.diff(idx) <= 0).any()):
        raise ValueError(f"indices must be strictly ascending in [0, d={d})")
    return idx, s * float(weight)


def signds_vote(d: int, selections: Iterable[tuple[int, np.ndarray, float]]) -> np.ndarray:
    """sum_i n_i s_i 1_{J_i} over (sign, indices, n_samples); float64 of length d."""
    votes = np.zeros(_check_d(d), dtype=np.float64)
    for i, (sign, indices, n_samples) in enumerate(selections):
        try:
            add_vote(votes, sign, indices, n_samples)
        except ValueError as exc:
            raise ValueError(f"selection {i}: {exc}") from None
    return votes


def signds_global_update(
    w_old: np.ndarray, votes_weighted: np.ndarray, total_n: float, step: float
) -> np.ndarray:
    """w_new = w_old + step * votes / total_n (spec section 5), in w_old's dtype.

    ``step`` is 3 N r_est from the MagRR state, or sign_global_lr without MagRR.
    """
    w = np.asarray(w_old)
    v = np.asarray(votes_weighted, dtype=np.float64)
    if w.shape != v.shape:
        raise ValueError(f"votes shape {v.shape} does not match the model shape {w.shape}")
    if not _is_real(total_n) or not 0 < float(total_n) < math.inf:
        raise ValueError(f"total_n = {total_n!r} is out of domain (0, inf)")
    if not _is_real(step) or not 0 <= float(step) < math.inf:
        raise ValueError(f"step = {step!r} is out of domain [0, inf)")
    return (w + (float(step) / float(total_n)) * v).astype(w.dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# Privacy descriptors


@dataclass(frozen=True)
class PureDpRelease:
    """A pure eps-DP release dp-accounting has no event for (e.g. an exponential mechanism).

    Local DP: any two updates of one device are neighbours. Record it with
    ``edge_fl.privacy.events.pure_privacy_event(eps, name)``, which uses the dominating
    randomized-response pair of a pure eps-DP release (relation replace-one, unit device).
    """

    eps: float
    name: str


def signds_dp_events(params: SignDSParams, rr_eps: float | None = 5.0) -> list[Any]:
    """What one SignDS client releases per round: the selection and (with MagRR) the RR bit.

    Returns ``[PureDpRelease(sign_eps, "signds.exponential_mechanism"),
    RandomizedResponseDpEvent(2/(1+e^rr_eps), 2)]``; pass ``rr_eps=None`` without MagRR.
    The sign is a data-independent coin and costs nothing.
    """
    events: list[Any] = [PureDpRelease(params.eps, "signds.exponential_mechanism")]
    if rr_eps is not None:
        if not _is_real(rr_eps) or not 0 < float(rr_eps) < math.inf:
            raise ValueError(f"magrr.rr_eps = {rr_eps!r} is out of domain (0, inf)")
        from edge_fl.privacy.randomized_response import rr_dp_event

        events.append(rr_dp_event(float(rr_eps)))
    return events


# ---------------------------------------------------------------------------------------------
# Audit (privacy spec 5.1)


def audit_signds(
    eps: float,
    n: int,
    rng: np.random.Generator,
    d: int = 20,
    k_count: int = 4,
    h: int | None = None,
    *,
    alpha: float = 0.05,
    sampler_eps: float | None = None,
) -> dict[str, Any]:
    """Exact distinguishing test for the selection (privacy spec 5.1), on the production sampler.

    Inputs A and B have disjoint top-k sets S_A = {0..k-1}, S_B = {k..2k-1}; the sign is fixed to +1
    (it is a released, data-independent coin). The event E* = {|J ∩ S_A| >= nu_th and
    |J ∩ S_B| < nu_th} has likelihood ratio exactly e^eps, so the Clopper-Pearson bound must stay
    <= eps. ``h=None`` uses the optimised h (rho = 0.6). ``sampler_eps`` runs the sampler with a
    different epsilon than claimed (a deliberately broken mechanism, to show the audit catches it).
    The result has the keys of the other audits in ``edge_fl.privacy.audit``, plus h and nu_th;
    ``epsilon_estimate`` = ln(k1/k0) should be within a few ``epsilon_estimate_se`` of eps.
    """
    from edge_fl.privacy.audit import eps_lower_bound

    eps = _check_eps(eps)
    d = _check_d(d)
    if not _is_int(k_count) or k_count < 1 or 2 * k_count > d:
        raise ValueError(f"k_count = {k_count!r} is out of domain integer [1, d/2]")
    if not _is_int(n) or n < 1:
        raise ValueError(f"n = {n!r} is out of domain integer [1, inf)")
    claimed = plan_from_counts(int(k_count), d, eps, 0.6, 0 if h is None else int(h), max(d, 100))
    used = claimed
    if sampler_eps is not None:
        used = _build_plan(
            claimed.topk, d, claimed.h, _check_eps(sampler_eps), claimed.nu_th, False, claimed.h
        )
    in_a = np.zeros(d, dtype=bool)
    in_a[:k_count] = True
    in_b = np.zeros(d, dtype=bool)
    in_b[k_count : 2 * k_count] = True

    def hits(top_mask: np.ndarray) -> int:
        update = top_mask.astype(np.float64)  # strictly larger on the top-k set, sign +1
        idx = select_batch(update, used, rng, n, sign=1).indices
        c_a = in_a[idx].sum(axis=1)
        c_b = in_b[idx].sum(axis=1)
        return int(np.count_nonzero((c_a >= claimed.nu_th) & (c_b < claimed.nu_th)))

    k1 = hits(in_a)  # D1 = A: E* is likely
    k0 = hits(in_b)  # D0 = B: E* is a false positive
    out: dict[str, Any] = {
        "mechanism": "signds",
        "claimed_epsilon": eps,
        "epsilon_lower_bound": float(eps_lower_bound(k0, k1, int(n), delta=0.0, alpha=alpha)),
        "n": int(n),
        "k0": k0,
        "k1": k1,
        "alpha": alpha,
        "delta": 0.0,
    }
    if k0 > 0 and k1 > 0:  # exact test: E[k1]/E[k0] = e^eps (privacy spec 5.1 step 6)
        p0, p1 = k0 / n, k1 / n
        out["epsilon_estimate"] = math.log(k1 / k0)
        out["epsilon_estimate_se"] = math.sqrt((1 - p1) / (n * p1) + (1 - p0) / (n * p0))
    out.update(h=claimed.h, nu_th=claimed.nu_th, sampler_epsilon=used.eps)
    return out
