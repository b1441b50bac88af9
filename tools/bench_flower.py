"""edge-fl against Flower: the same federated job in both, alternating runs, medians and ratios.

The job is edge-fl's default (digits, MLP with 64 hidden units, 50 devices, 20 rounds, 20 devices
per round, 5 local epochs, batch size 8, lr 0.3, FedAvg). Both frameworks get the same data split
(edge-fl's, written once to .npz files for Flower's devices), the same initial model, the same
local training (edge-fl's `local_sgd` in Flower's ClientApp, tools/flower_app/) and FedAvg weighted
by examples over the same number of devices per round; the global model is evaluated after every
round with edge-fl's model code in both. Only the framework differs.

Runtimes, one run of each per repetition, in this order:

- `edge-fl simulate --out DIR`: embedded Mosquitto, 50 MQTT sessions, the aggregator, one process.
- Flower Simulation Engine: `flower-superlink --simulation` and `flwr run --stream` with
  `num-supernodes=50` (Ray, Flower's default client resources).
- Flower Deployment Engine: `flower-superlink`, 50 `flower-supernode` processes on loopback and
  `flwr run --stream` (the like-for-like comparison: every update crosses a socket).

Flower runs in its own interpreter (`--flower-python`, a venv with flwr 1.42 and edge-fl
installed; flwr is never a dependency of edge-fl):

    python3 -m venv /work/flower-venv
    /work/flower-venv/bin/pip install 'flwr[simulation]==1.42.*' -e .
    .venv/bin/python tools/bench_flower.py --flower-python /work/flower-venv/bin/python --repeats 3

Measured per run: whole-process wall time (for Flower: start of the SuperLink to the last
process reaped), CPU time (user + system) of every process the run started, children and
orphans included (this process is their subreaper), per-round time (median interval between
the ends of consecutive rounds' evaluations, rounds 2..N, the same definition for both) and the
final accuracy (the comparison is void unless both land in the same range).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import edge_fl

APP_DIR = Path(__file__).with_name("flower_app")
EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))
RUNTIMES = ("edge-fl", "flower-simulation", "flower-deployment")
#: accuracies further apart than this make the comparison void
ACCURACY_RANGE = 0.03
RUN_TIMEOUT_S = 1800.0
PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Run:
    wall: float
    cpu: float
    per_round: float
    accuracy: float
    #: Flower only: from `flwr run` submitting the run to the end of its log stream
    flwr_run: float | None = None


@dataclass
class Results:
    runs: dict[str, list[Run]] = field(default_factory=dict)

    def add(self, runtime: str, run: Run) -> None:
        self.runs.setdefault(runtime, []).append(run)

    def count(self) -> int:
        return sum(len(runs) for runs in self.runs.values())

    def median(self, runtime: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.runs[runtime])


def become_subreaper() -> None:
    """Orphans of the processes this benchmark starts (a SuperNode's SuperExec, ClientApp
    processes, Ray's workers) are reparented here, so their CPU time is counted when reaped."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def own_children() -> list[int]:
    """Live (or zombie) processes whose parent is this process."""
    me, out = str(os.getpid()), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[1] == me:
                out.append(int(entry.name))
    return out


def reap_all(grace_s: float = 15.0) -> list[int]:
    """Wait for every child (orphans included); after ``grace_s`` terminate the ones left (they
    were started by this run). Returns the pids that had to be terminated."""
    deadline, killed = time.monotonic() + grace_s, []
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return killed
        if pid:
            continue
        if time.monotonic() > deadline:
            for pid in own_children():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL if pid in killed else signal.SIGTERM)
                    killed.append(pid)
            deadline = time.monotonic() + 5
        time.sleep(0.05)


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    """Until the SuperLink answers on its health endpoint (`flwr run` does not retry)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        url = f"http://127.0.0.1:{port}/health"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.05)
    raise SystemExit(f"bench_flower: the SuperLink on port {port} did not become ready")


def stop(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    """SIGTERM to all at once, wait for all; SIGKILL to those left after ``timeout_s``."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def free_ports(n: int, first: int = 20000) -> list[int]:
    """``n`` loopback ports free now, below the kernel's ephemeral range (32768-) so that none is
    taken meanwhile by an outgoing connection of the 100 processes a deployment starts."""
    ports: list[int] = []
    for port in range(first, 32768):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            ports.append(port)
            if len(ports) == n:
                return ports
    raise SystemExit("bench_flower: not enough free ports in 20000-32767")


