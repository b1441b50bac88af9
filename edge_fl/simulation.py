"""``edge-fl simulate`` and ``edge_fl.run_simulation``: broker + aggregator + fleet in one process,
over real MQTT sockets; and :class:`AggregatorRun`, the aggregator's composition that
``edge-fl aggregator`` uses too.

The embedded broker is a private Mosquitto (or amqtt as a slow fallback) on a free loopback port;
with ``broker.url`` set the same run goes to an external broker instead. The async entry point
runs on the caller's event loop (a notebook's), so it neither calls ``asyncio.run`` nor installs
signal handlers unless asked.

Every round record carries the fleet's wire bytes (``edge_fl.transport.wire``): ``wire_up`` /
``wire_down`` (all devices' MQTT packets, exact), ``wire_up_ip`` / ``wire_down_ip`` (the link
model's estimate with TLS records and TCP/IP headers and ACKs) and the per-device distribution
(``wire_up_p50`` / ``_p95`` / ``_max``, same for down). Payload ``bytes_up`` / ``bytes_down`` are
unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_fl.config import JobConfig, changed_keys, load_config, set_path, validate_config
from edge_fl.fleet.counts import FleetTotals, merge_totals, round_fields
from edge_fl.job import Job, build_job
from edge_fl.metrics import RunRecorder
from edge_fl.server.service import AggregatorService
from edge_fl.server.signals import StopSignals
from edge_fl.storage import OutputError, lock_run_dir, write_json
from edge_fl.transport.url import BrokerSpec, parse_broker_url
from edge_fl.transport.wire import DEFAULT_LINK, LinkModel

if TYPE_CHECKING:
    from edge_fl.fleet.processes import FleetProcesses

log = logging.getLogger("edge_fl.simulate")


class _ProgressBar:
    def __init__(self, total: int, enabled: bool) -> None:
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        self.progress = (
            Progress(
                TextColumn("[bold]round"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                transient=False,
            )
            if enabled
            else None
        )
        self.total = total
        self.task: Any = None  # rich's TaskID once the bar is shown

    def __enter__(self) -> _ProgressBar:
        if self.progress is not None:
            self.progress.__enter__()
            self.task = self.progress.add_task("rounds", total=self.total, info="connecting")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(None, None, None)

    def update(self, record: dict[str, Any]) -> None:
        if self.progress is None:
            return
        acc = record.get("accuracy")
        info = (
            f"acc {acc:.3f}" if acc is not None else "-"
        ) + f"  recv {record['received']}/{record['selected']}"
        self.progress.update(self.task, advance=1, info=info)


#: what a refusal of a run directory calls the options it points at, from Python (the
#: arguments of run_simulation and open_run) and from the command line (its flags)
_API_WORDS = {
    "out": "out_dir",
    "overwrite": "overwrite=True",
    "resume": "resume=True",
    "rounds": "rounds.rounds",
    "reproducible": "reproducible: true",
}
_CLI_WORDS = {
    "out": "--out",
    "overwrite": "--overwrite",
    "resume": "--resume",
    "rounds": "--rounds",
    "reproducible": "--reproducible",
}


class RunDirError(ValueError):
    """An output directory a run cannot start in (an unfinished job there, say).

    Its message names what to do in the caller's terms: ``str(exc)`` the Python arguments
    (``out_dir``, ``overwrite=True``, ``resume=True``), ``exc.cli`` the same sentence with the
    command line's flags (``--out``, ``--overwrite``, ``--resume``), which ``edge-fl`` prints.
    ``say``: the sentence as a function of those words (or one text for both)."""

    def __init__(self, say: str | Callable[[dict[str, str]], str]) -> None:
        text = say if isinstance(say, str) else say(_API_WORDS)
        super().__init__(text)
        self.cli = say if isinstance(say, str) else say(_CLI_WORDS)


class AggregatorRun:
    """The aggregator's half of a job, composed once for ``edge-fl aggregator`` and simulations.

    Its core, its records and, with an output directory, crash safety: the directory is locked,
    every round checkpointed and everything accepted in between journaled, so ``resume=True``
    continues a run that crashed (even kill -9) with nothing lost or counted twice. ``finish``
    writes summary.json and model.onnx (whole or not at all). Use :func:`open_run` to make one."""

    def __init__(self, job: Job, recorder: RunRecorder, *, resume: bool = False) -> None:
        self.job = job
        self.recorder = recorder
        self.out_dir = recorder.out_dir
        self.core = job.aggregator_core()
        self.notes: list[str] = []  # what resuming did, for the console
        self.resumed: Any = None  # edge_fl.server.journal.Resumed
        self.journal: Any = None  # edge_fl.server.journal.Journal
        self.service: AggregatorService | None = None
        self.summary: dict[str, Any] | None = None
        self.lock: Any = None  # the output directory's lock, held until close()
        if resume:
            self._resume()
        if self.out_dir is not None:
            from edge_fl.server.journal import Journal

            r = self.resumed
            self.journal = Journal.start(
                self.out_dir,
                job=job.cfg.job,
                digest=job.cfg.digest(),
                after=r.journal_seq if r else 0,
                records=r.records if r else None,
            )

    def _resume(self) -> None:
        from edge_fl.server.journal import resume

        if self.out_dir is None:
            raise RunDirError("resuming needs an output directory (where the checkpoint is)")
        r = self.resumed = resume(self.core, self.out_dir)
        if r.checkpoint_round is None and not r.records:
            self.notes.append(f"nothing to resume in {self.out_dir}: starting the job from round 1")
            return
        for note in self.recorder.reconcile(self.core.round_number, r.last_record):
            self.notes.append(f"metrics: {note}")
        self.notes.append(
            f"resumed after round {r.checkpoint_round or 0} (its checkpoint), model version "
            f"{self.core.version}; "
            f"{r.describe()}"
        )

    def make_service(
        self,
        spec: BrokerSpec,
        *,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        annotate: Callable[[dict[str, Any]], None] | None = None,
        finish_before_done: bool = False,
        **options: Any,
    ) -> AggregatorService:
        """The MQTT service around the core, checkpointing and journaling into the output
        directory. Each round's record gets ``annotate(record)``'s additions, is recorded, then
        passed to ``on_record``. ``finish_before_done``: write summary and model before devices
        are told the job ended (a lone aggregator; a simulation finishes after its fleet left).
        ``options`` go to :class:`AggregatorService` (signals, signer, acks, job_document,
        sharding)."""
        job, cfg = self.job, self.job.cfg

        def record(r: dict[str, Any]) -> None:
            if annotate is not None:
                annotate(r)
            self.recorder.add(r)
            if on_record is not None:
                on_record(r)

        self.service = AggregatorService(
            self.core,
            spec,
            job.topics,
            wait_for_devices_s=cfg.rounds.wait_for_devices_s,
            expected_devices=job.expected_devices,
            on_record=record,
            checkpoint_dir=None if self.out_dir is None else str(self.out_dir),
            journal=self.journal,
            on_finish=self._finish_before_done if finish_before_done else None,
            resumed_payload=self.resumed.open_payload if self.resumed else None,
            virtual_time=cfg.fleet.virtual,
            virtual_limit_s=None if cfg.fleet.sim_hours is None else cfg.fleet.sim_hours * 3600,
            **({"acks": cfg.security.acks, "signer": job.signer} | options),
        )
        return self.service

    def finish(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """summary.json and model.onnx, once; returns the summary."""
        if self.summary is not None:
            return self.summary
        core, service = self.core, self.service
        journal = dict(service.stats) if service is not None else {}
        if self.journal is not None:
            journal |= {"records": self.journal.appended, "fsyncs": self.journal.syncs}
        if self.resumed is not None:
            journal["replayed"] = len(self.resumed.records)
        self.summary = self.recorder.close(
            {
                "privacy": core.privacy.report() if core.privacy is not None else None,
                "ended_early": core.ended_early,
                "stopped": service.stopped if service is not None else None,
                "after_last_round": core.after_last_round(),
                "journal": journal,
                **(extra or {}),
            }
        )
        if self.out_dir is not None:
            self.export_model(self.out_dir / "model.onnx")
        return self.summary

    def _finish_before_done(self) -> None:
        self.finish()

    def export_model(self, final: Path) -> None:
        """The global model as ONNX, exported beside ``final`` then renamed: whole or absent."""
        partial = final.with_name(final.name + ".partial")
        try:
            if self.job.export_model(self.core.params, partial):
                os.replace(partial, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            raise OutputError(final, exc) from None

    def abandon(self) -> bool:
        """After a failure: when the run never opened a round and resumed nothing (a broker
        never reached, say), remove what it wrote (run.json, the empty records and journal) and
        return True, so the same command, corrected, is not refused as an earlier run's. A fresh
        run starts only where there is no earlier run (or ``overwrite`` removed it), so nothing
        else is touched; a run that did open a round is left to :meth:`finish`."""
        if self.out_dir is None or self.resumed is not None or self.recorder.records:
            return False
        if self.core.round_number > 0:
            return False
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        _remove_earlier_run(self.out_dir)
        return True

    def close(self) -> None:
        """The journal closed and the output directory released."""
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        if self.lock is not None:
            self.lock.close()
            self.lock = None


def open_run(
    job: Job,
    out_dir: str | Path | None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    meta: dict[str, Any] | None = None,
) -> AggregatorRun:
    """An :class:`AggregatorRun` writing into ``out_dir`` (None: records in memory only).

    Starting afresh over a directory that holds an earlier run, finished or not, is refused
    (RunDirError) unless ``overwrite``: it would destroy that run's records, model, checkpoint and
    journal. With ``overwrite`` the earlier run's checkpoint, journal, summary and model are
    removed first, so nothing of it can be mistaken for the new run's. ``meta`` (default: the
    job's metadata) becomes run.json, kept as it was when a run is resumed."""
    if out_dir is not None and not resume and not overwrite:
        refuse_earlier_run(out_dir)
    if resume:
        refuse_resume(job.cfg, out_dir, job.mechanism.describe())
    lock = lock_run_dir(out_dir)
    try:
        if out_dir is not None and overwrite and not resume:
            _remove_earlier_run(Path(out_dir))
        run = AggregatorRun(job, RunRecorder(out_dir, append=resume), resume=resume)
    except BaseException:
        if out_dir is not None and not resume:
            # a fresh run starts only where no earlier run is (or overwrite removed it): what
            # it wrote before failing (a mechanism refused by its own checks, say) is removed,
            # or the corrected command is refused as an unfinished job's directory
            _remove_run_files(Path(out_dir))
        if lock is not None:
            lock.close()
        raise
    run.lock = lock
    meta_path = None if out_dir is None else Path(out_dir) / "run.json"
    if resume and meta_path is not None and meta_path.exists():
        # the run id survives a resume even when the aggregator died before round 1 opened
        # (devices that joined from the job document are bound to it)
        saved = json.loads(meta_path.read_text()).get("run")
        if isinstance(saved, str) and len(saved) == 32:
            run.core.run_id = bytes.fromhex(saved)
    else:
        base = meta if meta is not None else job.metadata()
        run.recorder.write_meta({**base, "run": run.core.run_id.hex()})
    return run


