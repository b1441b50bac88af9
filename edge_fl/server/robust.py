"""Robust aggregation against poisoned updates: norm bound, sample-count cap, trimmed mean/median.

A device may send any finite update that decodes: one selected device per round sending its delta
scaled x100 takes digits from 0.93 to 0.10 accuracy under plain FedAvg, even with its sample count
capped at the declared one (tools/bench_poisoning.py). What this module adds on the aggregator
(``robust`` config section; post-processing of released updates, so no privacy cost):

- an L2 **norm bound** on every dense delta: a number, or ``auto``: ``norm_multiplier`` x the median
  norm of the last ``norm_window`` folded updates (after clipping, across rounds), fixed when a
  round (async: a window) opens. An update above it is clipped to it (``on_excess: clip``) or
  refused (``reject``: a ValueError from ``add``, which the core counts as a rejection). Updates
  are folded as they arrive; the only ones ever held are those of a round that opened while the
  reference had fewer than ``norm_min_updates`` norms (with ``auto``: the job's first round):
  when that round closes they are bounded by the median of the reference and all of them, and
  folded (one over the bound is clipped, also with ``reject``, because the core has already
  accepted it). A round's norms join the reference when it closes, in sorted order. Both make
  the result a function of the round's *set* of updates, not of their arrival order, which is
  what lets ingest workers fold disjoint shares that merge exactly (:meth:`RobustStrategy.merge`);
- an absolute cap ``max_samples`` on the sample count an update is weighted by (the aggregator core
  also caps the count at the one the device declared in its retained status); and with ``auto``
  a relative one: ``norm_multiplier`` x the median sample count of the same folded updates, fixed
  like the norm bound. A count is a claim: a device that declares n = 10^7 in its status *and*
  its update would otherwise carry the whole weighted mean (its clipped delta alone: digits
  0.93 -> 0.14, tools/bench_poisoning.py ``liar-default``);
- opt-in coordinate-wise **trimmed mean** or **median** instead of the sample-weighted mean, for
  untrusted fleets. They keep the round's deltas in memory (rows x n_params float32) and ignore
  sample counts (they are claims); the staleness weight still scales each delta.

What a mechanism allows is its :meth:`~edge_fl.mechanisms.base.Mechanism.robust_support`; the job
(``edge_fl.job``) resolves the config against it and hands the aggregator core a
:class:`RobustAggregation`, which is the mechanism with every strategy wrapped. The norm reference is
server-side state of the running job (not checkpointed: after a restart it is learned again).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_fl.protocol import DenseUpdate, PayloadRejected, Reject, Update

if TYPE_CHECKING:
    from edge_fl.config import RobustConfig
    from edge_fl.mechanisms.base import Mechanism, Strategy


class NormBoundExceeded(PayloadRejected):
    """An update refused by the norm bound (``on_excess: reject``): counted by the core as
    ``norm_exceeded``, and nothing changes."""

    def __init__(self, detail: str) -> None:
        super().__init__(Reject.NORM_EXCEEDED, detail)


@dataclass(frozen=True)
class RobustSettings:
    """The robust options in effect for one job, after resolving the config against the mechanism.

    ``norm_bound``: None (off), a positive number, or ``"auto"``."""

    norm_bound: float | str | None = None
    on_excess: str = "clip"
    norm_multiplier: float = 3.0
    norm_window: int = 100
    norm_min_updates: int = 5
    aggregator: str = "mean"
    trim: float = 0.1
    max_samples: int | None = None
    skipped: tuple[str, ...] = ()  # defaults the mechanism does not allow, and why

    @property
    def active(self) -> bool:
        return (
            self.norm_bound is not None or self.max_samples is not None or self.aggregator != "mean"
        )

    def describe(self) -> dict[str, Any]:
        """For run.json: what the aggregator does to updates before it folds them."""
        out: dict[str, Any] = {
            "norm_bound": self.norm_bound,
            "aggregator": self.aggregator,
            "max_samples": self.max_samples,
            "declared_sample_cap": True,  # the core's, always on
        }
        if self.norm_bound is not None:
            out["on_excess"] = self.on_excess
        if self.norm_bound == "auto":
            out["auto"] = {
                "multiplier": self.norm_multiplier,
                "window": self.norm_window,
                "min_updates": self.norm_min_updates,
            }
        if self.aggregator == "trimmed_mean":
            out["trim"] = self.trim
        if self.skipped:
            out["not_applied"] = list(self.skipped)
        return out


def resolve(cfg: RobustConfig, mechanism: Mechanism) -> RobustSettings:
    """The options in effect: defaults the mechanism cannot take are dropped (and said so in
    ``skipped``); an explicit setting it cannot take is a ValueError naming the key."""
    support = mechanism.robust_support()
    name = mechanism.name
    skipped: list[str] = []
    bound: float | str | None = None if cfg.norm_bound in (None, "off") else cfg.norm_bound
    if bound is not None and "norm_bound" not in support:
        if bound != "auto":
            raise ValueError(
                f"robust.norm_bound = {bound!r}: mechanism {name!r} takes no server-side norm "
                "bound (" + _why(mechanism) + "); use 'off' or 'auto'"
            )
        skipped.append(f"norm_bound: {name} ({_why(mechanism)})")
        bound = None
    if cfg.aggregator != "mean" and "aggregator" not in support:
        raise ValueError(
            f"robust.aggregator = {cfg.aggregator!r}: mechanism {name!r} needs its own server "
            "strategy (" + _why(mechanism) + "); use 'mean'"
        )
    max_samples = cfg.max_samples
    if max_samples is not None and "sample_cap" not in support:
        raise ValueError(
            f"robust.max_samples = {max_samples}: mechanism {name!r} does not weigh updates by "
            "their sample count"
        )
    return RobustSettings(
        norm_bound=bound,
        on_excess=cfg.on_excess,
        norm_multiplier=cfg.norm_multiplier,
        norm_window=cfg.norm_window,
        norm_min_updates=cfg.norm_min_updates,
        aggregator=cfg.aggregator,
        trim=cfg.trim,
        max_samples=max_samples,
        skipped=tuple(skipped),
    )


def _why(mechanism: Mechanism) -> str:
    if mechanism.acts_on_empty_round:
        return "its central noise is calibrated to its own clip bound over an unweighted sum"
    if mechanism.wire_kind != "u":
        return "its updates are votes, not dense deltas"
    return "its server strategy does more than average (e.g. downlink noise)"


def l2_norm(delta: np.ndarray) -> float:
    """L2 norm in float64 (a float32 sum of squares overflows at |x| ~ 1e19); inf is refused."""
    x = delta.astype(np.float64)
    norm = math.sqrt(float(np.dot(x, x)))
    if not math.isfinite(norm):
        raise ValueError("update norm is not finite")
    return norm


class NormReference:
    """Norms of the most recently folded dense updates (after clipping), across rounds."""

    def __init__(self, window: int, multiplier: float, min_updates: int) -> None:
        self.norms: deque[float] = deque(maxlen=window)
        self.samples: deque[int] = deque(maxlen=window)  # their (capped) sample counts
        self.multiplier = multiplier
        self.min_updates = min_updates

    def __len__(self) -> int:
        return len(self.norms)

    def bound(self, pending: list[float] | tuple[float, ...] = ()) -> float | None:
        """``multiplier`` x the median of the reference (and ``pending`` norms); None while there
        are none or the median is 0 (no scale to bound by)."""
        values = [*self.norms, *pending]
        if not values:
            return None
        median = float(np.median(values))
        return self.multiplier * median if median > 0 and math.isfinite(median) else None

    def add(self, norm: float) -> None:
        self.norms.append(norm)

    def sample_cap(self, pending: list[int] | tuple[int, ...] = ()) -> int | None:
        """``multiplier`` x the median sample count of the reference (and ``pending``), at least
        1; None while there are none."""
        values = [*self.samples, *pending]
        if not values:
            return None
        return max(1, math.ceil(self.multiplier * float(np.median(values))))

    def add_samples(self, n: int) -> None:
        self.samples.append(n)


@dataclass
class CoordinateTrimmedMean:
    """Coordinate-wise trimmed mean (``trim`` of the values cut at each end) or median.

    Opt-in for untrusted fleets: holds every delta of the round (rows x n_params float32) until
    ``finish``. Unweighted by sample count (a claim); ``weight`` (staleness) scales each delta, so
    FedAsync with one update applies ``server_lr * f(s) * delta`` as FedAvg does. When trimming
    ``floor(trim * m)`` at each end would leave nothing, or with ``median``, it is the median."""

    n_params: int
    server_lr: float = 1.0
    trim: float = 0.1
    median: bool = False
    _rows: list[np.ndarray] = field(default_factory=list, init=False)

    def add(self, update: Update, weight: float) -> None:
        if not isinstance(update, DenseUpdate):
            raise TypeError(f"a trimmed mean takes dense updates, got {type(update).__name__}")
        if update.delta.shape != (self.n_params,):
            raise ValueError(f"delta has shape {update.delta.shape}, expected ({self.n_params},)")
        self._rows.append((weight * update.delta.astype(np.float64)).astype(np.float32))

    def remove(self, update: Update, weight: float) -> None:
        assert isinstance(update, DenseUpdate)
        row = (weight * update.delta.astype(np.float64)).astype(np.float32)
        for i in range(len(self._rows) - 1, -1, -1):
            if np.array_equal(self._rows[i], row):
                del self._rows[i]
                return
        raise ValueError("no such row to remove")

    def partial(self) -> dict[str, Any]:
        """Every row (a trimmed mean of partial means is another estimator): sorting per
        coordinate makes the merged result independent of the rows' order."""
        return {"r": b"".join(row.astype("<f4").tobytes() for row in self._rows)}

    def merge(self, data: dict[str, Any]) -> None:
        rows = data.get("r") if isinstance(data, dict) else None
        if set(data) != {"r"} or not isinstance(rows, bytes) or len(rows) % (4 * self.n_params):
            raise ValueError(f"a trimmed-mean partial is {{'r': rows of {self.n_params} float32}}")
        block = np.frombuffer(rows, dtype="<f4").reshape(-1, self.n_params)
        self._rows.extend(np.array(row, dtype=np.float32) for row in block)

    @property
    def count(self) -> int:
        return len(self._rows)

    @property
    def state(self) -> None:
        return None

    def aggregate(self) -> np.ndarray:
        rows = np.stack(self._rows)
        m = len(rows)
        k = math.floor(self.trim * m)
        if self.median or 2 * k >= m:
            return np.median(rows, axis=0).astype(np.float64)
        ordered = np.sort(rows, axis=0)
        return ordered[k : m - k].astype(np.float64).mean(axis=0)

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        if not self._rows:
            return params.copy(), {}
        step = self.server_lr * self.aggregate()
        return (params.astype(np.float64) + step).astype(np.float32), {
            "update_norm": float(np.linalg.norm(step))
        }


