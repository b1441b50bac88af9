"""A population of modelled devices in compact arrays; only the online ones become agents.

Phone fleets in production are populations of millions of which thousands are online. A
:class:`Population` holds every device's profile as numpy columns (about 53 bytes a device:
1,000,000 devices in ~53 MB) drawn from a fleet profile's distributions in exactly the order
:meth:`FleetProfile.sample` draws them, so device i's profile here is the one ``sample`` would give
it (tested), without building a million :class:`DeviceProfile` objects. :meth:`profile` builds one
device's object on demand, :meth:`choose_online` picks which devices hold MQTT sessions at a
simulated time, and :func:`population_fleet` builds :class:`DeviceAgent` s for those only (their
data drawn lazily from the seed, see :mod:`edge_fl.data.lazy_synthetic`) and runs them with the
fleet runtime.

Which devices are online: every device whose availability model says it is available at ``t``
is eligible; at most ``limit`` of them, a uniform sample, hold sessions. That is the admission a
production FL server applies to check-ins (pace steering, Bonawitz et al., MLSys 2019): with the
phone-fleet profile at night most of a million phones are eligible, and no one admits them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_fl.device.agent import DeviceAgent
from edge_fl.fleet.profiles import (
    DAY_S,
    MBIT_S,
    AllOf,
    AlwaysAvailable,
    AlwaysSpec,
    AvailabilityModel,
    DeviceProfile,
    Diurnal,
    DiurnalSpec,
    FleetProfile,
    OnOffParams,
    RandomOnOff,
)

if TYPE_CHECKING:
    from edge_fl.fleet.runtime import Fleet
    from edge_fl.job import Job

__all__ = ["LazyDataAgent", "Population", "population_agents", "population_fleet"]

_F = np.float32


@dataclass
class Population:
    """Every device's profile as columns (index = device index); see the module docstring."""

    profile: FleetProfile
    tier: np.ndarray  # uint8: index into profile.tiers
    compute: np.ndarray  # samples/s
    uplink: np.ndarray  # bytes/s
    downlink: np.ndarray  # bytes/s
    latency: np.ndarray  # s
    dropout_train: np.ndarray
    dropout_upload: np.ndarray
    tz: np.ndarray  # hours, NaN where the tier is not diurnal
    mean_on: np.ndarray  # s, NaN where the tier has no on/off interruptions
    mean_off: np.ndarray
    seeds: np.ndarray  # int64 (n, 2): the RandomOnOff seed words (0 where unused)

    @classmethod
    def sample(cls, profile: FleetProfile, n: int, rng: np.random.Generator) -> Population:
        """Draw ``n`` devices with the same generator calls, in the same order, as
        ``profile.sample(n, rng)``: the same rng state gives the same fleet."""
        if n < 1 or len(profile.tiers) > 255:
            raise ValueError(f"n={n!r} must be >= 1 (and a profile has at most 255 tiers)")
        shares = np.array([t.share for t in profile.tiers], dtype=float)
        shares /= shares.sum()
        tier_of = rng.choice(len(profile.tiers), size=int(n), p=shares)
        cols = {k: np.full(n, np.nan, _F) for k in ("tz", "mean_on", "mean_off")}
        for k in ("compute", "uplink", "downlink", "latency", "dropout_train", "dropout_upload"):
            cols[k] = np.empty(n, _F)
        seeds = np.zeros((n, 2), np.int64)
        for j, spec in enumerate(profile.tiers):
            idx = np.flatnonzero(tier_of == j)
            m = idx.size
            cols["compute"][idx] = spec.compute_samples_per_s.sample(rng, m)
            cols["uplink"][idx] = spec.uplink_mbit_s.sample(rng, m) * MBIT_S
            cols["downlink"][idx] = spec.downlink_mbit_s.sample(rng, m) * MBIT_S
            cols["latency"][idx] = spec.latency_ms.sample(rng, m) / 1000.0
            cols["dropout_train"][idx] = spec.dropout_train.sample(rng, m)
            cols["dropout_upload"][idx] = spec.dropout_upload.sample(rng, m)
            avail = spec.availability
            on_off: OnOffParams | None = None
            if isinstance(avail, DiurnalSpec):
                cols["tz"][idx] = avail.tz_offset_h.sample(rng, m)
                on_off = avail.on_off
            elif not isinstance(avail, AlwaysSpec):
                on_off = avail  # OnOffSpec
            if on_off is not None:  # as OnOffParams.build draws them
                cols["mean_on"][idx] = on_off.mean_on_s.sample(rng, m)
                cols["mean_off"][idx] = on_off.mean_off_s.sample(rng, m)
                seeds[idx] = rng.integers(0, 2**63, size=(m, 2), dtype=np.int64)
        return cls(profile, tier_of.astype(np.uint8), **cols, seeds=seeds)

    def __len__(self) -> int:
        return int(self.tier.size)

    @property
    def nbytes(self) -> int:
        arrays = [v for v in vars(self).values() if isinstance(v, np.ndarray)]
        return sum(a.nbytes for a in arrays)

    # ------------------------------------------------------------------ one device

    def availability(self, i: int) -> AvailabilityModel:
        spec = self.profile.tiers[int(self.tier[i])].availability
        onoff = None
        if not math.isnan(self.mean_on[i]):
            s0, s1 = (int(s) for s in self.seeds[i])
            onoff = RandomOnOff.from_seed(float(self.mean_on[i]), float(self.mean_off[i]), (s0, s1))
        if isinstance(spec, DiurnalSpec):
            day = Diurnal(spec.windows, float(self.tz[i]))
            return day if onoff is None else AllOf(day, onoff)
        return onoff if onoff is not None else AlwaysAvailable()

    def device_profile(self, i: int) -> DeviceProfile:
        """Device ``i``'s :class:`DeviceProfile` (built now; the population keeps none)."""
        return DeviceProfile(
            float(self.compute[i]),
            float(self.uplink[i]),
            float(self.downlink[i]),
            float(self.latency[i]),
            self.availability(i),
            float(self.dropout_train[i]),
            float(self.dropout_upload[i]),
            tier=self.profile.tiers[int(self.tier[i])].name,
        )

    # ------------------------------------------------------------------ who is online

    def _window_open(self, t: float) -> np.ndarray:
        """Whether each device's daily window (if any) is open at ``t``; vectorised per tier."""
        out = np.ones(len(self), bool)
        for j, spec in enumerate(self.profile.tiers):
            avail = spec.availability
            if not isinstance(avail, DiurnalSpec):
                continue
            idx = np.flatnonzero(self.tier == j)
            zones, inverse = np.unique(self.tz[idx], return_inverse=True)
            if zones.size <= 4096:  # the model itself, once per distinct zone
                state = np.array([Diurnal(avail.windows, float(z)).available_at(t) for z in zones])
                out[idx] = state[inverse]
            else:  # a continuous zone distribution: the window test on local time
                local = (t % DAY_S + self.tz[idx].astype(np.float64) * 3600.0) % DAY_S
                hit = np.zeros(idx.size, bool)
                for a, b in avail.windows:
                    lo, hi = a * 3600.0, b * 3600.0
                    hit |= (local >= lo) & (local < hi) if lo < hi else (local >= lo) | (local < hi)
                out[idx] = hit
        return out

    def choose_online(self, t: float, limit: int, rng: np.random.Generator) -> np.ndarray:
        """Sorted indices of at most ``limit`` devices available at simulated time ``t``: a
        uniform sample of the eligible ones. Devices with random on/off periods are asked their
        own model (built from their seed) only as candidates come up, so the cost is about
        ``limit / P(on)`` model evaluations, not one per device of the population."""
        if limit < 1:
            raise ValueError(f"limit={limit!r}; must be >= 1")
        candidates = rng.permutation(np.flatnonzero(self._window_open(t)))
        needs_model = ~np.isnan(self.mean_on)
        chosen: list[int] = []
        for i in candidates.tolist():
            if needs_model[i]:
                s0, s1 = (int(s) for s in self.seeds[i])
                if not RandomOnOff.from_seed(
                    float(self.mean_on[i]), float(self.mean_off[i]), (s0, s1)
                ).available_at(t):
                    continue
            chosen.append(i)
            if len(chosen) == limit:
                break
        return np.array(sorted(chosen), dtype=np.int64)


