"""Test vectors of SecAgg+ (tests/secagg_vectors.json, docs/specs/secagg.md section 8): key
agreement, share encryption, Shamir, masking, the neighbour graph, and a whole 4-device round
with a dropout, byte for byte. The code must reproduce the file; ``python
tests/test_secagg_vectors.py --write`` rewrites it (review the diff: a change is a wire change).

Randomness in the vectors comes from ``drbg(label)``: the ChaCha20 keystream (key SHA-256 of the
UTF-8 label, nonce and counter 0), read in order; a device of the round draws from
``drbg("secagg-vector/<device>")``: 32 bytes for its share key, 32 for its mask key, 32 for its
seed (each redrawn while out of range, see the spec), then its Shamir coefficients."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

import edge_fl.secagg.messages as M
import edge_fl.secagg.primitives as P
from edge_fl.secagg import RoundParams, Summed
from edge_fl.secagg.driver import run_round
from edge_fl.secagg.graph import Graph, graph_seed, permutation

FILE = Path(__file__).with_name("secagg_vectors.json")
JOB, ROUND, NONCE = "job1", 7, bytes(range(16))


def drbg(label: str) -> P.RandBytes:
    enc = Cipher(
        algorithms.ChaCha20(hashlib.sha256(label.encode()).digest(), bytes(16)), None
    ).encryptor()
    return lambda n: enc.update(bytes(n))


def build() -> dict[str, Any]:
    rand = drbg("secagg-vector/keys")
    a, b = P.new_key(rand), P.new_key(rand)  # d0's and d1's share-encryption keys (c)
    am, bm = P.new_key(rand), P.new_key(rand)  # their mask keys (s)
    shared = P.agree(a, P.public_bytes(b))
    assert shared == P.agree(b, P.public_bytes(a))
    mask_shared = P.agree(am, P.public_bytes(bm))
    key_ab = P.share_key(shared, JOB, ROUND, NONCE, "d0", "d1")
    common = {"job": JOB, "round": ROUND, "nonce": NONCE.hex()}
    agreement = {
        **common,
        "d0_c_scalar_le": a.to_bytes(32, "little").hex(),
        "d0_c_public": P.public_bytes(a).hex(),
        "d1_c_scalar_le": b.to_bytes(32, "little").hex(),
        "d1_c_public": P.public_bytes(b).hex(),
        "d0_s_scalar_le": am.to_bytes(32, "little").hex(),
        "d0_s_public": P.public_bytes(am).hex(),
        "d1_s_scalar_le": bm.to_bytes(32, "little").hex(),
        "d1_s_public": P.public_bytes(bm).hex(),
        "x25519_c": shared.hex(),
        "x25519_s": mask_shared.hex(),
        "share_key_d0_to_d1": key_ab.hex(),
        "share_key_d1_to_d0": P.share_key(shared, JOB, ROUND, NONCE, "d1", "d0").hex(),
        "pair_seed_d0_d1": P.pair_seed(mask_shared, JOB, ROUND, NONCE, "d0", "d1").hex(),
        "hkdf_info_pair_mask": P.context("pair-mask", JOB, ROUND, "d0", "d1").hex(),
    }
    plain = P.share_bytes(12345) + P.share_bytes(P.PRIME - 1)
    keys = P.public_bytes(a) + P.public_bytes(am) + P.public_bytes(b) + P.public_bytes(bm)
    aad = P.share_aad(JOB, ROUND, NONCE, "d0", "d1", keys)
    encryption = {
        **common,
        "sender": "d0",
        "receiver": "d1",
        "key": key_ab.hex(),
        "plaintext": plain.hex(),
        "aad": aad.hex(),
        "sealed": P.seal(key_ab, plain, aad).hex(),
    }
    srand = drbg("secagg-vector/shamir")
    secret = P.new_seed(srand)
    shares = P.split(secret, 3, [1, 2, 5, 9], srand)
    shamir = {
        "prime": hex(P.PRIME),
        "secret": hex(secret),
        "threshold": 3,
        "points": [1, 2, 5, 9],
        "shares_le": [P.share_bytes(s).hex() for s in shares],
    }
    dim, bits = 8, 12
    x = np.array([-100, -1, 0, 1, 2, 3, 100, 2047], dtype=np.int64)
    seed = P.new_seed(rand)
    self_mask = P.expand(P.self_seed(seed, JOB, ROUND, NONCE, "d0"), dim, bits)
    pair_mask = P.expand(P.pair_seed(mask_shared, JOB, ROUND, NONCE, "d0", "d1"), dim, bits)
    y = (P.to_ring(x, bits) + self_mask + pair_mask) & P.ring_mask(bits)  # d0 < d1: +
    masking = {
        **common,
        "device": "d0",
        "peer": "d1",
        "bits": bits,
        "input": x.tolist(),
        "seed": hex(seed),
        "seed_commitment": P.seed_commitment(JOB, ROUND, NONCE, "d0", seed).hex(),
        "self_mask": self_mask.tolist(),
        "pair_mask": pair_mask.tolist(),
        "masked": y.tolist(),
        "packed": P.pack(y, bits).hex(),
    }
    ros = tuple(f"d{i}" for i in range(10))
    g = Graph(ros, 4, graph_seed(JOB, ROUND, NONCE))
    graph = {
        **common,
        "roster": list(ros),
        "k": 4,
        "seed": graph_seed(JOB, ROUND, NONCE).hex(),
        "permutation": permutation(graph_seed(JOB, ROUND, NONCE), 10),
        "neighbours": {d: list(g.neighbours(d)) for d in ros},
    }
    p = RoundParams(JOB, ROUND, NONCE, ("d0", "d1", "d2", "d3"), 3, 2, 12, 4, 100)
    inputs = {
        d: np.array([i + 1, -(i + 1), 100, -100], dtype=np.int64) for i, d in enumerate(p.roster)
    }
    trace = run_round(
        p, inputs, {"d3": "mask"}, randbytes=lambda d: drbg(f"secagg-vector/{d}"), record=True
    )
    assert isinstance(trace.outcome, Summed)
    round_ = {
        **common,
        "roster": list(p.roster),
        "neighbours": 3,
        "threshold": 2,
        "bits": 12,
        "dim": 4,
        "max_int": 100,
        "inputs": {d: v.tolist() for d, v in inputs.items()},
        "vanish": {"d3": "before its masked input"},
        "messages": [
            {"dir": way, "device": dev, "k": M.decode(b, 10**6).kind, "hex": b.hex()}
            for way, dev, b in trace.sent
        ],
        "contributors": list(trace.outcome.contributors),
        "sum": trace.outcome.total.tolist(),
    }
    # noise beyond the floor (section 12): floor 2, all four deliver, two reveal their noise
    pn = RoundParams(JOB, ROUND, NONCE, p.roster, 3, 2, 12, 4, 0, min_survivors=2, noise_floor=2)
    signal = {d: np.array([i + 1, -(i + 1), 5, -5], dtype=np.int64) for i, d in enumerate(p.roster)}
    noise = {d: np.array([7 * i - 9, 40 - i, -300, 2 * i], dtype=np.int64)
             for i, d in enumerate(p.roster)}  # fmt: skip
    denoise = run_round(
        pn, {d: signal[d] + noise[d] for d in pn.roster}, modular=True, noise=noise,
        randbytes=lambda d: drbg(f"secagg-vector/noise/{d}"), record=True,
    )  # fmt: skip
    assert isinstance(denoise.outcome, Summed)
    noise_round = {
        **common,
        "roster": list(pn.roster), "neighbours": 3, "threshold": 2, "bits": 12, "dim": 4,
        "min_survivors": 2,
        "signal": {d: v.tolist() for d, v in signal.items()},
        "noise": {d: v.tolist() for d, v in noise.items()},
        "messages": [
            {"dir": way, "device": dev, "k": M.decode(b, 10**6).kind, "hex": b.hex()}
            for way, dev, b in denoise.sent
        ],
        "denoised": list(denoise.outcome.denoised),
        "sum": denoise.outcome.total.tolist(),
    }  # fmt: skip
    ddg_vectors = distributed_gaussian()
    return {
        "about": "SecAgg+ test vectors, docs/specs/secagg.md section 8; checked by tests/test_secagg_vectors.py",
        "key_agreement": agreement,
        "share_encryption": encryption,
        "shamir": shamir,
        "masking": masking,
        "graph": graph,
        "round_with_dropout": round_,
        "round_with_noise_removal": noise_round,
        "distributed_gaussian": ddg_vectors,
    }


def distributed_gaussian() -> dict[str, Any]:
    """The deterministic parts of distributed-gaussian (docs/specs/secagg.md section 12): the
    round seed, the rotation's signs, a delta clipped, rotated and scaled to the grid, the
    default grid step, Delta_2, the ring's bit width, and the decode of a sum (floats are
    float64, exact in JSON)."""
    from fractions import Fraction

    from edge_fl.mechanisms.distributed_gaussian import BETA, default_gamma
    from edge_fl.protocol.secure import round_seed
    from edge_fl.secagg import ddg

    seed = round_seed(JOB, ROUND, NONCE)
    delta = np.array([0.5, -0.25, 0.125, 1.0, -0.75])
    clip, sigma2, n_min, selected = 1.0, 100, 3, 4
    dim_padded = ddg.padded(delta.size)
    gamma = default_gamma(clip, dim_padded)
    p = ddg.DdgParams(clip, gamma, Fraction(sigma2), BETA, delta.size, n_min)
    clipped = delta * min(1.0, clip / float(np.linalg.norm(delta)))
    rotated = ddg.rotate(clipped, seed)
    total = np.array([3, -1, 4, 1, -5, 9, -2, 6])
    bits = max(ddg.ring_bits(p, selected), (selected * math.ceil(p.l2)).bit_length() + 1)
    return {
        "job": JOB, "round": ROUND, "nonce": NONCE.hex(),
        "round_seed": seed.hex(),
        "delta": delta.tolist(), "clip": clip, "padded": dim_padded,
        "signs": ddg.signs(seed, dim_padded).astype(int).tolist(),
        "clipped": clipped.tolist(),
        "rotated": rotated.tolist(),
        "gamma": gamma,
        "scaled": (rotated / gamma).tolist(),
        "delta2": p.l2,
        "sigma2": sigma2, "selected": selected,
        "bits": bits,
        "sum": total.tolist(),
        "decoded": ddg.server_decode(total, p, seed).tolist(),
    }  # fmt: skip


def test_the_code_reproduces_the_vectors() -> None:
    assert build() == json.loads(FILE.read_text())


def test_the_vectors_mean_what_they_say() -> None:
    v = json.loads(FILE.read_text())
    enc = v["share_encryption"]
    opened = P.open_sealed(
        bytes.fromhex(enc["key"]), bytes.fromhex(enc["sealed"]), bytes.fromhex(enc["aad"])
    )
    assert opened.hex() == enc["plaintext"]
    sh = v["shamir"]
    pts = [
        (x, int.from_bytes(bytes.fromhex(s), "little"))
        for x, s in zip(sh["points"], sh["shares_le"], strict=True)
    ]
    assert P.combine(pts[1:]) == P.combine(pts[:3]) == int(sh["secret"], 16)
    m = v["masking"]
    mod = 1 << m["bits"]
    for i, x in enumerate(m["input"]):
        assert m["masked"][i] == (x + m["self_mask"][i] + m["pair_mask"][i]) % mod
    r = v["round_with_dropout"]
    assert r["contributors"] == ["d0", "d1", "d2"]
    assert r["sum"] == list(np.sum([r["inputs"][d] for d in r["contributors"]], axis=0))
    kinds = [(msg["dir"], msg["k"]) for msg in r["messages"]]
    assert ("up", "mx") in kinds and ("up", "ua") in kinds
    assert not any(msg["device"] == "d3" and msg["k"] == "mx" for msg in r["messages"])
    r = v["round_with_noise_removal"]
    kept = [d for d in r["roster"] if d not in r["denoised"]]
    assert len(kept) == r["min_survivors"] == 2
    assert r["sum"] == list(
        np.sum([r["signal"][d] for d in r["roster"]] + [r["noise"][d] for d in kept], axis=0)
    )
    asked = {m["device"] for m in r["messages"] if m["k"] == "uq" and b"\xa1z\xc3" in
             bytes.fromhex(m["hex"])}  # fmt: skip
    assert asked == set(r["denoised"])
    g = v["distributed_gaussian"]
    # the rotation is orthogonal: it keeps the clipped delta's norm, and the decode of the
    # rotated delta on the grid gives the clipped delta back
    assert np.isclose(np.linalg.norm(g["rotated"]), g["clip"])
    assert set(g["signs"]) <= {-1, 1} and len(g["signs"]) == g["padded"] == 8
    assert g["delta2"] <= 1.05 * g["clip"] / g["gamma"] * (1 + 1e-12)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        FILE.write_text(json.dumps(build(), indent=1) + "\n")
        print(f"wrote {FILE}")
