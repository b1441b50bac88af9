"""SecAgg+ messages and the legality rules of both state machines (docs/specs/secagg.md 6-7):
strict decoding, wrong round/nonce/phase, duplicates, late devices, tampering by the broker or
the aggregator, signed keys."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

import edge_fl.secagg.messages as M
import edge_fl.secagg.primitives as P
from edge_fl.protocol import PayloadRejected
from edge_fl.secagg import (
    Aborted,
    AggregatorSession,
    Deliver,
    DeviceSession,
    Failed,
    Rejected,
    RoundParams,
    Send,
    Summed,
)
from edge_fl.secagg.driver import run_round

NONCE = bytes(range(16))


def params(n: int = 5, k: int = 4, t: int = 2, dim: int = 8) -> RoundParams:
    return RoundParams("job1", 7, NONCE, tuple(f"d{i}" for i in range(n)), k, t, 16, dim, 50)


def raw(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


HEAD = {"v": 1, "k": "mx", "r": 7, "nc": NONCE, "b": 16, "m": b"\x0f", "y": b"\x00" * 16}


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (raw({**HEAD, "extra": 1}), "unknown_field"),
        (raw({**HEAD, "v": 2}), "wrong_version"),
        (raw({**HEAD, "k": "zz"}), "wrong_kind"),
        (raw({**HEAD, "nc": b"\x00" * 15}), "out_of_range"),
        (raw({**HEAD, "r": 1.0}), "bad_type"),
        (raw({**HEAD, "b": True}), "bad_type"),
        (raw({k: v for k, v in HEAD.items() if k != "y"}), "missing_field"),
        (raw({"v": 1, "k": "uq", "r": 7, "nc": NONCE, "a": [0, 1, 3, 0]}), "out_of_range"),
        (raw({"v": 1, "k": "uq", "r": 7, "nc": NONCE, "a": [0, 1]}), "out_of_range"),
        (
            raw({"v": 1, "k": "ua", "r": 7, "nc": NONCE, "s": [None, b"x", None, None]}),
            "out_of_range",
        ),
        (raw({"v": 1, "k": "nk", "r": 7, "nc": NONCE, "keys": [[b"a" * 32]] * 4}), "out_of_range"),
        (b"\x82\xa1v\x01\xa1v\x01", "malformed"),
        (raw(HEAD) + b"\x00", "malformed"),
        (raw({**HEAD, "m": b"\x1f"}), "out_of_range"),
        (raw({**HEAD, "m": b"\x0f\x00"}), "out_of_range"),
        (b"\x00" * 10_000, "oversized"),
    ],
)
def test_decoding_is_strict(payload: bytes, reason: str) -> None:
    with pytest.raises(PayloadRejected) as err:
        M.decode(payload, 5000, neighbours=4)
    assert err.value.reason.value == reason


def step(agg: AggregatorSession, devs: dict[str, DeviceSession], effects: list) -> list:
    """Deliver the aggregator's effects and feed the devices' answers back; the new effects."""
    out = []
    for e in effects:
        if isinstance(e, Deliver):
            for answer in devs[e.device].receive(e.payload):
                if isinstance(answer, Send):
                    out += agg.receive(e.device, answer.payload)
    return out


def started(
    p: RoundParams,
) -> tuple[AggregatorSession, dict[str, DeviceSession], list, dict[str, bytes]]:
    agg = AggregatorSession(p)
    devs = {d: DeviceSession(d, p) for d in p.roster}
    adverts = {d: devs[d].advertise().payload for d in p.roster}
    effects = []
    for d, payload in adverts.items():
        effects += agg.receive(d, payload)
    return agg, devs, effects, adverts


def test_aggregator_rejects_strangers_wrong_nonce_phase_and_duplicates() -> None:
    p = params()
    agg = AggregatorSession(p)
    dev = DeviceSession("d0", p)
    ak = dev.advertise().payload
    assert agg.receive("d9", ak)[0].reason == "not_selected"
    other = M.encode(
        "ak", 7, bytes(16), **{k: M.decode(ak, 999).body[k] for k in ("ck", "sk", "bh")}
    )
    assert agg.receive("d0", other)[0].reason == "wrong_nonce"
    assert (
        agg.receive("d0", M.encode("mx", 7, NONCE, b=16, m=b"\x0f", y=b"\x00" * 16))[0].reason
        == "wrong_phase"
    )
    assert agg.receive("d0", ak) == []
    assert agg.receive("d0", ak)[0].reason == "duplicate"
    assert agg.receive("d0", DeviceSession("d0", p).advertise().payload)[0].reason == "duplicate"


def test_a_device_dropped_in_an_earlier_phase_is_late() -> None:
    p = params()
    agg = AggregatorSession(p)
    devs = {d: DeviceSession(d, p) for d in p.roster}
    late = devs["d4"].advertise().payload
    effects = []
    for d in p.roster[:4]:
        effects += agg.receive(d, devs[d].advertise().payload)
    effects += agg.close_phase()  # d4 missed the keys phase
    assert agg.phase == "shares"
    assert agg.receive("d4", late)[0].reason == "wrong_phase"
    # a shares message from d4 (it never got keys) is late
    sh = M.encode("sh", 7, NONCE, c=[None] * 4)
    assert agg.receive("d4", sh)[0].reason == "late"


def test_aggregator_refuses_inconsistent_shares_and_masked_vectors() -> None:
    p = params()
    agg, devs, effects, _ = started(p)
    d = effects[0].device
    assert agg.receive(d, M.encode("sh", 7, NONCE, c=[None] * 4))[0].reason == "bad_shares"
    effects = step(agg, devs, effects)  # everyone shares; sf forwarded
    assert agg.phase == "masked"
    target = effects[0].device
    assert (
        agg.receive(target, M.encode("mx", 7, NONCE, b=12, m=b"\x0f", y=b"\x00" * 16))[0].reason
        == "bad_masked"
    )
    assert (
        agg.receive(target, M.encode("mx", 7, NONCE, b=16, m=b"\x0f", y=b"\x00" * 15))[0].reason
        == "bad_masked"
    )


def test_device_answers_a_duplicate_with_the_same_bytes_and_rejects_others() -> None:
    p = params()
    _, devs, effects, _ = started(p)
    nk = effects[0]
    first = devs[nk.device].receive(nk.payload)
    again = devs[nk.device].receive(nk.payload)
    assert isinstance(first[0], Send) and first == again
    wrong = M.encode("nk", 8, NONCE, keys=[None] * 4)
    assert devs[nk.device].receive(wrong)[0].reason == "wrong_nonce"
    assert devs[nk.device].receive(M.encode("uq", 7, NONCE, a=[0] * 4))[0].reason == "wrong_phase"
    assert devs[nk.device].receive(b"\xc1")[0].reason == "malformed"


def test_device_refuses_inputs_beyond_max_int() -> None:
    dev = DeviceSession("d0", params())
    with pytest.raises(ValueError, match="max_int"):
        dev.submit(np.full(8, 51))
    with pytest.raises(ValueError, match="8 integers"):
        dev.submit(np.zeros(8, dtype=np.float32))


def test_a_tampered_share_aborts_the_receiver_and_the_round_still_sums_or_fails() -> None:
    """A broker flips a bit of one sealed share: the receiver's AEAD refuses it and the device
    leaves the round; the others still produce the exact sum of the remaining devices."""
    p = params(6, 5, 2)

    def tamper(way: str, device: str, payload: bytes) -> bytes:
        msg = M.decode(payload, 10**6)
        if way == "down" and device == "d2" and msg.kind == "sf":
            c = list(msg.body["c"])
            i = next(i for i, x in enumerate(c) if x is not None)
            c[i] = bytes([c[i][0] ^ 1]) + c[i][1:]
            return M.encode("sf", msg.round, msg.nonce, c=c)
        return payload

    xs = {d: np.arange(8) * (i + 1) for i, d in enumerate(p.roster)}
    trace = run_round(p, xs, tamper=tamper)
    assert "do not authenticate" in trace.aborted["d2"]
    assert isinstance(trace.outcome, Summed)
    assert "d2" not in trace.outcome.contributors
    assert np.array_equal(trace.outcome.total, sum(xs[d] for d in trace.outcome.contributors))


def test_a_wrong_share_fails_the_round_instead_of_a_wrong_sum() -> None:
    """Every share is used (t = the answering neighbours): one wrong share from d1 would give a
    wrong seed and a wrong key; the commitment and the advertised key catch both."""
    p = params(6, 5, 4)

    def tamper(way: str, device: str, payload: bytes) -> bytes:
        msg = M.decode(payload, 10**6)
        if way == "up" and device == "d1" and msg.kind == "ua":
            s = [None if x is None else P.share_bytes(1234) for x in msg.body["s"]]
            return M.encode("ua", msg.round, msg.nonce, s=s)
        return payload

    trace = run_round(
        p, {d: np.ones(8, dtype=np.int64) for d in p.roster}, {"d0": "mask"}, tamper=tamper
    )
    assert isinstance(trace.outcome, Failed)
    assert "do not match its" in trace.outcome.reason


def test_a_request_for_a_share_the_device_never_held_aborts() -> None:
    p = params(5, 4, 2)
    agg = AggregatorSession(p)
    devs = {d: DeviceSession(d, p) for d in p.roster}
    effects = []
    for d in p.roster[:4]:  # d4 never advertises: nobody holds its shares
        effects += agg.receive(d, devs[d].advertise().payload)
    effects = step(agg, devs, effects + agg.close_phase())
    effects = step(agg, devs, effects)
    dev = devs["d0"]
    dev.submit(np.zeros(8, dtype=np.int64))
    near = p.graph.neighbours("d0")
    asks = [M.ASK_KEY if v == "d4" else M.ASK_NOTHING for v in near]
    (out,) = dev.receive(M.encode("uq", 7, NONCE, a=asks))
    assert isinstance(out, Aborted) and "sent none" in out.reason


def test_signed_keys_verify_and_a_substituted_key_aborts() -> None:
    p = params()
    signing = {d: Ed25519PrivateKey.generate() for d in p.roster}

    def session(d: str) -> DeviceSession:
        return DeviceSession(
            d, p, signer=signing[d], peer_key=lambda v: _Check(signing[v].public_key())
        )

    agg = AggregatorSession(p)
    devs = {d: session(d) for d in p.roster}
    effects = []
    for d in p.roster:
        effects += agg.receive(d, devs[d].advertise().payload)
    nk = next(e for e in effects if e.device == "d0")
    assert isinstance(devs["d0"].receive(nk.payload)[0], Send)
    # a man in the middle swaps a neighbour's mask key for its own: the signature no longer holds
    other = next(e for e in effects if e.device == "d1")
    msg = M.decode(other.payload, 10**6)
    keys = [
        None if k is None else [k[0], P.public_bytes(P.new_key(os.urandom)), k[2]]
        for k in msg.body["keys"]
    ]
    (out,) = devs["d1"].receive(M.encode("nk", 7, NONCE, keys=keys))
    assert isinstance(out, Aborted) and "not signed" in out.reason
    # and an unsigned entry where a signing key is known is refused the same way
    fresh = session("d1")
    fresh.advertise()
    keys = [None if k is None else [k[0], k[1]] for k in msg.body["keys"]]
    (out,) = fresh.receive(M.encode("nk", 7, NONCE, keys=keys))
    assert isinstance(out, Aborted) and "not signed" in out.reason


def test_a_device_that_is_done_answers_only_the_same_request() -> None:
    p = params(4, 3, 2)
    agg, devs, effects, _ = started(p)
    effects = step(agg, devs, effects)
    effects = step(agg, devs, effects)
    for d in p.roster:
        for e in devs[d].submit(np.zeros(8, dtype=np.int64)):
            effects += agg.receive(d, e.payload)
    uq = next(e for e in effects if isinstance(e, Deliver))
    first = devs[uq.device].receive(uq.payload)
    assert devs[uq.device].receive(uq.payload) == first
    assert isinstance(devs[uq.device].receive(M.encode("uq", 7, NONCE, a=[0, 0, 0]))[0], Rejected)


def test_low_order_keys_are_refused_by_both_sides() -> None:
    p = params()
    agg = AggregatorSession(p)
    bad = M.encode("ak", 7, NONCE, ck=bytes(32), sk=P.public_bytes(5 * 8 + 2**254), bh=bytes(32))
    (out,) = agg.receive("d0", bad)
    assert out.reason == "bad_keys" and "low-order" in out.detail
    dev = DeviceSession("d1", p)
    dev.advertise()
    near = p.graph.neighbours("d1")
    keys = [[bytes(32), bytes(32)] for _ in near]
    (out,) = dev.receive(M.encode("nk", 7, NONCE, keys=keys))
    assert isinstance(out, Aborted) and "low-order" in out.reason


def _mutations():
    # every integer msgpack can carry: a mutation must be a payload a broker could deliver
    ints = st.integers(-(2**63), 2**64 - 1)
    values = st.one_of(
        st.none(), st.booleans(), ints, st.binary(max_size=100),
        st.text(max_size=10), st.lists(st.one_of(st.none(), st.binary(max_size=90), ints), max_size=6),
    )  # fmt: skip
    return st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
        st.tuples(st.just("cut"), st.integers(0, 10**6)),
        st.tuples(st.just("set"), st.sampled_from(["v", "k", "r", "nc", "ck", "sk", "bh", "sig", "keys", "c", "b", "y", "a", "s", "zz"]), values),
        st.tuples(st.just("del"), st.sampled_from(["v", "k", "r", "nc", "ck", "c", "y", "a", "s", "keys"])),
        st.tuples(st.just("junk"), st.binary(max_size=300)),
    )  # fmt: skip


def _mutate(payload: bytes, how) -> bytes:
    kind = how[0]
    if kind == "flip":
        i = how[1] % len(payload)
        return payload[:i] + bytes([payload[i] ^ how[2]]) + payload[i + 1 :]
    if kind == "cut":
        return payload[: how[1] % len(payload)]
    if kind == "junk":
        return how[1]
    obj = msgpack.unpackb(payload, raw=False)
    if kind == "set":
        obj[how[1]] = how[2]
    else:
        obj.pop(how[1], None)
    return msgpack.packb(obj, use_bin_type=True)


class _Check:
    def __init__(self, key) -> None:
        self.key = key

    def verify(self, data: bytes, signature: bytes) -> bool:
        try:
            self.key.verify(signature, data)
        except Exception:
            return False
        return True


SIGNERS = {f"d{i}": Ed25519PrivateKey.generate() for i in range(6)}


def DIRECTORY(device: str) -> _Check:
    return _Check(SIGNERS[device].public_key())


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3), st.integers(0, 3), _mutations())
def test_no_payload_makes_a_session_raise(phase: int, who: int, how) -> None:
    """Any corruption of a genuine message of any phase, in either direction, is a Rejected,
    an abort or a (legal) effect; never an exception, and the round sums exactly or fails.
    With device signing keys (the model against a malicious broker): unsigned, the masked
    vector itself has no integrity but the broker's ACL and TLS."""
    p = params(4, 3, 2, dim=4)
    target = f"d{who}"
    kinds_up, kinds_down = ("ak", "sh", "mx", "ua"), ("nk", "sf", "uq")

    def tamper(way: str, device: str, payload: bytes) -> bytes:
        kind = M.decode(payload, 10**6).kind
        hit = (way == "up" and kind == kinds_up[phase]) or (
            way == "down" and phase < 3 and kind == kinds_down[phase]
        )
        return _mutate(payload, how) if hit and device == target else payload

    xs = {d: np.full(4, i, dtype=np.int64) for i, d in enumerate(p.roster)}
    trace = run_round(p, xs, tamper=tamper, signers=SIGNERS, directory=DIRECTORY)
    assert trace.outcome is not None
    if isinstance(trace.outcome, Summed):
        assert np.array_equal(trace.outcome.total, sum(xs[d] for d in trace.outcome.contributors))


