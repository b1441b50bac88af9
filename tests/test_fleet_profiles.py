"""Fleet device profiles: YAML validation, sampling, availability models, time formulas."""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pytest

from edge_fl.fleet.profiles import (
    DAY_S,
    MBIT_S,
    AllOf,
    AlwaysAvailable,
    DeviceProfile,
    Diurnal,
    FleetProfile,
    ProfileError,
    RandomOnOff,
    available_profiles,
    load_profile,
)
from edge_fl.privacy.rng import seeded_generator

H = 3600.0

TIER = """
  - name: {name}
    share: {share}
    compute_samples_per_s: 10
    uplink_mbit_s: {uplink}
    downlink_mbit_s: 5
    latency_ms: 10
{extra}"""


def profile_yaml(*tiers: dict[str, str]) -> str:
    body = "".join(
        TIER.format(
            name=t.get("name", "a"),
            share=t.get("share", "1.0"),
            uplink=t.get("uplink", "1"),
            extra=t.get("extra", ""),
        )
        for t in tiers
    )
    return "name: test\ntiers:" + body


def problems_of(text: str) -> str:
    with pytest.raises(ProfileError) as info:
        FleetProfile.from_yaml_text(text, "test.yaml")
    assert isinstance(info.value, ValueError)
    return str(info.value)


# ---------------------------------------------------------------- YAML validation


def test_valid_minimal_profile_loads():
    p = FleetProfile.from_yaml_text(profile_yaml({}), "ok.yaml")
    assert [t.name for t in p.tiers] == ["a"]
    assert p.tiers[0].availability.kind == "always"


def test_unknown_key_is_rejected_and_named():
    msg = problems_of(profile_yaml({"extra": "    bandwith_mbit_s: 3\n"}))
    assert "test.yaml" in msg
    assert "tiers[0]: unknown key 'bandwith_mbit_s'" in msg


def test_unknown_top_level_and_nested_keys():
    msg = problems_of(profile_yaml({}) + "\nversion: 2\n")
    assert "<root>: unknown key 'version'" in msg
    nested = "    availability: {kind: on_off, mean_on_s: 5, mean_off_s: 5, jitter: 1}\n"
    msg = problems_of(profile_yaml({"extra": nested}))
    assert "tiers[0].availability.on_off: unknown key 'jitter'" in msg


def test_shares_must_sum_to_one():
    msg = problems_of(profile_yaml({"name": "a", "share": "0.5"}, {"name": "b", "share": "0.4"}))
    assert "shares sum to 0.9" in msg
    assert "a=0.5" in msg and "b=0.4" in msg
    assert "within 1e-06" in msg


def test_shares_within_tolerance_are_accepted():
    text = profile_yaml({"name": "a", "share": "0.3333333"}, {"name": "b", "share": "0.6666668"})
    assert len(FleetProfile.from_yaml_text(text).tiers) == 2


def test_negative_bandwidth_names_key_value_and_domain():
    msg = problems_of(profile_yaml({"uplink": "-2"}))
    assert "tiers[0].uplink_mbit_s: fixed value=-2.0 is outside the domain (0, inf)" in msg
    msg = problems_of(profile_yaml({"uplink": "{dist: uniform, lo: -1, hi: 3}"}))
    assert "tiers[0].uplink_mbit_s: uniform lo=-1.0 is outside the domain (0, inf)" in msg
    msg = problems_of(profile_yaml({"uplink": "{dist: choice, values: [4, 0]}"}))
    assert "choice values[1]=0.0 is outside the domain (0, inf)" in msg
    msg = problems_of(profile_yaml({"uplink": "{dist: uniform, lo: 5, hi: 1}"}))
    assert "tiers[0].uplink_mbit_s.uniform: uniform needs lo <= hi, got lo=5.0 > hi=1.0" in msg


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("    dropout_train: 1.5\n", "tiers[0].dropout_train: fixed value=1.5 is outside"),
        (
            "    dropout_upload: {dist: lognormal, median: 0.02, sigma: 1}\n",
            "lognormal is unbounded above but the domain of dropout_upload is [0, 1]",
        ),
        (
            "    availability: {kind: diurnal, windows: [[5, 5]]}\n",
            "windows[0]=(5.0, 5.0) is empty or ambiguous",
        ),
        (
            "    availability: {kind: diurnal, windows: [[22, 25]]}\n",
            "hour 25.0 is outside [0, 24]",
        ),
        (
            "    availability: {kind: diurnal, windows: [[22, 6]], tz_offset_h: 15}\n",
            "tz_offset_h: fixed value=15.0 is outside the domain [-12, 14]",
        ),
        ("    availability: sometimes\n", "'sometimes'"),
    ],
)
def test_domain_errors(extra, expected):
    assert expected in problems_of(profile_yaml({"extra": extra}))


