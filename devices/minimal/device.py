"""Minimal edge-fl device from docs/protocol.md (wire protocol v1) alone: paho-mqtt 2, msgpack, numpy
(+ cryptography to verify signed globals). X of --data is preprocessed as the doc says; y = labels."""

import argparse
import logging
import math
import os
import queue
import secrets
import sys
from itertools import accumulate
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import msgpack  # msgpack >= 1.0 packs bytes as bin, floats as float64 and ints in the shortest form
import numpy as np
import paho.mqtt.client as mqtt

log = logging.getLogger("minimal-device")
CSPRNG = secrets.SystemRandom()  # os.urandom: signs, selections, coins, noise, randomized response
CONTEXT, DCONTEXT = b"edge-fl/global/v1\x00", b"edge-fl/dispatch/v1\x00"
BENIGN_NACKS = {"late", "not_selected", "duplicate", "stale", "future"}
# key:type of the global message ("!" = required), and the mp keys each mechanism needs here
GLOBAL = """v:int! k:str! job:str! ver:int! rnd:int! mode:str! dt:str! w:bin! dl:num! cfg:str! ts:num
    sel:list q:num sd:map mp:map done:bool nc:bin qp:bin run:bin"""
GLOBAL = dict(kv.split(":") for kv in GLOBAL.split())
DISPATCH = "v:int! k:str! job:str! ver:int! nc:bin! sel:list!"  # the dispatch message's keys
DISPATCH = dict(kv.split(":") for kv in DISPATCH.split())
MP = {"none": "", "signds": "d:int K:int h:int nth:int eps:num rr:num r0:num",
      "gaussian": "clip:num z:num", "gaussian-central": "clip:num"}  # fmt: skip
TYPES = dict(int=[int], num=[int, float], str=[str], bin=[bytes], bool=[bool], list=[list], map=[dict])  # fmt: skip
lg = math.lgamma


def is_a(value, t):  # exact msgpack types (a bool is never an int); numbers are finite
    return type(value) in TYPES[t] and (t != "num" or math.isfinite(value))


def unpack_map(payload):  # one map, nothing after it (msgpack raises ExtraData), str keys only once
    def pairs(kv):
        if len({k for k, _ in kv}) != len(kv) or not all(isinstance(k, str) for k, _ in kv):
            raise ValueError("malformed: repeated or non-str key")
        return dict(kv)

    obj = msgpack.unpackb(payload, raw=False, object_pairs_hook=pairs, strict_map_key=False)
    if not isinstance(obj, dict) or not is_a(obj.get("v"), "int") or obj["v"] != 1:
        raise ValueError("malformed or wrong_version")
    return obj


def unseal(payload, pubkey, kind, context, schema):  # -> body map, signature checked, key types
    m = unpack_map(payload)
    if m.get("k") == kind + "s":  # signed envelope: verify the body bytes as received, then parse
        if set(m) != {"v", "k", "b", "sig"} or not is_a(m["b"], "bin") or not is_a(m["sig"], "bin"):
            raise ValueError("malformed signed envelope")
        if pubkey is not None:  # InvalidSignature (also for a wrong length) = bad_signature
            pubkey.verify(m["sig"], context + m["b"])
        m = unpack_map(m["b"])
    elif pubkey is not None:
        raise ValueError("unsigned")
    bad = [] if m.get("k") == kind else ["k (wrong_kind)"]
    bad += [k for k in m if k not in schema or not is_a(m[k], schema[k].rstrip("!"))]
    return m, bad, [k for k, t in schema.items() if t.endswith("!") and k not in m]


def decode_dispatch(payload, pubkey=None):  # who trains on version ver (nonce nc), no model
    m, bad, missing = unseal(payload, pubkey, "d", DCONTEXT, DISPATCH)
    sel = [] if bad or missing else m["sel"]
    if not sel or len(m["nc"]) != 16 or len(set(map(str, sel))) != len(sel):
        raise ValueError(f"dispatch: unknown_field/bad_type {bad}, missing {missing}, nc or sel")
    if not all(is_a(d, "str") for d in sel):
        raise ValueError("dispatch: bad_type in sel")
    return m