# ---------------------------------------------------------------------- agents and the fleet


_NO_ROWS = np.empty((0,), dtype=np.float32)


class LazyDataAgent(DeviceAgent):
    """A device agent whose samples are drawn from the seed the first time it trains."""

    def __init__(
        self, device: str, index: int, n_samples: int, load: Callable, *args: Any, **kw: Any
    ) -> None:
        self._index, self._n, self._load = index, int(n_samples), load
        self._data: tuple[np.ndarray, np.ndarray] | None = None
        # X and y below are read from the seed on first use; their setters ignore these
        super().__init__(device, _NO_ROWS, _NO_ROWS, *args, **kw)

    def _samples(self) -> tuple[np.ndarray, np.ndarray]:
        if self._data is None:
            self._data = self._load(self._index)
        return self._data

    X = property(lambda self: self._samples()[0], lambda self, _v: None)
    y = property(lambda self: self._samples()[1], lambda self, _v: None)

    @property
    def n_samples(self) -> int:
        return self._n

    @property
    def materialised(self) -> bool:
        """Whether this device has drawn its data (it has been asked to train)."""
        return self._data is not None


def population_agents(job: Job, indices: np.ndarray) -> list[DeviceAgent]:
    """Agents for the devices ``indices`` (the online ones), built like :meth:`Job.agent`, each
    drawing its data lazily: a device that is never asked to train never draws it."""
    from edge_fl.data.lazy_synthetic import LazyFederatedDataset
    from edge_fl.device.agent import DeviceBudget
    from edge_fl.identity import STREAM_DEVICE, device_id
    from edge_fl.models.training import LocalTraining

    dataset = job.dataset
    if not isinstance(dataset, LazyFederatedDataset):
        raise TypeError(f"a population draws its data lazily, not from {type(dataset).__name__}")
    t, p = job.cfg.training, job.cfg.privacy
    enforce = job.private and p.budget_epsilon is not None
    agents: list[DeviceAgent] = []
    for index in indices.tolist():
        rng, _ = job.rng(STREAM_DEVICE, index)
        agents.append(
            LazyDataAgent(
                device_id(index),
                index,
                int(dataset.train_sizes[index]),
                dataset.device_data,
                job.model,
                LocalTraining(t.epochs, t.batch_size, t.lr),
                rng,
                mechanism=job.mechanism,
                budget=DeviceBudget(job.mechanism, p.budget_epsilon, p.delta) if enforce else None,
                codec=job.cfg.compression.build(),
            )
        )
    return agents