def test_duplicate_yaml_key_is_an_error_not_last_wins():
    msg = problems_of(profile_yaml({"extra": "    latency_ms: 3\n"}))
    assert "duplicate key 'latency_ms'" in msg


def test_unknown_distribution_tag_lists_allowed_tags():
    msg = problems_of(profile_yaml({"uplink": "{dist: gamma, k: 2}"}))
    assert "'gamma'" in msg and "'lognormal'" in msg and "'choice'" in msg


def test_duplicate_tier_names_rejected():
    msg = problems_of(profile_yaml({"name": "x", "share": "0.5"}, {"name": "x", "share": "0.5"}))
    assert "names must be unique" in msg and "'x'" in msg


def test_non_mapping_and_bad_yaml():
    assert "top level must be a mapping" in problems_of("- 1\n- 2\n")
    assert "not valid YAML" in problems_of("tiers: [\n")


# ---------------------------------------------------------------- sampling


THREE_TIERS = """
name: three
tiers:
  - name: slow
    share: 0.5
    compute_samples_per_s: {dist: lognormal, median: 20, sigma: 0.5}
    uplink_mbit_s: {dist: uniform, lo: 1, hi: 3}
    downlink_mbit_s: {dist: choice, values: [10, 100], weights: [3, 1]}
    latency_ms: 100
    availability: {kind: on_off, mean_on_s: 600, mean_off_s: 1800}
  - name: medium
    share: 0.3
    compute_samples_per_s: 60
    uplink_mbit_s: 5
    downlink_mbit_s: 20
    latency_ms: 50
    availability: {kind: diurnal, windows: [[22, 6]], tz_offset_h: {dist: uniform, lo: -3, hi: 3}}
  - name: fast
    share: 0.2
    compute_samples_per_s: 200
    uplink_mbit_s: 20
    downlink_mbit_s: 50
    latency_ms: 20
"""


def _fingerprint(devs: list[DeviceProfile]) -> list[tuple]:
    return [
        (
            d.tier,
            d.compute_samples_per_s,
            d.uplink_bytes_per_s,
            d.downlink_bytes_per_s,
            d.latency_s,
            d.dropout_train,
            d.dropout_upload,
            tuple(d.availability.on_intervals(0.0, 2 * DAY_S)),
        )
        for d in devs
    ]


def test_tier_counts_match_shares_within_sampling_error():
    p = FleetProfile.from_yaml_text(THREE_TIERS)
    n = 20_000
    counts = Counter(d.tier for d in p.sample(n, seeded_generator(7)))
    for tier in p.tiers:
        sd = math.sqrt(n * tier.share * (1 - tier.share))
        assert abs(counts[tier.name] - n * tier.share) < 4.5 * sd, (tier.name, counts)


def test_exact_shares_apportions_exactly_and_shuffles():
    p = FleetProfile.from_yaml_text(THREE_TIERS)
    devs = p.sample(1001, seeded_generator(1), exact_shares=True)
    counts = Counter(d.tier for d in devs)
    assert counts == {"slow": 501, "medium": 300, "fast": 200}  # 500.5 gets the remainder
    assert [d.tier for d in devs[:50]] != ["slow"] * 50