def _run_files() -> tuple[str, ...]:
    """The files whose presence says a directory holds a run, in the order a refusal names
    them (checkpoint parameter files, ``checkpoint*.npy``, and ledger files,
    ``checkpoint-ledger-*.jsonl``, go with checkpoint.json)."""
    from edge_fl.server.checkpoint import STATE
    from edge_fl.server.journal import JOURNAL

    return ("metrics.jsonl", "summary.json", "model.onnx", "run.json", STATE, JOURNAL)


def refuse_resume(
    cfg: JobConfig, out_dir: str | Path | None, privacy: dict[str, Any] | None = None
) -> None:
    """RunDirError, before anything is written, when ``out_dir`` cannot be resumed: under virtual
    time, a run written with other settings or (``privacy``: the built mechanism's
    ``describe()``) another privacy calibration, or a job that ran all the rounds asked now (a
    summary without a stop: resuming would only rewrite it). A run stopped by a signal, or
    given more rounds that leave the calibration as it was, is continued."""
    if cfg.fleet.virtual:
        raise RunDirError(
            lambda w: (
                f"{w['resume']} is not supported under virtual time (fleet.clock): the "
                "fleet's device timers are not checkpointed; run the job again (with "
                f"{w['reproducible']} it gives the same records), or use fleet.clock: wall"
            )
        )
    if out_dir is not None:
        refuse_other_settings(cfg, out_dir)
        if privacy is not None:
            refuse_other_calibration(privacy, out_dir)
        asked = _asked_rounds(out_dir)
        if "rounds" not in cfg.rounds.model_fields_set and asked not in (None, cfg.rounds.rounds):
            raise RunDirError(
                lambda w: (
                    f"{out_dir} holds a run asked for {asked} rounds, and this job has the "
                    f"default {cfg.rounds.rounds}: give {w['rounds']} (= {asked} continues it)"
                )
            )
    closed = _rounds_closed(out_dir)
    if closed is not None and closed > cfg.rounds.rounds:
        raise RunDirError(
            lambda w: (
                f"{out_dir} holds a run that closed {closed} rounds (checkpoint.json), more "
                f"than the {cfg.rounds.rounds} asked now: give {w['rounds']} above {closed} "
                f"to continue it, a new {w['out']}, or {w['overwrite']}"
            )
        )
    path = None if out_dir is None else Path(out_dir) / "summary.json"
    if path is not None and path.exists():
        try:
            summary = json.loads(path.read_text())
            stopped, rounds = summary.get("stopped"), int(summary.get("rounds") or 0)
        except (OSError, ValueError, TypeError, AttributeError):
            return  # not a summary this code wrote: the journal's own checks decide
        if not stopped and rounds >= cfg.rounds.rounds:
            raise RunDirError(
                lambda w: (
                    f"{out_dir} holds a finished run of {rounds} rounds (summary.json): "
                    f"nothing to resume; give more {w['rounds']} to continue it, a new {w['out']}, "
                    f"or {w['overwrite']}"
                )
            )


