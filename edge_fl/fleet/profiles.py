"""Device profiles for the fleet simulator: how slow, connected and available each device is.

Everything here is pure: a profile turns work (samples, bytes) into *simulated* seconds, and an
availability model answers "is this device reachable at simulated time t, and until when?". The
asyncio fleet runtime turns those simulated seconds into real sleeps (``--time-scale``); keeping the
model free of clocks and sockets lets us test it exhaustively and reproduce a fleet from a seed.

Simulated time ``t`` is in seconds; ``t = 0`` is 00:00 UTC of day 0 and a day is 86400 s.

A fleet profile is YAML validated by pydantic (unknown keys rejected). Attribute values are
distributions, written as a bare number (fixed) or a mapping with a ``dist`` tag::

    name: example
    tiers:
      - name: mid-range
        share: 0.6                                   # fraction of the fleet; shares sum to 1
        compute_samples_per_s: {dist: lognormal, median: 80, sigma: 0.3}
        uplink_mbit_s: {dist: uniform, lo: 2, hi: 10}
        downlink_mbit_s: {dist: choice, values: [10, 50], weights: [0.3, 0.7]}
        latency_ms: 60
        availability:                                # always | on_off | diurnal
          kind: diurnal
          windows: [[22, 7]]                         # local hours, may cross midnight
          tz_offset_h: {dist: choice, values: [-8, -5, 1]}
          on_off: {mean_on_s: 3600, mean_off_s: 600} # optional interruptions inside windows
        dropout_train: 0.03
        dropout_upload: 0.02
"""

from __future__ import annotations

import bisect
import functools
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = [
    "DAY_S",
    "MBIT_S",
    "AllOf",
    "AlwaysAvailable",
    "AvailabilityModel",
    "DeviceProfile",
    "Diurnal",
    "DropoutEvent",
    "FleetProfile",
    "ProfileError",
    "RandomOnOff",
    "TierSpec",
    "UnknownProfileError",
    "available_profiles",
    "load_profile",
]

DAY_S = 86400.0
MBIT_S = 125_000.0  # bytes per second in one Mbit/s (decimal units, as network rates are quoted)


def _check_time(t: float) -> float:
    t = float(t)
    if math.isnan(t):
        raise ValueError(f"t={t!r} is not a valid simulated time (must be a real number)")
    return t


# --------------------------------------------------------------------------------------------
# Availability models
# --------------------------------------------------------------------------------------------


class AvailabilityModel(ABC):
    """When a device can be reached: a piecewise-constant on/off signal over simulated time.

    ``available_at`` is right-continuous: at a change instant the new state already holds, and
    ``next_change(t)`` is the first change strictly after ``t`` (``inf`` if none).
    """

    @abstractmethod
    def available_at(self, t: float) -> bool: ...

    @abstractmethod
    def next_change(self, t: float) -> float: ...

    @abstractmethod
    def available_fraction(self) -> float:
        """Long-run fraction of time available (for sizing over-selection; not a sample)."""

    def on_intervals(self, t0: float, t1: float) -> list[tuple[float, float]]:
        """Maximal available intervals clipped to [t0, t1); walks ``next_change``."""
        t0, t1 = _check_time(t0), _check_time(t1)
        if t1 < t0:
            raise ValueError(f"on_intervals: t1={t1!r} must be >= t0={t0!r}")
        out: list[tuple[float, float]] = []
        t = t0
        state = self.available_at(t)
        while t < t1:
            nxt = min(self.next_change(t), t1)
            if state:
                out.append((t, nxt))
            t, state = nxt, not state
        return out


@dataclass(frozen=True)
class AlwaysAvailable(AvailabilityModel):
    """A mains-powered device on a stable link (e.g. a Raspberry Pi)."""

    def available_at(self, t: float) -> bool:
        _check_time(t)
        return True

    def next_change(self, t: float) -> float:
        _check_time(t)
        return math.inf

    def available_fraction(self) -> float:
        return 1.0