def test_sampling_is_deterministic_given_the_seed():
    p = FleetProfile.from_yaml_text(THREE_TIERS)
    a = _fingerprint(p.sample(300, seeded_generator(42)))
    b = _fingerprint(p.sample(300, seeded_generator(42)))
    c = _fingerprint(p.sample(300, seeded_generator(43)))
    assert a == b
    assert a != c


def test_sampled_attribute_distributions():
    p = FleetProfile.from_yaml_text(THREE_TIERS)
    devs = [d for d in p.sample(20_000, seeded_generator(3)) if d.tier == "slow"]
    n = len(devs)
    compute = np.array([d.compute_samples_per_s for d in devs])
    # sample median of a lognormal: log-space sd ~ sqrt(pi/2) * sigma / sqrt(n)
    tol = 4 * math.sqrt(math.pi / 2) * 0.5 / math.sqrt(n)
    assert abs(math.log(np.median(compute)) - math.log(20)) < tol
    assert abs(np.std(np.log(compute)) - 0.5) < 4 * 0.5 / math.sqrt(2 * n)
    up = np.array([d.uplink_bytes_per_s for d in devs]) / MBIT_S
    assert up.min() >= 1 and up.max() <= 3
    assert abs(up.mean() - 2) < 4 * (2 / math.sqrt(12)) / math.sqrt(n)
    down_fast = np.mean([d.downlink_bytes_per_s == 100 * MBIT_S for d in devs])
    assert abs(down_fast - 0.25) < 4 * math.sqrt(0.25 * 0.75 / n)
    assert all(d.latency_s == pytest.approx(0.1) for d in devs)
    assert all(isinstance(d.availability, RandomOnOff) for d in devs)


def test_sample_rejects_bad_sizes():
    p = FleetProfile.from_yaml_text(THREE_TIERS)
    assert p.sample(0, seeded_generator(0)) == []
    with pytest.raises(ValueError, match="n_devices=-1 must be >= 0"):
        p.sample(-1, seeded_generator(0))


def test_device_trajectory_independent_of_query_order_across_devices():
    p = FleetProfile.from_yaml_text(THREE_TIERS)
    a = [d for d in p.sample(200, seeded_generator(5)) if d.tier == "slow"]
    b = [d for d in p.sample(200, seeded_generator(5)) if d.tier == "slow"]
    ts = np.linspace(0, 3 * DAY_S, 97)
    res_a = [[d.availability.available_at(t) for t in ts] for d in a]
    res_b = [None] * len(b)
    for i in reversed(range(len(b))):  # other devices first, far future first
        res_b[i] = [b[i].availability.available_at(t) for t in ts[::-1]][::-1]
    assert res_a == res_b


# ---------------------------------------------------------------- availability models


def test_always_available():
    m = AlwaysAvailable()
    assert m.available_at(0) and m.available_at(1e9)
    assert m.next_change(5.0) == math.inf
    assert m.on_intervals(0, 10) == [(0.0, 10.0)]


def test_random_on_off_long_run_fraction():
    a, b = 60.0, 180.0
    m = RandomOnOff(a, b, seeded_generator(11))
    horizon = 2.4e6  # ~10,000 on/off cycles
    on = sum(hi - lo for lo, hi in m.on_intervals(0.0, horizon))
    p = a / (a + b)
    cycles = horizon / (a + b)
    # delta method for a ratio of renewal sums: var = ((1-p)^2 a^2 + p^2 b^2) / (a+b)^2 / N
    sd = math.sqrt(((1 - p) ** 2 * a**2 + p**2 * b**2) / (a + b) ** 2 / cycles)
    assert abs(on / horizon - p) < 4 * sd
    assert m.available_fraction() == pytest.approx(p)


