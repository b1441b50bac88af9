"""kill -9 the aggregator inside open rounds of a job, restart it with --resume, and check the ledger.

The job runs as a deployment would: a private Mosquitto, `edge-fl fleet` and `edge-fl aggregator
--out DIR` as separate processes. The aggregator is killed with SIGKILL ``--kills`` times and
restarted with ``--resume`` each time; after the last kill it runs to the end. A reference job
with the same configuration and seed (``reproducible``: seeded selection, same device data, same
training) runs without interruption.

Where kills land: a watcher on the broker sees what devices see, each round's global message (a
round opens) and each metrics record (a round closed). After every (re)start the tool waits for
the aggregator to open a round (a global message published by that process: start-up takes
seconds on a loaded machine, and a timer from the start landed 41 of 42 kills before the first
round or between rounds), then a random delay (``--min-gap``..``--max-gap``); if the round closed
meanwhile it waits for the next one (``--where any``: kill at once after the delay). Every kill
reports where it landed: before the process opened a round, inside an open round, or between
rounds (as the watcher saw it at the kill).

Checks (the run fails if any does not hold):

* every job finishes: the last aggregator exits 0 with summary.json and model.onnx, the fleet
  exits 0 by itself (it saw the done marker), metrics.jsonl has each round exactly once;
* no (device, round) appears twice in the final ledger (``releases`` of the final checkpoint,
  which lists them in its ledger file);
* the final ledger equals the uninterrupted run's, release for release: the same (device, round,
  samples), so the same epsilon for every device (recomputed from both ledgers);
* every update the fleet published is in the ledger (releases == updates published).

Usage::

    .venv/bin/python tools/chaos_kill9.py                     # 30 rounds, 20 kills in rounds
    .venv/bin/python tools/chaos_kill9.py --rounds 6 --kills 3 --json out.json
    .venv/bin/python tools/chaos_kill9.py --variant auto-ack  # paho acks on receipt (old)
    .venv/bin/python tools/chaos_kill9.py --rounds 8 --kills 5 --workers 2  # sharded ingest

``--variant auto-ack`` keeps the journal but lets paho acknowledge each update on receipt, as
before the journal existed: it measures the window between the broker's ack and the journal.
``--aggregator-src DIR`` runs the aggregator from another checkout (e.g. ``git archive`` of an
older commit), to measure what the code before the journal lost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BOOT = {
    "journal": "import sys; from edge_fl.cli import main; sys.argv[0] = 'edge-fl'; main()",
    "auto-ack": (
        "import sys; from edge_fl.server.service import AggregatorService; "
        "AggregatorService.ack_after_processing = False; "
        "from edge_fl.cli import main; sys.argv[0] = 'edge-fl'; main()"
    ),
}


#: always-on devices without dropout (so the reference run sees the same fleet), whose training
#: speeds spread over ~10x: updates of a round arrive over a second or more, and kills land
#: between the first and the last of them
PROFILE = """\
name: chaos-spread
description: always available, no dropout, compute spread over ~10x
tiers:
  - name: all
    share: 1.0
    compute_samples_per_s: {dist: lognormal, median: 80, sigma: 0.8, lo: 15, hi: 600}
    uplink_mbit_s: 10
    downlink_mbit_s: 10
    latency_ms: 50
    availability: always
    dropout_train: 0.0
    dropout_upload: 0.0