class RandomOnOff(AvailabilityModel):
    """Alternating exponential on/off periods (a two-state Markov chain in continuous time).

    The initial state is drawn from the stationary distribution, and because exponential durations
    are memoryless the process is stationary from t = 0: no warm-up bias in early rounds.

    The schedule is sampled lazily, always forward and in fixed-size steps, from a generator this
    object owns, so a device's trajectory depends only on that generator, never on which times were
    asked about first. Do not share the generator with anything else.
    """

    _CHUNK = 64

    def __init__(self, mean_on_s: float, mean_off_s: float, rng: np.random.Generator) -> None:
        self._init(mean_on_s, mean_off_s)
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng must be a numpy Generator, got {type(rng).__name__}")
        self._rng: np.random.Generator | None = rng
        self._seed: tuple[int, ...] | None = None

    @classmethod
    def from_seed(cls, mean_on_s: float, mean_off_s: float, seed: Sequence[int]) -> RandomOnOff:
        """Deferred construction: the private PCG64 is built on first query.

        The fleet sampler uses this so 10,000 devices cost 10,000 small tuples until queried. The
        seed words come from the injected generator, so the schedule is still determined by it;
        on/off timing is simulation, not privacy noise, so PCG64 is adequate here.
        """
        self = cls.__new__(cls)
        self._init(mean_on_s, mean_off_s)
        self._rng = None
        self._seed = tuple(int(s) for s in seed)
        return self

    def _init(self, mean_on_s: float, mean_off_s: float) -> None:
        for name, v in (("mean_on_s", mean_on_s), ("mean_off_s", mean_off_s)):
            if not (isinstance(v, int | float | np.floating | np.integer) and 0 < v < math.inf):
                raise ValueError(f"RandomOnOff: {name}={v!r} must be in (0, inf) seconds")
        self.mean_on_s = float(mean_on_s)
        self.mean_off_s = float(mean_off_s)
        self._initial_on: bool | None = None
        self._ends = np.empty(0)  # end time of period k; period k is "on" iff initial_on ^ (k odd)

    def __repr__(self) -> str:
        return f"RandomOnOff(mean_on_s={self.mean_on_s!r}, mean_off_s={self.mean_off_s!r})"

    def _generator(self) -> np.random.Generator:
        if self._rng is None:
            assert self._seed is not None
            self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(self._seed)))
        return self._rng

    def _extend_past(self, t: float) -> None:
        rng = self._generator()
        if self._initial_on is None:
            self._initial_on = bool(rng.random() < self.available_fraction())
        while self._ends.size == 0 or self._ends[-1] <= t:
            k0 = self._ends.size
            n = max(self._CHUNK, k0)  # doubling: amortised O(1) per period
            on = (np.arange(k0, k0 + n) % 2 == 0) == self._initial_on
            means = np.where(on, self.mean_on_s, self.mean_off_s)
            durations = rng.standard_exponential(n) * means
            start = self._ends[-1] if k0 else 0.0
            self._ends = np.concatenate([self._ends, start + np.cumsum(durations)])

    def _period(self, t: float) -> int:
        t = _check_time(t)
        if t < 0:
            raise ValueError(f"RandomOnOff: t={t!r} must be >= 0 (the schedule starts at t=0)")
        if math.isinf(t):
            raise ValueError(f"RandomOnOff: t={t!r} must be finite")
        self._extend_past(t)
        return int(np.searchsorted(self._ends, t, side="right"))

    def available_at(self, t: float) -> bool:
        k = self._period(t)
        return bool(self._initial_on) == (k % 2 == 0)

    def next_change(self, t: float) -> float:
        k = self._period(t)  # first: it may extend (replace) self._ends
        return float(self._ends[k])

    def available_fraction(self) -> float:
        return self.mean_on_s / (self.mean_on_s + self.mean_off_s)


