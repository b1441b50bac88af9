"""One device's CPU per SecAgg+ round, device side only: runs on the light (device) install.

What one device of a secure round computes, timed with ``time.process_time`` per device-round,
the same calls the device agent (edge_fl/device/agent.py) makes, training excluded:

- setup: ``params_from_wire`` of the round's ``sa`` map and a ``DeviceSession`` (the round's
  H(n, k) graph: a ChaCha20 permutation of the n-device roster);
- encode: the mechanism's ``secure_encode`` after training (``local_update`` is replaced by a
  fixed delta): ``none`` clips, scales and rounds stochastically into [-Q, Q];
  ``distributed-gaussian`` clips, rotates (Walsh-Hadamard, padded to D'), rounds conditionally
  and adds its discrete Gaussian noise share (``ddg.device_encode``, the exact sampler);
- session: the ``DeviceSession`` calls ``edge_fl.secagg.driver.run_round`` times for that
  device: X25519 keys and agreements with its k neighbours, Shamir shares of its seed and key
  half, sealing and opening the shares (ChaCha20-Poly1305), the PRG masks (its k neighbours'
  and its own over the vector), packing the masked vector, answering the unmasking request.

Only the measured device's closed neighbourhood (itself and its k neighbours, all real
``DeviceSession`` objects) takes part; the rest of the n-device roster vanishes before
advertising, so the measured device does exactly the work it does in a full round of n devices
(its graph, shares and masks depend only on k, t, the bits and the vector length) while the
harness costs ~k+1 devices instead of n (the neighbours' and the aggregator's CPU is not
counted). The harness's RoundParams takes min_survivors = 2 (the aggregator's floor only; a
device does not use it). The round's sum is checked.

Calibration as the engine's (edge_fl/server/secure.py ``plan_secure``, without importing it):
the mechanism's ``secure_layout`` of ``secure_job(d, n)`` (default 30% dropout floor), and (k, t)
from ``edge_fl.secagg.calibrate`` (the same k/t/bits bench_secagg.py uses for ``none``).
``distributed-gaussian``'s noise variance needs dp-accounting (the server extra) to calibrate;
a device takes it from the job document's calibration table: ``--calibration FILE`` holds those
rows (written by a run that has dp-accounting, read by one that has not).

    PYTHONPATH=. python tools/bench_secagg_device.py --calibration ddg.json --json host.json
    /opt/edge-fl/bin/python bench_secagg_device.py --calibration ddg.json --json pi.json
    python tools/bench_secagg_device.py --compare host.json pi.json   # the ratio table
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from randomgen import ChaCha

import edge_fl.mechanisms.distributed_gaussian as dg_module
import edge_fl.mechanisms.none as none_module
from edge_fl.config import PrivacyConfig
from edge_fl.mechanisms.base import JobFacts
from edge_fl.mechanisms.distributed_gaussian import DistributedGaussian
from edge_fl.mechanisms.none import NoPrivacy
from edge_fl.mechanisms.secure import SecureLayout, secure_job
from edge_fl.privacy import calibration as table
from edge_fl.privacy.rng import secure_generator
from edge_fl.protocol.secure import round_seed
from edge_fl.secagg import DeviceSession, RoundParams, Summed, calibrate, params_from_wire
from edge_fl.secagg.ddg import Exact, conditional_round, rotate
from edge_fl.secagg.driver import run_round

JOB = "bench"
#: top-level modules of the server extra (pyproject.toml); none may be imported on a device
SERVER_EXTRA = ("dp_accounting", "scipy", "onnx", "onnxruntime", "matplotlib", "amqtt", "rich")
MECHANISMS = ("none", "distributed-gaussian")


def mechanism(name: str, n: int, dim: int, args: argparse.Namespace) -> Any:
    if name == "none":
        return NoPrivacy(PrivacyConfig(mechanism="none", clip=args.clip), None)
    cfg = PrivacyConfig(mechanism=name, epsilon=args.epsilon, delta=args.delta, clip=args.clip)
    facts = JobFacts(
        rounds=args.rounds, n_devices=n, expected_participants=float(n), n_params=dim,
        local_lr=0.1, local_epochs=1, batch_size=32, min_dataset_size=1, max_uploads=args.rounds,
    )  # fmt: skip
    return DistributedGaussian(cfg, facts)


def wire(layout: SecureLayout, k: int, t: int, floor: int) -> dict[str, Any]:
    """The global message's ``sa`` map (edge_fl/server/secure.py SecurePlan.wire)."""
    return {"b": layout.bits, "k": k, "md": layout.modular, "ms": floor,
            "n": layout.length, "q": layout.max_int, "t": t}  # fmt: skip


