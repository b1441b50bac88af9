"""The minimal third-party device (`devices/minimal/device.py`, written from docs/protocol.md alone)
against the vectors, against the real `edge-fl aggregator` in a mixed fleet with `edge-fl device`
processes (mechanisms `none` and `signds`), and against a scripted aggregator that signs (the CLI
has no documented way to give the aggregator a key or to turn acks on)."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import math
import queue
import subprocess
import sys
import time
import uuid
from fractions import Fraction
from pathlib import Path

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ROOT / "devices" / "minimal" / "device.py"
VECTORS = ROOT / "tests" / "vectors"
EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))
SPEC = importlib.util.spec_from_file_location("minimal_device", DEVICE)
dev = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(dev)


def vectors(name: str) -> dict:
    return json.loads((VECTORS / f"{name}.json").read_text())


def unhex(obj):
    """A vectors' `wire` map with {"bin": hex} turned back into bytes."""
    if isinstance(obj, dict):
        return (
            bytes.fromhex(obj["bin"])
            if set(obj) == {"bin"}
            else {k: unhex(v) for k, v in obj.items()}
        )
    return [unhex(v) for v in obj] if isinstance(obj, list) else obj


def test_device_file_is_small_and_standalone():
    text = DEVICE.read_text()
    assert len(text.splitlines()) < 345  # 300 before q8 global models, 320 before dispatch messages
    assert "edge_fl" not in text.replace("edge-fl", "")


# --- offline: the device's pieces against tests/vectors (the doc's "To prove an implementation offline")


def public_key():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    return Ed25519PublicKey.from_public_bytes(
        bytes.fromhex(vectors("messages")["signing_key"]["public_key"])
    )


def test_message_vectors_decode_and_encode_byte_for_byte():
    for v in vectors("messages")["vectors"]:
        raw, msg = bytes.fromhex(v["hex"]), v["message"]
        if v["type"] == "global":
            g = dev.decode_global(raw, public_key() if v["signed"] else None)
            params = v.get("decoded_params", msg["params"])  # q8: what a device decodes
            assert g["w"].tolist() == params and (g["rnd"], g["ver"]) == (
                msg["round"],
                msg["version"],
            )
            assert g.get("mp") == msg["mechanism_params"] and g.get("sd") == msg["mechanism_state"]
            assert g.get("sel") == msg["selected"] and g.get("q") == msg["sample_rate"]
            assert g.get("done", False) == msg["done"]
        elif v["type"] == "update":  # the device's order: header (v r bv n nc), then the body
            head = {"v": 1, "r": msg["round"], "bv": msg["base_version"], "n": msg["n_samples"]}
            head["nc"] = bytes.fromhex(msg["nonce"])
            if msg["kind"] == "dense":
                x = np.array(msg["delta"]).astype("<" + msg["wire_dtype"]).tobytes()
                body = {"k": "u", "dt": msg["wire_dtype"], "m": msg["mechanism"], "x": x}
            else:
                c, ix = dev.code_indices(msg["indices"], msg["dim"])
                sb = (msg["sign"] > 0) | (msg["magrr_bit"] << 1)
                body = {"k": "s", "sb": sb, "h": len(msg["indices"]), "c": c, "ix": ix}
            assert msgpack.packb({**head, **body}) == raw, v["name"]
        elif v["type"] == "status":
            fake = type(
                "D",
                (),
                {"id": msg["device"], "n": msg["n_samples"], "stopped": msg["info"].get("stopped")},
            )
            assert dev.Device.status(fake, msg["online"]) == raw, v["name"]
        else:
            assert dev.unpack_map(raw) == unhex(v["wire"])


def test_global_rejection_vectors_are_not_answered():
    for v in vectors("rejections")["vectors"]:
        if v["decoder"] != "global":
            continue
        with pytest.raises(Exception):  # noqa: B017 (any rejection: the device logs, ignores)
            g = dev.decode_global(
                bytes.fromhex(v["hex"]), public_key() if v["public_key"] else None
            )
            mp = dev.check_mp(g.get("mp"))
            assert len(g["w"]) == v["expected_dim"] and mp.get("d", len(g["w"])) == len(g["w"])


def test_malformed_payloads_raise():
    ok = msgpack.packb({"v": 1, "k": "a", "ok": True})
    for bad in (
        ok + b"\x00",
        b"\xc1",
        b"\x82\xa1v\x01\xa1v\x01",
        msgpack.packb([1]),
        msgpack.packb({"v": True}),
    ):
        with pytest.raises(Exception):  # noqa: B017
            dev.unpack_map(bad)


def test_index_codings():
    for v in vectors("indices")["vectors"]:
        assert dev.code_indices(v["indices"], v["d"]) == (
            v["chosen_c"],
            bytes.fromhex(v["chosen_hex"]),
        )