def test_a_dropped_forwarded_share_is_caught_by_the_mask_set() -> None:
    """A broker removes one sealed share from a device's forwarded shares: the device masks
    without that neighbour, the neighbour masks with it. The mask set in ``mx`` shows the
    mismatch: the device is refused and treated as dropped, and the sum of the others is exact."""
    p = params(5, 4, 2)
    cut = {}

    def tamper(way: str, device: str, payload: bytes) -> bytes:
        msg = M.decode(payload, 10**6)
        if way == "down" and device == "d0" and msg.kind == "sf":
            c = list(msg.body["c"])
            i = next(i for i, x in enumerate(c) if x is not None)
            cut["at"] = i
            c[i] = None
            return M.encode("sf", msg.round, msg.nonce, c=c)
        return payload

    xs = {d: np.arange(8) + i for i, d in enumerate(p.roster)}
    trace = run_round(p, xs, tamper=tamper)
    assert "at" in cut
    assert isinstance(trace.outcome, Summed)
    assert "d0" not in trace.outcome.contributors
    assert np.array_equal(trace.outcome.total, sum(xs[d] for d in trace.outcome.contributors))


def test_a_key_altered_on_its_way_to_one_device_aborts_it_instead_of_a_wrong_sum() -> None:
    """Unsigned keys; a broker swaps one neighbour's mask key in d0's ``nk`` for another valid
    key. d0 would mask against a key its neighbour never used; because each seal's associated
    data holds the keys the sealer saw, d0 cannot open that neighbour's shares and leaves the
    round, and the others' sum is exact."""
    p = params(5, 4, 2)

    def tamper(way: str, device: str, payload: bytes) -> bytes:
        msg = M.decode(payload, 10**6)
        if way == "down" and device == "d0" and msg.kind == "nk":
            keys = list(msg.body["keys"])
            ck, _, _ = keys[0]
            keys[0] = [ck, P.public_bytes(P.new_key(os.urandom))]
            keys = [k if i == 0 else [k[0], k[1]] for i, k in enumerate(keys)]
            return M.encode("nk", msg.round, msg.nonce, keys=keys)
        return payload

    xs = {d: np.arange(8) * (i + 2) for i, d in enumerate(p.roster)}
    trace = run_round(p, xs, tamper=tamper)
    assert "do not authenticate" in trace.aborted["d0"]
    assert isinstance(trace.outcome, Summed) and "d0" not in trace.outcome.contributors
    assert np.array_equal(trace.outcome.total, sum(xs[d] for d in trace.outcome.contributors))


