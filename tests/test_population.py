"""A population of modelled devices in arrays, lazily drawn data, and only the online devices as
MQTT sessions (edge_fl.fleet.population, edge_fl.data.lazy_synthetic)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from scipy.stats import ks_2samp

from edge_fl.config import ConfigError, load_config
from edge_fl.data.lazy_synthetic import LazyFederatedDataset, LazySynthetic
from edge_fl.data.synthetic import make_synthetic
from edge_fl.fleet.population import LazyDataAgent, Population, population_of
from edge_fl.fleet.profiles import FleetProfile, load_profile
from edge_fl.job import build_job

# ------------------------------------------------------------------ the population's profiles


@pytest.mark.parametrize("name", ["phone-fleet", "raspberry-pi", "homogeneous"])
def test_population_draws_the_profiles_fleet_profile_sample_draws(name: str) -> None:
    profile = load_profile(name)
    reference = profile.sample(400, np.random.default_rng(11))
    population = Population.sample(profile, 400, np.random.default_rng(11))
    times = [0.0, 3 * 3600.0, 7.5 * 3600, 14 * 3600.0, 86400 * 1.7]
    for i, ref in enumerate(reference):
        got = population.device_profile(i)
        assert got.tier == ref.tier
        for attr in (
            "compute_samples_per_s",
            "uplink_bytes_per_s",
            "downlink_bytes_per_s",
            "latency_s",
            "dropout_train",
            "dropout_upload",
        ):
            assert getattr(got, attr) == pytest.approx(getattr(ref, attr), rel=1e-6), (i, attr)
        assert [got.availability.available_at(t) for t in times] == [
            ref.availability.available_at(t) for t in times
        ], i


def test_population_is_compact() -> None:
    population = Population.sample(load_profile("phone-fleet"), 20_000, np.random.default_rng(0))
    assert population.nbytes / len(population) <= 56  # a DeviceProfile object alone is ~10x this


def test_choose_online_is_exactly_the_available_devices_when_not_capped() -> None:
    """At 15:00 UTC some zones' night windows are shut and opportunistic phones are mostly off:
    with no cap the chosen set is the brute-force set of devices whose own model says available."""
    population = Population.sample(load_profile("phone-fleet"), 600, np.random.default_rng(3))
    t = 15 * 3600.0 + 86400.0
    truth = [i for i in range(600) if population.device_profile(i).availability.available_at(t)]
    assert 0 < len(truth) < 600
    got = population.choose_online(t, 600, np.random.default_rng(1))
    assert got.tolist() == truth


def test_choose_online_caps_with_a_seeded_uniform_sample() -> None:
    population = Population.sample(load_profile("phone-fleet"), 5_000, np.random.default_rng(3))
    t = 4 * 3600.0
    a = population.choose_online(t, 300, np.random.default_rng(9))
    b = population.choose_online(t, 300, np.random.default_rng(9))
    c = population.choose_online(t, 300, np.random.default_rng(10))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
    assert len(a) == 300 and len(set(a.tolist())) == 300
    assert all(population.device_profile(i).availability.available_at(t) for i in a.tolist())
    assert a.min() < 500 and a.max() > 4_500  # spread over the population, not its head


def test_window_test_for_continuous_time_zones_agrees_with_the_model() -> None:
    profile = FleetProfile.from_mapping(
        {
            "tiers": [
                {
                    "name": "t",
                    "share": 1.0,
                    "compute_samples_per_s": 10,
                    "uplink_mbit_s": 1,
                    "downlink_mbit_s": 1,
                    "latency_ms": 10,
                    "availability": {
                        "kind": "diurnal",
                        "windows": [[22, 6]],
                        "tz_offset_h": {"dist": "uniform", "lo": -11, "hi": 13},
                    },
                }
            ]
        }
    )
    population = Population.sample(profile, 5_000, np.random.default_rng(0))  # > 4096 zones
    for t in (1000.0, 40_000.0, 70_000.0):
        fast = population._window_open(t)
        slow = [population.device_profile(i).availability.available_at(t) for i in range(5_000)]
        assert (fast == np.array(slow)).mean() > 0.999  # float32 zones: a boundary may differ
        assert 0.1 < fast.mean() < 0.6


# ------------------------------------------------------------------ lazy synthetic data


def test_lazy_device_data_is_a_pure_function_of_seed_and_index() -> None:
    gen = LazySynthetic(seed=4)
    X1, y1 = gen.device(17, 30)
    gen.device(3, 50)  # drawing another device first changes nothing
    X2, y2 = gen.device(17, 30)
    assert np.array_equal(X1, X2) and np.array_equal(y1, y2)
    assert not np.array_equal(X1, gen.device(18, 30)[0])
    assert not np.array_equal(X1, LazySynthetic(seed=5).device(17, 30)[0])
    Xtr, ytr, _, yte = gen.split(17, 30)
    assert len(ytr) == 24 and len(yte) == 6 and np.array_equal(Xtr, X1[:24])


def _per_device_stats(parts: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    return {
        "size": np.array([len(y) for _, y in parts]),
        "mean_x0": np.array([X[:, 0].mean() for X, _ in parts]),
        "mean_x59": np.array([X[:, -1].mean() for X, _ in parts]),
        "std_x0": np.array([X[:, 0].std() for X, _ in parts]),
        "majority": np.array([np.bincount(y, minlength=10).max() / len(y) for _, y in parts]),
    }


def _lazy_parts(gen: LazySynthetic, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    sizes = gen.sizes(k)
    return [gen.device(i, int(sizes[i])) for i in range(k)]


def test_lazy_per_device_statistics_match_make_synthetic() -> None:
    """Two-sample KS tests over 800 devices, per device statistic; and a control with another
    beta that the same tests reject (so they can fail)."""
    k = 800
    ref = make_synthetic(k, np.random.default_rng(0), standardize=False, test_fraction=0.2)
    ref_parts = [ref.device_data(i) for i in range(k)]  # training shares, as lazy.split's
    lazy = LazySynthetic(seed=1, standardize=False)
    lazy_parts = []
    for i, n in enumerate(lazy.sizes(k).tolist()):
        X, y, _, _ = lazy.split(i, n)
        lazy_parts.append((X, y))
    a, b = _per_device_stats(ref_parts), _per_device_stats(lazy_parts)
    for name in a:
        assert ks_2samp(a[name], b[name]).pvalue > 1e-3, name
    other = LazySynthetic(seed=1, beta=3.0, standardize=False)
    c = _per_device_stats([other.split(i, 40)[:2] for i in range(k)])
    assert ks_2samp(a["mean_x0"], c["mean_x0"]).pvalue < 1e-6


def test_lazy_standardisation_gives_unit_moments_over_the_population() -> None:
    parts = _lazy_parts(LazySynthetic(seed=2), 400)
    X = np.concatenate([p[0] for p in parts])
    assert np.abs(X.mean(axis=0)).max() < 0.2
    std = X.std(axis=0)  # devices of ~50 rows: between-device spread dominates per feature
    assert abs(std.mean() - 1) < 0.05 and np.abs(std - 1).max() < 0.3


def test_lazy_dataset_draws_only_the_test_sample_and_the_asked_devices() -> None:
    ds = LazyFederatedDataset(LazySynthetic(seed=3), 100_000, test_devices=50)
    assert ds.train_sizes.dtype == np.int32 and len(ds.train_sizes) == 100_000
    assert len(ds.test_sample) == 50 and len(ds.y_test) == len(ds.X_test) > 50
    assert ds.generated == 50  # the test sample
    X, y = ds.device_data(99_999)
    assert ds.generated == 51 and len(y) == ds.train_sizes[99_999] and X.shape[1] == 60


# ------------------------------------------------------------------ the job


def _population_cfg(devices: int, online: int, per_round: int, **extra: object):
    return load_config(
        None,
        {
            "job": f"pop{devices}-{online}",
            "data.dataset": "synthetic",
            "data.devices": devices,
            "population.online": online,
            "population.test_devices": 100,
            "model.name": "logreg",
            "fleet.profile": "phone-fleet",
            "fleet.start_hour": 8,
            "rounds.clients_per_round": per_round,
            "rounds.deadline_s": 30,
            "rounds.wait_for_devices_s": 30,
            "training.epochs": 1,
            **extra,
        },
    )


def test_build_job_for_a_population_materialises_no_population_data() -> None:
    t0 = time.perf_counter()
    job = build_job(_population_cfg(300_000, 2_000, 100, **{"rounds.rounds": 3}))
    assert time.perf_counter() - t0 < 5
    assert isinstance(job.dataset, LazyFederatedDataset)
    assert job.dataset.generated == 100  # the pooled test set's devices only
    facts = job.facts
    assert len(facts.dataset_sizes) == 300_000 and isinstance(facts.dataset_sizes, np.ndarray)
    assert facts.n_devices == 2_000 == job.expected_devices  # rounds select among the online
    assert job.metadata()["dataset"]["train"] == int(job.dataset.train_sizes.sum())


def test_population_config_is_refused_where_it_cannot_hold() -> None:
    with pytest.raises(ConfigError, match="synthetic"):
        build_job(_population_cfg(1_000, 50, 10, **{"data.dataset": "digits"}))
    with pytest.raises(ConfigError, match="only 50"):
        build_job(_population_cfg(1_000, 50, 60))
    with pytest.raises(ConfigError, match="exceeds the population"):
        build_job(_population_cfg(1_000, 2_000, 10))


# ------------------------------------------------------------------ over MQTT


def test_a_population_runs_with_only_its_online_devices_as_sessions(mosquitto) -> None:
    """1,000 modelled devices, 50 online in two fleet shards, 10 per round over a real broker:
    the aggregator only ever hears of the 50, and only selected devices draw their data."""
    from edge_fl.fleet.population import online_devices
    from edge_fl.server.service import AggregatorService
    from edge_fl.transport.url import parse_broker_url

    # wall clock: this aggregator is built here without virtual time (and two fleet shards)
    extra = {"rounds.rounds": 2, "job": "pop-e2e", "fleet.dropout": 0.0, "fleet.clock": "wall"}
    cfg = _population_cfg(1_000, 50, 10, **extra)
    job = build_job(cfg)
    spec = parse_broker_url(mosquitto.url)
    online = {f"d{i:05d}" for i in online_devices(job, population_of(job)).tolist()}
    records: list[dict] = []

    async def run() -> tuple[object, list]:
        core = job.aggregator_core()
        service = AggregatorService(
            core,
            spec,
            job.topics,
            wait_for_devices_s=30,
            expected_devices=job.expected_devices,
            on_record=records.append,
        )
        agg = asyncio.create_task(service.run())
        await service.connected.wait()
        fleets = [job.fleet_runtime(spec, range(i, 1_000, 2), prefix=f"pop-s{i}") for i in (0, 1)]
        tasks = [asyncio.create_task(f.run()) for f in fleets]
        await asyncio.wait_for(agg, 60)
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        return core, fleets

    core, fleets = asyncio.run(run())
    assert [r["status"] for r in records] == ["closed", "closed"]
    assert all(r["received"] == 10 for r in records)
    assert set(core.devices) == online  # no state for the 950 that never connected
    agents = {d: a for f in fleets for d, a in f.agents.items()}
    assert set(agents) == online and all(isinstance(a, LazyDataAgent) for a in agents.values())
    trained = {d for d, a in agents.items() if a.materialised}
    assert 10 <= len(trained) <= 20  # the selected devices, no one else
    assert trained == {d for d, a in agents.items() if a.state.updates_sent}