def decode_indices(c: int, ix: bytes, d: int, h: int) -> list[int]:
    if c == 0:
        wb = max(1, (d - 1).bit_length())
        acc, pad = int.from_bytes(ix, "big"), len(ix) * 8 - h * wb
        assert 0 <= pad < 8 and acc & ((1 << pad) - 1) == 0
        out = [(acc >> (pad + wb * (h - 1 - j))) & ((1 << wb) - 1) for j in range(h)]
    else:
        out, val, shift = [], 0, 0
        for byte in ix:
            val |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                out.append(val + (out[-1] if out else 0))
                val = shift = 0
        assert shift == 0
    assert len(out) == h and all(a < b for a, b in itertools.pairwise(out)) and out[-1] < d
    return out


def test_signds_pmfs_magrr_bits_and_votes():
    s = vectors("signds")
    for p in s["plans"]:
        pmf = dev.nu_pmf(p["d"], p["K"], p["h"], p["nu_th"], p["sign_eps"])
        assert sum(pmf[p["nu_th"] :]) == pytest.approx(p["p_nu_ge_nu_th"], rel=1e-9)
        for got, want in zip(pmf, p.get("nu_pmf", []), strict=False):
            assert got == pytest.approx(want, rel=1e-9, abs=0 if want else 1e-300)
        u = np.random.default_rng(0).normal(0, 0.01, p["d"])
        for _ in range(3):
            vote = dev.signds_vote(u, p["mp"], {"r_est": 0.01, "reached": False})
            assert vote["h"] == p["h"] and 0 <= vote["sb"] <= 3
            decode_indices(vote["c"], vote["ix"], p["d"], p["h"])
            other = dev.code_indices(decode_indices(vote["c"], vote["ix"], p["d"], p["h"]), p["d"])
            assert other == (vote["c"], vote["ix"])
    for b in s["magrr_bits"]:
        u = np.array(b["update"])
        top = np.argsort(-b["sign"] * u, kind="stable")[: b["K"]]
        assert sorted(top.tolist()) == b["topk"]
        assert (
            dev.magrr_bit(u, top, {"r_est": b["r_est"], "reached": b["reached"]}, 1e-5) == b["bit"]
        )
    assert 1 / (1 + math.exp(-s["rr_keep_probability"]["rr_eps"])) == pytest.approx(
        s["rr_keep_probability"]["p"], rel=1e-15
    )


def signds_plan(d, k, eps, rho, hout, hmax):
    """The doc's plan. E[nu] MUST be computed in log space, exp(LSE(lw + log tau) - LSE(lw)): the
    plain sum of tau * P(tau) gives h = 16 and 10 instead of 10 and 9 for two of the nine vectors
    (ties t = E_t and E/h = rho that only the log-space rounding breaks the reference's way)."""
    K, lg = math.floor(Fraction(repr(k)) * d), math.lgamma

    def lc(n, r):
        return np.where(
            (r >= 0) & (r <= n),
            [lg(n + 1) - lg(x + 1) - lg(n - x + 1) if 0 <= x <= n else 0 for x in r],
            -np.inf,
        )

    def nth_and_e(h):
        tau = np.arange(h + 1)
        base, logtau = (
            lc(K, tau) + lc(d - K, h - tau),
            np.log(np.maximum(tau, 1)) + np.where(tau > 0, 0, -np.inf),
        )
        for t in range(1, h + 1):  # the smallest t with t >= E_t, else h
            lw = base + np.where(tau >= t, eps, 0.0)
            lse = lw.max() + np.log(np.exp(lw - lw.max()).sum())
            e = float(np.exp(np.logaddexp.reduce(lw + logtau) - lse))
            if t >= e or t == h:
                return t, e

    opt, h = 1, 1
    while hout == 0 and nth_and_e(h)[1] / h >= rho:
        opt, h = h, h + 1
    h = hout or min(opt, hmax)
    return K, h, nth_and_e(h)[0], hout or opt


def test_signds_plans_recomputed_from_the_doc():
    for p in vectors("signds")["plans"]:
        args = (
            p["sign_k"],
            p["sign_eps"],
            p["sign_thr_ratio"],
            p["sign_dim_out"],
            p["max_dim_out"],
        )
        assert signds_plan(p["d"], *args) == (p["K"], p["h"], p["nu_th"], p["h_uncapped"]), p


