"""Minimal SecAgg+ device from docs/specs/secagg.md (and docs/protocol.md) alone: the device side of
one secure round as a state machine (bytes in, bytes out), on cryptography, msgpack and numpy."""

import hashlib
import os
import sys
from math import isqrt
from pathlib import Path

import msgpack
import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

P = 2**255 - 19  # GF(p): Shamir shares, X25519 scalars and self-mask seeds are field elements
R_MAX = 2**40
RECEIVED = {"nk": "keys", "sf": "c", "uq": "a"}  # kind -> its per-neighbour array
OPTIONAL = {"uq": ("z",)}  # kind -> its optional keys (uq's z: "reveal your noise", section 12)


class Rejected(Exception):  # a message the session ignores (its reason, as the protocol names it)
    pass


class Aborted(Exception):  # the session leaves the round and sends nothing more
    pass


# --- primitives (spec section 3 and 4)
def context(label, job, r, *names):  # "edge-fl/secagg/v1/" label 0 job 0 r(8 BE) (name 0)*
    head = b"edge-fl/secagg/v1/" + label.encode() + b"\0" + job.encode() + b"\0"
    return head + r.to_bytes(8, "big") + b"".join(n.encode() + b"\0" for n in names)


def hkdf(ikm, salt, info):  # HKDF-SHA256, 32 bytes; an empty salt is RFC 5869's default
    return HKDF(hashes.SHA256(), 32, salt or None, info).derive(ikm)


def keystream(key, n):  # ChaCha20, nonce and counter 0 (cryptography's 16-byte counter ‖ nonce)
    return Cipher(algorithms.ChaCha20(key, bytes(16)), None).encryptor().update(bytes(n))


def prg(seed, d, b):  # d values uniform in Z_2^b: LE 32-bit words (b <= 32) else 64-bit, low b bits
    w = keystream(seed, d * (4 if b <= 32 else 8))
    return np.frombuffer(w, "<u4" if b <= 32 else "<u8").astype(np.uint64) & np.uint64(2**b - 1)


def field_element(randbytes):  # uniform in [0, p): 255 random bits, redrawn when >= p
    while (v := int.from_bytes(randbytes(32), "little") & (2**255 - 1)) >= P:
        pass
    return v


def x25519_key(randbytes):  # -> (private key, clamped scalar < p); the two scalars >= p redrawn
    while True:
        raw = bytearray(randbytes(32))
        raw[0], raw[31] = raw[0] & 248, (raw[31] & 127) | 64
        if (scalar := int.from_bytes(raw, "little")) < P:
            return X25519PrivateKey.from_private_bytes(bytes(raw)), scalar


def public(key):
    return key.public_key().public_bytes_raw()


def exchange(key, peer):  # a low-order peer key (all-zero secret) raises ValueError
    secret = key.exchange(X25519PublicKey.from_public_bytes(peer))
    if secret == bytes(32):
        raise ValueError("low-order key")
    return secret


def split(secret, coefficients, points):  # f(x) = secret + a1 x + ... + a_{t-1} x^(t-1) mod p
    def f(x):
        acc = 0
        for a in reversed([secret, *coefficients]):
            acc = (acc * x + a) % P
        return acc

    return [f(x) for x in points]


def combine(points, shares):  # Lagrange at 0 (used by the tests: the device never rebuilds)
    total = 0
    for i, (xi, yi) in enumerate(zip(points, shares, strict=True)):
        num = den = 1
        for j, xj in enumerate(points):
            if j != i:
                num, den = num * -xj % P, den * (xi - xj) % P
        total = (total + yi * num * pow(den, -1, P)) % P
    return total


def le32(v):
    return v.to_bytes(32, "little")


def circle(roster, job, r, nc):  # the roster permuted: Fisher-Yates from the top, ChaCha20 words
    seed, ring = hkdf(nc, b"", context("graph", job, r)), list(roster)
    enc = Cipher(algorithms.ChaCha20(seed, bytes(16)), None).encryptor()
    for i in range(len(ring) - 1, 0, -1):
        while (w := int.from_bytes(enc.update(bytes(8)), "little")) >= 2**64 - 2**64 % (i + 1):
            pass
        j = w % (i + 1)
        ring[i], ring[j] = ring[j], ring[i]
    return ring