class Diurnal(AvailabilityModel):
    """Available inside daily windows of local time (e.g. charging + Wi-Fi + idle, at night).

    Windows are ``(start_hour, end_hour)`` in local time, start inclusive, end exclusive; a window
    with start > end crosses midnight. Overlapping windows merge. ``tz_offset_h`` = local - UTC.
    """

    def __init__(self, windows: Sequence[tuple[float, float]], tz_offset_h: float = 0.0) -> None:
        if len(windows) == 0:
            raise ValueError("Diurnal: windows must hold at least one (start_hour, end_hour)")
        norm: list[tuple[float, float]] = []
        for i, w in enumerate(windows):
            if len(w) != 2:
                raise ValueError(f"Diurnal: windows[{i}]={w!r} must be (start_hour, end_hour)")
            a, b = float(w[0]), float(w[1])
            for h in (a, b):
                if not 0.0 <= h <= 24.0:
                    raise ValueError(f"Diurnal: windows[{i}] hour {h!r} is outside [0, 24]")
            if a % 24.0 == b % 24.0 and (a, b) != (0.0, 24.0):
                raise ValueError(
                    f"Diurnal: windows[{i}]={w!r} is empty or ambiguous (start == end mod 24); "
                    "use (0, 24) for all day"
                )
            norm.append((a, b))
        tz = float(tz_offset_h)
        if not -24.0 < tz < 24.0:
            raise ValueError(f"Diurnal: tz_offset_h={tz_offset_h!r} must be in (-24, 24)")
        self.windows: tuple[tuple[float, float], ...] = tuple(norm)
        self.tz_offset_h = tz
        self._bounds, self._states = self._segments()
        self._changes = [
            b for i, b in enumerate(self._bounds) if self._states[i] != self._states[i - 1]
        ]

    def __repr__(self) -> str:
        return f"Diurnal(windows={list(self.windows)!r}, tz_offset_h={self.tz_offset_h!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Diurnal):
            return NotImplemented
        return (self.windows, self.tz_offset_h) == (other.windows, other.tz_offset_h)

    def __hash__(self) -> int:
        return hash((self.windows, self.tz_offset_h))

    def _in_local(self, local_s: float) -> bool:
        for a, b in self.windows:
            lo, hi = a * 3600.0, b * 3600.0
            if (lo <= local_s < hi) if lo < hi else (local_s >= lo or local_s < hi):
                return True
        return False

    def _segments(self) -> tuple[list[float], list[bool]]:
        """Cut the UTC day at every window edge; segment i = [bounds[i], bounds[i+1]) (cyclic)."""
        shift = self.tz_offset_h * 3600.0
        cuts = {0.0}
        for a, b in self.windows:
            for h in (a, b):
                cuts.add((h * 3600.0 - shift) % DAY_S)
        bounds = sorted(cuts)
        states = []
        for i, lo in enumerate(bounds):
            hi = bounds[i + 1] if i + 1 < len(bounds) else DAY_S
            mid_utc = (lo + hi) / 2.0
            states.append(self._in_local((mid_utc + shift) % DAY_S))
        return bounds, states

    def available_at(self, t: float) -> bool:
        s = _check_time(t) % DAY_S
        if math.isnan(s):
            raise ValueError(f"Diurnal: t={t!r} must be finite")
        return self._states[bisect.bisect_right(self._bounds, s) - 1]

    def next_change(self, t: float) -> float:
        t = _check_time(t)
        if math.isinf(t):
            raise ValueError(f"Diurnal: t={t!r} must be finite")
        if not self._changes:
            return math.inf
        s = t % DAY_S
        base = t - s
        i = bisect.bisect_right(self._changes, s)
        nxt = base + self._changes[i] if i < len(self._changes) else base + DAY_S + self._changes[0]
        return nxt if nxt > t else math.nextafter(t, math.inf)  # guard float rounding in t - s

    def available_fraction(self) -> float:
        total = 0.0
        for i, lo in enumerate(self._bounds):
            hi = self._bounds[i + 1] if i + 1 < len(self._bounds) else DAY_S
            total += (hi - lo) if self._states[i] else 0.0
        return total / DAY_S