def test_model_layouts_logits_gradient_and_preprocessing():
    for m in vectors("models")["vectors"]:
        shapes = [tuple(s) for _, s in m["layout"]]
        flat = np.concatenate(
            [np.asarray(m["tensors"][n], np.float32).ravel() for n, _ in m["layout"]]
        )
        assert flat.astype("<f4").tobytes().hex() == m["flat_f4_hex"]
        assert dev.layout(m["model"], m["n_features"], m["n_classes"], len(flat)) == shapes
        x = np.asarray(m["x"], np.float32)
        np.testing.assert_allclose(dev.forward(flat, shapes, x)[0], m["logits"], atol=1e-6)
        # the gradient of the mean cross-entropy, against central differences (float64)
        X, y = np.random.default_rng(1).normal(size=(5, m["n_features"])), np.array([0, 1, 1, 0, 1])
        w = flat.astype(np.float64)

        def loss(w, X=X, y=y, shapes=shapes):
            z = dev.forward(w, shapes, X)[0]
            return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(y)), y]))

        num = [(loss(w + e) - loss(w - e)) / 2e-6 for e in np.eye(len(w)) * 1e-6]
        np.testing.assert_allclose(dev.gradient(w, shapes, X, y), num, atol=1e-6)
    assert dev.layout("auto", 64, 10, 4810) == [(64, 64), (64,), (64, 10), (10,)]  # not logreg c=74
    pre = vectors("preprocessing")
    assert (np.float32(pre["digits"]["pixels"]) / np.float32(16)).astype(
        "<f4"
    ).tobytes().hex() == pre["digits"]["f4_hex"]
    assert (np.float32(pre["mnist"]["bytes"]) / np.float32(255)).astype(
        "<f4"
    ).tobytes().hex() == pre["mnist"]["f4_hex"]


# --- over a real Mosquitto