def test_random_on_off_starts_stationary():
    a, b = 300.0, 900.0
    p = a / (a + b)
    n = 4000
    rng = seeded_generator(12)
    models = [
        RandomOnOff.from_seed(a, b, rng.integers(0, 2**63, size=2).tolist()) for _ in range(n)
    ]
    sd = math.sqrt(p * (1 - p) / n)
    for t in (0.0, 50.0, 5000.0):
        frac = np.mean([m.available_at(t) for m in models])
        assert abs(frac - p) < 4.5 * sd, (t, frac)
    # the first period is a full exponential residual (memoryless), not a shortened one
    first = np.array([m.next_change(0.0) for m in models])
    on0 = np.array([m.available_at(0.0) for m in models])
    assert abs(first[on0].mean() - a) < 4.5 * a / math.sqrt(on0.sum())
    assert abs(first[~on0].mean() - b) < 4.5 * b / math.sqrt((~on0).sum())


def test_random_on_off_trajectory_independent_of_query_order():
    ts = seeded_generator(0).uniform(0, 1e5, 400)
    m1 = RandomOnOff(100.0, 50.0, seeded_generator(9))
    m2 = RandomOnOff(100.0, 50.0, seeded_generator(9))
    r1 = [(m1.available_at(t), m1.next_change(t)) for t in sorted(ts)]
    m2.available_at(2e5)  # jump far ahead first
    r2 = dict((t, (m2.available_at(t), m2.next_change(t))) for t in ts[::-1])
    assert r1 == [r2[t] for t in sorted(ts)]
    m3 = RandomOnOff.from_seed(100.0, 50.0, (9,))
    m4 = RandomOnOff(100.0, 50.0, np.random.Generator(np.random.PCG64(np.random.SeedSequence(9))))
    assert m3.on_intervals(0, 1e4) == m4.on_intervals(0, 1e4)


def test_random_on_off_rejects_bad_input():
    with pytest.raises(ValueError, match=r"mean_on_s=0 must be in \(0, inf\)"):
        RandomOnOff(0, 5, seeded_generator(0))
    m = RandomOnOff(5, 5, seeded_generator(0))
    with pytest.raises(ValueError, match=r"t=-1\.0 must be >= 0"):
        m.available_at(-1)
    with pytest.raises(ValueError, match="not a valid simulated time"):
        m.next_change(float("nan"))


def _assert_next_change_consistent(model, ts):
    for t in ts:
        state = model.available_at(t)
        c = model.next_change(t)
        assert c > t
        if math.isinf(c):
            continue
        for frac in (1e-6, 0.25, 0.5, 0.999):
            assert model.available_at(t + frac * (c - t)) == state, (t, c, frac)
        assert model.available_at(c) != state, (t, c)


@pytest.mark.parametrize(
    "make",
    [
        lambda: RandomOnOff(120.0, 40.0, seeded_generator(21)),
        lambda: Diurnal([(22, 6), (12, 13)], tz_offset_h=-5.5),
        lambda: AllOf(Diurnal([(20, 8)], 2), RandomOnOff(900.0, 300.0, seeded_generator(22))),
    ],
    ids=["on_off", "diurnal", "all_of"],
)
def test_next_change_consistent_with_available_at(make):
    model = make()
    ts = np.concatenate([seeded_generator(1).uniform(0, 3 * DAY_S, 300), [0.0]])
    _assert_next_change_consistent(model, ts)
    # consecutive changes alternate the state and land exactly on interval edges
    edges = [x for iv in model.on_intervals(0.0, DAY_S) for x in iv]
    for e in edges[1:-1]:
        assert model.available_at(e) != model.available_at(math.nextafter(e, -math.inf))


def test_diurnal_window_crossing_midnight():
    d = Diurnal([(22, 6)])
    assert d.available_at(23 * H) and d.available_at(3 * H) and d.available_at(DAY_S + 1 * H)
    assert not d.available_at(12 * H)
    assert d.available_at(22 * H)  # start inclusive
    assert not d.available_at(6 * H)  # end exclusive
    assert d.next_change(12 * H) == 22 * H
    assert d.next_change(22 * H) == DAY_S + 6 * H
    assert d.next_change(23 * H) == DAY_S + 6 * H
    assert d.available_at(-1 * H)  # 23:00 the day before
    assert d.available_fraction() == pytest.approx(8 / 24)