def one_round(
    mech: Any,
    layout: SecureLayout,
    sa: dict,
    roster: tuple[str, ...],
    dim: int,
    rng: np.random.Generator,
) -> dict[str, float]:
    """One device-round; its CPU in seconds by part."""
    rnd, nonce = 3, os.urandom(16)
    me = roster[int(rng.integers(len(roster)))]
    # setup: what the device computes from the signed global message
    t0 = time.process_time()
    params = params_from_wire(JOB, rnd, nonce, roster, sa)
    DeviceSession(me, params)
    setup = time.process_time() - t0
    # encode: the mechanism's secure_encode, training replaced by a fixed delta
    delta = rng.normal(0.0, 0.05, dim)  # norm ~3.5 at d = 4,810: clipped to 1
    device = SimpleNamespace(rng=secure_generator())
    msg = SimpleNamespace(mechanism_params=None, job=JOB, round=rnd, nonce=nonce)
    saved = none_module.local_update, dg_module.local_update
    none_module.local_update = dg_module.local_update = lambda _d, _m: delta
    try:
        t0 = time.process_time()
        values = mech.secure_encode(device, msg, layout, round_seed(JOB, rnd, nonce))
        values = np.asarray(values, dtype=np.int64)  # as the agent keeps them
        encode = time.process_time() - t0
    finally:
        none_module.local_update, dg_module.local_update = saved
    # session: the measured device and its k neighbours through every phase
    harness = RoundParams(
        JOB, rnd, nonce, roster, sa["k"], sa["t"], sa["b"], sa["n"], 0 if sa["md"] else sa["q"]
    )
    near = set(harness.graph.neighbours(me)) | {me}
    inputs = {d: values if d == me else np.zeros(sa["n"], np.int64) for d in near}
    vanish = {d: "advertise" for d in roster if d not in near}
    trace = run_round(harness, inputs, vanish, clock=time.process_time, modular=sa["md"])
    assert isinstance(trace.outcome, Summed), trace.outcome
    assert me in trace.outcome.contributors and not trace.aborted, trace.aborted
    if not sa["md"]:
        assert np.array_equal(trace.outcome.total, values)
    return {"setup": setup, "encode": encode, "session": trace.cpu_device[me]}


def ddg_parts(mech: Any, job: Any, dim: int, reps: int) -> dict[str, float]:
    """Diagnostic: the three steps of ``ddg.device_encode`` timed apart (its body, step by
    step, with ddg's own functions), medians in ms over ``reps`` after one warm-up."""
    p = mech.calibration(job).params
    rng = np.random.default_rng(dim)
    times: dict[str, list[float]] = {"rotate": [], "round": [], "noise": []}
    for i in range(reps + 1):
        delta, randbytes = rng.normal(0.0, 0.05, dim), secure_generator().bytes
        t0 = time.process_time()
        norm = float(np.linalg.norm(delta))
        scaled = rotate(delta * min(1.0, p.clip / norm), os.urandom(32)) / p.gamma
        t1 = time.process_time()
        key = int.from_bytes(randbytes(32), "little")
        rounded = conditional_round(
            scaled, p.l2, np.random.Generator(ChaCha(key=key, counter=0, rounds=20))
        )
        t2 = time.process_time()
        Exact(randbytes).discrete_gaussians(p.sigma2, rounded.size)
        t3 = time.process_time()
        if i:
            for part, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[part].append(1e3 * dt)
    return {f"ddg_{part}_median_ms": statistics.median(v) for part, v in times.items()}


def bench(name: str, n: int, dim: int, args: argparse.Namespace) -> dict[str, Any]:
    mech = mechanism(name, n, dim, args)
    job = secure_job(dim, n)
    layout = mech.secure_layout(job)
    # the SecAgg+ core's bounds take (clip, step) with Q = ceil(clip / step) (plan_secure)
    clip, step = (1.0, 1.0) if layout.modular else (float(max(layout.max_int, 1)), 1.0)
    cal = calibrate(n, clip, step)
    sa = wire(layout, cal.neighbours, cal.threshold, job.min_survivors)
    roster = tuple(f"d{i:05d}" for i in range(n))
    rng = np.random.default_rng([n, dim, len(name)])
    one_round(mech, layout, sa, roster, dim, rng)  # warm-up, not counted
    runs = [one_round(mech, layout, sa, roster, dim, rng) for _ in range(args.reps)]
    total = [1e3 * sum(r.values()) for r in runs]
    out = {
        "mechanism": name, "n": n, "d": dim, "length": layout.length, "k": cal.neighbours,
        "t": cal.threshold, "bits": layout.bits, "q": layout.max_int, "reps": args.reps,
        "total_ms": total,
        "median_ms": statistics.median(total), "max_ms": max(total),
    }  # fmt: skip
    for part in ("setup", "encode", "session"):
        out[f"{part}_median_ms"] = statistics.median(1e3 * r[part] for r in runs)
    if name != "none":
        out["sigma2"] = float(mech.calibration(job).params.sigma2)
        if args.encode_parts:
            out.update(ddg_parts(mech, job, dim, args.reps))
    return out