def neighbours(me, roster, k, job, r, nc):  # Harary H(n, k) on the circle, sorted by id
    roster = sorted(roster)
    n = len(roster)
    if k >= n - 1:
        return [v for v in roster if v != me]
    if k < 2 or k % 2:
        raise ValueError(f"out_of_range: k = {k} must be even below n - 1 = {n - 1}")
    ring = circle(roster, job, r, nc)
    p = ring.index(me)
    return sorted({ring[(p + s * o) % n] for o in range(1, k // 2 + 1) for s in (1, -1)})


# --- strict msgpack (docs/protocol.md, "Encoding rules")
def unpack(payload):  # one map, str keys, none repeated, nothing after it
    def pairs(kv):
        if len({k for k, _ in kv}) != len(kv) or not all(type(k) is str for k, _ in kv):
            raise Rejected("malformed")
        return dict(kv)

    try:
        m = msgpack.unpackb(payload, raw=False, object_pairs_hook=pairs, strict_map_key=False)
    except Rejected:
        raise
    except Exception:
        raise Rejected("malformed") from None
    if type(m) is not dict:
        raise Rejected("malformed")
    return m


def decode(payload):  # -> (kind, r, nc, per-neighbour array, {optional key: value}) received
    m = unpack(payload)
    if type(m.get("v")) is not int or m["v"] != 1:
        raise Rejected("wrong_version")
    if type(m.get("k")) is not str or m["k"] not in RECEIVED:
        raise Rejected("wrong_kind")
    keys = ("v", "k", "r", "nc", RECEIVED[m["k"]])
    if any(k not in keys + OPTIONAL.get(m["k"], ()) for k in m):
        raise Rejected("unknown_field")
    if any(k not in m for k in keys):
        raise Rejected("missing_field")
    r, nc, arr = m["r"], m["nc"], m[keys[4]]
    if type(r) is not int or type(nc) is not bytes or type(arr) is not list:
        raise Rejected("bad_type")
    if not 0 <= r <= R_MAX or len(nc) != 16:
        raise Rejected("out_of_range")
    more = {k: m[k] for k in OPTIONAL.get(m["k"], ()) if k in m}
    if "z" in more and type(more["z"]) is not bool:  # a bool is never an int (rule 5)
        raise Rejected("bad_type")
    if "z" in more and more["z"] is not True:  # its domain is {true}: false is not "absent"
        raise Rejected("out_of_range")
    return m["k"], r, nc, arr, more


def pack(kind, r, nc, **body):  # key order: v k r nc, then the table's
    return msgpack.packb({"v": 1, "k": kind, "r": r, "nc": nc, **body})


def packed(v, b):  # values mod 2^b (uint64) -> LE, ceil(b/8) bytes each (mx's y, ua's z)
    return v.astype("<u8").view(np.uint8).reshape(-1, 8)[:, : -(-b // 8)].tobytes()


def bins(entry, sizes):  # an array of bins of these sizes
    if type(entry) is not list or not all(type(x) is bytes for x in entry):
        raise Rejected("bad_type")
    if len(entry) not in sizes or [len(x) for x in entry] != [32, 32, 64][: len(entry)]:
        raise Rejected("out_of_range")
    return entry


class Session:
    """The device's side of one SecAgg+ round (spec section 7): `advertise`, then `receive` each
    `nk`, `sf`, `uq` payload and `submit` the integer input; each returns the bytes to publish on
    up/<device> (or None). Rejected: ignore that message; Aborted: out of the round for good."""

    def __init__(self, me, job, r, nc, roster, k, t, b, d, q, randbytes=os.urandom, sign=None,
                 directory=None):  # fmt: skip
        roster = sorted(roster)
        if me not in roster or len(set(roster)) != len(roster) or len(nc) != 16:
            raise ValueError("out_of_range: not in the roster, a repeated id, or nc not 16 bytes")
        if not (1 <= b <= 64 and d >= 1 and q >= 0 and t >= 1 and 0 <= r <= R_MAX):
            raise ValueError("out_of_range: b, d, Q, t or r")
        self.me, self.job, self.r, self.nc = me, job, r, nc
        self.b, self.d, self.q, self.t = b, d, q, t
        self.nb = neighbours(me, roster, k, job, r, nc)
        self.point = {v: 1 + i for i, v in enumerate(roster)}  # Shamir point: 1 + roster index
        self.randbytes, self.sign, self.directory = randbytes, sign, directory or {}
        self.state, self.x, self.answers, self.mx = "new", None, {}, None
        self.noise = None  # the noise added to x (mod 2^b), kept apart until the uq (section 12)
        self.c, _ = x25519_key(randbytes)  # draw order: share key, mask key, seed
        self.s, self.s_scalar = x25519_key(randbytes)
        self.beta = field_element(randbytes)
        self.ck, self.sk = public(self.c), public(self.s)

    def ctx(self, label, *names):
        return context(label, self.job, self.r, *names)

    def advertise(self):  # ak: ck, sk, bh = SHA-256(context ‖ nc ‖ β LE), sig
        if self.state != "new":
            raise Rejected("wrong_phase")
        self.state = "advertised"
        bh = hashlib.sha256(self.ctx("seed-commitment", self.me) + self.nc + le32(self.beta))
        self.bh = bh.digest()  # signed again in mx (the advert's signature does not cover it)
        sig = self.sign and self.sign(self.ctx("advert", self.me) + self.nc + self.ck + self.sk)
        body = {"ck": self.ck, "sk": self.sk, "bh": self.bh, **({"sig": sig} if sig else {})}
        return pack("ak", self.r, self.nc, **body)

    def receive(self, payload):
        if payload in self.answers:  # the same bytes again: the same answer again
            return self.mx if self.answers[payload] == "sf" else self.answers[payload]
        if self.state in ("done", "aborted"):
            raise Rejected("closed")
        kind, r, nc, arr, more = decode(payload)
        if (r, nc) != (self.r, self.nc):
            raise Rejected("wrong_nonce")
        if kind != {"advertised": "nk", "shared": "sf", "masked": "uq"}.get(self.state):
            raise Rejected("wrong_phase")
        if len(arr) != len(self.nb):
            raise Rejected("out_of_range")
        try:
            out = getattr(self, "on_" + kind)(arr, **more)
        except Aborted:
            self.state, self.x, self.beta, self.noise = "aborted", None, None, None
            raise
        self.answers[payload] = "sf" if kind == "sf" else out
        return out

    def on_nk(self, keys):  # -> sh: key and seed shares sealed for each neighbour with keys
        for e in keys:
            if e is not None:
                bins(e, (2, 3))
        self.keys = {v: e for v, e in zip(self.nb, keys, strict=True) if e is not None}
        for v, e in self.keys.items():
            pub = self.directory.get(v)
            if pub is not None:  # a key without a valid signature where the directory has v's
                try:
                    sig = e[2] if len(e) == 3 else b""
                    pub.verify(sig, self.ctx("advert", v) + self.nc + e[0] + e[1])
                except Exception:
                    raise Aborted(f"keys of {v}: missing or bad signature") from None
        if len(self.keys) < self.t:
            raise Aborted(f"{len(self.keys)} neighbours with keys, fewer than t = {self.t}")
        try:
            self.pair = {v: exchange(self.s, e[1]) for v, e in self.keys.items()}
            self.shared = {v: exchange(self.c, e[0]) for v, e in self.keys.items()}
        except ValueError:
            raise Aborted("a neighbour's key is of low order") from None
        pts = [self.point[v] for v in self.keys]
        coef_key = [field_element(self.randbytes) for _ in range(self.t - 1)]
        coef_seed = [field_element(self.randbytes) for _ in range(self.t - 1)]
        ks, ss = split(self.s_scalar, coef_key, pts), split(self.beta, coef_seed, pts)
        sealed = {v: le32(a) + le32(b) for v, a, b in zip(self.keys, ks, ss, strict=True)}
        self.s_scalar = None  # the mask key's scalar lives on in its shares only
        c = [self.seal(v, sealed[v]) if v in sealed else None for v in self.nb]
        self.state = "shared"
        return pack("sh", self.r, self.nc, c=c)

    def aead(self, sender, receiver, ck_s, sk_s, ck_r, sk_r):  # K_{sender→receiver} and its AD
        key = hkdf(self.shared[sender if receiver == self.me else receiver], self.nc,
                   self.ctx("share-key", sender, receiver))  # fmt: skip
        ad = self.ctx("share", sender, receiver) + self.nc + ck_s + sk_s + ck_r + sk_r
        return ChaCha20Poly1305(key), ad

    def seal(self, v, plain):
        box, ad = self.aead(self.me, v, self.ck, self.sk, *self.keys[v][:2])
        return box.encrypt(bytes(12), plain, ad)

    def on_sf(self, c):  # open what each neighbour sealed for me; they are my mask set
        self.held = {}
        for v, e in zip(self.nb, c, strict=True):
            if e is None:
                continue
            if type(e) is not bytes:
                raise Rejected("bad_type")
            if len(e) != 80:
                raise Rejected("out_of_range")
            if v not in self.keys:
                raise Aborted(f"shares from {v}, which advertised no keys")
            box, ad = self.aead(v, self.me, *self.keys[v][:2], self.ck, self.sk)
            try:
                plain = box.decrypt(bytes(12), e, ad)
            except Exception:
                raise Aborted(f"the share from {v} does not authenticate") from None
            shares = int.from_bytes(plain[:32], "little"), int.from_bytes(plain[32:], "little")
            if max(shares) >= P:
                raise Aborted(f"the share from {v} is not a field element")
            self.held[v] = shares
        self.state = "ready"
        return self.masked()

    def submit(self, x, modular=False, noise=None):  # |x_i| <= Q, or any int64 mod 2^b (modular)
        # noise (distributed DP, modular only): d more int64 added to x, and kept on their own
        # until the uq, which may ask for them (`z`, section 12); without it a `z` request aborts
        if self.x is not None or self.state in ("masked", "done", "aborted"):
            raise ValueError("submit: already submitted, or the session is closed")
        if noise is not None and not modular:
            raise ValueError("submit: noise is for modular (distributed DP) inputs only")
        vs = [np.asarray(v) for v in (x, *(() if noise is None else (noise,)))]
        for v in vs:
            if v.shape != (self.d,) or not (v.dtype.kind in "iu" or v.size == 0):
                raise ValueError(f"submit: expected {self.d} integers, got {v.dtype} {v.shape}")
            if modular and v.size and v.dtype.kind == "u" and int(v.max()) >= 2**63:
                raise ValueError("submit: modular values must be int64")
        if not modular and vs[0].size and int(np.abs(vs[0].astype(object)).max()) > self.q:
            raise ValueError(f"submit: a value beyond Q = {self.q} could wrap the sum")
        x, *z = (v.astype(np.int64).astype(np.uint64) for v in vs)  # two's complement: mod 2^64
        self.x = x + z[0] if z else x  # uint64 wraps: mod 2^64, so mod 2^b
        self.noise = z[0] & np.uint64(2**self.b - 1) if z else None
        return self.masked() if self.state == "ready" else None

    def masked(self):  # y = x + PRG(self) + Σ ±PRG(pair) mod 2^b, once both sf and x are in
        if self.x is None or self.state != "ready":
            return None
        seed = hkdf(le32(self.beta), self.nc, self.ctx("self-mask", self.me))
        y = self.x + prg(seed, self.d, self.b)
        for v in self.held:
            lo, hi = sorted((self.me, v))
            mask = prg(hkdf(self.pair[v], self.nc, self.ctx("pair-mask", lo, hi)), self.d, self.b)
            y = y + mask if self.me < v else y - mask  # uint64 wraps: mod 2^64, so mod 2^b
        y &= np.uint64(2**self.b - 1)
        self.x, self.beta, self.pair = None, None, None  # the input goes as soon as it is masked
        m = sum(1 << i for i, v in enumerate(self.nb) if v in self.held)
        m = m.to_bytes(-(-len(self.nb) // 8), "little")
        y = packed(y, self.b)
        sig = self.sign and self.sign(self.ctx("masked", self.me) + self.nc + self.bh + m + y)
        self.state = "masked"
        self.mx = pack("mx", self.r, self.nc, b=self.b, m=m, y=y, **({"sig": sig} if sig else {}))
        return self.mx

    def on_uq(self, a, z=False):  # -> ua: per neighbour its seed share (1), key share (2) or
        # nil (0); with z (true: decode refused anything else) also my own noise, packed as y
        if not all(type(x) is int for x in a):
            raise Rejected("bad_type")
        if not all(x in (0, 1, 2) for x in a):
            raise Rejected("out_of_range")
        if z and self.noise is None:
            raise Aborted("asked for my noise, but I added none")
        if z and self.sign:  # an aggregator that may lie could ask everyone: all noise stripped
            raise Aborted("asked for my noise, but I sign (device keys): I never reveal it")
        s = []
        for v, x in zip(self.nb, a, strict=True):
            if x and v not in self.held:
                raise Aborted(f"asked for a share of {v}, which I do not hold")
            s.append(le32(self.held[v][2 - x]) if x else None)
        body = {"s": s, **({"z": packed(self.noise, self.b)} if z else {})}
        self.state, self.held, self.noise = "done", None, None  # the noise goes with the round
        return pack("ua", self.r, self.nc, **body)


# --- distributed discrete Gaussian (spec section 12; docs/protocol.md, `distributed-gaussian`)
DDG = "distributed-gaussian"
SQRT_2_LN_1_OVER_BETA = 1.0  # β = e^(-1/2), a constant of the mechanism: √(2 ln(1/β)) = 1


def round_seed(job, r, nc):  # the public round seed: HKDF(nc, salt empty, context("round-seed"))
    return hkdf(nc, b"", context("round-seed", job, r))


def padded(d):  # D′: the next power of two >= d
    return 1 << max(0, (d - 1).bit_length())


def signs(seed, dp):  # ±1 from the ChaCha20 keystream of the seed: bit i, LSB first, 1 -> +1
    bits = np.unpackbits(np.frombuffer(keystream(seed, -(-dp // 8)), np.uint8), bitorder="little")
    return np.where(bits[:dp] == 1, 1.0, -1.0)


def walsh_hadamard(x):  # H x, H Sylvester-ordered (H_2n = [[H, H], [H, -H]]), unnormalised
    y = np.array(x, dtype=np.float64)
    n, h = len(y), 1
    if n & (n - 1):
        raise ValueError("walsh_hadamard: the length must be a power of two")
    while h < n:
        y = y.reshape(-1, 2, h)
        y = np.stack((y[:, 0] + y[:, 1], y[:, 0] - y[:, 1]), axis=1).reshape(-1)
        h *= 2
    return y


def rotate(x, s):  # H·diag(s)·x / √D′, x zero-padded to D′ = len(s)
    z = np.zeros(len(s))
    z[: len(x)] = x
    return walsh_hadamard(s * z) / np.sqrt(len(s))


def unrotate(y, s, d):  # the inverse (H² = D′ I): diag(s)·H·y / √D′, its first d values
    return (s * walsh_hadamard(y) / np.sqrt(len(s)))[:d]


def delta2(clip, g, dp):  # Δ₂ = min(c/γ + √D′, √((c/γ)² + D′/4 + √(2 ln 1/β) (c/γ + √D′/2)))
    cg = clip / g
    tight = np.sqrt(cg**2 + dp / 4 + SQRT_2_LN_1_OVER_BETA * (cg + np.sqrt(dp) / 2))
    return float(min(cg + np.sqrt(dp), tight))


def ring_bits(n, d2, s2, sds=7):  # bit_length(⌈n Δ₂ + sds √(n σ²)⌉) + 1
    return int(np.ceil(n * d2 + sds * np.sqrt(n * float(s2)))).bit_length() + 1


class Generator:
    """A ChaCha20-keyed generator (key from the device's CSPRNG unless given): bytes, uniform
    integers by rejection on whole bytes, Bernoulli(a/b), and 53-bit uniform floats."""

    def __init__(self, key=None):
        key = os.urandom(32) if key is None else key
        self.enc = Cipher(algorithms.ChaCha20(key, bytes(16)), None).encryptor()
        self.buf, self.pos = b"", 0

    def bytes(self, n):
        if self.pos + n > len(self.buf):
            self.buf, self.pos = self.buf[self.pos :] + self.enc.update(bytes(max(n, 1 << 16))), 0
        out, self.pos = self.buf[self.pos : self.pos + n], self.pos + n
        return out

    def below(self, n):  # uniform in [0, n): whole bytes, masked to n−1's bit length, redrawn
        bits = (n - 1).bit_length()
        mask, size = (1 << bits) - 1, -(-bits // 8)
        while (v := int.from_bytes(self.bytes(size), "little") & mask) >= n:
            pass
        return v

    def bernoulli(self, a, b):  # P = a/b, integers 0 <= a <= b
        return self.below(b) < a

    def uniform(self, n):  # n floats uniform in [0, 1), 53 bits each
        return (np.frombuffer(self.bytes(8 * n), "<u8") >> np.uint64(11)) / 2.0**53


def bernoulli_exp(a, b, rng):  # Bernoulli(exp(−a/b)), a >= 0, b > 0 integers (CKS20, Alg. 1)
    while a > b:  # γ > 1: ⌊γ⌋ draws of Bernoulli(e^−1), then the rest
        if not bernoulli_exp(1, 1, rng):
            return False
        a -= b
    k = 1
    while rng.bernoulli(a, b * k):  # γ <= 1: K <- K + 1 while Bernoulli(γ/K); return K odd
        k += 1
    return k % 2 == 1


def discrete_laplace(t, rng):  # P(y) ∝ exp(−|y|/t), t >= 1 integer, by its geometric decomposition
    while True:
        u = rng.below(t)
        if not bernoulli_exp(u, t, rng):
            continue
        v = 0
        while bernoulli_exp(1, 1, rng):
            v += 1
        y, negative = u + t * v, rng.below(2) == 1
        if negative and y == 0:
            continue
        return -y if negative else y


def sigma2_fraction(s2):  # mp.s2: an integer, or thousandths below 1 -> (numerator, denominator)
    if s2 >= 1:
        if s2 != int(s2):
            raise ValueError(f"out_of_range: mp.s2 = {s2} is neither an integer nor below 1")
        return int(s2), 1
    num = round(s2 * 1000)
    if not 1 <= num < 1000 or abs(num / 1000 - s2) > 1e-12:
        raise ValueError(f"out_of_range: mp.s2 = {s2} is not a whole number of thousandths")
    return num, 1000


def discrete_gaussian(s2, n, rng):  # n exact draws of N_Z(0, σ²), σ² = a/b rational (CKS20)
    a, b = s2 if isinstance(s2, tuple) else sigma2_fraction(s2)
    t = isqrt(a // b) + 1  # ⌊σ⌋ + 1
    out = np.empty(n, np.int64)
    for i in range(n):
        while True:
            y = discrete_laplace(t, rng)
            # accept with exp(−(|y| − σ²/t)² / 2σ²) = exp(−(|y| b t − a)² / (2 a b t²))
            if bernoulli_exp((abs(y) * b * t - a) ** 2, 2 * a * b * t * t, rng):
                out[i] = y
                break
    return out


def conditional_round(z, bound, rng):  # up with probability frac, again until ‖·‖₂ <= bound
    low = np.floor(z)
    while True:
        x = low + (rng.uniform(len(z)) < z - low)
        if float(np.sqrt(np.sum(x * x))) <= bound:
            return x.astype(np.int64)


def check_ddg(mp, sa, d):  # -> mp's values; ValueError names the key, as the protocol's reasons
    spec = {"clip": "num", "g": "num", "s2": "num", "nmin": "int", "dp": "int", "b": "int"}
    bad = [k for k, t in spec.items() if not plain.is_a(mp.get(k), t)]
    if bad:
        raise ValueError(f"missing_field/bad_type: mp.{bad[0]}")
    for key in ("clip", "g", "s2"):
        if not mp[key] > 0:
            raise ValueError(f"out_of_range: mp.{key} = {mp[key]}")
    sigma2_fraction(mp["s2"])
    if mp["dp"] != padded(d):
        raise ValueError(f"out_of_range: mp.dp = {mp['dp']}, not the next power of two >= {d}")
    if not 1 <= mp["nmin"] <= 2**40 or not 2 <= mp["b"] <= 64:
        raise ValueError("out_of_range: mp.nmin or mp.b")
    # sa.q is not checked: section 7 says "Q is then 0 on the wire", the aggregator sends ⌈Δ₂⌉
    if not sa["md"] or sa["n"] != mp["dp"] or sa["b"] != mp["b"]:
        raise ValueError(f"out_of_range: sa (md {sa['md']}, n {sa['n']}, b {sa['b']}) disagrees"
                         f" with mp (dp {mp['dp']}, b {mp['b']})")  # fmt: skip
    if mp["nmin"] > sa["ms"]:
        raise ValueError(f"out_of_range: mp.nmin = {mp['nmin']} above sa.ms = {sa['ms']}")
    return mp


def check_cal(mp, d, config, cal):  # mp against the job document's `cal` row for its arguments
    # (ε, δ, T from the job's config; c, γ, n_min from mp; d = len(w)); -> the row, or None
    if config is None:
        return None
    pv, rounds = config["privacy"], config["rounds"]["rounds"]
    if float(mp["clip"]) != float(pv["clip"]):
        raise ValueError(f"mp.clip = {mp['clip']} is not the job's privacy.clip {pv['clip']}")
    want = [DDG, pv["epsilon"], pv["delta"], rounds, pv["clip"], mp["g"], d, mp["nmin"]]
    rows = [row for row in cal or [] if list(row[:-1]) == want]
    if not rows:
        return None  # no row for these arguments: mp is taken from the signed global alone
    if mp["s2"] != rows[0][-1]:  # the row's value is σ² as it travels in mp (float, exact)
        raise ValueError(f"mp.s2 = {mp['s2']} disagrees with the job's cal row {rows[0]}")
    return rows[0]


def ddg_encode(u, mp, job, r, nc, rng=None):  # -> (x, noise): D′ integers each, before the
    # reduction mod 2^b; x + noise is what is summed, noise is kept apart for a `z` request
    rng = rng or Generator()
    clip, g, dp = float(mp["clip"]), float(mp["g"]), mp["dp"]
    u = np.asarray(u, np.float64)
    u = u * min(1.0, clip / max(float(np.linalg.norm(u)), 1e-300))
    z = rotate(u, signs(round_seed(job, r, nc), dp)) / g
    x = conditional_round(z, delta2(clip, g, dp), rng)
    return x, discrete_gaussian(mp["s2"], dp, rng)


# --- the MQTT device: devices/minimal/device.py plus secure rounds (docs/protocol.md, "Secure
# aggregation": the `sa` map, inbox/<device>, ak at once then training, mx when sf and x are in)
sys.path.insert(0, str(Path(__file__).resolve().parent))
import device as plain  # noqa: E402  (the folder's plain device: decoding, training, the MQTT loop)

plain.GLOBAL["sa"] = "map"  # a secure round's parameters, inside the signed global body
plain.MP[DDG] = "clip:num g:num s2:num nmin:int dp:int b:int"  # secure rounds only
SA = {"b": (2, 64), "k": (1, None), "md": None, "ms": (2, None), "n": (1, 2**31), "q": (0, 2**62),
      "t": (1, None)}  # fmt: skip


def check_sa(g, signing=False):  # -> sa, the roster; ValueError names the key (`sa.k`)
    sa, sel = g["sa"], g.get("sel") or []
    if set(sa) - set(SA) or set(SA) - set(sa):
        raise ValueError(f"unknown_field/missing_field: sa keys {sorted(sa)}")
    for key, rng in SA.items():
        if type(sa[key]) is not (bool if rng is None else int):
            raise ValueError(f"bad_type: sa.{key}")
    # fedbuff: a cohort (protocol.md "Secure FedBuff cohorts"), answered as a sync round
    if g["mode"] not in ("sync", "fedbuff") or "nc" not in g or len(set(sel)) != len(sel):
        raise ValueError("out_of_range: sa needs mode sync or fedbuff, nc and a distinct sel")
    if len(sel) < 2:
        raise ValueError("out_of_range: sa needs a sel of >= 2 devices")
    n = len(sel)
    hi = {"k": n - 1, "ms": n, "t": sa["k"]}
    for key, rng in SA.items():
        if rng and not rng[0] <= sa[key] <= (rng[1] if rng[1] else hi[key]):
            raise ValueError(f"out_of_range: sa.{key} = {sa[key]}")
    if not sa["md"] and n * sa["q"] >= 2 ** (sa["b"] - 1):
        raise ValueError("out_of_range: sa.q (n q >= 2^(b-1))")
    # with device keys (a device that signs) the aggregator may lie about who dropped: then t
    # must exceed k/2, so it never collects t shares of both of a device's secrets
    if signing and not 2 * sa["t"] > sa["k"]:
        raise ValueError(f"out_of_range: sa.t = {sa['t']} (2t must exceed k = {sa['k']})")
    return sa, sorted(sel)


def encode(u, mp, sa, clip, step=None):  # `none`: L2-clip to clip, /step, unbiased rounding
    if mp["m"] != "none" or sa["md"] or len(u) != sa["n"]:
        raise ValueError(f"no secure encoding here for {mp['m']!r}, md {sa['md']}, n {sa['n']}")
    step = step or clip / sa["q"]  # q = ceil(clip / step)
    v = u * min(1.0, clip / max(float(np.linalg.norm(u)), 1e-300)) / step
    coin = (np.frombuffer(os.urandom(8 * len(v)), "<u8") >> np.uint64(11)) / 2.0**53
    return np.clip(np.floor(v) + (coin < v - np.floor(v)), -sa["q"], sa["q"]).astype(np.int64)


class SecureDevice(plain.Device):
    def __init__(self, a):
        super().__init__(a)
        pre, self.session, self.clip = f"{a.prefix or 'edgefl'}/{a.job}", None, (a.clip, a.step)
        self.config = self.cal = None  # the job document's config and cal rows, once it arrived
        self.t_inbox, self.t_job = f"{pre}/inbox/{a.id}", f"{pre}/job"

    def on_connect(self, client, userdata, flags, reason, props):  # the inbox before the status
        if reason.is_failure:
            return plain.log.error("connect refused: %s", reason)
        topics = (self.t_inbox, self.t_job, self.t_global, self.t_ack, self.t_dispatch)
        client.subscribe([(t, 1) for t in topics])
        client.publish(self.t_status, self.status(True), qos=1, retain=True)
        self.q.put(("connected", b"", False))

    def run(self):  # plain's loop; inbox payloads go to the current session, job documents here
        get = self.q.get

        def next_message():
            while True:
                topic, payload, retained = get()
                if topic not in (self.t_inbox, self.t_job):
                    return topic, payload, retained
                if payload and topic == self.t_job:
                    self.on_job(payload)
                elif payload and self.session:
                    self.on_inbox(payload)

        self.q.get = next_message
        super().run()

    def on_job(self, payload):  # the clip (and step) the job quantises with: not in `mp` or `sa`
        try:
            m = plain.unpack_map(payload)
            if m.get("k") == "js" and self.pubkey is not None:
                self.pubkey.verify(m["sig"], b"edge-fl/job/v1\x00" + m["b"])
            elif self.pubkey is not None:
                raise ValueError("unsigned")
            body = plain.unpack_map(m["b"]) if m.get("k") == "js" else m
            if body.get("k") != "j" or body.get("job") != self.a.job:
                raise ValueError("not this job's document")
            config = body["config"]
            clip, step = config["privacy"]["clip"], config["secure_aggregation"].get("step")
            if not plain.is_a(clip, "num") or not (step is None or plain.is_a(step, "num")):
                raise ValueError("privacy.clip or secure_aggregation.step is not a number")
        except Exception as e:
            return plain.log.warning("job document ignored: %s %s", type(e).__name__, e)
        self.clip = (self.a.clip or clip, self.a.step or step)
        self.config, self.cal = config, body.get("cal")
        plain.log.info("job document: clip %s, step %s", *self.clip)

    def publish(self, body, what):
        self.client.publish(self.t_up, body, qos=1)
        plain.log.info("round %d: sent %s, %d bytes", self.session.r, what, len(body))

    def on_inbox(self, payload):
        try:
            out = self.session.receive(payload)
        except Rejected as e:
            return plain.log.info("inbox message ignored: %s", e)
        except Aborted as e:
            return plain.log.warning("round %d: left the secure round: %s", self.session.r, e)
        if out:
            m = msgpack.unpackb(out)
            self.publish(out, m["k"])
            if "z" in m:  # a uq with z: the aggregator removes this noise from the sum
                plain.log.info("round %d: revealed my noise (z) in ua", self.session.r)

    def answer(self, g):  # a secure round: a new session, ak at once, then train and submit
        if "sa" not in g:
            return super().answer(g)
        sa, roster = check_sa(g)
        ddg = (g.get("mp") or {}).get("m") == DDG  # its clip travels in mp
        if self.clip[0] is None and not ddg:  # checked before anything is sent
            raise ValueError("no clip: give --clip or let the job document arrive")
        if g["rnd"] <= self.answered or self.stopped or self.halted or self.id not in roster:
            return False
        self.answered, mp = g["rnd"], plain.check_mp(g.get("mp"))
        if ddg:  # refused before ak when mp disagrees with sa, the model or the job's calibration
            check_ddg(mp, sa, len(g["w"]))
            check_cal(mp, len(g["w"]), self.config, self.cal)
        elif mp["m"] != "none" or sa["md"]:  # refused before ak: joining would cost the round
            raise ValueError(f"mechanism {mp['m']!r}: no secure encoding here (none, {DDG})")
        if self.session and self.session.nc == g["nc"]:  # the same round again: nothing new
            return False
        self.session = Session(self.id, self.a.job, g["rnd"], g["nc"], roster, sa["k"], sa["t"],
                               sa["b"], sa["n"], sa["q"])  # fmt: skip
        self.publish(self.session.advertise(), "ak")
        f, c, d = self.X.shape[1], self.a.classes, len(g["w"])
        self.shapes = self.shapes or plain.layout(self.a.model, f, c, d)
        u = plain.train(g["w"], self.shapes, self.X, self.y, mp["lr"], mp["ep"], mp["bs"])
        if ddg:
            x, noise = ddg_encode(u, mp, self.a.job, g["rnd"], g["nc"])
            out = self.session.submit(x, modular=True, noise=noise)
        else:
            out = self.session.submit(encode(u, mp, sa, *self.clip))
        self.uploads += 1
        if out:
            self.publish(out, "mx")
        return False


def main(argv=None):
    p = plain.argparse.ArgumentParser(description=__doc__)
    for flag in ("--broker", "--job", "--id", "--data", "--password", "--username", "--prefix",
                 "--digest", "--public-key"):  # fmt: skip
        p.add_argument(flag, required=flag in ("--broker", "--job", "--id", "--data"))
    p.add_argument("--model", default="auto", choices=["auto", "logreg", "mlp"])
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--clip", type=float, help="privacy.clip; default: the job document's")
    p.add_argument("--step", type=float, help="default: the job document's, else clip / sa.q")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    plain.logging.basicConfig(level=plain.logging.INFO if a.verbose else plain.logging.WARNING,
                              format=f"%(asctime)s {a.id} %(levelname)s %(message)s")  # fmt: skip
    SecureDevice(a).run()


if __name__ == "__main__":
    main()