def test_diurnal_tz_offsets():
    # local 22:00-06:00 at UTC+2 is 20:00-04:00 UTC
    d = Diurnal([(22, 6)], tz_offset_h=2)
    assert d.available_at(21 * H) and d.available_at(3.5 * H)
    assert not d.available_at(5 * H) and not d.available_at(19.5 * H)
    assert d.next_change(12 * H) == 20 * H
    # a window that does not cross midnight locally but does in UTC: 01-05 at UTC+3 = 22-02 UTC
    e = Diurnal([(1, 5)], tz_offset_h=3)
    assert e.available_at(23 * H) and e.available_at(1.5 * H) and not e.available_at(3 * H)
    assert e.next_change(23 * H) == DAY_S + 2 * H
    # fractional offsets: 01-05 at UTC-5.5 = 06:30-10:30 UTC
    f = Diurnal([(1, 5)], tz_offset_h=-5.5)
    assert not f.available_at(6.4 * H) and f.available_at(6.5 * H) and not f.available_at(10.5 * H)
    assert f.next_change(0.0) == 6.5 * H
    assert f.available_fraction() == pytest.approx(4 / 24)


def test_diurnal_overlapping_windows_merge_and_full_day():
    d = Diurnal([(8, 12), (11, 14), (20, 2)])
    assert d.next_change(9 * H) == 14 * H
    assert d.next_change(14 * H) == 20 * H
    assert d.next_change(21 * H) == DAY_S + 2 * H
    assert d.available_fraction() == pytest.approx(12 / 24)
    full = Diurnal([(0, 24)], tz_offset_h=3)
    assert full.available_at(12345.0) and full.next_change(0.0) == math.inf
    adjacent = Diurnal([(22, 24), (0, 6)])
    assert adjacent.next_change(23 * H) == DAY_S + 6 * H  # midnight is not a change


def test_all_of_intersection():
    both = AllOf(Diurnal([(0, 12)]), Diurnal([(6, 18)]))
    assert not both.available_at(3 * H) and both.available_at(7 * H)
    assert both.next_change(0.0) == 6 * H
    assert both.next_change(7 * H) == 12 * H
    assert both.next_change(13 * H) == DAY_S + 6 * H


# ---------------------------------------------------------------- one device


def _device(**kw) -> DeviceProfile:
    base = dict(
        compute_samples_per_s=100.0,
        uplink_bytes_per_s=125_000.0,
        downlink_bytes_per_s=1_250_000.0,
        latency_s=0.05,
        availability=AlwaysAvailable(),
    )
    return DeviceProfile(**(base | kw))


def test_time_formulas():
    d = _device()
    assert d.compute_time(50, 1) == pytest.approx(0.5)
    assert d.compute_time(50, 3) == pytest.approx(1.5)
    assert d.compute_time(0, 5) == 0.0
    assert d.upload_time(1_000_000) == pytest.approx(0.05 + 8.0)
    assert d.download_time(1_000_000) == pytest.approx(0.05 + 0.8)
    assert d.upload_time(0) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="n_samples=-1 must be >= 0"):
        d.compute_time(-1, 1)
    with pytest.raises(ValueError, match="n_bytes=-5 must be >= 0"):
        d.upload_time(-5)


def test_device_profile_validation():
    with pytest.raises(ValueError, match=r"uplink_bytes_per_s=-1.0 must be in \(0, inf\)"):
        _device(uplink_bytes_per_s=-1.0)
    with pytest.raises(ValueError, match=r"dropout_train=1.2 must be a probability"):
        _device(dropout_train=1.2)
    with pytest.raises(ValueError, match="latency_s=nan"):
        _device(latency_s=float("nan"))


