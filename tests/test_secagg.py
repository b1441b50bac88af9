"""SecAgg+ core (edge_fl/secagg, docs/specs/secagg.md): exactness under dropouts at every phase,
clear failure beyond the threshold, secrecy (masked vectors, t-1 shares, the aggregator's
vectors), strict messages and the state machines' legality."""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

import edge_fl.secagg.messages as M
import edge_fl.secagg.primitives as P
from edge_fl.secagg import (
    AggregatorSession,
    CalibrationError,
    DeviceSession,
    Failed,
    RoundParams,
    Send,
    Summed,
    calibrate,
    check,
)
from edge_fl.secagg.calibration import hypergeom_tail
from edge_fl.secagg.driver import VANISH, run_round
from edge_fl.secagg.graph import Graph, permutation


def drbg(label: str) -> P.RandBytes:
    """A deterministic byte source (tests only): the ChaCha20 stream of SHA-256(label)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    stream = Cipher(algorithms.ChaCha20(hashlib.sha256(label.encode()).digest(), bytes(16)), None)
    enc = stream.encryptor()
    return lambda n: enc.update(bytes(n))


def roster(n: int) -> tuple[str, ...]:
    return tuple(f"d{i:03d}" for i in range(n))


def params(
    n: int, k: int, t: int, dim: int = 16, bits: int = 20, max_int: int = 100, **kw
) -> RoundParams:
    return RoundParams("job1", 7, bytes(range(16)), roster(n), k, t, bits, dim, max_int, **kw)


def inputs(p: RoundParams, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {d: rng.integers(-p.max_int, p.max_int + 1, p.dim) for d in p.roster}


def expected_outcome(p: RoundParams, vanish: dict[str, str]) -> tuple[bool, tuple[str, ...]]:
    """An independent oracle: does the round succeed, and who contributes?"""
    order = {ph: i for i, ph in enumerate(VANISH)}

    def reached(d: str, phase: str) -> bool:  # d sent its message of `phase`
        return d not in vanish or order[vanish[d]] > order[phase]

    g = p.graph
    u1 = {d for d in p.roster if reached(d, "advertise")}
    if len(u1) < p.min_survivors:
        return False, ()
    # a device shares only if at least t neighbours advertised keys
    u2 = {
        d
        for d in u1
        if reached(d, "share") and sum(v in u1 for v in g.neighbours(d)) >= p.threshold
    }
    if len(u2) < p.min_survivors:
        return False, ()
    u3 = {d for d in u2 if reached(d, "mask")}
    if len(u3) < p.min_survivors:
        return False, ()
    u4 = {d for d in u3 if reached(d, "unmask")}
    needed = set(u3) | {v for v in u2 - u3 if any(u in u3 for u in g.neighbours(v))}
    for v in needed:
        if sum(u in u4 for u in g.neighbours(v) if u in u2) < p.threshold:
            return False, tuple(sorted(u3))
    return True, tuple(sorted(u3))


# ---------------------------------------------------------------- primitives


def test_prime_is_the_curve25519_prime_and_prime() -> None:
    assert P.PRIME == 2**255 - 19
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):  # Miller-Rabin witnesses
        d, s = P.PRIME - 1, 0
        while d % 2 == 0:
            d, s = d // 2, s + 1
        x = pow(a, d, P.PRIME)
        assert x in (1, P.PRIME - 1) or any(pow(x, 2**r, P.PRIME) == P.PRIME - 1 for r in range(s))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(0, 12), st.randoms(use_true_random=False))
def test_shamir_any_t_shares_rebuild_the_secret(t: int, extra: int, rnd) -> None:
    secret = P.new_seed(os.urandom)
    xs = rnd.sample(range(1, 10_000), t + extra)
    shares = P.split(secret, t, xs, os.urandom)
    subset = rnd.sample(list(zip(xs, shares, strict=True)), t)
    assert P.combine(subset) == secret
    if t > 1:
        assert P.combine(subset[: t - 1]) != secret  # 2^-255 chance of a false failure


def test_shamir_refuses_bad_input() -> None:
    with pytest.raises(P.ShareError):
        P.split(P.PRIME, 2, [1, 2], os.urandom)
    with pytest.raises(P.ShareError):
        P.split(1, 3, [1, 2], os.urandom)
    with pytest.raises(P.ShareError):
        P.split(1, 2, [1, 1], os.urandom)
    with pytest.raises(P.ShareError):
        P.combine([(1, 5), (1, 6)])


def test_t_minus_1_shares_are_independent_of_the_secret() -> None:
    """Chi-square two-sample test: the low bytes of t-1 shares of secret 0 and of secret
    2^254 (and of a random secret) have one distribution (uniform); the reconstruction from t-1
    shares is uniform too. A leaky scheme (e.g. a constant polynomial) fails this at once."""
    t, xs, trials = 4, [3, 8, 11, 20], 6000
    rand = drbg("t-1")
    samples = {}
    for secret in (0, 2**254, P.new_seed(rand)):
        lows = []
        for _ in range(trials):
            shares = P.split(secret, t, xs, rand)
            lows.extend(s & 0xFF for s in shares[: t - 1])
        samples[secret] = np.bincount(lows, minlength=256)
    table = np.array(list(samples.values()))
    assert stats.chi2_contingency(table).pvalue > 1e-4
    for counts in table:
        assert stats.chisquare(counts).pvalue > 1e-4
    guesses = [P.combine(list(zip(xs[: t - 1], P.split(0, t, xs, rand)[: t - 1], strict=True))) & 0xFF
               for _ in range(3000)]  # fmt: skip
    assert stats.chisquare(np.bincount(guesses, minlength=256)).pvalue > 1e-4
    # the control: shares of a degree-0 polynomial (t = 1) reveal the secret outright
    assert P.split(2**254, 1, xs, rand)[0] == 2**254


def test_ring_packing_round_trips_and_rejects_high_bits() -> None:
    rng = np.random.default_rng(1)
    for bits in (2, 7, 8, 13, 16, 24, 31, 32, 40, 63, 64):
        signed = rng.integers(-(2 ** (bits - 1)), 2 ** (bits - 1), 100, dtype=np.int64)
        ring = P.to_ring(signed, bits)
        assert np.array_equal(P.from_ring(ring, bits), signed)
        blob = P.pack(ring, bits)
        assert len(blob) == 100 * ((bits + 7) // 8)
        back = P.unpack(blob, 100, bits)
        assert back is not None and np.array_equal(back, ring)
        if bits % 8:
            bad = bytearray(blob)
            bad[(bits + 7) // 8 - 1] |= 0x80
            assert P.unpack(bytes(bad), 100, bits) is None
    assert P.unpack(b"\x00" * 5, 2, 16) is None


def test_prg_masks_are_uniform_and_seed_bound() -> None:
    a = P.expand(b"\x01" * 32, 40_000, 12)
    assert np.array_equal(a, P.expand(b"\x01" * 32, 40_000, 12))
    assert not np.array_equal(a, P.expand(b"\x02" * 32, 40_000, 12))
    assert int(a.max()) < 2**12
    assert stats.chisquare(np.bincount(a >> np.uint64(4), minlength=256)).pvalue > 1e-4
    wide = P.expand(b"\x03" * 32, 1000, 64)
    assert int(wide.max()) > 2**62


# ---------------------------------------------------------------- graph


@pytest.mark.parametrize(("n", "k"), [(10, 4), (31, 6), (50, 8), (7, 6), (7, 10)])
def test_graph_is_k_regular_symmetric_and_deterministic(n: int, k: int) -> None:
    g = Graph(roster(n), k, b"\x05" * 32)
    degree = min(k, n - 1)
    for d in g.roster:
        near = g.neighbours(d)
        assert len(near) == degree and d not in near and list(near) == sorted(near)
        assert all(d in g.neighbours(v) for v in near)
    assert Graph(roster(n), k, b"\x05" * 32).neighbours("d000") == g.neighbours("d000")


def test_graph_refuses_odd_degree() -> None:
    with pytest.raises(ValueError, match="even"):
        Graph(roster(10), 3, b"\x00" * 32)


def test_permutation_is_uniform() -> None:
    counts: dict[tuple[int, ...], int] = {}
    for i in range(2400):
        perm = tuple(permutation(i.to_bytes(32, "little"), 4))
        counts[perm] = counts.get(perm, 0) + 1
    assert len(counts) == 24
    assert stats.chisquare(list(counts.values())).pvalue > 1e-4


# ---------------------------------------------------------------- calibration


def test_hypergeometric_tail_matches_scipy() -> None:
    for pop, marked, draws, at in [(999, 300, 34, 28), (99, 30, 24, 20), (50, 5, 10, 2)]:
        ours = float(hypergeom_tail(pop, marked, draws, at))
        assert ours == pytest.approx(stats.hypergeom(pop, marked, draws).sf(at - 1), rel=1e-9)


def test_calibrate_then_check_accept_and_bits_fit_the_sum() -> None:
    for n in (3, 10, 50, 100, 1000):
        c = calibrate(n, 1.0, 1 / 256)
        assert check(n, c.neighbours, c.threshold, c.bits, 1.0, 1 / 256) == c
        assert n * c.max_int < 2 ** (c.bits - 1) and n * c.max_int >= 2 ** (c.bits - 2)
        assert c.log2_disconnect <= -40 and c.log2_failure <= -20
    c = calibrate(1000, 1.0, 1 / 256)
    assert (c.neighbours, c.threshold, c.bits) == (34, 7, 19)  # docs/specs/secagg.md section 5


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((100, 24, 20, 16), {}, "dropouts fail a round"),
        ((100, 8, 5, 16), {}, "survivors split"),
        ((100, 24, 5, 16), {"collude": 0.1}, "colluding devices reach"),
        ((100, 24, 5, 12), {}, "needs 16 to 64 bits"),
        ((100, 23, 5, 16), {}, "must be even"),
        ((100, 24, 1, 16), {}, "threshold 1"),
        ((100, 24, 10, 16), {"against_lying": True}, "must exceed k/2"),
        ((1, 1, 1, 16), {}, "at least 2 devices"),
        ((100, 24, 5, 16), {"dropout": 1.2}, "fractions"),
    ],
)
def test_unsound_settings_are_refused_in_one_line(args, kwargs, match) -> None:
    with pytest.raises(CalibrationError, match=match) as err:
        check(*args, 1.0, 1 / 256, **kwargs)
    assert "\n" not in str(err.value)


def test_disconnection_bound_holds_against_simulation() -> None:
    """The bound C(n,2)(m)_k/(n)_k against the measured rate of split survivor graphs."""
    n, k, gone = 30, 6, 15
    c_bound = math.comb(n, 2) * math.perm(gone, k) / math.perm(n, k)
    rng = np.random.default_rng(3)
    splits, trials = 0, 4000
    for _ in range(trials):
        removed = np.zeros(n, dtype=bool)
        removed[rng.choice(n, gone, replace=False)] = True
        runs, run = 0, 0
        for pos in list(range(n)) * 2:  # circular runs of >= k/2 removed positions
            run = run + 1 if removed[pos] else 0
            runs += run == k // 2
        splits += runs // 2 >= 2
    assert splits / trials <= c_bound


# ---------------------------------------------------------------- exactness


@st.composite
def rounds(draw):
    n = draw(st.integers(3, 14))
    complete = draw(st.booleans()) or n < 5
    k = n - 1 if complete else draw(st.sampled_from([x for x in (2, 4, 6, 8) if x < n - 1]))
    t = draw(st.integers(2, max(2, k)))
    bits = draw(st.integers(8, 64))
    max_int = (2 ** (bits - 1) - 1) // n
    p = RoundParams("job1", draw(st.integers(0, 2**40)), draw(st.binary(min_size=16, max_size=16)),
                    roster(n), k, min(t, k), bits, draw(st.integers(1, 24)), max_int)  # fmt: skip
    cap = math.floor(0.3 * n)  # at most 30% of the selection vanish at each phase
    vanish: dict[str, str] = {}
    for phase in VANISH:
        left = [d for d in p.roster if d not in vanish]
        for d in draw(st.lists(st.sampled_from(left), max_size=cap, unique=True)) if left else []:
            vanish[d] = phase
    extreme = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    xs = {
        d: (
            rng.choice([-max_int, max_int], p.dim)
            if extreme
            else rng.integers(-max_int, max_int + 1, p.dim)
        )
        for d in p.roster
    }
    return p, xs, vanish


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rounds())
def test_the_sum_is_exact_or_the_round_fails_clearly(case) -> None:
    p, xs, vanish = case
    trace = run_round(p, xs, vanish)
    ok, contributors = expected_outcome(p, vanish)
    if ok:
        assert isinstance(trace.outcome, Summed), trace.outcome
        assert trace.outcome.contributors == contributors
        expected = np.sum([xs[d] for d in contributors], axis=0, dtype=np.int64)
        assert np.array_equal(trace.outcome.total, expected)
    else:
        assert isinstance(trace.outcome, Failed), "a round the oracle fails must not yield a sum"
        assert trace.outcome.reason and "\n" not in trace.outcome.reason


def test_calibrated_harary_round_survives_30_percent_spread_over_phases() -> None:
    n = 60
    c = calibrate(n, 1.0, 1 / 64)
    assert c.neighbours < n - 1  # a real SecAgg+ graph, not the complete one
    p = RoundParams(
        "job1", 3, os.urandom(16), roster(n), c.neighbours, c.threshold, c.bits, 300, c.max_int
    )
    xs = inputs(p, 5)
    gone = np.random.default_rng(9).permutation(p.roster)[:18]  # 30%
    vanish = {d: VANISH[i % 4] for i, d in enumerate(gone)}
    trace = run_round(p, xs, vanish)
    assert isinstance(trace.outcome, Summed)
    survivors = [d for d in p.roster if vanish.get(d) not in ("advertise", "share", "mask")]
    assert trace.outcome.contributors == tuple(survivors)
    assert np.array_equal(trace.outcome.total, np.sum([xs[d] for d in survivors], axis=0))


def test_beyond_the_threshold_the_round_fails_with_a_reason() -> None:
    p = params(8, 7, 5)
    vanish = {d: "unmask" for d in p.roster[:4]}  # 4 survivors answer: fewer than t = 5
    trace = run_round(p, inputs(p), vanish)
    assert isinstance(trace.outcome, Failed)
    assert trace.outcome.phase == "unmask"
    assert "need 5 shares; 4 neighbours answered" in trace.outcome.reason


def test_too_few_masked_inputs_fail_before_anyone_is_asked_for_shares() -> None:
    p = params(5, 4, 2, min_survivors=3)
    trace = run_round(p, inputs(p), {d: "mask" for d in p.roster[:3]}, record=True)
    assert isinstance(trace.outcome, Failed) and trace.outcome.phase == "masked"
    assert not any(M.decode(b, 10**6).kind == "uq" for _, _, b in trace.sent)


# ---------------------------------------------------------------- secrecy


def test_a_recorded_masked_vector_does_not_correlate_with_the_update() -> None:
    """What a subscriber to every topic holds: each ``mx`` payload. Its correlation with the
    device's true (structured, large) update is within 4.5/sqrt(d) of 0 for every device; the
    same statistic on an unmasked vector is 1."""
    n, d = 6, 20_000
    p = RoundParams("job1", 1, os.urandom(16), roster(n), n - 1, 3, 16, d, 5000)
    ramp = np.linspace(-4000, 4000, d).astype(np.int64)
    xs = {dev: np.roll(ramp, 50 * i) for i, dev in enumerate(p.roster)}
    trace = run_round(p, xs, {}, record=True)
    assert isinstance(trace.outcome, Summed)
    masked = {dev: M.decode(b, 10**7) for way, dev, b in trace.sent if way == "up"}
    for dev, msg in masked.items():
        if msg.kind != "mx":
            continue
        y = P.from_ring(P.unpack(msg.body["y"], d, 16), 16).astype(float)
        r = np.corrcoef(y, xs[dev])[0, 1]
        assert abs(r) * math.sqrt(d) < 4.5, (dev, r)
    assert np.corrcoef(xs["d000"].astype(float), xs["d000"])[0, 1] == pytest.approx(1.0)


def test_the_aggregator_never_holds_an_individual_vector() -> None:
    seen: list[tuple[str, np.ndarray]] = []
    p = params(7, 6, 3, dim=4000, bits=24, max_int=1000)
    xs = inputs(p, 2)
    vanish = {"d001": "mask", "d004": "unmask"}
    trace = run_round(p, xs, vanish, observer=lambda label, v: seen.append((label, v)))
    assert isinstance(trace.outcome, Summed)
    assert {label for label, _ in seen} == {"masked_sum", "self_mask", "pair_mask", "sum"}
    for label, vec in seen:
        signed = P.from_ring(vec, p.bits) if label != "sum" else vec
        for x in xs.values():
            assert not np.array_equal(signed, x)
            if label != "sum":
                assert abs(np.corrcoef(signed.astype(float), x)[0, 1]) * math.sqrt(p.dim) < 4.5
    # the session keeps no attribute holding a vector of the round's dimension but its sum
    agg = AggregatorSession(p)
    vectors = [k for k, v in vars(agg).items() if isinstance(v, np.ndarray)]
    assert vectors == ["_sum"]


def test_a_lying_aggregator_with_t_minus_1_key_shares_gets_no_key() -> None:
    """The aggregator asks t-1 neighbours of a survivor for its key share (as if it had dropped)
    on top of the seed shares: t-1 key shares rebuild a scalar whose public key is not the
    device's advertised mask key (and a uniformly random one, test above)."""
    p = params(6, 5, 3)
    devs = {d: DeviceSession(d, p) for d in p.roster}
    agg = AggregatorSession(p)
    mask_keys, pending = {}, []
    for d, dev in devs.items():
        payload = dev.advertise().payload
        mask_keys[d] = M.decode(payload, 10**6).body["sk"]
        pending += agg.receive(d, payload)
    for _ in range(2):  # keys -> shares -> forwarded shares
        batch, pending = pending, []
        for e in batch:
            for out in devs[e.device].receive(e.payload):
                pending += agg.receive(e.device, out.payload)
    target = "d000"
    shares = []
    for u in p.graph.neighbours(target)[: p.threshold - 1]:
        devs[u].submit(np.zeros(p.dim, dtype=np.int64))
        near = p.graph.neighbours(u)
        asks = [M.ASK_KEY if v == target else M.ASK_NOTHING for v in near]
        (reply,) = devs[u].receive(M.encode("uq", p.round, p.nonce, a=asks))
        assert isinstance(reply, Send)
        blob = M.decode(reply.payload, 10**6).body["s"][near.index(target)]
        shares.append((p.graph.point(u), P.share_value(blob)))
    assert P.public_bytes(P.combine(shares)) != mask_keys[target]


def test_the_benchmark_runs_and_checks_its_sum() -> None:
    """tools/bench_secagg.py on a tiny round: the numbers it prints come from a checked sum."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "bench_secagg.py"
    spec = importlib.util.spec_from_file_location("bench_secagg", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.bench(12, 40, 1.0, 2**-8, 0.1, np.random.default_rng(0))
    assert row["up"] > 40 * 2 and row["dropped"] == 1 and row["agg_s"] >= 0


def test_the_device_side_needs_no_server_extra() -> None:
    """A Pi runs DeviceSession and the distributed-DP device step from the base install: neither
    imports dp-accounting, scipy or anything else of the server extra."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, numpy as np, os\n"
        "import edge_fl.secagg, edge_fl.secagg.ddg as ddg\n"
        "from fractions import Fraction\n"
        "p = ddg.DdgParams(1.0, 0.01, Fraction(9), 0.6, 20, 5)\n"
        "ddg.device_encode(np.ones(20), p, bytes(32), os.urandom)\n"
        "bad = ('dp_accounting', 'scipy', 'onnx', 'onnxruntime', 'sklearn', 'matplotlib', 'amqtt')\n"
        "print(sorted(m for m in bad if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