class AllOf(AvailabilityModel):
    """Available only when every part is (e.g. inside the night window AND not interrupted)."""

    def __init__(self, *parts: AvailabilityModel) -> None:
        if not parts:
            raise ValueError("AllOf: needs at least one availability model")
        self.parts = parts

    def __repr__(self) -> str:
        return f"AllOf({', '.join(map(repr, self.parts))})"

    def available_at(self, t: float) -> bool:
        return all(p.available_at(t) for p in self.parts)

    def next_change(self, t: float) -> float:
        state = self.available_at(t)
        s = _check_time(t)
        while True:
            s = min(p.next_change(s) for p in self.parts)
            if math.isinf(s) or self.available_at(s) != state:
                return s

    def available_fraction(self) -> float:
        """Product of the parts' fractions: exact when the parts are independent and the random
        ones stationary, which is how the fleet sampler builds them."""
        return math.prod(p.available_fraction() for p in self.parts)


# --------------------------------------------------------------------------------------------
# One device
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DropoutEvent:
    """A device that vanishes mid-round: in which phase and how far through it (0..1)."""

    stage: Literal["train", "upload"]
    at_fraction: float


@dataclass(frozen=True)
class DeviceProfile:
    """Speed, links and reliability of one simulated device; all times are simulated seconds."""

    compute_samples_per_s: float
    uplink_bytes_per_s: float
    downlink_bytes_per_s: float
    latency_s: float
    availability: AvailabilityModel
    dropout_train: float = 0.0
    dropout_upload: float = 0.0
    tier: str = "default"

    def __post_init__(self) -> None:
        for name in ("compute_samples_per_s", "uplink_bytes_per_s", "downlink_bytes_per_s"):
            v = getattr(self, name)
            if not 0.0 < v < math.inf:
                raise ValueError(f"DeviceProfile: {name}={v!r} must be in (0, inf)")
        if not 0.0 <= self.latency_s < math.inf:
            raise ValueError(f"DeviceProfile: latency_s={self.latency_s!r} must be in [0, inf)")
        for name in ("dropout_train", "dropout_upload"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"DeviceProfile: {name}={v!r} must be a probability in [0, 1]")
        if not isinstance(self.availability, AvailabilityModel):
            raise TypeError(
                f"DeviceProfile: availability must be an AvailabilityModel, "
                f"got {type(self.availability).__name__}"
            )

    def compute_time(self, n_samples: int, epochs: float = 1) -> float:
        """Local training time: every epoch touches every sample once."""
        if n_samples < 0:
            raise ValueError(f"compute_time: n_samples={n_samples!r} must be >= 0")
        if not 0 <= epochs < math.inf:
            raise ValueError(f"compute_time: epochs={epochs!r} must be in [0, inf)")
        return n_samples * epochs / self.compute_samples_per_s

    def upload_time(self, n_bytes: int) -> float:
        """One-way latency plus serialisation at the uplink rate (no slow start, no loss)."""
        if n_bytes < 0:
            raise ValueError(f"upload_time: n_bytes={n_bytes!r} must be >= 0")
        return self.latency_s + n_bytes / self.uplink_bytes_per_s

    def download_time(self, n_bytes: int) -> float:
        if n_bytes < 0:
            raise ValueError(f"download_time: n_bytes={n_bytes!r} must be >= 0")
        return self.latency_s + n_bytes / self.downlink_bytes_per_s

    def draw_dropout(self, rng: np.random.Generator) -> DropoutEvent | None:
        """Whether this round is lost, and where; always consumes three draws so a device's
        random stream stays aligned across rounds whatever the outcome."""
        u_train, u_upload, frac = rng.random(3)
        if u_train < self.dropout_train:
            return DropoutEvent("train", float(frac))
        if u_upload < self.dropout_upload:
            return DropoutEvent("upload", float(frac))
        return None


# --------------------------------------------------------------------------------------------
# Fleet profile (YAML) and sampling
# --------------------------------------------------------------------------------------------