def _cap_samples(update: Update, max_samples: int | None) -> tuple[Update, bool]:
    """``update`` claiming at most ``max_samples`` samples, and whether its claim was cut."""
    if max_samples is None or update.n_samples <= max_samples:
        return update, False
    return replace(update, n_samples=max_samples), True


@dataclass
class RobustStrategy:
    """Wraps one round's strategy: caps the sample count and bounds the norm of each update, then
    folds it into ``inner`` at once (see the module docstring for the one exception)."""

    inner: Strategy
    settings: RobustSettings
    reference: NormReference | None = None  # the job's; None unless norm_bound is "auto"
    clipped: int = 0
    rejected: int = 0
    capped: int = 0
    #: the round's bound, fixed when it opens (auto: from the reference; None while there is none)
    bound: float | None = field(default=None, init=False)
    #: the round's relative cap on a sample count (auto only; None: none yet)
    sample_cap: int | None = field(default=None, init=False)
    _samples: list[int] = field(default_factory=list, init=False)  # folded: for the reference
    _held: list[tuple[DenseUpdate, float, float]] | None = field(default=None, init=False)
    _norms: list[float] = field(default_factory=list, init=False)  # folded: for the reference

    def __post_init__(self) -> None:
        s = self.settings
        if s.norm_bound is None:
            return
        if self.reference is None:
            self.bound = float(s.norm_bound)
        elif len(self.reference) >= self.reference.min_updates:
            self.bound = self.reference.bound()
            self.sample_cap = _reference_cap(self.reference)
        else:
            self._held = []  # no reference yet (the job's first updates): hold until there is one

    @property
    def holding(self) -> bool:
        """No reference when the round opened: its updates are held and bounded at its close."""
        return self._held is not None

    def add(self, update: Update, weight: float) -> None:
        s = self.settings
        update, capped = _cap_samples(update, s.max_samples)
        if s.norm_bound is None:
            self.inner.add(update, weight)
            self.capped += capped
            return
        if not isinstance(update, DenseUpdate):
            raise TypeError(f"a norm bound takes dense updates, got {type(update).__name__}")
        norm = l2_norm(update.delta)
        if self._held is not None:  # no reference when the round opened: bounded at its close
            self._held.append((update, weight, norm))
            self.capped += capped
            return
        bound = self.bound
        if bound is not None and norm > bound and s.on_excess == "reject":
            self.rejected += 1
            raise NormBoundExceeded(f"update norm {norm:.4g} exceeds the bound {bound:.4g}")
        self._fold(update, weight, norm)  # may raise (wrong type): nothing counted then
        self.capped += capped

    def _fold(self, update: DenseUpdate, weight: float, norm: float) -> None:
        cap = self.sample_cap
        if cap is not None and update.n_samples > cap:
            update = replace(update, n_samples=cap)
            self.capped += 1
        self._samples.append(update.n_samples)
        bound = self.bound
        clip = bound is not None and norm > bound
        if clip:
            scale = bound / norm  # type: ignore[operator]
            delta = (update.delta.astype(np.float64) * scale).astype(np.float32)
            update = replace(update, delta=delta)
        self.inner.add(update, weight)
        self.clipped += clip
        self._norms.append(min(norm, bound) if bound is not None else norm)

    def remove(self, update: Update, weight: float) -> None:
        """Take back an update ``add`` took (the same cap and bound decide the same way)."""
        s = self.settings
        update, capped = _cap_samples(update, s.max_samples)
        self.capped -= capped
        if s.norm_bound is None:
            self.inner.remove(update, weight)
            return
        assert isinstance(update, DenseUpdate)
        norm = l2_norm(update.delta)
        if self._held is not None:
            for i in range(len(self._held) - 1, -1, -1):
                held, w, n = self._held[i]
                if n == norm and w == weight and np.array_equal(held.delta, update.delta):
                    del self._held[i]
                    return
            raise ValueError("no such held update to remove")
        cap = self.sample_cap
        if cap is not None and update.n_samples > cap:
            update = replace(update, n_samples=cap)
            self.capped -= 1
        self._samples.remove(update.n_samples)
        bound = self.bound
        clip = bound is not None and norm > bound
        if clip:
            delta = (update.delta.astype(np.float64) * (bound / norm)).astype(np.float32)  # type: ignore[operator]
            update = replace(update, delta=delta)
        self.inner.remove(update, weight)
        self.clipped -= clip
        self._norms.remove(min(norm, bound) if bound is not None else norm)

    def _flush(self) -> None:
        """Bound the held updates by the median of the reference and themselves, and fold them
        (over the bound: clipped, also with ``reject``, since the core accepted them)."""
        assert self.reference is not None and self._held is not None
        held, self._held = self._held, None
        self.bound = self.reference.bound(tuple(n for _, _, n in held))
        self.sample_cap = _reference_cap(self.reference, tuple(u.n_samples for u, _, _ in held))
        for update, weight, norm in held:
            self._fold(update, weight, norm)

    def partial(self) -> dict[str, Any]:
        """The inner partial, held updates as they came (delta, samples, weight, norm), the
        folded norms and the counters."""
        held = [
            [u.delta.astype("<f4").tobytes(), int(u.n_samples), float(w), float(n)]
            for u, w, n in self._held or ()
        ]
        return {
            "i": self.inner.partial(),
            "h": held if self._held is not None else None,
            "n": [float(n) for n in self._norms],
            "s": [int(n) for n in self._samples],
            "k": [self.clipped, self.rejected, self.capped],
        }

    def merge(self, data: dict[str, Any]) -> None:
        if not isinstance(data, dict) or set(data) != {"i", "h", "n", "s", "k"}:
            raise ValueError("a robust partial is a map with exactly the keys i, h, n, s and k")
        if (data["h"] is None) != (self._held is None):
            raise ValueError("a robust partial must hold updates exactly when this round does")
        counters, norms = data["k"], data["n"]
        if not (isinstance(counters, list) and len(counters) == 3
                and all(type(c) is int and c >= 0 for c in counters)):  # fmt: skip
            raise ValueError("a robust partial's 'k' must be 3 counts")
        if not isinstance(norms, list) or not all(isinstance(n, float) for n in norms):
            raise ValueError("a robust partial's 'n' must be a list of floats")
        samples = data["s"]
        if not isinstance(samples, list) or not all(type(n) is int and n > 0 for n in samples):
            raise ValueError("a robust partial's 's' must be a list of positive ints")
        held = [_held_update(item, self.inner) for item in data["h"] or ()]
        self.inner.merge(data["i"])
        if self._held is not None:
            self._held.extend(held)
        self._norms.extend(norms)
        self._samples.extend(samples)
        self.clipped += counters[0]
        self.rejected += counters[1]
        self.capped += counters[2]

    @property
    def count(self) -> int:
        return self.inner.count + len(self._held or ())

    @property
    def state(self) -> Any:
        return self.inner.state

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        if self._held:
            self._flush()
        if self.reference is not None:  # in sorted order: the same for any arrival order
            for norm in sorted(self._norms):
                self.reference.add(norm)
            add_samples = getattr(self.reference, "add_samples", None)
            if add_samples is not None:  # a sharded worker's stand-in keeps no reference
                for n in sorted(self._samples):
                    add_samples(n)
        new, info = self.inner.finish(params)
        out = dict(info)
        if self.settings.norm_bound is not None:
            out["norm_bound"] = self.bound
            out["norm_clipped"] = self.clipped
            out["norm_rejected"] = self.rejected
        if self.settings.max_samples is not None or self.sample_cap is not None:
            out["max_samples_capped"] = self.capped
        if self.sample_cap is not None:
            out["sample_cap"] = self.sample_cap
        return new, out


