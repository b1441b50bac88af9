"""MagRR: the SignDS step-size estimator (``docs/specs/signds.md`` section 4), as a pure state machine.

SignDS uploads carry no magnitudes, so the aggregator learns a step from one randomized-response bit
per client: "is the mean of my signed top-k values below the current estimate?". In a fast phase the
estimate grows x5 until enough rounds say "yes"; then it shrinks /1.5 on every majority "yes".

Where the MindSpore docs and code differ, this module follows the code (spec section 9):

| topic | doc | code (used here) |
|---|---|---|
| step / global lr | 2 r_est num_clients | 3 N r_est, N = configured uploads per round |
| shrink-phase bit threshold | r_est | r_est / 2 |
| shrink factor | halve | / 1.5 |
| fast-phase growth | "a certain multiple" | x 5 |
| initial r_est | "e^-5" | 1e-5 |
| phase switch | when B = 1 | on the 11th fast-phase round with B = 1 (cumulative counter) |
| RR epsilon | not specified | fixed 5.0 on both sides |

Deliberate differences from the reference code: r_est is kept as a double (the reference stores it
in Redis via ``std::to_string(float)``, six decimals, so repeated shrinking eventually stores 0);
the majority B is decided from the raw counts (c1 > c0), which equals the reference's debiased
comparison for P > 1/2 and keeps an exact tie at B = 0 without float noise; bits other than 0/1 are
rejected (the codec validates them before they reach this module).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_fl.privacy import randomized_response as _rr
from edge_fl.privacy.signds import topk_indices

__all__ = [
    "MagRRConfig",
    "MagRRRoundInfo",
    "MagRRState",
    "accept_r_est",
    "magrr_bit",
    "magrr_bit_from_r",
    "magrr_step",
    "randomized_response",
    "rr_estimate",
    "rr_keep_probability",
    "topk_abs_mean",
]

log = logging.getLogger(__name__)


def _is_real(x: Any) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _domain_error(key: str, value: Any, domain: str) -> ValueError:
    return ValueError(f"magrr.{key} = {value!r} is out of domain {domain}")


@dataclass(frozen=True)
class MagRRConfig:
    """MagRR constants; defaults are the reference values (``signds.h``)."""

    r_est0: float = 1e-5  # kSignInitREst
    growth: float = 5.0  # kSignExpansionFactor
    shrink: float = 1.5  # kSignReductionFactor
    reached_threshold: int = 10  # kSignReachedThreshold (switch on the (threshold+1)-th B=1)
    rr_eps: float = 5.0  # kSignRREps
    step_ratio: float = 3.0  # kSignDSGlobalLRRatioOf{NotReached,Reached}
    fallback_ratio: float = 0.05  # kSignOldRatioUpper

    def __post_init__(self) -> None:
        checks = (
            ("r_est0", lambda v: 0 < v < 1, "(0, 1)"),  # clients only accept [0, 1)
            ("growth", lambda v: 1 < v < math.inf, "(1, inf)"),
            ("shrink", lambda v: 1 < v < math.inf, "(1, inf)"),
            ("rr_eps", lambda v: 0 < v < math.inf, "(0, inf)"),
            ("step_ratio", lambda v: 0 < v < math.inf, "(0, inf)"),
            ("fallback_ratio", lambda v: 0 <= v <= 1, "[0, 1]"),
        )
        for key, ok, domain in checks:
            v = getattr(self, key)
            if not _is_real(v) or not ok(float(v)):
                raise _domain_error(key, v, domain)
            object.__setattr__(self, key, float(v))
        if not _is_int(self.reached_threshold) or self.reached_threshold < 0:
            raise _domain_error("reached_threshold", self.reached_threshold, "integer [0, inf)")
        object.__setattr__(self, "reached_threshold", int(self.reached_threshold))


# ---------------------------------------------------------------------------------------------
# Client side


def accept_r_est(r_est: Any) -> float:
    """The client's check of the received r_est: 0 <= r_est < 1, else 1.0 with a warning."""
    if _is_real(r_est) and 0 <= float(r_est) < 1:
        return float(r_est)
    log.warning("MagRR: received r_est = %r is outside [0, 1); using 1.0", r_est)
    return 1.0