def digits_share(path: Path, part: slice) -> Path:
    """Raw UCI digits (0..16) preprocessed as the doc says: float32(v) / float32(16)."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    np.savez(path, X=X[part].astype(np.float32) / np.float32(16), y=y[part].astype(np.int64))
    return path


def config_digest(run_json: Path, agg: subprocess.Popen, timeout: float = 180.0) -> str:
    """What an operator provisions devices with: `config_digest` from the aggregator's run.json."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and agg.poll() is None:
        try:
            return json.loads(run_json.read_text())["config_digest"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
    raise AssertionError(f"no {run_json} (aggregator exit status {agg.poll()})")


def minimal_device(broker: str, job: str, dev_id: str, data: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(DEVICE),
        "--broker",
        broker,
        "--job",
        job,
        "--id",
        dev_id,
        "--data",
        str(data),
    ]
    return subprocess.Popen([*cmd, "-v", *extra], stderr=subprocess.PIPE, text=True)


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


@pytest.mark.broker
@pytest.mark.parametrize(
    ("mechanism", "downlink"), [("none", "f32"), ("signds", "f32"), ("none", "q8")]
)
def test_mixed_fleet_with_the_real_aggregator(mosquitto, tmp_path, mechanism, downlink):
    """4 devices, 3 rounds, all selected: d00000 and d00001 are `edge-fl device`, d00002 and
    pi-kitchen are minimal devices (provisioned with the config digest from run.json); with
    `--downlink q8` every device decodes the quantised global model."""
    job, out, t0 = f"mini-{mechanism}-{uuid.uuid4().hex[:6]}", tmp_path / "run", time.monotonic()
    common = ["--broker", mosquitto.url, "--job", job, "--devices", "4", "--rounds", "3"]
    common += ["--clients-per-round", "4", "--deadline", "30", "--mechanism", mechanism]
    common += ["--downlink", downlink]
    agg = subprocess.Popen(
        [EDGE_FL, "aggregator", *common, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs = [agg]
    try:
        digest = config_digest(out / "run.json", agg)
        procs += [
            subprocess.Popen(
                [EDGE_FL, "device", "--broker", mosquitto.url, "--job", job, "--id", f"d0000{i}"],
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in (0, 1)
        ]
        minis = {
            name: minimal_device(
                mosquitto.url,
                job,
                name,
                digits_share(tmp_path / f"{name}.npz", part),
                "--digest",
                digest,
            )
            for name, part in (("d00002", slice(0, 90)), ("pi-kitchen", slice(90, 150)))
        }
        procs += list(minis.values())
        stdout, stderr = agg.communicate(timeout=120)
        logs = {name: p.communicate(timeout=30)[1] for name, p in minis.items()}
        for p in procs[1:3]:
            p.communicate(timeout=30)
    finally:
        stop(*procs)
    assert agg.returncode == 0, stderr
    assert [line.split(":")[0] for line in stdout.splitlines() if line.startswith("round")] == [
        f"round {i} closed" for i in (1, 2, 3)
    ]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(
        mechanism,
        [(r["round"], r["selected"], r["received"], r["rejected_by_reason"]) for r in records],
        f"{time.monotonic() - t0:.1f}s",
    )
    assert [r["status"] for r in records] == ["closed"] * 3
    assert all(
        r["selected"] == r["received"] == 4 and r["rejected"] == r["late"] == 0 for r in records
    )
    assert all(r["rejected_by_reason"] == {} for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["rounds_closed"], summary["total_received"], summary["total_rejected"]) == (
        3,
        12,
        0,
    )
    for name, p in minis.items():
        assert p.returncode == 0 and f"{name}: 3 updates sent" in logs[name], logs[name]
        assert f"sent a {mechanism} update" in logs[name] and "ignored" not in logs[name]


class ScriptedAggregator:
    """Just enough of an aggregator to check signatures, re-broadcasts, acks, done markers, wills."""

    def __init__(self, url: str, prefix: str):
        host, port = url.split("//")[1].rsplit(":", 1)
        self.prefix, self.seen, self.pending = prefix, queue.Queue(), []
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"agg-{prefix}")
        self.client.on_message = lambda c, u, m: self.seen.put(
            (m.topic.split("/", 2)[2], m.payload, m.retain)
        )
        self.client.connect(host, int(port))
        self.client.subscribe([(f"{prefix}/demo/up/+", 1), (f"{prefix}/demo/status/+", 1)])
        self.client.loop_start()

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(
            f"{self.prefix}/demo/{topic}", payload, qos=1, retain=retain
        ).wait_for_publish(10)

    def _drain(self, seconds: float) -> None:
        with contextlib.suppress(queue.Empty):
            self.pending.append(self.seen.get(timeout=seconds))

    def expect(self, topic: str, timeout: float = 20.0) -> bytes:
        """The payload of the oldest message not yet expected on `topic` (others stay pending)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, (got, payload, _) in enumerate(self.pending):
                if got == topic:
                    del self.pending[i]
                    return payload
            self._drain(0.1)
        raise AssertionError(f"nothing on {topic} within {timeout}s")

    def nothing_on(self, prefix: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._drain(0.1)
        assert not [m for m in self.pending if m[0].startswith(prefix)], self.pending


@pytest.mark.broker
def test_signed_globals_rebroadcast_acks_done_and_will(mosquitto, tmp_path):
    """The vectors' signed SignDS round (d = 40: logreg with f = 3, c = 10) played to a minimal
    device holding the vectors' public key."""
    msgs = {v["name"]: bytes.fromhex(v["hex"]) for v in vectors("messages")["vectors"]}
    forged = next(v for v in vectors("rejections")["vectors"] if v["name"] == "bad_signature")
    rng = np.random.default_rng(2)
    data = tmp_path / "d.npz"
    np.savez(data, X=rng.normal(size=(40, 3)).astype(np.float32), y=rng.integers(0, 10, 40))
    agg = ScriptedAggregator(mosquitto.url, prefix := f"mini{uuid.uuid4().hex[:6]}")
    agg.publish("global", msgs["global_done"], retain=True)  # an earlier run's marker: ignored
    key = vectors("messages")["signing_key"]["public_key"]
    device = minimal_device(
        mosquitto.url, "demo", "d00001", data, "--prefix", prefix, "--public-key", key
    )
    other = minimal_device(mosquitto.url, "demo", "d00009", data, "--prefix", prefix)
    try:
        assert msgpack.unpackb(agg.expect("status/d00001"))["on"] is True
        assert msgpack.unpackb(agg.expect("status/d00009"))["on"] is True
        other.kill()  # vanishes: the broker publishes its will
        will = agg.expect("status/d00009")
        assert msgpack.unpackb(will) == {"v": 1, "k": "st", "dev": "d00009", "on": False, "n": 40}
        for bad in (msgs["global_sync_dense"], bytes.fromhex(forged["hex"])):  # unsigned; forged
            agg.publish("global", bad)
        agg.nothing_on("up/", 1.0)
        agg.publish("global", msgs["global_signed_signds"])
        vote = msgpack.unpackb(first := agg.expect("up/d00001"))
        assert list(vote) == ["v", "r", "bv", "n", "nc", "k", "sb", "h", "c", "ix"]
        assert (vote["r"], vote["bv"], vote["n"], vote["nc"].hex(), vote["h"]) == (
            8,
            7,
            40,
            "00112233445566778899aabbccddeeff",
            11,
        )
        decode_indices(vote["c"], vote["ix"], 40, 11)
        agg.publish("global", msgs["global_signed_signds"])  # the same round again: the same bytes
        assert agg.expect("up/d00001") == first
        agg.publish("ack/d00001", msgs["ack_accepted"])
        agg.publish("global", msgs["global_done"])  # live: the job ends
        assert msgpack.unpackb(agg.expect("status/d00001"))["on"] is False
        _, log = device.communicate(timeout=20)
    finally:
        stop(device, other)
        agg.client.loop_stop()
    assert device.returncode == 0 and "d00001: 1 updates sent" in log, log
    assert "unsigned" in log and "InvalidSignature" in log and "'ok': True" in log, log