def resumed_config(cfg: JobConfig, out_dir: str | Path | None) -> JobConfig:
    """``cfg`` for resuming the run in ``out_dir``: the rounds it was last asked for unless
    ``rounds.rounds`` is given (the default 20 would end a stopped 80-round job at round 20 as
    if it had finished). Any other setting must match (:func:`refuse_resume`)."""
    if out_dir is None or "rounds" in cfg.rounds.model_fields_set:
        return cfg
    rounds = _asked_rounds(out_dir)
    if rounds is None or rounds == cfg.rounds.rounds:
        return cfg
    data = cfg.model_dump(exclude_unset=True)
    set_path(data, "rounds.rounds", rounds)
    return validate_config(data, source=f"the run in {out_dir}")


def _run_json(out_dir: str | Path) -> dict[str, Any]:
    """The run.json of the run in ``out_dir`` (what it was started with), or {} when there is
    none this code wrote (the checkpoint's own checks then decide)."""
    try:
        earlier = json.loads((Path(out_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return earlier if isinstance(earlier, dict) else {}


def _listed(changed: list[str], limit: int) -> str:
    return "; ".join(changed[:limit]) + (
        f"; and {len(changed) - limit} more" if len(changed) > limit else ""
    )


def _asked_rounds(out_dir: str | Path) -> int | None:
    """The rounds the run in ``out_dir`` was last asked for: its checkpoint's (written by the
    latest start or resume), else its run.json's (the first start), if either says."""
    from edge_fl.server.checkpoint import STATE

    try:
        rounds = json.loads((Path(out_dir) / STATE).read_text())["rounds"]
    except (OSError, ValueError, TypeError, KeyError):
        config = _run_json(out_dir).get("config")
        section = config.get("rounds") if isinstance(config, dict) else None
        rounds = section.get("rounds") if isinstance(section, dict) else None
    return rounds if isinstance(rounds, int) and not isinstance(rounds, bool) else None


def refuse_other_settings(cfg: JobConfig, out_dir: str | Path) -> None:
    """RunDirError naming what changed when ``out_dir`` holds a run written with other settings
    (its run.json's config digest); the checkpoint's and the journal's own digests stay the
    last word (a directory without run.json, say)."""
    earlier = _run_json(out_dir)
    config = earlier.get("config")
    if not isinstance(config, dict) or earlier.get("config_digest") in (None, cfg.digest()):
        return
    changed = cfg.digest_changes(config) or [f"the files data.data_dir holds ({cfg.data.data_dir})"]
    what = _listed(changed, 6)
    raise RunDirError(
        lambda w: (
            f"{out_dir} holds a run with other settings ({what}): {w['resume']} it with the "
            f"settings it was started with, or start a new {w['out']}, or {w['overwrite']}"
        )
    )


def refuse_other_calibration(privacy: dict[str, Any], out_dir: str | Path) -> None:
    """RunDirError when the mechanism would now be calibrated otherwise than the run in
    ``out_dir`` was (its run.json's ``privacy``): a target epsilon is split over
    ``rounds.rounds`` uploads, outside the config digest, and the ledger accounts every release
    of a run with its one calibration, so more rounds would report a smaller epsilon than the
    releases made under the first calibration carry."""
    earlier = _run_json(out_dir).get("privacy")
    now = json.loads(json.dumps(privacy, default=str))
    if not isinstance(earlier, dict) or earlier == now:
        return
    what = _listed(changed_keys(earlier, now), 4)
    raise RunDirError(
        lambda w: (
            f"{out_dir} holds a run whose privacy mechanism was calibrated otherwise ({what}): "
            f"its releases are accounted with the calibration it started with, which "
            f"{w['rounds']} feeds; {w['resume']} it with the rounds it was started with, or "
            f"start a new {w['out']} (a run started with privacy.max_uploads set keeps its "
            "calibration when it is given more rounds)"
        )
    )


def _rounds_closed(out_dir: str | Path | None) -> int | None:
    """The rounds the checkpoint in ``out_dir`` says closed; None without a readable one (the
    journal's and the checkpoint's own checks then decide)."""
    from edge_fl.server.checkpoint import STATE

    if out_dir is None:
        return None
    try:
        closed = json.loads((Path(out_dir) / STATE).read_text()).get("round_number")
    except (OSError, ValueError, AttributeError):
        return None
    return closed if type(closed) is int else None


def refuse_earlier_run(out_dir: str | Path) -> None:
    """RunDirError, in one line naming what is there, if ``out_dir`` holds an earlier run:
    finished (summary.json) or interrupted (records, a checkpoint or a journal, no summary)."""
    d = Path(out_dir)
    if not d.is_dir():
        return
    present = [name for name in _run_files() if (d / name).exists()]
    if not present:
        return
    listed = ", ".join(present)
    if (d / "summary.json").exists():
        stopped = stopped_at(d)
        if stopped is not None:
            raise RunDirError(
                lambda w: (
                    f"{out_dir} holds a run {stopped} ({listed}): {w['resume']} continues "
                    f"it, {w['overwrite']} replaces it, or use a new {w['out']}"
                )
            )
        raise RunDirError(
            lambda w: (
                f"{out_dir} holds a finished run ({listed}): use a new {w['out']}, or "
                f"{w['overwrite']}"
            )
        )
    from edge_fl.server.checkpoint import STATE
    from edge_fl.server.journal import JOURNAL, read_journal

    if (d / STATE).exists():
        what = "a checkpoint"
    elif (d / JOURNAL).exists() and read_journal(d / JOURNAL).records:
        what = "a journal of accepted updates"
    else:
        what = "records without a summary"
    raise RunDirError(
        lambda w: (
            f"{out_dir} holds an unfinished job ({what}): {listed}; continue it with "
            f"{w['resume']}, use a new {w['out']}, or {w['overwrite']}"
        )
    )


def stopped_at(out_dir: str | Path) -> str | None:
    """The words "stopped by SIGTERM at round 11 of 40" when ``out_dir``'s summary is of a run
    that can be continued (stopped by a signal, or ended by an error before its last round);
    None for one that completed (all its rounds, or ended early on its own: a budget spent)."""
    d = Path(out_dir)
    try:
        summary = json.loads((d / "summary.json").read_text())
        rounds, stopped = int(summary.get("rounds") or 0), summary.get("stopped")
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    try:
        total: int | None = int(
            json.loads((d / "run.json").read_text())["config"]["rounds"]["rounds"]
        )
    except (OSError, ValueError, TypeError, KeyError):
        total = None
    if not stopped and (summary.get("ended_early") or total is None or rounds >= total):
        return None
    return (
        (f"stopped by {stopped}" if stopped else "interrupted")
        + f" at round {rounds}"
        + (f" of {total}" if total is not None else "")
    )


def _remove_earlier_run(d: Path) -> None:
    """What an earlier run left that the new one would not rewrite at once (its checkpoint and
    journal would otherwise be resumable as if they were the new run's), and what ``edge-fl
    report`` wrote there of it (metrics.csv, the figures)."""
    from edge_fl.report import REPORT_FILES

    for name in REPORT_FILES:
        (d / name).unlink(missing_ok=True)
    _remove_run_files(d)


def _remove_run_files(d: Path) -> None:
    """A run's own files: records, summary, model, run.json, checkpoint, ledger and journal."""
    for name in _run_files():
        (d / name).unlink(missing_ok=True)
    for params in d.glob("checkpoint*.npy"):
        params.unlink(missing_ok=True)
    for ledger in d.glob("checkpoint-ledger-*.jsonl"):
        ledger.unlink(missing_ok=True)


def _preload(job: Job) -> None:
    """On a thread, import onnxruntime (and onnx, the first time a model's shape is seen on this
    machine: edge_fl.models.onnx_template; about 0.3 s on a slow machine) and build the
    job's evaluation session, while the broker starts and devices connect, which mostly wait
    on sockets, instead of on the event loop when the first round closes. A failure is left
    for the real call to report. Not a daemon: a command that fails before its first round
    (a bad profile, say) waits for it at exit, where killing it in the middle of building an
    onnxruntime session aborted the process ("terminate called without an active exception",
    exit -6 instead of the one-line error)."""

    def load() -> None:
        with contextlib.suppress(Exception):
            importlib.import_module("edge_fl.models.onnx_runtime")
            job.evaluation_session()

    threading.Thread(target=load, name="preload").start()


@dataclass
class SimulationResult:
    """What :func:`run_simulation` returns: the summary (as in summary.json), every round's
    record, the final global model's parameters and the job that ran."""

    summary: dict[str, Any]
    records: list[dict[str, Any]] = field(repr=False)
    params: np.ndarray = field(repr=False)
    job: Job = field(repr=False)


async def run_job(
    job: Job,
    spec: BrokerSpec,
    recorder: RunRecorder,
    *,
    progress: bool = False,
    fleet_hook: Any = None,
    signals: StopSignals | None = None,
    link: LinkModel | None = None,
    device_downlink: bool = False,
) -> dict[str, Any]:
    """Aggregator and fleet on one event loop, records into ``recorder``; returns the summary.
    (The composition without an output directory's crash safety; see :func:`run_simulation`.)"""
    run = AggregatorRun(job, recorder)
    try:
        return await _run_with_fleet(
            run,
            spec,
            progress=progress,
            fleet_hook=fleet_hook,
            signals=signals,
            link=link,
            device_downlink=device_downlink,
        )
    finally:
        run.close()


async def _run_with_fleet(
    run: AggregatorRun,
    spec: BrokerSpec,
    *,
    progress: bool = False,
    fleet_hook: Any = None,
    signals: StopSignals | None = None,
    link: LinkModel | None = None,
    device_downlink: bool = False,
    signer: Any = None,
    shares: FleetProcesses | None = None,
) -> dict[str, Any]:
    """Aggregator and fleet on one event loop; returns the run summary.

    With ``signals``, SIGTERM/SIGINT stop the job cleanly: the open round is decided, the fleet is
    told the job ended (and leaves), and the summary says ``stopped``. ``link``: the model of the
    wire IP estimate (default: Ethernet MSS 1448); ``device_downlink``: every device receives
    the global model on its own session (measured rather than charged; N copies on the wire).
    ``signer``: the global messages' key (default: the job's, else a new one); ``shares``: the
    fleet's other processes, forked already (:class:`FleetProcesses`; default: none)."""
    from edge_fl.fleet.processes import (
        LEAVE_GRACE_S,
        FleetProcessError,
        FleetProcesses,
        share_fleet,
    )

    job = run.job
    cfg = job.cfg
    shares = shares or FleetProcesses([], 1)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    bar = _ProgressBar(cfg.rounds.rounds, progress)

    def annotate(record: dict[str, Any]) -> None:
        record["elapsed_s"] = round(time.perf_counter() - t0, 4)
        if service.vclock is None:
            now = job.clock.now()
        else:  # when the round closed, not after the last round's drain (up to a deadline)
            now = service.closed_at if service.closed_at is not None else service.sim_now()
        record["sim_time_s"] = round(now - job.clock.start_s, 3)
        record.update(round_fields([fleet.take_round(), *shares.take_round()]))
        if "first_round_s" not in timings:
            timings["first_round_s"] = record["elapsed_s"]

    def on_record(record: dict[str, Any]) -> None:
        bar.update(record)
        if fleet_hook is not None:
            fleet_hook(record, fleet)

    # one simulation = one key: every global message is signed and every device verifies it
    if signer is None:
        from edge_fl.protocol.signing import Signer

        signer = job.signer or Signer.generate()
    # the job document, retained while the job runs and cleared at its end (as `edge-fl
    # aggregator` does): a live dashboard takes the rounds and the budget from it
    from dataclasses import replace

    from edge_fl.protocol.jobdoc import encode_job_document

    document = encode_job_document(replace(job.job_document(), run=run.core.run_id), signer)
    service = run.make_service(
        spec,
        on_record=on_record,
        annotate=annotate,
        signals=signals,
        signer=signer,
        job_document=document,
    )
    n = shares.n  # share 0 of n: the others run in their own processes
    fleet = share_fleet(job, spec, 0, n, signer.verifier)
    released = device_releases(run.core) if run.resumed is not None else {}
    fleet.resume_devices(released)
    fleet.link = link or DEFAULT_LINK
    fleet.device_downlink = device_downlink
    with bar:
        aggregator = asyncio.create_task(service.run(), name="aggregator")
        await asyncio.wait(
            {aggregator, asyncio.create_task(service.connected.wait())},
            return_when=asyncio.FIRST_COMPLETED,
        )
        job.clock.reset()
        shares.start(spec, service.request_stop, released)
        fleet_task = asyncio.create_task(fleet.run(), name="fleet")
        await fleet.connected.wait() if not aggregator.done() else None
        timings["fleet_connected_s"] = round(time.perf_counter() - t0, 4)
        try:
            await aggregator
        except BaseException:
            fleet_task.cancel()  # no done marker was published: the fleet would wait for one
            shares.close()  # and the other processes exit (their devices' last wills)
            with contextlib.suppress(BaseException):
                await fleet_task
            raise
        if service.broker_lost:  # no done marker reached it: it would wait for one
            fleet_task.cancel()

        async def fleet_left() -> None:
            # the done marker ends the fleet; one that missed it (still connecting when a stop
            # came) is told to leave after a grace, as the other processes' shares are
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):  # (broker lost)
                await asyncio.wait_for(asyncio.shield(fleet_task), timeout=LEAVE_GRACE_S)
            if not fleet_task.done() and not fleet.leaving:
                fleet_task.cancel()
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(fleet_task, timeout=10)
            if not fleet_task.done():
                fleet_task.cancel()

        _, (share_totals, share_after) = await asyncio.gather(
            fleet_left(), shares.finish(wait=not service.broker_lost)
        )
    timings["run_s"] = round(time.perf_counter() - t0, 4)
    totals = merge_totals([fleet.totals(), *share_totals])
    after = round_fields([fleet.take_round(), *share_after])
    summary = run.finish(
        {
            "mechanism": cfg.privacy.mechanism,
            "devices": cfg.data.devices,
            "model": job.model.name,
            "n_params": job.model.n_params,
            "dataset": job.dataset.name,
            "timings": timings,
            "fleet_processes": n,
            "fleet_published": totals.published,
            "fleet_publish_failures": totals.publish_failures,
            # on their own account (a budget spent); those whose training failed: below
            "stopped_devices": totals.stopped_devices,
            # trainings that raised, in all and per error ("RuntimeError: boom": count)
            "device_failures": totals.device_failures,
            "device_failure_errors": totals.failure_errors,
            **_virtual_time_summary(service, fleet, job.clock.start_s),
            **_wire_summary(run.recorder, after, totals, fleet),
        }
    )
    failed = shares.failures()
    if failed:  # the job stopped cleanly when the first one failed
        if not run.recorder.records:
            where = "the job stopped before its first round"
        elif run.out_dir is None:
            where = f"the job stopped after round {summary.get('rounds')}"
        else:
            where = (
                f"the job stopped after round {summary.get('rounds')}; its records, model and "
                "checkpoint are written, and resuming continues it"
            )
        raise FleetProcessError("; ".join(failed) + f" ({where})")
    return summary


def fleet_processes(cfg: JobConfig, *, fleet_hook: Any = None, given_job: bool = False) -> int:
    """How many processes a simulation's fleet runs in (``fleet.processes``; ``auto``: one per
    usable core, at most 4 and at most one per device, when forking is safe and changes
    nothing a caller sees: Linux, the main thread and no other, the wall clock, no secure
    aggregation, no ``reproducible`` (the order in which updates arrive from two processes is
    the machine's: FedBuff, FedAsync and over-selected rounds depend on it), no ``fleet_hook``
    (it is handed the fleet object) and a job built here from a config (``given_job``: the
    caller built it, with its own dataset, model or device factory, whose Python state a forked
    copy would not share back); else 1)."""
    from edge_fl.fleet.processes import usable_cores

    asked = cfg.fleet.processes
    if asked != "auto":
        if asked > 1 and not hasattr(os, "fork"):
            raise ValueError(f"fleet.processes = {asked} needs os.fork (Linux or macOS)")
        if asked > 1 and fleet_hook is not None:
            raise ValueError(
                f"fleet.processes = {asked}: a fleet_hook is handed the fleet, whose devices "
                "would be split over processes; use fleet.processes = 1 with a hook"
            )
        return max(1, min(asked, cfg.data.devices))
    forking_is_safe = (
        sys.platform == "linux"
        and threading.current_thread() is threading.main_thread()
        and threading.active_count() == 1
    )
    if not forking_is_safe or fleet_hook is not None or given_job or cfg.fleet.virtual:
        return 1
    if cfg.secure_aggregation.enabled or cfg.reproducible:
        return 1
    return max(1, min(usable_cores(), 4, cfg.data.devices))


def device_releases(core: Any) -> dict[str, tuple[int, int]]:
    """Each device's releases in the ledger (``device: (count, last round)``): what a resumed
    simulation's rebuilt devices go on from (``Fleet.resume_devices``)."""
    out: dict[str, tuple[int, int]] = {}
    for device, number, _ in core.releases:
        count, last = out.get(device, (0, -1))
        out[device] = (count + 1, max(last, number))
    return out


def _virtual_time_summary(service: AggregatorService, fleet: Any, start_s: float) -> dict:
    """Under virtual time: how far it went and what it cost (grants, the wall time devices
    spent training while the clock waited for them)."""
    vc = service.vclock
    if vc is None:
        return {}
    return {
        "virtual_time": {
            "sim_end_s": None if vc.now is None else round(vc.now - start_s, 3),
            "grants": vc.grants,
            "same_time_grants": vc.same_time,
            "fleet_published": vc.fleet_published,
            # the aggregator's messages the clock counted, and those the fleet saw (models,
            # dispatches, inbox messages): a message one side leaves uncounted can be handed
            # over at a later simulated time than it was sent
            "aggregator_published": vc.published,
            "fleet_seen": fleet.vt_seen,
            "train_wall_s": round(fleet.vt_train_s, 3),
        }
    }


def _wire_summary(
    recorder: RunRecorder, after: dict[str, int], totals: FleetTotals, fleet: Any
) -> dict[str, Any]:
    """Run totals of the fleet's wire bytes: every record's plus ``after``, what came after the
    last one (the end-of-job model, statuses, DISCONNECT), and the link model the estimate
    used (``fleet``'s: every process's share uses the same)."""
    link = fleet.link
    sums = {
        key: sum(r.get(key, 0) for r in recorder.records) + after[key]
        for key in ("wire_up", "wire_down", "wire_up_ip", "wire_down_ip")
    }
    return {
        **{f"total_{key}": value for key, value in sums.items()},
        "wire": {
            "after_last_round": {k: after[k] for k in sums},
            "device_downlink": fleet.device_downlink,
            # one session per fleet process
            "shared_downlink": {"up": totals.downlink_up, "down": totals.downlink_down},
            "link_model": {
                "tls": fleet.spec.tls,
                "mss": link.mss,
                "header": link.header,
                "ack_ratio": link.ack_ratio,
                "tls_record_overhead": link.tls_record_overhead,
                "tls_handshake_up": link.tls_handshake_up,
                "tls_handshake_down": link.tls_handshake_down,
            },
        },
    }


async def run_simulation_async(
    job: Job | JobConfig | str | os.PathLike,
    out_dir: str | Path | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = False,
    handle_signals: bool = False,
    fleet_hook: Any = None,
    signals: StopSignals | None = None,
) -> SimulationResult:
    """Run a whole simulation on the running event loop (a notebook's, say).

    ``job``: a :class:`~edge_fl.job.Job` (``build_job`` with your own dataset, model or device
    factory), a config, or a config file's path (YAML or TOML). The embedded broker is started
    unless ``broker.url`` is set.
    ``out_dir``: metrics.jsonl, run.json, summary.json, model.onnx, and the checkpoint and journal
    that ``resume=True`` continues from; a directory holding an earlier run is refused
    (RunDirError) unless ``resume`` or ``overwrite``. ``on_record(record)``: after every round.
    ``handle_signals``: SIGTERM/SIGINT stop the job cleanly (never installed unless asked);
    ``signals``: handlers the caller installed already (the CLI, before building the job)."""
    t_start = time.perf_counter()
    if out_dir is not None and not resume and not overwrite:
        refuse_earlier_run(out_dir)  # before the job is built and the broker started
    if isinstance(job, str | os.PathLike):  # a config file's path, as `edge-fl --config`
        job = load_config(Path(job))
    if not isinstance(job, Job | JobConfig):
        raise TypeError(
            f"run_simulation takes a Job, a JobConfig or a config file's path, not "
            f"{type(job).__name__}"
        )
    given_job = isinstance(job, Job)
    if resume and isinstance(job, JobConfig):
        job = resumed_config(job, out_dir)
    with contextlib.ExitStack() as stack:
        broker = _spawn_broker(job.cfg if isinstance(job, Job) else job)  # starts as job builds
        if broker is not None:
            stack.callback(broker.stop)
        job = job if isinstance(job, Job) else build_job(job)
        cfg = job.cfg
        if resume:
            # before anything is written or onnx loads on a thread
            refuse_resume(cfg, out_dir, job.mechanism.describe())
        job.check_device_keys()  # the simulated devices' own keys: before anything is written
        from edge_fl.fleet.processes import FleetProcesses
        from edge_fl.protocol.signing import Signer

        signer = job.signer or Signer.generate()  # the shares verify what it signs
        # forked before any thread of ours starts (a forked process holds only the forking
        # thread); the shares close before the broker stops
        n = fleet_processes(cfg, fleet_hook=fleet_hook, given_job=given_job)
        meta = job.metadata()  # (it imports the job's generator, which the shares' devices use)
        shares = FleetProcesses.fork(job, n, signer.verifier)
        stack.callback(shares.close)
        if cfg.model.evaluate_with == "onnxruntime" and job.onnx is not None:
            _preload(job)
        timings = {"build_s": round(time.perf_counter() - t_start, 4)}
        if broker is None:
            assert cfg.broker.url  # (_spawn_broker: None only with a URL)
            spec = parse_broker_url(cfg.broker.url)
            meta["broker"] = {"kind": "external", "url": spec.redacted()}
        else:
            broker.wait_ready()
            spec = parse_broker_url(broker.url)
            meta["broker"] = {"kind": f"embedded-{broker.kind}", "url": broker.url}
            timings["broker_ready_s"] = round(time.perf_counter() - t_start, 4)
        run = open_run(job, out_dir, resume=resume, overwrite=overwrite, meta=meta)
        stack.callback(run.close)
        for note in run.notes:
            log.warning("%s", note)
        if signals is None and handle_signals:
            signals = StopSignals().install()
            stack.callback(signals.restore)

        def hook(record: dict[str, Any], fleet: Any) -> None:
            if on_record is not None:
                on_record(record)
            if fleet_hook is not None:
                fleet_hook(record, fleet)

        try:
            summary = await _run_with_fleet(
                run,
                spec,
                progress=progress,
                fleet_hook=hook,
                signals=signals,
                signer=signer,
                shares=shares,
            )
        except Exception:
            run.abandon()  # a run that never opened a round does not block a retry
            raise
    summary["timings"] = {**timings, **summary.get("timings", {})}
    summary["timings"]["total_s"] = round(time.perf_counter() - t_start, 4)
    if out_dir:
        write_json(Path(out_dir) / "summary.json", summary)
    return SimulationResult(summary, run.recorder.records, run.core.params.copy(), job)


def _spawn_broker(cfg: JobConfig) -> Any:
    """The embedded broker, its process started (None: ``broker.url`` names one to use)."""
    if cfg.broker.url:
        return None
    from edge_fl.transport.broker import EmbeddedBroker

    broker = EmbeddedBroker(kind=cfg.broker.embedded)
    if broker.max_devices is not None and cfg.data.devices > broker.max_devices:
        raise ValueError(
            f"data.devices = {cfg.data.devices} exceeds the {broker.kind} fallback broker's "
            f"cap of {broker.max_devices}; install mosquitto (apt-get install mosquitto) or "
            "pass --broker mqtt://HOST:PORT"
        )
    return broker.spawn()


def run_simulation(
    job: Job | JobConfig | str | os.PathLike,
    out_dir: str | Path | None = None,
    **options: Any,
) -> SimulationResult:
    """:func:`run_simulation_async` from a script (its own event loop; none may be running:
    inside one, ``await run_simulation_async(...)``).

    Unless ``handle_signals`` is given: in the main thread, Ctrl-C (SIGINT) or SIGTERM stops the
    job cleanly (the open round decided, summary.json and model.onnx written, resumable), then
    raises KeyboardInterrupt or SystemExit(143) so the script stops too. Without this, Ctrl-C
    broke off the event loop with two chained tracebacks and no summary or model."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # none running: run it here, outside this handler (an error it raises is not
    else:  # shown "during handling of" the missing loop)
        raise RuntimeError(
            "run_simulation() was called inside a running event loop (a notebook?): use "
            "`await edge_fl.run_simulation_async(...)` there"
        )
    own = not ({"handle_signals", "signals"} & options.keys()) and (
        threading.current_thread() is threading.main_thread()
    )
    if not own:
        return asyncio.run(run_simulation_async(job, out_dir, **options))
    signals = StopSignals().install()
    try:
        result = asyncio.run(run_simulation_async(job, out_dir, signals=signals, **options))
    finally:
        signals.restore()
    if signals.received == "SIGINT":
        raise KeyboardInterrupt(f"simulation stopped by SIGINT ({_where(result, out_dir)})")
    if signals.received is not None:
        log.warning("simulation stopped by %s (%s)", signals.received, _where(result, out_dir))
        raise SystemExit(128 + int(getattr(signal, signals.received)))
    return result


def _where(result: SimulationResult, out_dir: str | Path | None) -> str:
    """How far a stopped simulation got, and where its files are."""
    closed = result.summary.get("rounds_closed")
    return f"{closed} rounds closed" + (f"; resumable in {out_dir}" if out_dir else "")


def simulate(
    cfg: Job | JobConfig,
    out_dir: str | Path | None = None,
    *,
    progress: bool = False,
    fleet_hook: Any = None,
    resume: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """``edge-fl simulate``: a whole simulation; returns the summary.

    SIGTERM and SIGINT (from the main thread's point of view) stop it cleanly: the summary and
    model are written, the fleet leaves, and the summary's ``stopped`` names the signal."""
    signals = StopSignals().install()  # before the job is built: a signal then is kept too
    try:
        result = run_simulation(
            cfg,
            out_dir,
            resume=resume,
            overwrite=overwrite,
            progress=progress,
            fleet_hook=fleet_hook,
            signals=signals,
        )
    finally:
        signals.restore()
    return result.summary