def population_of(job: Job) -> Population:
    """The job's population (profiles from ``fleet.profile``, the job's profile stream)."""
    from edge_fl.fleet.profiles import load_profile
    from edge_fl.identity import STREAM_PROFILE

    rng = np.random.default_rng([job.cfg.seed, STREAM_PROFILE])
    return Population.sample(load_profile(job.cfg.fleet.profile), job.cfg.data.devices, rng)


#: the generator stream that picks which eligible devices hold sessions
STREAM_ONLINE = 6


def online_devices(job: Job, population: Population) -> np.ndarray:
    """The devices holding sessions in this run: the same in every shard process (seeded)."""
    wanted = job.cfg.population.online
    if wanted is None:
        raise ValueError("population.online is not set: there is no population model")
    rng = np.random.default_rng([job.cfg.seed, STREAM_ONLINE])
    online = population.choose_online(job.clock.start_s, wanted, rng)
    if online.size < wanted:
        raise ValueError(
            f"population.online = {wanted} but only {online.size} of the "
            f"{len(population)} devices are available at hour {job.cfg.fleet.start_hour:g}"
        )
    return online


def population_fleet(
    job: Job,
    spec: Any,
    indices: range | None = None,
    *,
    prefix: str | None = None,
    trust: Any = None,
    population: Population | None = None,
) -> Fleet:
    """The fleet runtime for the online devices among ``indices`` (all of them by default):
    agents and profiles exist for those only."""
    from edge_fl.fleet.runtime import Fleet

    population = population or population_of(job)
    online = online_devices(job, population)
    if indices is not None:
        keep = (online >= indices.start) & (online < indices.stop)
        keep &= (online - indices.start) % indices.step == 0
        online = online[keep]
    agents = population_agents(job, online)
    pairs = zip(agents, online.tolist(), strict=True)
    profiles = {a.device_id: population.device_profile(i) for a, i in pairs}
    return Fleet(
        agents,
        spec,
        job.topics,
        connect_concurrency=job.cfg.broker.connect_concurrency,
        keepalive_s=job.cfg.broker.keepalive_s,
        client_prefix=prefix,
        profiles=profiles,
        clock=job.clock,
        dropout=job.cfg.fleet.dropout,
        train_workers=job.cfg.fleet.train_workers,
        machine_samples_per_s=job.cfg.fleet.machine_samples_per_s,
        digest=job.cfg.digest(),
        trust=trust or job.trust(),
    )