"""


def job_args(url: str, job: str, a: argparse.Namespace) -> list[str]:
    return [
        "--broker", url, "--job", job, "--seed", str(a.seed), "--reproducible",
        "--devices", str(a.devices), "--rounds", str(a.rounds),
        "--clients-per-round", str(a.clients_per_round), "--deadline", str(a.deadline),
        "--model", "logreg", "--epochs", "1", "--time-scale", str(a.time_scale),
        "--mechanism", "gaussian", "--clip", "1.0", "--noise-multiplier", "1.0",
        "--profile", str(a.profile),
    ]  # fmt: skip


class Proc:
    """A child process with its stdout/stderr in files (unbuffered, so a SIGKILL loses nothing)."""

    def __init__(
        self, argv: list[str], log: Path, env: dict[str, str] | None = None, cwd: str | None = None
    ) -> None:
        self.log = log
        self.out = open(log.with_suffix(".out"), "w")  # noqa: SIM115
        self.err = open(log.with_suffix(".err"), "w")  # noqa: SIM115
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.p = subprocess.Popen(argv, stdout=self.out, stderr=self.err, env=full_env, cwd=cwd)
        self.started = time.time()

    def wait(self, timeout: float | None = None) -> int:
        rc = self.p.wait(timeout)
        self.out.close()
        self.err.close()
        return rc

    def kill9(self) -> None:
        os.kill(self.p.pid, signal.SIGKILL)
        self.wait(10)

    def stdout(self) -> str:
        return self.log.with_suffix(".out").read_text()

    def stderr(self) -> str:
        return self.log.with_suffix(".err").read_text()


def aggregator(a, url, job, out: Path, log: Path, resume: bool) -> Proc:
    argv = [sys.executable, "-c", BOOT[a.variant], "aggregator", *job_args(url, job, a)]
    argv += ["--out", str(out)] + (["--resume"] if resume else [])
    if a.workers:
        argv += ["--workers", str(a.workers)]
    if a.aggregator_src:  # python -c puts the working directory first on sys.path
        return Proc(argv, log, {"PYTHONPATH": a.aggregator_src}, cwd=a.aggregator_src)
    return Proc(argv, log)


def fleet(a, url, job, log: Path) -> Proc:
    argv = [sys.executable, "-c", BOOT["journal"], "fleet", *job_args(url, job, a)]
    return Proc(argv, log)


BEFORE, INSIDE, BETWEEN = "before start", "inside an open round", "between rounds"


class Watcher:
    """What the job's devices see on the broker: each global message (a round opens; its round
    number) and each metrics record (a round closed), with when each arrived."""

    def __init__(self, url: str, job: str) -> None:
        import paho.mqtt.client as mqtt

        from edge_fl.transport.url import parse_broker_url

        spec = parse_broker_url(url)
        self.base = f"edgefl/{job}"
        self.opened: list[tuple[float, int]] = []  # (arrival, round) of each global message
        self.closed: set[int] = set()
        self.done = False
        self.cond = threading.Condition()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"watch-{job}")
        self.client.on_connect = lambda c, *_: c.subscribe(
            [(f"{self.base}/global", 1), (f"{self.base}/metrics", 1)]
        )
        self.client.on_message = self._on_message
        self.client.connect(spec.host, spec.port)
        self.client.loop_start()

    def _on_message(self, _client, _userdata, message) -> None:
        from edge_fl.protocol import decode_global

        now = time.time()
        with self.cond:
            try:
                if message.topic.endswith("/global") and message.payload:
                    g = decode_global(bytes(message.payload))
                    self.done = self.done or g.done
                    if not g.done:
                        self.opened.append((now, int(g.round)))
                elif message.topic.endswith("/metrics"):
                    self.closed.add(int(json.loads(message.payload)["round"]))
            except Exception:  # not ours to judge: the aggregator's tests do
                return
            self.cond.notify_all()

    def open_round(self, since: float) -> int | None:
        """The round a process started at ``since`` opened last, if it is still open."""
        mine = [r for t, r in self.opened if t >= since]
        return mine[-1] if mine and mine[-1] not in self.closed else None

    def where(self, since: float) -> str:
        if not any(t >= since for t, _ in self.opened):
            return BEFORE
        return INSIDE if self.open_round(since) is not None else BETWEEN

    def wait_open(self, since: float, proc: subprocess.Popen) -> int | None:
        """Until the process ``proc`` started at ``since`` has a round open (None: it exited,
        or the job is done)."""
        with self.cond:
            while proc.poll() is None and not self.done:
                rnd = self.open_round(since)
                if rnd is not None:
                    return rnd
                self.cond.wait(0.2)
        return None

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def state_at_kill(out: Path) -> dict[str, Any]:
    """Where the job was when the aggregator died: checkpointed round, open round, journal."""
    from edge_fl.server.journal import JOURNAL, read_journal

    ckpt = out / "checkpoint.json"
    seq, rnd = 0, 0
    if ckpt.exists():
        try:
            state = json.loads(ckpt.read_text())
            seq, rnd = int(state.get("journal_seq", 0)), int(state["round_number"])
        except (ValueError, KeyError):
            pass
    contents = read_journal(out / JOURNAL)
    fresh = [r for r in contents.records if int(r["s"]) > seq]
    opened = [r for r in fresh if r["k"] == "open"]
    return {
        "checkpoint_round": rnd,
        "open_round": opened[-1]["fields"]["number"] if opened else None,
        "journal_accepts": sum(1 for r in fresh if r["k"] == "accept"),
        "journal_releases": sum(1 for r in fresh if r["k"] == "release"),
        "torn_bytes": contents.torn_bytes,
    }


def phase(s: dict[str, Any], started: bool) -> str:
    if not started:
        return "starting (journal not yet open)"
    if s["open_round"] is not None:
        return f"round {s['open_round']} open, {s['journal_accepts']} accepted"
    return "between rounds"


def finish_fleet(fl: Proc, timeout: float) -> int | None:
    try:
        return fl.wait(timeout)
    except subprocess.TimeoutExpired:
        fl.p.kill()
        fl.wait(10)
        return None


def ledger_of(out: Path) -> list[tuple[str, int, int]]:
    from edge_fl.server.checkpoint import read_checkpoint  # either format, the ledger file's too

    state = read_checkpoint(out)
    return [(d, int(r), int(n)) for d, r, n in state["releases"]]


def epsilon_by_device(a, releases: list[tuple[str, int, int]]) -> dict[str, float]:
    """Each device's epsilon, recomputed from a ledger by the job's own accountant."""
    from edge_fl.config import load_config
    from edge_fl.job import build_job

    cfg = load_config(
        None,
        {
            "seed": a.seed,
            "reproducible": True,
            "data.devices": a.devices,
            "rounds.rounds": a.rounds,
            "rounds.clients_per_round": a.clients_per_round,
            "model.name": "logreg",
            "training.epochs": 1,
            "privacy.mechanism": "gaussian",
            "privacy.clip": 1.0,
            "privacy.noise_multiplier": 1.0,
        },
    )
    core = build_job(cfg).aggregator_core()
    for d, r, n in releases:
        core.record_release(d, r, n)
    assert core.privacy is not None
    ledger, delta = core.privacy.ledger, core.privacy.delta
    return {d: ledger.best(delta, d)[0].epsilon for d in sorted({d for d, _, _ in releases})}


def _records(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def check_run(out: Path, rounds: int) -> dict[str, Any]:
    records = _records(out)
    summary = json.loads((out / "summary.json").read_text())
    return {
        "metric_rounds": [r["round"] for r in records],
        "rounds_once": [r["round"] for r in records] == list(range(1, rounds + 1)),
        "closed": sum(1 for r in records if r["status"] == "closed"),
        "summary_rounds": summary["rounds"],
        "model_onnx": (out / "model.onnx").exists() and (out / "model.onnx").stat().st_size > 0,
        "final_accuracy": summary.get("final_accuracy"),
        "epsilon": summary.get("epsilon"),
        "journal": summary.get("journal"),
    }


def published(fl: Proc) -> int | None:
    for line in fl.stderr().splitlines():
        if "updates published" in line:
            return int(line.split(":")[1].split()[0])
    return None


def reference(a, url: str, work: Path) -> dict[str, Any]:
    job = f"chaos-ref-{uuid.uuid4().hex[:6]}"
    out = work / "reference"
    out.mkdir(parents=True)
    t0 = time.monotonic()
    fl = fleet(a, url, job, work / "reference-fleet.log")
    agg = aggregator(a, url, job, out, work / "reference-aggregator.log", resume=False)
    rc = agg.wait(a.timeout)
    frc = finish_fleet(fl, 60)
    return {
        "rc": rc,
        "fleet_rc": frc,
        "wall_s": round(time.monotonic() - t0, 1),
        "ledger": ledger_of(out),
        "published": published(fl),
        **check_run(out, a.rounds),
    }


def chaos(a, url: str, work: Path, rng: random.Random) -> dict[str, Any]:
    job = f"chaos-{uuid.uuid4().hex[:6]}"
    out = work / "chaos"
    out.mkdir(parents=True)
    t0 = time.monotonic()
    watch = Watcher(url, job)
    fl = fleet(a, url, job, work / "chaos-fleet.log")
    kills: list[dict[str, Any]] = []
    resumes: list[str] = []
    duplicates = 0
    n = 0
    agg = aggregator(a, url, job, out, work / f"chaos-aggregator-{n}.log", resume=False)
    while a.warmup_rounds and len(_records(out)) < a.warmup_rounds and agg.p.poll() is None:
        time.sleep(0.05)  # no kill before this many rounds are done
    try:
        while len(kills) < a.kills:
            if a.where == "open" and watch.wait_open(agg.started, agg.p) is None:
                break  # it finished (or failed) before this kill
            delay = rng.uniform(a.min_gap, a.max_gap)
            try:
                rc = agg.p.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                rc = None
            if rc is not None:
                break
            with watch.cond:
                where = watch.where(agg.started)
                if a.where == "open" and where != INSIDE:
                    continue  # the round closed during the delay: wait for the next one
                journal = out / "journal.bin"
                started = journal.exists() and journal.stat().st_mtime >= agg.started
                agg.kill9()  # under the lock: no round opens or closes in the watcher meanwhile
                rnd = watch.open_round(agg.started)
            s = state_at_kill(out)
            kills.append(
                {
                    "kill": len(kills) + 1,
                    "t_s": round(time.monotonic() - t0, 2),
                    "after_s": round(delay, 2),
                    "where": where if where != INSIDE else f"{where} ({rnd})",
                    "phase": phase(s, started),
                    **s,
                }
            )
            duplicates += agg.stderr().count("already in the ledger")
            n += 1
            resume = not a.aggregator_src or (out / "checkpoint.json").exists()
            agg = aggregator(a, url, job, out, work / f"chaos-aggregator-{n}.log", resume=resume)
    finally:
        watch.stop()
    rc = agg.wait(a.timeout)
    duplicates += agg.stderr().count("already in the ledger")
    frc = finish_fleet(fl, 60)
    for k in range(n + 1):
        text = (work / f"chaos-aggregator-{k}.out").read_text()
        resumes += [line for line in text.splitlines() if line.startswith("resumed at")]
    last_err = agg.stderr()
    return {
        "rc": rc,
        "fleet_rc": frc,
        "wall_s": round(time.monotonic() - t0, 1),
        "kills": kills,
        "landed": dict(Counter(k["where"].split(" (")[0] for k in kills)),
        "resumes": resumes,
        "duplicates_absorbed": duplicates,
        "ledger": ledger_of(out),
        "published": published(fl),
        "traceback": "Traceback" in last_err,
        **check_run(out, a.rounds),
    }


def compare(a, ref: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    keys = Counter((d, r) for d, r, _ in run["ledger"])
    doubled = sorted(k for k, c in keys.items() if c > 1)
    ref_set, run_set = Counter(ref["ledger"]), Counter(run["ledger"])
    missing = sorted((ref_set - run_set).elements())
    extra = sorted((run_set - ref_set).elements())
    eps_ref = epsilon_by_device(a, ref["ledger"])
    eps_run = epsilon_by_device(a, run["ledger"])
    eps_diff = max(
        (abs(eps_ref.get(d, 0.0) - eps_run.get(d, 0.0)) for d in {*eps_ref, *eps_run}),
        default=0.0,
    )
    checks = {
        "job finished (aggregator exit 0)": run["rc"] == 0,
        "fleet exited by itself (exit 0)": run["fleet_rc"] == 0,
        "metrics: each round exactly once": run["rounds_once"],
        "summary.json and model.onnx written": run["summary_rounds"] == a.rounds
        and run["model_onnx"],
        "no (device, round) twice in the ledger": not doubled,
        "ledger == uninterrupted run's ledger": not missing and not extra,
        "epsilon by device == uninterrupted run's": eps_diff <= 1e-9,
        "every published update is in the ledger": run["published"] == len(run["ledger"]),
        "no traceback": not run["traceback"],
    }
    return {
        "checks": checks,
        "ok": all(checks.values()),
        "doubled": doubled,
        "missing": missing,
        "extra": extra,
        "eps_max_abs_diff": eps_diff,
        "eps_ref": eps_ref,
        "eps_run": eps_run,
    }


def report(a, ref, run, cmp) -> str:
    lines = [
        f"## kill -9 chaos: {a.rounds} rounds, {len(run['kills'])} kills (variant {a.variant})",
        "",
        f"{a.devices} devices, {a.clients_per_round} per round, logreg on digits, local Gaussian "
        f"(clip 1, z 1), seed {a.seed}, time scale {a.time_scale}, training speeds spread "
        f"~10x; kill delay uniform [{a.min_gap}, {a.max_gap}] s after "
        + ("a round opened (killed only inside it)" if a.where == "open" else "each (re)start")
        + (f", first kill after round {a.warmup_rounds}." if a.warmup_rounds else ".")
        + (f" Aggregator from {a.aggregator_src}." if a.aggregator_src else ""),
        "",
        "| kill | t (s) | after (s) | where (watcher) | journal at the kill | checkpoint round |"
        " journaled accepts | release-only records | torn bytes |",
        "|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for k in run["kills"]:
        lines.append(
            f"| {k['kill']} | {k['t_s']} | {k['after_s']} | {k['where']} | {k['phase']} | "
            f"{k['checkpoint_round']} | {k['journal_accepts']} | {k['journal_releases']} | "
            f"{k['torn_bytes']} |"
        )
    landed = run["landed"]
    lines += [
        "",
        f"kills landed: {landed.get(BEFORE, 0)} before the process opened a round, "
        f"{landed.get(INSIDE, 0)} inside an open round, {landed.get(BETWEEN, 0)} between rounds",
        "",
        "| | uninterrupted | with kills |",
        "|---|---:|---:|",
        f"| wall time (s) | {ref['wall_s']} | {run['wall_s']} |",
        f"| rounds closed | {ref['closed']}/{a.rounds} | {run['closed']}/{a.rounds} |",
        f"| ledger releases | {len(ref['ledger'])} | {len(run['ledger'])} |",
        f"| updates published by the fleet | {ref['published']} | {run['published']} |",
        f"| job epsilon (summary) | {_fmt(ref['epsilon'])} | {_fmt(run['epsilon'])} |",
        f"| final accuracy | {_fmt(ref['final_accuracy'])} | {_fmt(run['final_accuracy'])} |",
        f"| re-deliveries absorbed (already in the ledger) | - | {run['duplicates_absorbed']} |",
        "",
        f"releases missing vs uninterrupted: {len(cmp['missing'])}; extra: {len(cmp['extra'])}; "
        f"(device, round) twice: {len(cmp['doubled'])}; max |epsilon difference| over devices: "
        f"{cmp['eps_max_abs_diff']:.3g}",
        "",
    ]
    lines += [f"- [{'x' if v else ' '}] {k}" for k, v in cmp["checks"].items()]
    lines += ["", "RESULT: " + ("PASS" if cmp["ok"] else "FAIL")]
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--devices", type=int, default=10)
    p.add_argument("--clients-per-round", type=int, default=5)
    p.add_argument("--deadline", type=float, default=60.0)
    p.add_argument("--time-scale", type=float, default=0.3, help="real s per simulated s")
    p.add_argument(
        "--where",
        choices=("open", "any"),
        default="open",
        help="open: kill only inside an open round (the delay counts from its opening); any: "
        "after the delay from each (re)start, wherever the job is",
    )
    p.add_argument("--min-gap", type=float, default=0.05, help="shortest delay before a kill (s)")
    p.add_argument("--max-gap", type=float, default=1.5, help="longest delay before a kill (s)")
    p.add_argument("--seed", type=int, default=7, help="job seed and kill-schedule seed")
    p.add_argument("--warmup-rounds", type=int, default=0, help="no kill before N rounds closed")
    p.add_argument("--timeout", type=float, default=300.0, help="per aggregator run (s)")
    p.add_argument("--variant", choices=sorted(BOOT), default="journal")
    p.add_argument("--aggregator-src", help="PYTHONPATH for the aggregator (another checkout)")
    p.add_argument(
        "--workers", type=int, default=0, help="sharded ingest: the aggregator's --workers N"
    )
    p.add_argument("--broker", help="use this Mosquitto (default: start a private one)")
    p.add_argument("--work", type=Path, help="keep logs and outputs here (default: a temp dir)")
    p.add_argument("--json", type=Path, help="write the results as JSON")
    a = p.parse_args(argv)

    import tempfile

    from edge_fl.transport.broker import EmbeddedBroker

    work = a.work or Path(tempfile.mkdtemp(prefix="edge-fl-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    a.profile = work / "chaos-spread.yaml"
    a.profile.write_text(PROFILE)
    rng = random.Random(a.seed)
    broker = None if a.broker else EmbeddedBroker(kind="mosquitto").start()
    url = a.broker or broker.url
    try:
        ref = reference(a, url, work)
        run = chaos(a, url, work, rng)
    finally:
        if broker is not None:
            broker.stop()
    cmp = compare(a, ref, run)
    text = report(a, ref, run, cmp)
    print(text)
    print(f"\nlogs and outputs: {work}")
    if a.json:
        args = {k: str(v) for k, v in vars(a).items()}
        results = {"args": args, "reference": ref, "run": run, "compare": cmp}
        a.json.write_text(json.dumps(results, indent=1, default=str))
    return 0 if cmp["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