def topk_abs_mean(update: np.ndarray, sign: int, topk_indices_or_k: np.ndarray | int) -> float:
    """r = |mean of the signed top-k values|; NaN when the top-k set is empty."""
    u = np.asarray(update).reshape(-1)
    if isinstance(topk_indices_or_k, int | np.integer) and not isinstance(topk_indices_or_k, bool):
        idx = topk_indices(u, int(topk_indices_or_k), sign)
    else:
        idx = np.asarray(topk_indices_or_k)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError("topk_indices must be a 1-D integer array or the count K")
    if idx.size == 0:
        return math.nan
    return abs(float(np.mean(u[idx], dtype=np.float64)))


def magrr_bit_from_r(r: float, r_est: float, is_reached: bool | int) -> int:
    """Fast phase: 1 iff r < 2 r_est; shrink phase: 1 iff r < r_est / 2 (code, not doc)."""
    if not _is_real(r_est) or not 0 <= float(r_est) < math.inf:
        raise ValueError(f"r_est = {r_est!r} is out of domain [0, inf)")
    if is_reached not in (0, 1):  # also accepts False/True
        raise ValueError(f"is_reached = {is_reached!r} is out of domain {{0, 1}}")
    limit = float(r_est) / 2 if is_reached else 2 * float(r_est)
    return 1 if r < limit else 0  # NaN (empty top-k) gives 0, as the Java comparison does


def magrr_bit(
    update: np.ndarray,
    selection_sign: int,
    topk_indices_or_k: np.ndarray | int,
    r_est: float,
    is_reached: bool | int,
) -> int:
    """The client's true MagRR bit (before randomized response), from the signed top-k mean.

    ``topk_indices_or_k`` is the top-k index set (as used for the selection) or K (recomputed).
    ``r_est`` should already have passed ``accept_r_est``.
    """
    r = topk_abs_mean(update, selection_sign, topk_indices_or_k)
    return magrr_bit_from_r(r, r_est, is_reached)


def rr_keep_probability(eps: float) -> float:
    """P = e^eps / (1 + e^eps), computed without overflow."""
    if not _is_real(eps) or not 0 < float(eps) < math.inf:
        raise _domain_error("rr_eps", eps, "(0, inf)")
    return _rr.truth_probability(float(eps))


def randomized_response(bit: int, eps: float, rng: np.random.Generator) -> int:
    """One MagRR report: keep the bit w.p. e^eps/(1+e^eps), else flip it (eps-LDP).

    Delegates to ``edge_fl.privacy.randomized_response`` so there is one RR implementation.
    """
    if isinstance(bit, float) or bit not in (0, 1):
        raise ValueError(f"bit = {bit!r} is out of domain {{0, 1}}")
    rr_keep_probability(eps)  # validates with a magrr.* message
    return int(_rr.randomized_response(int(bit), float(eps), rng))


def rr_estimate(count_ones: int, n: int, eps: float) -> tuple[float, float]:
    """Unbiased count of true ones and its standard deviation (privacy spec section 2).

    N_T = (N_C - N + N P) / (2P - 1), Var = N P (1 - P) / (2P - 1)^2. Not clipped to [0, N].
    """
    if not _is_int(n) or n < 0:
        raise ValueError(f"n = {n!r} is out of domain integer [0, inf)")
    if not _is_int(count_ones) or not 0 <= count_ones <= n:
        raise ValueError(f"count_ones = {count_ones!r} is out of domain integer [0, n={n}]")
    rr_keep_probability(eps)
    if n == 0:
        return 0.0, 0.0
    est, std = _rr.debias_count(count_ones, n, float(eps))
    return float(est), float(std)


# ---------------------------------------------------------------------------------------------
# Server side