class ProfileError(ValueError):
    """A fleet profile that cannot be used; ``problems`` lists one line per issue."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"invalid fleet profile {source}:\n  " + "\n  ".join(problems))


class UnknownProfileError(ProfileError):
    """A profile name that is neither a packaged profile nor a YAML file's path."""

    def __init__(self, name: str) -> None:
        self.source = name
        self.problems = ["no such packaged profile, and not a path to a .yaml file"]
        ValueError.__init__(
            self,
            f"fleet profile {name!r} is neither a YAML file nor a packaged profile; packaged "
            f"profiles: {', '.join(available_profiles())}",
        )


@dataclass(frozen=True)
class _Domain:
    lo: float
    lo_closed: bool
    hi: float = math.inf
    hi_closed: bool = False

    def __contains__(self, x: float) -> bool:
        above = x >= self.lo if self.lo_closed else x > self.lo
        below = x <= self.hi if self.hi_closed else x < self.hi
        return above and below

    def __str__(self) -> str:
        def fmt(v: float) -> str:
            return "inf" if v == math.inf else f"{v:g}"

        return (
            f"{'[' if self.lo_closed else '('}{fmt(self.lo)}, "
            f"{fmt(self.hi)}{']' if self.hi_closed else ')'}"
        )


_POSITIVE = _Domain(0.0, False)
_NON_NEGATIVE = _Domain(0.0, True)
_PROBABILITY = _Domain(0.0, True, 1.0, True)
_TZ_HOURS = _Domain(-12.0, True, 14.0, True)

_Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FixedDist(_Strict):
    dist: Literal["fixed"]
    value: _Finite

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value)

    def bounds(self) -> list[tuple[str, float]]:
        return [("value", self.value)]