def test_draw_dropout_rates_and_stream_alignment():
    d = _device(dropout_train=0.2, dropout_upload=0.5)
    rng = seeded_generator(4)
    n = 20_000
    draws = [d.draw_dropout(rng) for _ in range(n)]
    stages = Counter(e.stage if e else None for e in draws)
    for stage, p in (("train", 0.2), ("upload", 0.8 * 0.5), (None, 0.8 * 0.5)):
        assert abs(stages[stage] / n - p) < 4.5 * math.sqrt(p * (1 - p) / n), stages
    assert all(0 <= e.at_fraction < 1 for e in draws if e)
    r1, r2 = seeded_generator(8), seeded_generator(8)
    _device().draw_dropout(r1)
    r2.random(3)
    assert r1.random() == r2.random()


# ---------------------------------------------------------------- packaged profiles


def test_packaged_profile_names():
    assert {"homogeneous", "phone-fleet", "raspberry-pi"} <= set(available_profiles())
    with pytest.raises(ValueError, match=r"packaged profiles: .*phone-fleet"):
        load_profile("no-such-profile")


@pytest.mark.parametrize("name", ["homogeneous", "phone-fleet", "raspberry-pi"])
def test_packaged_profiles_sample_10k(name):
    p = load_profile(name)
    assert p.name == name
    t0 = time.perf_counter()
    devs = p.sample(10_000, seeded_generator(2024))
    assert time.perf_counter() - t0 < 5.0
    assert len(devs) == 10_000 and all(isinstance(d, DeviceProfile) for d in devs)
    assert {d.tier for d in devs} == {t.name for t in p.tiers}
    assert all(d.availability.available_at(1234.5) in (True, False) for d in devs[:500])


def test_homogeneous_is_identical_and_reliable():
    devs = load_profile("homogeneous").sample(1000, seeded_generator(0))
    assert len({_fingerprint([d])[0][:-1] for d in devs}) == 1
    assert all(d.dropout_train == 0 and d.dropout_upload == 0 for d in devs)
    assert all(d.availability.next_change(0.0) == math.inf for d in devs)


def test_phone_fleet_heterogeneity():
    p = load_profile("phone-fleet")
    devs = p.sample(10_000, seeded_generator(5))
    by = {t.name: [d for d in devs if d.tier == t.name] for t in p.tiers}
    med = {k: np.median([d.compute_samples_per_s for d in v]) for k, v in by.items()}
    assert 6 < med["high-end"] / med["low-end"] < 15  # ~10x compute spread
    for v in by.values():
        assert np.median([d.uplink_bytes_per_s for d in v]) < 0.5 * np.median(
            [d.downlink_bytes_per_s for d in v]
        )
        lat = np.array([d.latency_s for d in v])
        assert lat.min() >= 0.01 and lat.max() <= 0.8 and 0.03 < np.median(lat) < 0.2
        drop = 1 - (1 - v[0].dropout_train) * (1 - v[0].dropout_upload)
        assert 0.03 < drop < 0.10


def test_phone_fleet_availability_is_diurnal_and_matches_expectation():
    p = load_profile("phone-fleet")
    devs = p.sample(600, seeded_generator(6), exact_shares=True)
    horizon = 2 * DAY_S
    fracs = np.array(
        [sum(b - a for a, b in d.availability.on_intervals(0.0, horizon)) / horizon for d in devs]
    )
    expected = p.expected_available_fraction()
    assert abs(fracs.mean() - expected) < 4 * fracs.std() / math.sqrt(len(devs))
    night_utc = np.mean([d.availability.available_at(9 * H) for d in devs])  # ~1-4 am local
    noon_utc = np.mean([d.availability.available_at(20 * H) for d in devs])  # ~noon local
    assert night_utc > 0.6 and noon_utc < 0.05


def test_raspberry_pi_always_on():
    devs = load_profile("raspberry-pi").sample(500, seeded_generator(1))
    assert all(isinstance(d.availability, AlwaysAvailable) for d in devs)
    assert all(d.uplink_bytes_per_s >= 5 * MBIT_S for d in devs)


def test_load_profile_from_path(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text(profile_yaml({"uplink": "7"}))
    p = load_profile(f)
    assert p.tiers[0].sample(seeded_generator(0), 1)[0].uplink_bytes_per_s == 7 * MBIT_S
    assert load_profile(str(f)).name == "test"
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.yaml")