@dataclass(frozen=True)
class MagRRState:
    """The aggregator's MagRR state; travels in the global-model message and in checkpoints."""

    r_est: float = 1e-5
    is_reached: bool = False
    reached_count: int = 0

    def __post_init__(self) -> None:
        if not _is_real(self.r_est) or not 0 < float(self.r_est) < math.inf:
            raise _domain_error("r_est", self.r_est, "(0, inf)")
        if self.is_reached not in (0, 1) or isinstance(self.is_reached, float):
            raise _domain_error("is_reached", self.is_reached, "{0, 1}")
        if not _is_int(self.reached_count) or self.reached_count < 0:
            raise _domain_error("reached_count", self.reached_count, "integer [0, inf)")
        object.__setattr__(self, "r_est", float(self.r_est))
        object.__setattr__(self, "is_reached", bool(self.is_reached))
        object.__setattr__(self, "reached_count", int(self.reached_count))

    @classmethod
    def initial(cls, cfg: MagRRConfig | None = None) -> MagRRState:
        return cls(r_est=(cfg or MagRRConfig()).r_est0)

    def step(self, expected_n: int, cfg: MagRRConfig | None = None) -> float:
        """The server's SignDS step g = step_ratio * N * r_est (N = configured uploads)."""
        return (cfg or MagRRConfig()).step_ratio * _check_n(expected_n) * self.r_est

    def to_dict(self) -> dict[str, Any]:
        return {
            "r_est": self.r_est,
            "reached": self.is_reached,
            "reached_count": self.reached_count,
        }

    @classmethod
    def from_dict(cls, data: Any) -> MagRRState:
        """Inverse of ``to_dict``; rejects missing, extra or ill-typed fields."""
        if not isinstance(data, dict):
            raise ValueError(f"MagRR state must be a dict, got {type(data).__name__}")
        expected = {"r_est", "reached", "reached_count"}
        if set(data) != expected:
            raise ValueError(
                f"MagRR state keys {sorted(map(str, data))} do not match {sorted(expected)}"
            )
        reached = data["reached"]
        if not isinstance(reached, bool | int) or reached not in (0, 1):
            raise _domain_error("reached", reached, "{0, 1}")
        return cls(
            r_est=data["r_est"], is_reached=bool(reached), reached_count=data["reached_count"]
        )


@dataclass(frozen=True)
class MagRRRoundInfo:
    """What happened in one ``magrr_step``, for round metrics."""

    action: str  # "fallback", "grow", "count", "switch", "shrink" or "hold"
    n_bits: int
    ones: int
    zeros: int
    ones_debiased: float | None  # None on fallback
    majority: int | None  # B; None on fallback
    r_est: float  # after the step
    step: float  # step_ratio * N * r_est for the next round


def _check_n(expected_n: Any) -> int:
    if not _is_int(expected_n) or expected_n < 1:
        raise ValueError(f"expected_n = {expected_n!r} is out of domain integer [1, inf)")
    return int(expected_n)


def magrr_step(
    state: MagRRState,
    bits: Sequence[int] | np.ndarray,
    expected_n: int,
    global_lr: float,
    cfg: MagRRConfig | None = None,
) -> tuple[MagRRState, MagRRRoundInfo]:
    """End-of-round update (spec section 4, ``SignDS::SummarizeSignDS``).

    ``expected_n`` is the configured number of uploads per round (not the number received);
    ``bits`` are the randomized-response bits received this round.
    """
    cfg = cfg or MagRRConfig()
    n = _check_n(expected_n)
    if not _is_real(global_lr) or not 0 < float(global_lr) < math.inf:
        raise ValueError(f"signds.sign_global_lr = {global_lr!r} is out of domain (0, inf)")
    b = np.asarray(bits)
    if b.size and (
        b.ndim != 1
        or not (np.issubdtype(b.dtype, np.integer) or b.dtype == np.bool_)
        or not np.isin(b, (0, 1)).all()
    ):
        raise ValueError("MagRR bits must be a 1-D sequence of 0/1 integers")
    n_bits = int(b.size)
    ones = int(np.count_nonzero(b))
    zeros = n_bits - ones

    def done(new: MagRRState, action: str, debiased: float | None, maj: int | None):
        info = MagRRRoundInfo(
            action=action,
            n_bits=n_bits,
            ones=ones,
            zeros=zeros,
            ones_debiased=debiased,
            majority=maj,
            r_est=new.r_est,
            step=new.step(n, cfg),
        )
        return new, info

    # Old-client fallback: too few bits, so the step reverts to sign_global_lr; nothing else moves.
    if n_bits < cfg.fallback_ratio * n:
        new = MagRRState(
            float(global_lr) / cfg.step_ratio / n, state.is_reached, state.reached_count
        )
        return done(new, "fallback", None, None)

    p = rr_keep_probability(cfg.rr_eps)
    ones_debiased = (ones + n_bits * (p - 1)) / (2 * p - 1)
    majority = 1 if ones > zeros else 0  # == (debiased ones > debiased zeros) for P > 1/2

    if not state.is_reached:
        if majority == 0:
            new = MagRRState(state.r_est * cfg.growth, False, state.reached_count)
            return done(new, "grow", ones_debiased, majority)
        switch = state.reached_count >= cfg.reached_threshold  # the value read before incrementing
        new = MagRRState(state.r_est, switch, state.reached_count + 1)
        return done(new, "switch" if switch else "count", ones_debiased, majority)
    if majority == 1:
        new = MagRRState(state.r_est / cfg.shrink, True, state.reached_count)
        return done(new, "shrink", ones_debiased, majority)
    return done(state, "hold", ones_debiased, majority)