class UniformDist(_Strict):
    dist: Literal["uniform"]
    lo: _Finite
    hi: _Finite

    @model_validator(mode="after")
    def _ordered(self) -> UniformDist:
        if self.lo > self.hi:
            raise ValueError(f"uniform needs lo <= hi, got lo={self.lo!r} > hi={self.hi!r}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.uniform(self.lo, self.hi, n)

    def bounds(self) -> list[tuple[str, float]]:
        return [("lo", self.lo), ("hi", self.hi)]


class LogNormalDist(_Strict):
    """median * exp(sigma * N(0, 1)), optionally clipped to [lo, hi] to cut implausible tails."""

    dist: Literal["lognormal"]
    median: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    sigma: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    lo: _Finite | None = None
    hi: _Finite | None = None

    @model_validator(mode="after")
    def _ordered(self) -> LogNormalDist:
        if self.lo is not None and self.hi is not None and self.lo > self.hi:
            raise ValueError(f"lognormal needs lo <= hi, got lo={self.lo!r} > hi={self.hi!r}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = self.median * np.exp(self.sigma * rng.standard_normal(n))
        if self.lo is not None or self.hi is not None:
            x = np.clip(x, self.lo, self.hi)
        return x

    def bounds(self) -> list[tuple[str, float]]:
        out = [("median", self.median)]
        out += [("lo", self.lo)] if self.lo is not None else []
        out += [("hi", self.hi)] if self.hi is not None else [("upper tail", math.inf)]
        return out


class ChoiceDist(_Strict):
    dist: Literal["choice"]
    values: Annotated[list[_Finite], Field(min_length=1)]
    weights: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = None

    @model_validator(mode="after")
    def _weights(self) -> ChoiceDist:
        if self.weights is not None:
            if len(self.weights) != len(self.values):
                raise ValueError(
                    f"choice has {len(self.values)} values but {len(self.weights)} weights"
                )
            if sum(self.weights) <= 0:
                raise ValueError(f"choice weights {self.weights!r} must have a positive sum")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        p = None
        if self.weights is not None:
            w = np.asarray(self.weights, dtype=float)
            p = w / w.sum()
        return rng.choice(np.asarray(self.values, dtype=float), size=n, p=p)

    def bounds(self) -> list[tuple[str, float]]:
        return [(f"values[{i}]", v) for i, v in enumerate(self.values)]


def _number_is_fixed(v: Any) -> Any:
    if isinstance(v, int | float) and not isinstance(v, bool):
        return {"dist": "fixed", "value": v}
    return v


Dist = Annotated[
    FixedDist | UniformDist | LogNormalDist | ChoiceDist,
    Field(discriminator="dist"),
    BeforeValidator(_number_is_fixed),
]


def _check_domain(dist: Any, field: str, domain: _Domain) -> Any:
    for label, v in dist.bounds():
        if label == "upper tail":
            if domain.hi < math.inf:
                raise ValueError(
                    f"lognormal is unbounded above but the domain of {field} is {domain}; "
                    f"set hi <= {domain.hi:g}"
                )
            continue
        if v not in domain:
            raise ValueError(f"{dist.dist} {label}={v!r} is outside the domain {domain}")
    return dist


class OnOffParams(_Strict):
    mean_on_s: Dist
    mean_off_s: Dist

    @field_validator("mean_on_s", "mean_off_s")
    @classmethod
    def _domain(cls, v: Any, info: ValidationInfo) -> Any:
        return _check_domain(v, str(info.field_name), _POSITIVE)

    def mean_fraction(self) -> float:
        """Fleet average of on/(on+off); a fixed-seed estimate when the means are random (it is a
        description of the profile, not part of any simulated trajectory)."""
        if isinstance(self.mean_on_s, FixedDist) and isinstance(self.mean_off_s, FixedDist):
            on, off = self.mean_on_s.value, self.mean_off_s.value
            return on / (on + off)
        rng = np.random.Generator(np.random.PCG64(20240601))
        on_s, off_s = self.mean_on_s.sample(rng, 1 << 14), self.mean_off_s.sample(rng, 1 << 14)
        return float(np.mean(on_s / (on_s + off_s)))

    def build(self, rng: np.random.Generator, n: int) -> list[RandomOnOff]:
        on = self.mean_on_s.sample(rng, n)
        off = self.mean_off_s.sample(rng, n)
        seeds = rng.integers(0, 2**63, size=(n, 2), dtype=np.int64)
        return [
            RandomOnOff.from_seed(float(a), float(b), (int(s0), int(s1)))
            for a, b, (s0, s1) in zip(on, off, seeds.tolist(), strict=True)
        ]


class AlwaysSpec(_Strict):
    kind: Literal["always"]

    def build(self, rng: np.random.Generator, n: int) -> list[AvailabilityModel]:
        one = AlwaysAvailable()
        return [one] * n

    def available_fraction(self) -> float:
        return 1.0


class OnOffSpec(OnOffParams):
    kind: Literal["on_off"]

    def available_fraction(self) -> float:
        return self.mean_fraction()


class DiurnalSpec(_Strict):
    kind: Literal["diurnal"]
    windows: Annotated[list[tuple[_Finite, _Finite]], Field(min_length=1)]
    tz_offset_h: Dist = FixedDist(dist="fixed", value=0.0)
    on_off: OnOffParams | None = None

    @field_validator("windows")
    @classmethod
    def _windows(cls, v: list[tuple[float, float]]) -> list[tuple[float, float]]:
        Diurnal(v)  # one place owns the window rules and their messages
        return v

    @field_validator("tz_offset_h")
    @classmethod
    def _tz(cls, v: Any) -> Any:
        return _check_domain(v, "tz_offset_h", _TZ_HOURS)

    def build(self, rng: np.random.Generator, n: int) -> list[AvailabilityModel]:
        tz = self.tz_offset_h.sample(rng, n)
        cache: dict[float, Diurnal] = {}  # diurnal models are stateless: share equal ones
        days = []
        for z in tz.tolist():
            if z not in cache:
                cache[z] = Diurnal(self.windows, z)
            days.append(cache[z])
        if self.on_off is None:
            return list(days)
        return [AllOf(d, r) for d, r in zip(days, self.on_off.build(rng, n), strict=True)]

    def available_fraction(self) -> float:
        frac = Diurnal(self.windows).available_fraction()
        if self.on_off is not None:
            frac *= self.on_off.mean_fraction()
        return frac


def _string_is_kind(v: Any) -> Any:
    return {"kind": v} if isinstance(v, str) else v


AvailabilitySpec = Annotated[
    AlwaysSpec | OnOffSpec | DiurnalSpec,
    Field(discriminator="kind"),
    BeforeValidator(_string_is_kind),
]


class TierSpec(_Strict):
    """One device class and its share of the fleet; each attribute is a distribution."""

    name: Annotated[str, Field(min_length=1)]
    share: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
    compute_samples_per_s: Dist
    uplink_mbit_s: Dist
    downlink_mbit_s: Dist
    latency_ms: Dist
    availability: AvailabilitySpec = AlwaysSpec(kind="always")
    dropout_train: Dist = FixedDist(dist="fixed", value=0.0)
    dropout_upload: Dist = FixedDist(dist="fixed", value=0.0)

    @field_validator("compute_samples_per_s", "uplink_mbit_s", "downlink_mbit_s")
    @classmethod
    def _positive(cls, v: Any, info: ValidationInfo) -> Any:
        return _check_domain(v, str(info.field_name), _POSITIVE)

    @field_validator("latency_ms")
    @classmethod
    def _non_negative(cls, v: Any, info: ValidationInfo) -> Any:
        return _check_domain(v, str(info.field_name), _NON_NEGATIVE)

    @field_validator("dropout_train", "dropout_upload")
    @classmethod
    def _probability(cls, v: Any, info: ValidationInfo) -> Any:
        return _check_domain(v, str(info.field_name), _PROBABILITY)

    def sample(self, rng: np.random.Generator, n: int) -> list[DeviceProfile]:
        """n devices of this tier; draws in a fixed attribute order so results follow the rng."""
        compute = self.compute_samples_per_s.sample(rng, n)
        up = self.uplink_mbit_s.sample(rng, n) * MBIT_S
        down = self.downlink_mbit_s.sample(rng, n) * MBIT_S
        latency = self.latency_ms.sample(rng, n) / 1000.0
        d_train = self.dropout_train.sample(rng, n)
        d_upload = self.dropout_upload.sample(rng, n)
        avail = self.availability.build(rng, n)
        cols = zip(
            compute.tolist(),
            up.tolist(),
            down.tolist(),
            latency.tolist(),
            avail,
            d_train.tolist(),
            d_upload.tolist(),
            strict=True,
        )
        return [
            DeviceProfile(c, u, d, lat, av, dt, du, tier=self.name)
            for c, u, d, lat, av, dt, du in cols
        ]


_SHARE_TOL = 1e-6


class FleetProfile(_Strict):
    """A population of devices as tiers with shares; ``sample`` draws a concrete fleet."""

    name: str = "custom"
    description: str = ""
    tiers: Annotated[list[TierSpec], Field(min_length=1)]

    @model_validator(mode="after")
    def _tiers(self) -> FleetProfile:
        names = [t.name for t in self.tiers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tiers: names must be unique, repeated: {dup}")
        total = math.fsum(t.share for t in self.tiers)
        if abs(total - 1.0) > _SHARE_TOL:
            parts = ", ".join(f"{t.name}={t.share:g}" for t in self.tiers)
            raise ValueError(
                f"tiers[*].share: shares sum to {total:.9g} ({parts}); "
                f"they must sum to 1 within {_SHARE_TOL:g}"
            )
        return self

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, data: Any, source: str = "<mapping>") -> FleetProfile:
        if not isinstance(data, dict):
            raise ProfileError(source, [f"top level must be a mapping, got {type(data).__name__}"])
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ProfileError(source, _describe(e)) from None

    @classmethod
    def from_yaml_text(cls, text: str, source: str = "<string>") -> FleetProfile:
        import yaml  # only here: a fleet without a profile does not pay for it

        try:
            data = yaml.load(text, Loader=_unique_key_loader())  # a SafeLoader subclass
        except yaml.YAMLError as e:
            raise ProfileError(source, [f"not valid YAML: {e}"]) from None
        return cls.from_mapping(data, source)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> FleetProfile:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ProfileError(str(p), [f"cannot read: {e}"]) from None
        return cls.from_yaml_text(text, str(p))

    # -- sampling -------------------------------------------------------------------------

    def sample(
        self, n_devices: int, rng: np.random.Generator, *, exact_shares: bool = False
    ) -> list[DeviceProfile]:
        """Draw ``n_devices`` profiles: i.i.d. tier per device (or exact largest-remainder
        counts in shuffled order with ``exact_shares``), then attributes vectorised per tier."""
        if isinstance(n_devices, bool) or not isinstance(n_devices, int | np.integer):
            raise TypeError(f"sample: n_devices must be an int, got {type(n_devices).__name__}")
        if n_devices < 0:
            raise ValueError(f"sample: n_devices={n_devices!r} must be >= 0")
        shares = np.array([t.share for t in self.tiers], dtype=float)
        shares /= shares.sum()
        if exact_shares:
            counts = _largest_remainder(shares, int(n_devices))
            tier_of = rng.permutation(np.repeat(np.arange(len(self.tiers)), counts))
        else:
            tier_of = rng.choice(len(self.tiers), size=int(n_devices), p=shares)
        out: list[DeviceProfile | None] = [None] * int(n_devices)
        for j, tier in enumerate(self.tiers):
            idx = np.flatnonzero(tier_of == j)
            for i, dev in zip(idx.tolist(), tier.sample(rng, idx.size), strict=True):
                out[i] = dev
        devices = [dev for dev in out if dev is not None]
        assert len(devices) == len(out)  # tier_of gives every device exactly one tier
        return devices

    def expected_available_fraction(self) -> float:
        """Share-weighted long-run availability (what over-selection has to compensate)."""
        return math.fsum(t.share * t.availability.available_fraction() for t in self.tiers)


def _largest_remainder(shares: np.ndarray, n: int) -> np.ndarray:
    raw = shares * n
    counts = np.floor(raw).astype(int)
    short = n - int(counts.sum())
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[:short]] += 1
    return counts


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def _describe(err: ValidationError) -> list[str]:
    """Turn pydantic errors into one line each: where, what, the offending value."""
    lines = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{_loc(loc[:-1])}: unknown key {loc[-1]!r}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error":
            lines.append(f"{_loc(loc)}: {msg}" if loc else msg)
        else:
            got = repr(e.get("input"))
            got = got if len(got) <= 80 else got[:77] + "..."
            lines.append(f"{_loc(loc)}: {msg} (got {got})")
    return lines


@functools.cache
def _unique_key_loader() -> type[Any]:
    """A SafeLoader that rejects repeated keys, which plain YAML silently resolves to the last
    (built on first use, so that importing this module does not import yaml)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


# --------------------------------------------------------------------------------------------
# Packaged profiles
# --------------------------------------------------------------------------------------------


def _packaged_dir() -> Path:
    # next to this module: importlib.resources trips over editable installs' path hooks
    return Path(__file__).resolve().parent / "profiles"


def available_profiles() -> list[str]:
    """Names of the profiles shipped with the package (``edge_fl/fleet/profiles/*.yaml``)."""
    d = _packaged_dir()
    return sorted(p.name[: -len(".yaml")] for p in d.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str | os.PathLike[str]) -> FleetProfile:
    """A packaged profile by name (``phone-fleet``) or any YAML file by path."""
    s = os.fspath(name_or_path)
    looks_like_path = (
        isinstance(name_or_path, os.PathLike)
        or s.endswith((".yaml", ".yml"))
        or os.sep in s
        or "/" in s
    )
    if looks_like_path:
        return FleetProfile.from_yaml(s)
    entry = _packaged_dir().joinpath(f"{s}.yaml")
    if not entry.is_file():
        raise UnknownProfileError(s)
    return FleetProfile.from_yaml_text(entry.read_text(encoding="utf-8"), f"{s} (packaged)")
