"""``edge-fl ingest``: one ingest worker of a sharded aggregator, and the local spawner of them."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import aiomqtt
import click

from edge_fl.transport.broker import make_preexec

from . import (
    common_job_options,
    configure_logging,
    fail,
    job_overrides,
    load_job_config,
    require_server,
)

log = logging.getLogger("edge_fl.ingest")


@click.command()
@common_job_options
@click.option("--worker", "index", type=int, required=True, help="this worker's index I (name wI)")
@click.option("--workers", type=int, help="how many workers the job has (ingest.workers)")
@click.option(
    "--key-file",
    type=click.Path(dir_okay=False),
    help="this worker's key (64 hex characters) from the coordinator's secret (--mint-key)",
)
@click.option(
    "--mint-key",
    "mint",
    type=click.Path(dir_okay=False),
    help="print worker I's key from the coordinator's secret in this file (made if missing, "
    "mode 0600; the aggregator reads it from $EDGE_FL_INGEST_SECRET_FILE) and exit",
)
def ingest(index, workers, key_file, mint, verbose, config, **kw) -> None:
    """Run ingest worker wI of a job whose aggregator has ingest.workers = N (docs/scale.md).

    It takes its share of the updates (a shared subscription, or with ingest.partition = hash
    the devices whose id hashes to I), decodes, validates and folds them with the aggregator's
    own code, and hands the aggregator an exact partial sum when a round closes. It ends when
    the aggregator ends the job. Use the aggregator's config, so both build the same job.
    Its messages are sealed with its key (--key-file, or derived from
    $EDGE_FL_INGEST_SECRET_FILE); the aggregator refuses anything else."""
    if mint:
        click.echo(mint_key(mint, f"w{index}"))
        return
    require_server("ingest")
    configure_logging(verbose or 1)
    overrides = job_overrides(kw) | {"ingest.workers": workers}
    cfg = load_job_config(config, overrides)
    n = cfg.ingest.workers
    if not cfg.broker.url:
        fail("an ingest worker needs --broker (or broker.url in the config)")
    if n < 1 or not 0 <= index < n:
        fail(f"--worker {index}: need ingest.workers = N >= 1 (here {n}) and 0 <= I < N")
    from edge_fl.job import build_job
    from edge_fl.server.ingest import IngestService
    from edge_fl.server.sharding import SECRET_ENV, IngestWorker, ShardingError, load_key
    from edge_fl.transport.url import parse_broker_url

    if key_file is None and not os.environ.get(SECRET_ENV):
        fail(f"an ingest worker needs its key: --key-file FILE (from `edge-fl ingest --worker "
              f"{index} --mint-key SECRET`) or {SECRET_ENV}")  # fmt: skip
    try:
        key = load_key(key_file) if key_file is not None else None
    except ShardingError as exc:
        fail(str(exc))
    job = build_job(cfg)
    worker = IngestWorker(f"w{index}", job.aggregator_core(), key=key)
    service = IngestService(
        worker,
        parse_broker_url(cfg.broker.url),
        job.topics,
        group=cfg.ingest.group,
        hash_partition=(index, n) if cfg.ingest.partition == "hash" else None,
        whole_stream=cfg.ingest.partition == "site",
    )

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # say offline, then leave
            loop.add_signal_handler(sig, service.request_stop)
        return await service.run()

    try:
        stats = asyncio.run(run())
    except (RuntimeError, aiomqtt.MqttError, OSError) as exc:
        fail(str(exc))
    click.echo(f"ingest worker w{index}: {stats['updates']} updates folded", err=True)


def mint_key(secret_file: str, worker: str) -> str:
    """``worker``'s key (hex) from the coordinator's secret, which is made (0600) if missing."""
    from edge_fl.server.sharding import ShardingError, load_key, worker_key

    path = Path(secret_file)
    if not path.exists():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            fail(f"cannot create {secret_file}: {exc.strerror}")
        with os.fdopen(fd, "w") as fh:
            fh.write(os.urandom(32).hex() + "\n")
        click.echo(f"created the coordinator's secret {secret_file} (mode 0600)", err=True)
    try:
        return worker_key(load_key(path), worker).hex()
    except ShardingError as exc:
        fail(str(exc))


WORKER_PASSWORD_LABEL = b"edge-fl ingest worker "


def worker_password(password: str, worker: str) -> str:
    """Worker ``worker``'s MQTT password, derived from the aggregator's (what
    ``broker/mint-credentials.sh --ingest-workers`` mints: HMAC-SHA256, 18 bytes, URL-safe
    base64): the aggregator can start its workers, a worker's password reveals nothing of it."""
    digest = hmac.new(password.encode(), WORKER_PASSWORD_LABEL + worker.encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(digest.digest()[:18]).decode()


def worker_url(url: str, worker: str) -> str:
    """The broker URL worker ``worker`` logs in with: user ``<aggregator's user>-<worker>``
    and its derived password (each worker its own user: a broker with
    ``use_username_as_clientid`` allows one connection per user, and the ACL gives each worker
    only its own ingest topics). Without credentials in ``url``: ``url`` itself."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, hosts = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    name = f"{unquote(user)}-{worker}"
    secret = worker_password(unquote(password), worker)
    netloc = f"{quote(name, safe='')}:{secret}@{hosts}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class LocalWorkers:
    """The workers of ``edge-fl aggregator`` with ingest.spawn: child processes running
    ``edge-fl ingest`` on the aggregator's validated config (a 0600 file each, with the worker's
    own broker login, :func:`worker_url`) and their keys from this process's secret (0600
    files: the coordinator in this process checks every message against them), restarted when one dies (the coordinator counts the share of the round
    it died in as lost), stopped when the aggregator ends."""

    #: restarts per worker at most, so a worker that cannot start does not loop forever
    MAX_RESTARTS = 10

    def __init__(self, cfg, verbose: int = 0) -> None:
        self.cfg = cfg
        self.verbose = verbose
        self.procs: list[subprocess.Popen] = []
        self.restarts = [0] * cfg.ingest.workers
        self._dir = tempfile.TemporaryDirectory(prefix="edgefl-ingest-")
        self._path = Path(self._dir.name)
        self._stopping = threading.Event()
        self._watch = threading.Thread(target=self._supervise, name="ingest-workers", daemon=True)

    def _spawn(self, index: int) -> subprocess.Popen:
        entry = "import sys; from edge_fl.cli import main; sys.argv[0] = 'edge-fl'; main()"
        config, key = self._path / f"w{index}.json", self._path / f"w{index}.key"
        argv = [sys.executable, "-c", entry, "ingest", "--config", str(config)]
        argv += ["--worker", str(index), "--key-file", str(key), *["-v"] * self.verbose]
        # a worker dies with the thread that started it (SIGTERM): an aggregator killed with
        # kill -9 must not leave workers that fight its resumed successor's for their client ids.
        # Its own session: a Ctrl-C at the terminal stops the aggregator, which closes the open
        # round with the workers' shares, instead of stopping the workers under it
        return subprocess.Popen(
            argv, preexec_fn=make_preexec(parent_death_signal=True), start_new_session=True
        )

    def start(self) -> None:
        from edge_fl.server.sharding import run_secret, worker_key

        for i in range(self.cfg.ingest.workers):
            # what was set: defaults that clamp stay defaults
            dump = self.cfg.model_dump(mode="json", exclude_unset=True)
            dump.setdefault("broker", {})["url"] = worker_url(self.cfg.broker.url, f"w{i}")
            self._private(f"w{i}.json", json.dumps(dump))
            self._private(f"w{i}.key", worker_key(run_secret(), f"w{i}").hex())
        self.procs = [self._spawn(i) for i in range(self.cfg.ingest.workers)]
        log.info("started %d ingest workers (pids %s)", len(self.procs),
                 ", ".join(str(p.pid) for p in self.procs))  # fmt: skip
        self._watch.start()

    def _private(self, name: str, text: str) -> None:
        fd = os.open(self._path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)

    def _supervise(self) -> None:
        while not self._stopping.wait(0.5):
            for i, proc in enumerate(self.procs):
                code = proc.poll()
                if code is None or self._stopping.is_set():
                    continue
                if self.restarts[i] >= self.MAX_RESTARTS:
                    continue
                self.restarts[i] += 1
                log.error("ingest worker w%d (pid %d) exited with status %s; restarting it "
                          "(%d/%d)", i, proc.pid, code, self.restarts[i],
                          self.MAX_RESTARTS)  # fmt: skip
                self.procs[i] = self._spawn(i)

    def stop(self, wait_s: float = 10.0) -> None:
        """The job's end message stops them; whoever is still running after ``wait_s`` (all
        together) is terminated, and killed if that does not do it within 5 s."""
        self._stopping.set()
        if self._watch.is_alive():
            self._watch.join()
        for deadline, signal_them in ((wait_s, None), (5.0, "terminate"), (5.0, "kill")):
            running = [p for p in self.procs if p.poll() is None]
            if not running:
                break
            if signal_them is not None:
                for proc in running:
                    getattr(proc, signal_them)()
            until = time.monotonic() + deadline
            for proc in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, until - time.monotonic()))
        self._dir.cleanup()
