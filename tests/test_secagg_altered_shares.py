"""A device that answers the unmask request with altered shares cannot fail the round while t
honest shares of every secret remain: the aggregator recovers each secret from a t-subset that
passes its check (the seed's commitment, the dropped device's advertised key) and names the
device whose shares lie off the polynomial (a red team's device failed every FedBuff cohort it
joined this way, and its honest partners were charged for nothing)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import edge_fl.secagg.messages as M
import edge_fl.secagg.primitives as P
from edge_fl.secagg.aggregator import MAX_SUBSETS, _subsets, recover
from edge_fl.secagg.driver import run_round
from edge_fl.secagg.session import Failed, RoundParams, Summed


def params(n: int, k: int, t: int) -> RoundParams:
    roster = tuple(f"d{i:02d}" for i in range(n))
    return RoundParams("job1", 7, bytes(range(16)), roster, k, t, 20, 8, 100)


def drbg(label: str) -> P.RandBytes:
    """Deterministic shares and keys (tests only): the ChaCha20 stream of SHA-256(label)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    key = hashlib.sha256(label.encode()).digest()
    enc = Cipher(algorithms.ChaCha20(key, bytes(16)), None).encryptor()
    return lambda n: enc.update(bytes(n))


def lying(liars: set[str], how: str = "flip"):
    def tamper(way: str, device: str, payload: bytes) -> bytes:
        msg = M.decode(payload, 10**6)
        if way == "up" and device in liars and msg.kind == "ua":

            def alter(blob: bytes | None) -> bytes | None:
                if blob is None:
                    return None
                if how == "flip":
                    return bytes([blob[0] ^ 1]) + blob[1:]
                return P.share_bytes(1234)

            return M.encode("ua", msg.round, msg.nonce, s=[alter(x) for x in msg.body["s"]])
        return payload

    return tamper


@pytest.mark.parametrize("how", ["flip", "constant"])
@pytest.mark.parametrize("dropped", [{}, {"d00": "mask"}])
def test_one_liar_among_the_answers_still_gives_the_exact_sum_and_is_named(how, dropped):
    p = params(9, 8, 5)  # every secret has 8 (7 with d0 gone) shares; t = 5
    xs = {d: np.arange(8) * (i + 1) - 20 for i, d in enumerate(p.roster)}
    trace = run_round(p, xs, dict(dropped), tamper=lying({"d03"}, how), randbytes=drbg)
    assert isinstance(trace.outcome, Summed), trace.outcome
    assert trace.outcome.altered == ("d03",)
    expected = sum(xs[d] for d in trace.outcome.contributors)
    assert np.array_equal(trace.outcome.total, expected)
    assert "d03" in trace.outcome.contributors  # its own input is summed: only its shares lied


def test_two_liars_beyond_exhaustive_search_are_recovered_around():
    p = params(16, 14, 8)  # C(14, 8) = 3003 subsets: sampled, not enumerated
    xs = {d: np.full(8, i) for i, d in enumerate(p.roster)}
    trace = run_round(p, xs, {}, tamper=lying({"d01", "d02"}), randbytes=drbg)
    assert isinstance(trace.outcome, Summed), trace.outcome
    assert trace.outcome.altered == ("d01", "d02")
    assert np.array_equal(trace.outcome.total, sum(xs.values()))


def test_without_t_honest_shares_the_round_still_fails_rather_than_sum_wrong():
    p = params(6, 5, 4)  # 5 shares per secret, t = 4: two liars leave 3 honest
    trace = run_round(
        p, {d: np.ones(8, dtype=np.int64) for d in p.roster}, {}, tamper=lying({"d01", "d02"})
    )
    assert isinstance(trace.outcome, Failed)
    assert "do not match its" in trace.outcome.reason


def test_subsets_start_with_the_arrival_order_and_stay_deterministic():
    shares = [(x, x * 7) for x in range(1, 15)]
    first = list(_subsets(shares, 8, "seed"))
    assert first[0] == shares[:8] and len(first) == MAX_SUBSETS
    assert first == list(_subsets(shares, 8, "seed"))
    small = list(_subsets(shares[:6], 4, "seed"))  # C(6, 4) = 15: every subset, once
    assert len(small) == 15 and len({tuple(s) for s in small}) == 15


def lagrange_at_zero(points: list[int], i: int) -> int:
    num = den = 1
    for x in points:
        if x != i:
            num = num * x % P.PRIME
            den = den * (x - i) % P.PRIME
    return num * pow(den, -1, P.PRIME) % P.PRIME


@pytest.mark.parametrize("holders", [6, 7])
def test_altered_shares_that_cancel_at_zero_never_name_an_honest_holder(holders):
    """Two altered shares whose errors cancel at 0 (d_A L_A(0) + d_B L_B(0) = 0 for the subset
    {A, B, C}) pass the check through a wrong polynomial, off which the honest shares lie: the
    secret is still right, and honest holders are never named. With 7 holders, t = 3 and 2
    altered (h >= t + 2e) the two are named; with 6 the shares cannot tell, and nobody is."""
    secret, t = 123456789, 3
    xs = list(range(1, holders + 1))
    values = P.split(secret, t, xs, drbg("cancel"))
    a, b, c = 1, 4, 2  # arrival order below: A, C, D, B, ...: the first t hold A but not B
    delta_a = 5
    delta_b = (
        -delta_a * lagrange_at_zero([a, b, c], a) * pow(lagrange_at_zero([a, b, c], b), -1, P.PRIME)
    )
    shares = dict(zip(xs, values, strict=True))
    shares[a] = (shares[a] + delta_a) % P.PRIME
    shares[b] = (shares[b] + delta_b) % P.PRIME
    order = [a, c, 3, b] + [x for x in xs if x not in (a, b, c, 3)]
    arrived = [(x, shares[x]) for x in order]
    assert P.combine(arrived[:t]) != secret  # the first t fail
    assert P.combine([(a, shares[a]), (b, shares[b]), (c, shares[c])]) == secret  # cancelled

    got, off = recover(arrived, t, "seed", lambda v: v == secret)
    assert got == secret
    assert set(off) <= {a, b}
    assert set(off) == ({a, b} if holders == 7 else set())


def test_the_round_record_names_the_altered_holders():
    from types import SimpleNamespace

    from edge_fl.server.secure import SecureRound

    sr = SecureRound.__new__(SecureRound)  # only its result(): the record's secure map
    sr.rejected = {}
    summed = Summed(np.zeros(2, np.int64), ("d01", "d02"), ("d02",))
    sr.plan = SimpleNamespace(layout=SimpleNamespace(removable_noise=False))
    sr.session = SimpleNamespace(outcome=summed, phase="done", counts={"unmask": 2})
    outcome, info = sr.result()
    assert outcome is summed and info["altered"] == ["d02"] and info["outcome"] == "summed"
    sr.session = SimpleNamespace(outcome=Summed(np.zeros(2, np.int64), ("d01",)), phase="done",
                                 counts={})  # fmt: skip
    assert "altered" not in sr.result()[1]