def write_job_data(data_dir: Path, overrides: dict[str, int]) -> dict[str, object]:
    """edge-fl's job (the default, or ``overrides``): each device's shard, the initial model and
    the test set as .npz files for Flower's apps; returns the Flower run config (the keys of
    tools/flower_app/pyproject.toml)."""
    cfg = edge_fl.load_config(None, overrides)
    job = edge_fl.build_job(cfg)
    for i in range(cfg.data.devices):
        X, y = job.dataset.device_data(i)
        np.savez(data_dir / f"device-{i}.npz", X=X, y=y)
    np.savez(
        data_dir / "server.npz",
        w0=job.initial_params().astype(np.float32),
        X_test=job.dataset.X_test,
        y_test=job.dataset.y_test,
    )
    return {
        "data-dir": str(data_dir),
        "num-rounds": cfg.rounds.rounds,
        "clients-per-round": job.target,
        "devices": cfg.data.devices,
        "epochs": cfg.training.epochs,
        "batch-size": cfg.training.batch_size,
        "lr": cfg.training.lr,
        "hidden": cfg.model.hidden,
        "n-classes": job.model.n_classes,
        "seed": cfg.seed,
    }


def per_round(ends: list[float]) -> float:
    """Median interval between consecutive round ends, from round 2 (round 1 also waits for
    the fleet in Flower and for the first connections in edge-fl)."""
    return statistics.median(b - a for a, b in itertools.pairwise(ends))