def _rewrite_commitment_and_seed_shares(p: RoundParams, victim: str, fake_seed: int):
    """A broker's tamper: ``victim``'s seed commitment in its ``ak`` becomes that of
    ``fake_seed``, and every seed share of it asked for in an unmask request is answered with a
    share of the constant polynomial ``fake_seed`` (valid t-of-n shares of it)."""

    asked: dict[str, list[int]] = {}  # device -> its unmask request (1: a seed share)

    def tamper(way: str, device: str, payload: bytes) -> bytes:
        m = msgpack.unpackb(payload, raw=False)
        if way == "down":
            if m["k"] == "uq":
                asked[device] = list(m["a"])
            return payload
        near = p.graph.neighbours(device)
        if m["k"] == "ak" and device == victim:
            m["bh"] = P.seed_commitment(p.job, p.round, p.nonce, victim, fake_seed)
        elif m["k"] == "ua" and victim in near and asked[device][near.index(victim)] == 1:
            m["s"][near.index(victim)] = P.share_bytes(fake_seed)
        else:
            return payload
        return raw(m)

    return tamper


def test_a_rewritten_seed_commitment_cannot_change_the_sum() -> None:
    """The red team's attack: a broker rewrites d3's seed commitment and every share of its
    seed, so the aggregator would rebuild a seed of the broker's choosing and remove the wrong
    self mask. Signed: ``mx``'s signature covers the commitment d3 made, so its masked input is
    refused against the rewritten one, d3 counts as dropped and the others' sum is exact.
    Unsigned (no directory: the model against an honest-but-curious operator only), the
    range check still turns the wrong sum into a failed round."""
    p = RoundParams("job1", 7, NONCE, tuple(f"d{i}" for i in range(6)), 4, 3, 20, 8, 50)
    xs = {d: np.arange(8, dtype=np.int64) * (i + 1) - 20 for i, d in enumerate(p.roster)}
    tamper = _rewrite_commitment_and_seed_shares(p, "d3", 42)
    signed = run_round(p, xs, tamper=tamper, signers=SIGNERS, directory=DIRECTORY)
    assert isinstance(signed.outcome, Summed), signed.outcome
    assert "d3" not in signed.outcome.contributors
    assert np.array_equal(signed.outcome.total, sum(xs[d] for d in signed.outcome.contributors))
    unsigned = run_round(p, xs, tamper=tamper)
    assert isinstance(unsigned.outcome, Failed), unsigned.outcome
    assert "beyond what the inputs can reach" in unsigned.outcome.reason