def load_calibration(path: Path | None) -> None:
    if path is not None and path.exists():
        table.load(json.loads(path.read_text()))


def save_calibration(path: Path | None) -> None:
    """Write the process's rows when they are not the file's already (a host with dp-accounting
    adds what it calibrated; a device only read them)."""
    rows = table.table()
    if path is not None and rows and (not path.exists() or json.loads(path.read_text()) != rows):
        path.write_text(json.dumps(rows))


def compare(host: Path, emulated: Path) -> None:
    """The markdown table of two runs' results (the same configurations)."""
    a, b = json.loads(host.read_text()), json.loads(emulated.read_text())
    print(f"host: {a['machine']} ({a['python']}); emulated: {b['machine']} ({b['python']})")
    print("| d | devices / round | k / t / bits | mechanism | host CPU ms median / max "
          "| qemu arm64 CPU ms median / max | ratio (medians) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    key = ("mechanism", "n", "d")
    theirs = {tuple(r[k] for k in key): r for r in b["rows"]}
    for r in a["rows"]:
        e = theirs.get(tuple(r[k] for k in key))
        if e is None:
            continue
        dim = f"{r['d']:,}" + (f" (D' {r['length']:,})" if r["length"] != r["d"] else "")
        print(
            f"| {dim} | {r['n']:,} | {r['k']} / {r['t']} / {r['bits']} | {r['mechanism']} | "
            f"{r['median_ms']:.1f} / {r['max_ms']:.1f} | {e['median_ms']:.1f} / "
            f"{e['max_ms']:.1f} | {e['median_ms'] / r['median_ms']:.1f}x |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[100, 1000], help="devices per round")
    ap.add_argument("--dim", type=int, nargs="+", default=[4810, 61706])
    ap.add_argument("--mechanism", nargs="+", choices=MECHANISMS, default=list(MECHANISMS))
    ap.add_argument("--reps", type=int, default=5, help="timed device-rounds per row (+1 warm-up)")
    ap.add_argument("--clip", type=float, default=1.0, help="privacy.clip (L2)")
    ap.add_argument("--epsilon", type=float, default=4.0, help="distributed-gaussian's target")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--rounds", type=int, default=20, help="rounds the epsilon covers")
    ap.add_argument(
        "--calibration", type=Path, help="calibration rows: read if present, else written"
    )
    ap.add_argument(
        "--encode-parts",
        action="store_true",
        help="distributed-gaussian: also time ddg.device_encode's rotate / round / noise apart",
    )
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("HOST", "EMULATED"))
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    load_calibration(args.calibration)
    head = {"machine": platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__, "argv": sys.argv[1:],
            "load_avg_start": os.getloadavg(), "rows": []}  # fmt: skip
    print(f"{head['machine']}, Python {head['python']}, numpy {head['numpy']}; CPU ms of one "
          "device per secure round (process_time), median / max of the reps")  # fmt: skip
    print("mechanism | n | d | k/t/bits | median | max | setup | encode | session (medians)")
    for name in args.mechanism:
        for n in args.n:
            for dim in args.dim:
                t0 = time.perf_counter()
                r = bench(name, n, dim, args)
                head["rows"].append(r)
                print(
                    f"{name} | {n} | {dim} | {r['k']}/{r['t']}/{r['bits']} | "
                    f"{r['median_ms']:.1f} | {r['max_ms']:.1f} | {r['setup_median_ms']:.1f} | "
                    f"{r['encode_median_ms']:.1f} | {r['session_median_ms']:.1f} "
                    f"(wall {time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
                if "ddg_noise_median_ms" in r:
                    steps = [f"{k[4:-10]} {r[k]:.1f}" for k in r if k.startswith("ddg_")]
                    print(f"  device_encode's steps, medians in ms: {', '.join(steps)}")
                save_calibration(args.calibration)
                head["load_avg_end"] = os.getloadavg()
                head["server_extra_imported"] = [m for m in SERVER_EXTRA if m in sys.modules]
                if args.json:
                    args.json.write_text(json.dumps(head, indent=1))
    imported = [m for m in SERVER_EXTRA if m in sys.modules]
    print(f"server-extra modules imported: {', '.join(imported) or 'none'}")


if __name__ == "__main__":
    main()