def _reference_cap(reference: Any, pending: tuple[int, ...] = ()) -> int | None:
    """The reference's relative sample cap (a sharded worker's stand-in has none: None)."""
    cap = getattr(reference, "sample_cap", None)
    return cap(pending) if cap is not None else None


def _held_update(item: Any, inner: Strategy) -> tuple[DenseUpdate, float, float]:
    n_params = getattr(inner, "n_params", None)
    ok = isinstance(item, list) and len(item) == 4 and isinstance(item[0], bytes)
    if not ok or type(item[1]) is not int or not all(isinstance(x, float) for x in item[2:]):
        raise ValueError("a held update is [delta bytes, samples, weight, norm]")
    if n_params is not None and len(item[0]) != 4 * n_params:
        raise ValueError(f"a held delta must be {n_params} float32")
    delta = np.frombuffer(item[0], dtype="<f4").astype(np.float32)
    update = DenseUpdate(device="", round=0, base_version=0, n_samples=item[1], delta=delta)
    return update, item[2], item[3]


class RobustAggregation:
    """The job's mechanism as the aggregator core sees it: everything is the mechanism's, except
    that every strategy comes wrapped by the robust settings (one norm reference per core)."""

    def __init__(self, mechanism: Mechanism, settings: RobustSettings) -> None:
        self.mechanism = mechanism
        self.settings = settings
        self.reference = (
            NormReference(settings.norm_window, settings.norm_multiplier, settings.norm_min_updates)
            if settings.norm_bound == "auto"
            else None
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.mechanism, name)

    def new_strategy(self, state: Any, server_lr: float, rng: np.random.Generator) -> Strategy:
        s = self.settings
        inner: Strategy
        if s.aggregator == "mean":
            inner = self.mechanism.new_strategy(state, server_lr, rng)
        else:
            inner = CoordinateTrimmedMean(
                self.mechanism.facts.n_params, server_lr, s.trim, median=s.aggregator == "median"
            )
        return RobustStrategy(inner, s, self.reference)