def run_edge_fl(flags: list[str]) -> Run:
    with tempfile.TemporaryDirectory() as out:
        t, c = time.perf_counter(), children_cpu()
        cmd = [EDGE_FL, "simulate", *flags, "--out", out, "--no-progress"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t
        reap_all()
        cpu = children_cpu() - c
        summary = json.loads((Path(out) / "summary.json").read_text())
        recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    ends = [r["elapsed_s"] for r in recs]
    return Run(wall, cpu, per_round(ends), summary["final_accuracy"])


class Flower:
    """One Flower run in a scratch directory: its own FLWR_HOME, ports and logs."""

    def __init__(self, python: str, run_config: dict[str, object], verbose: bool) -> None:
        self.bin = Path(python).parent
        self.run_config = run_config
        self.verbose = verbose

    def env(self, home: Path) -> dict[str, str]:
        env = dict(os.environ)
        # SuperLink and SuperNode start `flower-superexec` (and it the apps) by name
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env["FLWR_HOME"] = str(home)
        env["FLWR_TELEMETRY_ENABLED"] = "0"  # no network calls from the measured processes
        env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
        env.pop("VIRTUAL_ENV", None)
        return env

    def run(self, simulation: bool) -> Run:
        with tempfile.TemporaryDirectory(prefix="bench-flower-") as tmp:
            scratch = Path(tmp)
            home, logs = scratch / "flwr-home", scratch / "logs"
            home.mkdir()
            logs.mkdir()
            devices = int(self.run_config["devices"])  # type: ignore[call-overload]
            link_port, *node_ports = free_ports(1 + (0 if simulation else devices))
            (home / "config.toml").write_text(
                f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
                f'address = "127.0.0.1:{link_port}"\ninsecure = true\n'
            )
            env = self.env(home)
            out_file = scratch / "result.json"
            overrides = " ".join(
                f"{k}={json.dumps(v)}"
                for k, v in {**self.run_config, "out-file": str(out_file)}.items()
            )
            procs: list[subprocess.Popen[bytes]] = []

            def start(name: str, cmd: list[str]) -> None:
                log = open(logs / f"{name}.log", "wb")  # noqa: SIM115 (closed with the directory)
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

            t, c = time.perf_counter(), children_cpu()
            try:
                link = [str(self.bin / "flower-superlink"), "--insecure", "--host", "127.0.0.1"]
                link += ["--port", str(link_port), "--disable-runtime-dependency-installation"]
                start("superlink", [*link, "--simulation"] if simulation else link)
                wait_ready(link_port, procs[0])
                for i, port in enumerate(node_ports):
                    node = [str(self.bin / "flower-supernode"), "--insecure", "--port", str(port)]
                    node += ["--superlink", f"127.0.0.1:{link_port}"]
                    node += ["--node-config", f"partition-id={i} num-partitions={devices}"]
                    start(f"supernode-{i}", node)
                cmd = [str(self.bin / "flwr"), "run", str(APP_DIR), "bench", "--stream"]
                cmd += ["--run-config", overrides]
                if simulation:
                    cmd += ["--federation-config", f"num-supernodes={devices}"]
                t_run = time.perf_counter()
                submitted = self._flwr_run(cmd, env, logs)
                flwr_run = time.perf_counter() - t_run
            finally:
                try:
                    stop(procs[1:])  # the SuperNodes first, then the SuperLink
                finally:
                    stop(procs[:1])
                    killed = reap_all()
            wall = time.perf_counter() - t
            cpu = children_cpu() - c
            if killed and self.verbose:
                print(f"    (terminated {len(killed)} leftover processes)", file=sys.stderr)
            if not submitted or not out_file.exists():
                self._fail(logs, "the Flower run did not finish")
            result = json.loads(out_file.read_text())
        return Run(wall, cpu, per_round(result["round_ends"]), result["accuracy"][-1], flwr_run)

    def _flwr_run(self, cmd: list[str], env: dict[str, str], logs: Path) -> bool:
        with open(logs / "flwr-run.log", "wb") as log:
            try:
                p = subprocess.run(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
                )
            except subprocess.TimeoutExpired:
                return False
        return p.returncode == 0

    def _fail(self, logs: Path, why: str) -> None:
        for name in ("flwr-run", "superlink", "supernode-0"):
            path = logs / f"{name}.log"
            if path.exists():
                print(f"--- {name}.log (tail)", file=sys.stderr)
                print(
                    "\n".join(path.read_text(errors="replace").splitlines()[-40:]), file=sys.stderr
                )
        raise SystemExit(f"bench_flower: {why}")


def flower_version(python: str) -> str:
    code = "import flwr, importlib.metadata as m; print(flwr.__version__, m.version('ray'))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    flwr, ray = out.stdout.split()
    return f"flwr {flwr}, ray {ray}"


def report(results: Results, repeats: int) -> None:
    base, med = "edge-fl", results.median
    print(f"\n{repeats} alternating repeats, medians (x = runtime / edge-fl simulate):")
    print(
        f"  {'runtime':<19}{'wall s':>8}{'run s':>8}{'CPU s':>8}{'round ms':>10}{'accuracy':>10}"
        f"{'wall x':>8}{'CPU x':>7}{'round x':>9}"
    )
    for name, runs in results.runs.items():
        wall, cpu, rnd = med(name, "wall"), med(name, "cpu"), med(name, "per_round")
        flwr = [r.flwr_run for r in runs if r.flwr_run is not None]
        run_s = f"{statistics.median(flwr):8.2f}" if flwr else f"{'-':>8}"
        line = f"  {name:<19}{wall:8.2f}{run_s}{cpu:8.2f}{rnd * 1000:10.1f}"
        line += f"{med(name, 'accuracy'):10.4f}"
        if base in results.runs:
            line += f"{wall / med(base, 'wall'):8.2f}{cpu / med(base, 'cpu'):7.2f}"
            line += f"{rnd / med(base, 'per_round'):9.2f}"
        print(line)
    print("  run s: Flower's `flwr run --stream` alone (a standing federation's wait)")
    print("  each run (wall s / CPU s / per-round ms / accuracy):")
    for name, runs in results.runs.items():
        cells = [
            f"{r.wall:.2f}/{r.cpu:.2f}/{r.per_round * 1000:.0f}/{r.accuracy:.4f}" for r in runs
        ]
        print(f"    {name:<19}" + "  ".join(cells))
    accs = [r.accuracy for runs in results.runs.values() for r in runs]
    spread = max(accs) - min(accs)
    verdict = "comparable" if spread <= ACCURACY_RANGE else "VOID: accuracies differ"
    print(f"  final accuracy over all runs: {min(accs):.4f}-{max(accs):.4f} ({verdict})")


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def on_sigterm(*_: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the cleanup must not be interrupted
    sys.exit(143)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flower-python", required=True, help="the interpreter of a flwr 1.42 venv")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runtimes", default=",".join(RUNTIMES), help="comma-separated subset")
    ap.add_argument("--verbose", action="store_true", help="print each run as it ends")
    smaller = "instead of the default job's (a smoke test; the default is what is compared)"
    ap.add_argument("--devices", type=int, help=f"devices {smaller}")
    ap.add_argument("--rounds", type=int, help=f"rounds {smaller}")
    ap.add_argument("--clients-per-round", type=int, help=f"devices per round {smaller}")
    args = ap.parse_args()
    keys = {"devices": "data.devices", "rounds": "rounds.rounds"}
    keys["clients_per_round"] = "rounds.clients_per_round"
    overrides = {k: getattr(args, a) for a, k in keys.items() if getattr(args, a) is not None}
    flags = [f"--{a.replace('_', '-')}={getattr(args, a)}" for a in keys if getattr(args, a)]
    runtimes = args.runtimes.split(",")
    unknown = set(runtimes) - set(RUNTIMES)
    if unknown:
        raise SystemExit(f"bench_flower: unknown runtimes {sorted(unknown)}; known: {RUNTIMES}")
    become_subreaper()
    # a SIGTERM unwinds like Ctrl-C, so every process a run started is stopped and reaped
    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"edge-fl {edge_fl.__version__} ({EDGE_FL}); {flower_version(args.flower_python)}")
    print(f"before: {load()}", flush=True)
    results = Results()
    with tempfile.TemporaryDirectory(prefix="bench-flower-data-") as data_dir:
        flower = Flower(args.flower_python, write_job_data(Path(data_dir), overrides), args.verbose)
        try:
            for i in range(args.repeats):
                for name in runtimes:
                    if name == "edge-fl":
                        run = run_edge_fl(flags)
                    else:
                        run = flower.run(simulation=name == "flower-simulation")
                    results.add(name, run)
                    if args.verbose:
                        print(f"  [{i + 1}/{args.repeats}] {name}: {run}", flush=True)
        except (KeyboardInterrupt, SystemExit) as stopped:  # report what finished
            print(f"stopped ({type(stopped).__name__}) after {results.count()} runs", flush=True)
            if not results.runs:
                raise
    print(f"after: {load()}")
    report(results, args.repeats)


if __name__ == "__main__":
    main()