def decode_global(payload, pubkey=None):
    m, bad, missing = unseal(payload, pubkey, "g", CONTEXT, GLOBAL)
    bad += ["qp (unknown_field)"] if "qp" in m and m.get("dt") != "q8" else []
    sized = {len(m.get(k, b"x" * 16)) for k in ("nc", "run")}  # the round's nonce, the run id
    if bad or missing or m["dt"] not in ("f4", "f2", "q8") or sized != {16}:
        raise ValueError(f"unknown_field/bad_type {bad}, missing_field {missing} or bad dt/nc/run")
    if m["dt"] == "q8":  # levels w_i; per block of 256: (lo, step) float32; x = lo + w_i step
        qp = np.frombuffer(m.get("qp", b""), "<f4").astype(np.float64).reshape(-1, 2)
        block = np.arange(len(m["w"])) // 256
        if len(qp) != -(-len(m["w"]) // 256) or not np.isfinite(qp).all() or (qp[:, 1] < 0).any():
            raise ValueError("missing_field/wrong_shape/out_of_range: qp")
        m["w"] = (qp[block, 0] + np.frombuffer(m["w"], np.uint8) * qp[block, 1]).astype(np.float32)
    else:
        m["w"] = np.frombuffer(m["w"], dtype="<" + m["dt"]).astype(np.float32)
    if not (len(m["w"]) and np.isfinite(m["w"]).all()):
        raise ValueError("wrong_shape or non_finite: w")
    return m


def check_mp(mp):  # mp carries the values a device MUST use; type-check the ones used here
    if not isinstance(mp, dict) or not is_a(mp.get("m"), "str") or mp["m"] not in MP:
        raise ValueError(f"mp absent, or mechanism {mp and mp.get('m')!r} not implemented here")
    need = [kv.split(":") for kv in ("m:str lr:num ep:int bs:int " + MP[mp["m"]]).split()]
    bad = [k for k, t in need if not is_a(mp.get(k), t)]
    if bad or mp["lr"] <= 0 or min(mp["ep"], mp["bs"]) < 1:
        raise ValueError(f"mp: a value is missing or invalid in {mp}")
    return mp


# --- models: the flat vector is the tensors in layout order, each in C order (row-major)
def layout(model, f, c, d):  # d alone is ambiguous (mlp f=64 H=64 c=10 = logreg c=74): c is given
    hid, rem = divmod(d - c, f + 1 + c)
    if model in ("logreg", "auto") and d == f * c + c:
        return [(f, c), (c,)]
    if model in ("mlp", "auto") and rem == 0 and hid > 0:
        return [(f, hid), (hid,), (hid, c), (c,)]
    raise ValueError(f"wrong_shape: d = {d} fits no {model} model with f = {f}, c = {c}")


def forward(w, shapes, X):  # -> logits, the mlp's hidden pre-activation, the tensors (views of w)
    ends = np.cumsum([0] + [math.prod(s) for s in shapes])
    t = [w[a:b].reshape(s) for a, b, s in zip(ends[:-1], ends[1:], shapes, strict=True)]
    a = X @ t[0] + t[1]
    return (a, None, t) if len(t) == 2 else (np.maximum(a, 0) @ t[2] + t[3], a, t)


def gradient(w, shapes, X, y):  # of the mean softmax cross-entropy over the batch
    z, a, t = forward(w, shapes, X)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    g = (p / p.sum(axis=1, keepdims=True) - np.eye(z.shape[1], dtype=z.dtype)[y]) / len(y)
    if a is None:
        return np.concatenate([(X.T @ g).ravel(), g.sum(0)])
    gh, hid = (g @ t[2].T) * (a > 0), np.maximum(a, 0)  # ReLU'(0) = 0
    return np.concatenate([(X.T @ gh).ravel(), gh.sum(0), (hid.T @ g).ravel(), g.sum(0)])


def train(w, shapes, X, y, lr, ep, bs):  # local SGD from w (float32); returns the delta (float64)
    w_local, rng = w.copy(), np.random.default_rng(int.from_bytes(os.urandom(16)))
    for _ in range(ep):
        perm = rng.permutation(len(y))
        for i in range(0, len(y), bs):
            b = perm[i : i + bs]
            w_local -= np.float32(lr) * gradient(w_local, shapes, X[b], y[b])
    return w_local.astype(np.float64) - w.astype(np.float64)


# --- SignDS
def nu_pmf(d, K, h, nth, eps):  # P(nu = tau), tau = 0..h, in log space (log-binomials, log-sum-exp)
    def lc(n, r):  # log C(n, r); C(n, r) = 0 outside 0 <= r <= n
        return lg(n + 1) - lg(r + 1) - lg(n - r + 1) if 0 <= r <= n else -math.inf

    lw = [lc(K, t) + lc(d - K, h - t) + (eps if t >= nth else 0.0) for t in range(h + 1)]
    lse = max(lw) + math.log(sum(math.exp(x - max(lw)) for x in lw))
    return [math.exp(x - lse) for x in lw]


def magrr_bit(u, S, sd, r0):  # before randomized response
    r = abs(float(np.mean(u[S]))) if len(S) else math.nan
    r_est = sd.get("r_est", r0) if 0 <= sd.get("r_est", r0) < 1 else 1.0
    reached = sd.get("reached") is True or (is_a(sd.get("reached"), "int") and sd["reached"] == 1)
    return int(r < r_est / 2) if reached else int(r < 2 * r_est)


def code_indices(idx, d):  # -> (c, bytes): 0 bit-packing, 1 delta + LEB128; the shorter, ties to 0
    wb, acc, dv = max(1, (d - 1).bit_length()), 0, []
    for n, i in enumerate(idx):
        acc, gap = (acc << wb) | i, i - idx[n - 1] if n else i
        groups = range(0, max(gap.bit_length(), 1), 7)
        dv += [(gap >> s & 0x7F) | (0x80 if gap >> s + 7 else 0) for s in groups]
    nbits = wb * len(idx)
    bp = (acc << (-nbits % 8)).to_bytes((nbits + 7) // 8, "big")
    return (0, bp) if len(bp) <= len(dv) else (1, bytes(dv))


def signds_vote(u, mp, sd):  # the doc's "SignDS on the device", steps 2-8
    d, K, h = len(u), mp["K"], mp["h"]
    s = 1 if secrets.randbits(1) else -1
    order = np.argsort(-s * u, kind="stable")  # top-k of the signed values: largest s * u first
    S, R, U = order[:K], order[K:], 1.0 - CSPRNG.random()  # U in (0, 1]
    pmf = nu_pmf(d, K, h, mp["nth"], mp["eps"])
    last, cum = max(t for t, p in enumerate(pmf) if p > 0), list(accumulate(pmf))
    nu = next(t for t in range(h + 1) if t >= last or cum[t] >= U)  # cum = 1 from `last` on
    picked = [int(S[i]) for i in CSPRNG.sample(range(K), nu)]
    picked += [int(R[i]) for i in CSPRNG.sample(range(d - K), h - nu)]
    bit = magrr_bit(u, S, sd, mp["r0"]) ^ (CSPRNG.random() >= 1 / (1 + math.exp(-mp["rr"])))
    c, ix = code_indices(sorted(picked), d)  # the bit is kept with p = e^rr / (1 + e^rr)
    return {"k": "s", "sb": (s > 0) | (bit << 1), "h": h, "c": c, "ix": ix}


# --- the device: the doc's state machine
class Device:
    def __init__(self, a):
        data = np.load(a.data)
        self.X, self.y = data["X"].astype(np.float32), data["y"].astype(np.int64)
        self.a, self.id, self.n, self.shapes = a, a.id, min(len(self.y), 10**7), None
        ok = len(self.y) == len(self.X) > 0 and self.X.ndim == 2
        if not ok or not 0 <= self.y.min() <= self.y.max() < a.classes:
            raise SystemExit(f"--data: X must be (n, f) rows and y n labels in [0, {a.classes})")
        self.pubkey, k = None, a.public_key
        if k:  # 64 hex characters, or a PEM (SubjectPublicKeyInfo) file
            from cryptography.hazmat.primitives import serialization as ser
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey as Pub

            pem = Path(k).exists() and ser.load_pem_public_key(Path(k).read_bytes())
            self.pubkey = pem or Pub.from_public_bytes(bytes.fromhex(k))
        pre = f"{a.prefix or 'edgefl'}/{a.job}"
        self.t_global, self.t_up = f"{pre}/global", f"{pre}/up/{a.id}"
        self.t_status, self.t_ack = f"{pre}/status/{a.id}", f"{pre}/ack/{a.id}"
        self.t_dispatch = f"{pre}/dispatch"  # who trains on a version, sent without the model
        self.q, self.fresh, self.stopped, self.halted = queue.Queue(), True, None, None
        self.last_rnd = self.last_ver = self.answered = -1
        self.sent, self.uploads = (None, b""), 0  # sent = (round, bytes) of the last update
        self.model = self.asked = None  # the last accepted global; (ver, nc) a dispatch asked for
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=a.id)
        self.client.will_set(self.t_status, self.status(False), qos=1, retain=True)
        self.client.on_connect = self.on_connect  # on_message: hand over to the main thread
        self.client.on_message = lambda c, u, msg: self.q.put((msg.topic, msg.payload, msg.retain))

    def status(self, on):
        st = {"v": 1, "k": "st", "dev": self.id, "on": on, "n": self.n}
        return msgpack.packb({**st, "i": {"stopped": self.stopped}} if self.stopped and on else st)

    def on_connect(self, client, userdata, flags, reason, props):
        if reason.is_failure:
            return log.error("connect refused: %s", reason)
        client.publish(self.t_status, self.status(True), qos=1, retain=True)  # status first
        client.subscribe([(self.t_global, 1), (self.t_ack, 1), (self.t_dispatch, 1)])
        self.q.put(("connected", b"", False))

    def run(self):
        u = urlparse(self.a.broker)
        user = self.a.username or (unquote(u.username) if u.username else self.id)
        password = self.a.password or (unquote(u.password) if u.password else None)
        self.client.username_pw_set(user, password)
        if u.scheme == "mqtts":
            self.client.tls_set(ca_certs=parse_qs(u.query).get("ca", [None])[0])
        self.client.connect_async(u.hostname, u.port or (8883 if u.scheme == "mqtts" else 1883))
        self.client.loop_start()  # reconnects by itself; every reconnect republishes the status
        while True:
            topic, payload, retained = self.q.get()
            try:
                if topic == "connected":
                    self.fresh = True  # window.rejoin(): the next global may be any number ahead
                elif payload and topic == self.t_ack:  # acks are optional: log them
                    ack = unpack_map(payload)
                    ok = ack.get("ok") is True
                    log.log(logging.INFO if ok else logging.WARNING, "ack %s", ack)
                    if not ok and ack.get("why") not in BENIGN_NACKS:
                        self.halted = ack.get("why")  # a bug or misconfiguration: stop uploading
                elif payload and topic == self.t_global and self.on_global(payload, retained):
                    break
                elif payload and topic == self.t_dispatch:
                    self.on_dispatch(decode_dispatch(payload, self.pubkey))
            except Exception as e:  # a message that cannot be decoded or answered: log, go on
                log.warning("%s ignored: %s %s", topic, type(e).__name__, e)
        bye = self.client.publish(self.t_status, self.status(False), qos=1, retain=True)
        bye.wait_for_publish(10)
        self.client.disconnect()
        self.client.loop_stop()
        print(f"{self.id}: {self.uploads} updates sent", file=sys.stderr)

    def on_global(self, payload, retained):  # -> True when the job is over
        g = decode_global(payload, self.pubkey)
        rnd, ver = g["rnd"], g["ver"]
        in_window = 0 <= rnd - self.last_rnd <= 64 and 0 <= ver - self.last_ver <= 64
        if g["job"] != self.a.job or not (self.fresh or in_window):  # another job, stale, too new
            return log.warning("global ignored: job %s, round %d, version %d", g["job"], rnd, ver)
        if g.get("done"):  # a retained marker may be an earlier run's: keep waiting
            return not retained
        self.fresh, self.last_rnd, self.last_ver = False, rnd, ver
        if self.a.digest and g["cfg"] not in ("", self.a.digest):
            return log.error("config digest %s is not mine: not training", g["cfg"])
        self.model = g
        selected = self.id in g.get("sel", [self.id]) or self.asked == (ver, g.get("nc"))
        if not selected:  # checked first: a re-publication that no longer selects me asks nothing
            return False
        if self.sent[0] == rnd:  # the same round again (QoS 1 redelivery, republish): same bytes
            self.client.publish(self.t_up, self.sent[1], qos=1)
            return False
        return self.answer(g)

    def on_dispatch(self, d):  # never moves the window, never re-sends; binds to (ver, nc)
        ver, in_window = d["ver"], self.fresh or 0 <= d["ver"] - self.last_ver <= 64
        if d["job"] != self.a.job or not in_window or self.id not in d["sel"]:
            return log.info("dispatch ignored: job %s, version %d", d["job"], ver)
        self.asked, g = (ver, d["nc"]), self.model  # a dispatch may arrive before its global
        if g is not None and (g["ver"], g.get("nc")) == self.asked and self.sent[0] != g["rnd"]:
            self.answer(g)

    def answer(self, g):  # train on g and publish the update, once per round
        rnd, ver = g["rnd"], g["ver"]
        if rnd <= self.answered or self.stopped or self.halted:
            return False
        self.answered = rnd
        if "q" in g and CSPRNG.random() >= g["q"]:  # Poisson selection: a fresh secret coin
            return log.info("round %d: not sampled", rnd)
        if g["mode"] != "sync" and any(t == self.t_global for t, _, _ in list(self.q.queue)):
            return log.info("version %d skipped: a newer one is queued", ver)
        body = self.update(g, check_mp(g.get("mp")))  # raises if this round cannot be answered
        head = {"v": 1, "r": rnd, "bv": ver, "n": self.n, **({"nc": g["nc"]} if "nc" in g else {})}
        if body:
            self.sent, self.uploads = (rnd, msgpack.packb({**head, **body})), self.uploads + 1
            self.client.publish(self.t_up, self.sent[1], qos=1)
            log.info("round %d: sent a %s update, %d bytes", rnd, g["mp"]["m"], len(self.sent[1]))
        return False

    def update(self, g, mp):  # -> the update's body after the header, or None (budget spent)
        m, w, d = mp["m"], g["w"], len(g["w"])
        dt = "<f4" if g["dt"] == "q8" else "<" + g["dt"]  # a q8 model is answered in f4
        if self.uploads >= mp.get("L", math.inf):  # budget spent: say so, never upload again
            self.stopped = "budget_exhausted"
            self.client.publish(self.t_status, self.status(True), qos=1, retain=True)
            return None
        self.shapes = self.shapes or layout(self.a.model, self.X.shape[1], self.a.classes, d)
        if sum(math.prod(s) for s in self.shapes) != d or (m == "signds" and mp["d"] != d):
            raise ValueError(f"wrong_shape: w (or mp.d) is not my model's d, {self.shapes}")
        u = train(w, self.shapes, self.X, self.y, mp["lr"], mp["ep"], mp["bs"])
        if m == "signds":
            return signds_vote(u, mp, g.get("sd", {}))
        if m != "none":  # gaussian(-central): clip in L2 to S
            u = u * min(1.0, mp["clip"] * (1 - 1e-6) / max(float(np.linalg.norm(u)), 1e-300))
        if m == "gaussian":  # + N(0, (zS)^2): Box-Muller on os.urandom uniforms in (0, 1]
            v = ((np.frombuffer(os.urandom(16 * d), "<u8") >> np.uint64(11)) + 1) / 2.0**53
            u = u + np.sqrt(-2 * np.log(v[:d])) * np.cos(2 * np.pi * v[d:]) * mp["z"] * mp["clip"]
        while m == "gaussian-central" and np.linalg.norm(u.astype(dt).astype(float)) > mp["clip"]:
            u = u * (1 - 2e-4)  # f2 rounding can push the norm over S: shrink until within
        return {"k": "u", "dt": dt[1:], "m": m, "x": u.astype(dt).tobytes()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for flag, text in [("--broker", "mqtt[s]://[user:pass@]host:port[?ca=CA_FILE]"), ("--job", "job id"),
            ("--id", "device id (= its MQTT username)"), ("--data", "npz with X and y"), ("--password", ""),
            ("--username", "default: from the URL, else the device id"), ("--prefix", "default edgefl"),
            ("--digest", "the job's config digest (run.json config_digest); unset: not checked"),
            ("--public-key", "aggregator Ed25519 key: 64 hex or a PEM file; requires signed globals")]:  # fmt: skip
        p.add_argument(flag, help=text, required=flag in ("--broker", "--job", "--id", "--data"))
    p.add_argument("--model", default="auto", choices=["auto", "logreg", "mlp"])
    p.add_argument("--classes", type=int, default=10, help="c, the number of classes (digits: 10)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {a.id} %(levelname)s %(message)s")  # fmt: skip
    Device(a).run()


if __name__ == "__main__":
    main()
