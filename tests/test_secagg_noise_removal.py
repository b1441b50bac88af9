"""Noise beyond the floor (docs/specs/secagg.md section 12): distributed-DP noise is calibrated
for the survivors floor, so when more devices deliver, the aggregator asks the survivors beyond
the floor for their own noise and removes it. The sum then holds exactly the floor's noise
shares (never fewer), devices with signing keys never reveal theirs, and every malformed
request or answer is refused. Pure and broker-free, except the last test, which runs a secure
job over a real Mosquitto."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from scipy import stats
from test_distributed_gaussian import N_PARAMS, mechanism, message
from test_secure_sum import devices

import edge_fl.secagg.messages as M
from edge_fl.mechanisms.secure import SecureInput, SecureJob
from edge_fl.secagg import AggregatorSession, RoundParams, Summed
from edge_fl.secagg.driver import VANISH, run_round
from edge_fl.secagg.primitives import pack, to_ring

ROSTER = tuple(f"d{i}" for i in range(8))
BITS = 24


def params(floor: int, survivors: int = 4, nonce: bytes | None = None) -> RoundParams:
    return RoundParams("job1", 3, nonce or os.urandom(16), ROSTER, 7, 4, BITS, 16, 0,
                       min_survivors=survivors, noise_floor=floor)  # fmt: skip


def inputs(rng: np.random.Generator) -> tuple[dict, dict]:
    signal = {d: rng.integers(-50, 50, 16) for d in ROSTER}
    noise = {d: rng.integers(-(10**5), 10**5, 16) for d in ROSTER}
    return {d: signal[d] + noise[d] for d in ROSTER}, noise


@pytest.mark.parametrize("trial", range(40))
def test_the_sum_keeps_exactly_the_floors_noise_whoever_vanishes(trial):
    """Property: with devices vanishing at any phase, the sum is every contributor's input less
    the noise of exactly max(0, |U3| - floor) of them, all of whom are contributors; an asked
    device that vanishes before answering keeps its noise in the sum (more noise, never less)."""
    rnd = random.Random(trial)
    values, noise = inputs(np.random.default_rng(trial))
    vanish = {d: rnd.choice(VANISH) for d in rnd.sample(ROSTER, rnd.randint(0, 3))}
    floor = rnd.randint(4, 8)
    trace = run_round(params(floor), values, vanish, modular=True, noise=noise, record=True)
    out = trace.outcome
    assert isinstance(out, Summed), out
    u3 = set(out.contributors)
    assert set(out.denoised) <= u3
    expected = sum(values[d] for d in u3) - sum(noise[d] for d in out.denoised)
    assert np.array_equal(out.total, expected)
    asked = max(0, len(u3) - floor)
    at_unmask = {d for d, phase in vanish.items() if phase == "unmask"}  # in U3, never answer
    assert not set(out.denoised) & at_unmask
    assert asked - len(at_unmask) <= len(out.denoised) <= asked
    assert len(out.denoised) == len(asked_set(trace, u3))  # every answering asked device
    assert len(u3) - len(out.denoised) >= min(len(u3), floor)
    assert len(out.noise_asked) == asked and set(out.denoised) <= set(out.noise_asked) <= u3


def asked_set(trace, u3) -> set[str]:
    """The devices a round's uq asked for noise, read from the traffic delivered (a device
    gone before the unmask phase receives nothing)."""
    asked = set()
    for direction, device, payload in trace.sent:
        msg = M.decode(payload, 10**6) if direction == "down" else None
        if msg is not None and msg.kind == "uq" and msg.body["z"]:
            asked.add(device)
    return asked & u3


def test_the_asked_devices_are_the_ones_beyond_the_floor_and_change_with_the_nonce():
    values, noise = inputs(np.random.default_rng(1))
    chosen = []
    for _ in range(6):
        trace = run_round(params(5), values, modular=True, noise=noise, record=True)
        assert len(asked_set(trace, set(ROSTER))) == 3 == len(trace.outcome.denoised)
        chosen.append(trace.outcome.denoised)
    assert len(set(chosen)) > 1  # keyed by the nonce: the extra upload moves around


def test_no_floor_no_request_and_the_sum_keeps_every_share():
    values, noise = inputs(np.random.default_rng(2))
    trace = run_round(params(0), values, modular=True, noise=noise, record=True)
    assert trace.outcome.denoised == () and not asked_set(trace, set(ROSTER))
    assert np.array_equal(trace.outcome.total, sum(values.values()))


def test_a_device_never_reveals_noise_it_did_not_add_or_under_device_keys():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    values, noise = inputs(np.random.default_rng(3))
    no_noise = run_round(params(4), values, modular=True)  # asked, but holds no noise
    assert len(no_noise.aborted) == 4
    assert set(no_noise.aborted.values()) == {"asked for noise it never added"}
    # a device with a signing key (its aggregator may be malicious) aborts rather than answer
    signers = {d: Ed25519PrivateKey.generate() for d in ROSTER}
    signed = run_round(params(4), values, modular=True, noise=noise, signers=signers)
    assert set(signed.aborted.values()) == {"asked for its noise in a job with device keys"}
    assert len(signed.aborted) == 4


def test_requests_and_answers_that_break_the_rules_are_refused():
    p = params(4)
    bad_request = {"v": 1, "k": "uq", "r": 3, "nc": p.nonce, "a": [0] * 7, "z": False}
    import msgpack

    from edge_fl.protocol import PayloadRejected

    with pytest.raises(PayloadRejected, match="'z'"):
        M.decode(msgpack.packb(bad_request), 10**6, 7)
    with pytest.raises(PayloadRejected, match="'z'"):
        bad_answer = {k: v for k, v in bad_request.items() if k != "a"}
        M.decode(msgpack.packb({**bad_answer, "k": "ua", "s": [None] * 7, "z": 1}), 10**6, 7)

    # an aggregator: one round to the unmask phase, then answers altered in transit
    values, noise = inputs(np.random.default_rng(4))

    def run(tamper_z):
        def tamper(direction, device, payload):
            msg = msgpack.unpackb(payload)
            if direction == "up" and msg["k"] == "ua":
                return msgpack.packb(tamper_z(device, msg))
            return payload

        return run_round(params(5), values, modular=True, noise=noise, tamper=tamper)

    extra = pack(to_ring(np.zeros(16, np.int64), BITS), BITS)
    # noise from a device not asked: its answer is refused, and too few shares remain
    unasked = run(lambda d, m: {**m, "z": extra} if "z" not in m else m)
    assert not isinstance(unasked.outcome, Summed)
    # an asked device's answer without its noise, or with a short one: refused; the others'
    # shares unmask the sum, which keeps every noise share (more noise, never a wrong sum)
    for change in (
        lambda d, m: {k: v for k, v in m.items() if k != "z"},
        lambda d, m: {**m, "z": m["z"][:-1]} if "z" in m else m,
    ):
        out = run(change).outcome
        assert isinstance(out, Summed) and out.denoised == ()
        assert np.array_equal(out.total, sum(values.values()))


def test_the_mechanism_keeps_its_noise_apart_and_the_layout_says_it_is_removable():
    mech = mechanism(epsilon=None, noise_multiplier=1.0)
    job = SecureJob(N_PARAMS, 6, 4)
    layout = mech.secure_layout(job)
    assert layout.removable_noise and layout.modular
    enc = mech.secure_encode(devices(1)[0], message(), layout, os.urandom(32))
    assert isinstance(enc, SecureInput) and enc.noise is not None
    p = mech.calibration(job).params
    rounded = enc.values - enc.noise
    assert np.linalg.norm(rounded) <= p.l2  # the noise-free part is the bounded signal
    assert np.var(enc.noise) > 0.2 * float(p.sigma2)  # chi2(32)/32 below 0.2: p ~ 3e-7


def test_with_everyone_delivering_the_decoded_noise_is_the_floors_not_the_selections():
    """Statistical: 6 devices, floor 4, nobody drops. Over 36 rounds of the real encode, the
    in-memory SecAgg+ round and decode, the summed noise's variance is 4 sigma^2 (chi-square,
    both tails at 1e-6), and 6 sigma^2 (no removal) is rejected at 1e-6 (with 12 rounds that
    last check failed one run in three: 4 shares' mean sat half a standard deviation inside)."""
    n, floor = 6, 4
    mech = mechanism(epsilon=None, noise_multiplier=1.0)
    job = SecureJob(N_PARAMS, n, floor)
    layout = mech.secure_layout(job)
    p = mech.calibration(job).params
    msg = message()
    devs = devices(n, seed=11)
    roster = tuple(sorted(d.device_id for d in devs))
    residuals = []
    for _ in range(36):  # 1,152 values: 6 shares' lower 1e-6 tail is 4.9 sds above 4 shares' mean
        seed = os.urandom(32)
        enc = {d.device_id: mech.secure_encode(d, msg, layout, seed) for d in devs}
        rp = RoundParams("job1", 2, os.urandom(16), roster, n - 1, 3, layout.bits,
                         layout.length, 0, min_survivors=floor, noise_floor=floor)  # fmt: skip
        trace = run_round(rp, {d: e.values for d, e in enc.items()}, modular=True,
                          noise={d: e.noise for d, e in enc.items()})  # fmt: skip
        out = trace.outcome
        assert isinstance(out, Summed) and len(out.denoised) == n - floor
        signal = sum(e.values - e.noise for e in enc.values())
        residuals.append(out.total - signal)  # the kept noise, in grid units
    r = np.concatenate(residuals).astype(np.float64)
    df = r.size
    var = floor * float(p.sigma2)
    assert float(np.sum(r**2)) / var < stats.chi2.ppf(1 - 1e-6, df)
    assert float(np.sum(r**2)) / var > stats.chi2.ppf(1e-6, df)
    assert float(np.sum(r**2)) / (n * float(p.sigma2)) < stats.chi2.ppf(1e-6, df)  # not 6 shares


def test_an_aggregator_session_holds_only_the_sum():
    """The revealed noise goes straight out of the running sum: no second vector is kept."""
    agg = AggregatorSession(params(5))
    assert [k for k, v in vars(agg).items() if isinstance(v, np.ndarray)] == ["_sum"]


def test_the_record_counts_only_the_shares_never_asked_for():
    """An asked device that answers late keeps its noise in the sum, but its late ua still
    reveals it: the record's noise_shares counts the contributors never asked (the auditor's
    finding), noise_removed the ones subtracted; with no removable noise, neither key."""
    from types import SimpleNamespace

    from edge_fl.server.secure import SecureRound

    sr = SecureRound.__new__(SecureRound)  # only its result(): the record's secure map
    sr.rejected = {}
    sr.plan = SimpleNamespace(layout=SimpleNamespace(removable_noise=True))
    out = Summed(np.zeros(2, np.int64), tuple(ROSTER[:7]), (), ("d1", "d2"), ("d1", "d2", "d5"))
    sr.session = SimpleNamespace(outcome=out, phase="done", counts={})
    info = sr.result()[1]
    assert info["noise_shares"] == 4 and info["noise_removed"] == ["d1", "d2"]
    sr.plan = SimpleNamespace(layout=SimpleNamespace(removable_noise=False))
    assert "noise_shares" not in sr.result()[1]
