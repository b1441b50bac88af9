"""``edge-fl aggregator | fleet | device``: the parts of a job as separate processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

import aiomqtt
import click

from edge_fl.cli import (
    common_job_options,
    configure_logging,
    error_text,
    fail,
    job_overrides,
    load_job_config,
    open_tracking,
    require_server,
    tracking_options,
)

log = logging.getLogger("edge_fl.aggregator")


def _broker_problem(url: str, exc: BaseException) -> str:
    """One line an operator can act on, for a broker that refused or could not be reached."""
    from edge_fl.transport.url import parse_broker_url

    where = parse_broker_url(url).redacted()
    text = str(exc) or type(exc).__name__
    low = text.lower()
    if "not authori" in low or "bad user name or password" in low or "code:135" in low:
        hint = "check the username and password (broker/mint-credentials.sh) and the ACL"
    elif "certificate" in low or "ssl" in low or "tls" in low:
        hint = "check the CA file (?ca=...) and that the broker's certificate names this host"
    elif "refused" in low or "unreachable" in low or "timed out" in low or "name" in low:
        hint = "is the broker running and reachable from here?"
    else:
        hint = "see the broker's log"
    return f"broker {where}: {text} ({hint})"


def _fail_now(message: str) -> None:
    """One line and exit at once: a fleet that failed mid-connect leaves thousands of half-open
    clients whose collection at interpreter exit (after their event loop closed) would log noise
    under the error; nothing of the fleet's is left to write."""
    import os

    click.echo(f"edge-fl: error: {message}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


def _parse_shard(shard: str, n_devices: int) -> range:
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        fail(f"--shard {shard!r}: use I/N, e.g. 0/4")
    if not (n >= 1 and 0 <= i < n):
        fail(f"--shard {shard!r}: need N >= 1 and 0 <= I < N")
    return range(i, n_devices, n)


@click.command()
@common_job_options
@click.option("--out", type=click.Path(file_okay=False), help="records, checkpoints, model.onnx")
@click.option(
    "--resume", is_flag=True, help="continue from the checkpoint and journal in --out (if any)"
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="start afresh over an earlier run in --out (its records, model, checkpoint and report "
    "files go)",
)
@click.option(
    "--workers",
    type=int,
    help="sharded ingest: N worker processes fold the updates (ingest.workers)",
)
@click.option(
    "--spawn-workers/--no-spawn-workers",
    default=None,
    help="start the workers here (default), or run `edge-fl ingest --worker I` yourself",
)
@tracking_options
def aggregator(
    out, resume, overwrite, verbose, config, workers, spawn_workers, track, tensorboard_dir, **kw
) -> None:
    """Run the aggregator against a broker (devices run elsewhere).

    With --out, every round is checkpointed and everything accepted in between is journaled, so
    `--resume` after a crash (even kill -9) continues with nothing lost or counted twice. An --out
    holding an earlier run is refused unless --resume or --overwrite. SIGTERM
    and SIGINT stop cleanly: the open round is decided, summary.json, model.onnx and the
    checkpoint are written, devices are told the job ended, and the exit status is 0."""
    from edge_fl.server.signals import StopSignals

    require_server("aggregator")
    signals = StopSignals().install()  # from here on, SIGTERM/SIGINT mean "stop cleanly"
    configure_logging(verbose or 1)
    cfg = load_job_config(
        config, job_overrides(kw) | {"ingest.workers": workers, "ingest.spawn": spawn_workers}
    )
    if not cfg.broker.url:
        fail("the aggregator needs --broker (or broker.url in the config)")
    if resume and not out:
        fail("--resume needs --out DIR (where the checkpoint is)")
    if resume and overwrite:
        fail("--resume and --overwrite contradict each other: continue the run, or replace it")
    if resume:
        from edge_fl.simulation import resumed_config

        cfg = resumed_config(cfg, out)  # the run's rounds unless --rounds is given
    from edge_fl.storage import OutputError
    from edge_fl.tracking import tracked

    if out and not resume and not overwrite and (track or tensorboard_dir):
        from edge_fl.simulation import RunDirError, refuse_earlier_run

        try:  # refused below anyway: before a tracked run is opened
            refuse_earlier_run(out)
        except RunDirError as exc:
            fail(error_text(exc))
    try:
        tracker = open_tracking(cfg, track, tensorboard_dir, out, resumed=resume)
    except SystemExit:
        signals.restore()
        raise
    local = None
    if cfg.ingest.workers and cfg.ingest.spawn:
        from .ingest_cmd import LocalWorkers

        local = LocalWorkers(cfg, verbose)
        local.start()
    finished = False
    try:
        with tracked(tracker):
            summary = _run_aggregator(cfg, out, resume, overwrite, signals)
        finished = True
    except OutputError as exc:  # disk full, read-only or unwritable output: one line
        fail(str(exc))
    finally:
        signals.restore()
        if local is not None:  # after the job's end they leave by themselves; else at once
            local.stop(wait_s=10.0 if finished else 0.0)
    if tracker is not None:
        tracker.finish(summary, out)


def _run_aggregator(cfg, out, resume, overwrite, signals) -> dict:
    from dataclasses import replace

    from edge_fl.job import build_job
    from edge_fl.metrics import job_facts
    from edge_fl.protocol.jobdoc import encode_job_document
    from edge_fl.simulation import RunDirError, open_run, refuse_earlier_run
    from edge_fl.storage import OutputError
    from edge_fl.transport.url import parse_broker_url

    try:
        if out and not resume and not overwrite:
            refuse_earlier_run(out)  # before the job is built: the cheap refusal first
        job = build_job(cfg)
        if cfg.security.device_keys is not None and job.signer is None:
            fail(
                "security.device_keys needs security.signing_key: unsigned global messages "
                "would let the broker drop a round's secure parameters or lower its threshold "
                "(create one with `edge-fl keygen DIR`)"
            )
        run = open_run(job, out, resume=resume, overwrite=overwrite)
    except (RunDirError, ValueError) as exc:
        fail(error_text(exc))
    for note in run.notes:
        click.echo(note)
    run.recorder.facts = job_facts(job)  # the summary names the job as simulate's does
    core = run.core
    service = run.make_service(
        parse_broker_url(cfg.broker.url),
        on_record=lambda r: click.echo(_line(r)),
        finish_before_done=True,
        signals=signals,
        # the run's id: devices that join with this document refuse any other run's messages
        job_document=encode_job_document(replace(job.job_document(), run=core.run_id), job.signer),
        sharding=_coordinator(cfg, core),
    )
    if job.signer is None:
        log.warning(
            "global messages are unsigned: devices cannot tell them from a forgery; "
            "create a key with `edge-fl keygen DIR` and set security.signing_key"
        )
    try:
        asyncio.run(service.run())
    except OutputError:
        raise
    except (RuntimeError, ValueError) as exc:
        try:  # what the run did is still worth its summary and model; one that never opened a
            if not run.abandon():  # round (no broker) leaves nothing that blocks a retry
                run.finish()
        except OutputError as write_exc:
            click.echo(f"edge-fl: error: {write_exc}", err=True)
        fail(str(exc))
    finally:
        run.close()
    if service.stopped is not None:
        click.echo(
            f"stopped on {service.stopped} after round {core.round_number}"
            + ("" if service.done_published else " (devices were not told: no broker)")
        )
    click.echo(_final_line(run.summary or {}, out, cfg.rounds.rounds))
    return run.summary or {}


def _coordinator(cfg, core):
    """With ingest.workers: the coordinator's half of sharded ingest (edge_fl.server.sharding)."""
    if not cfg.ingest.workers:
        return None
    from edge_fl.server.sharding import Coordinator

    names = [f"w{i}" for i in range(cfg.ingest.workers)]
    return Coordinator(core, names, dealt=cfg.ingest.partition == "shared")


def _final_line(summary: dict, out: str | None, total: int | None = None) -> str:
    """The last line of a run: how it ended (finished, or stopped at round N of ``total``, the
    rounds asked), what it achieved and cost, and where the files are."""
    acc = summary.get("final_accuracy")
    rounds, closed = summary.get("rounds", "?"), summary.get("rounds_closed", 0)
    if summary.get("stopped"):
        of = "" if total is None else f" of {total}"
        how = f"job stopped by {summary['stopped']} at round {rounds}{of}: {closed} closed"
    else:
        how = f"job finished: {closed}/{rounds} rounds closed"
    line = (
        f"{how}, final accuracy {acc if acc is None else round(acc, 4)}, bytes up "
        f"{summary.get('total_bytes_up', 0):,}, down {summary.get('total_bytes_down', 0):,}"
    )
    privacy = summary.get("privacy")
    if privacy and privacy.get("epsilon") is not None:
        line += (
            f", epsilon {privacy['epsilon']:.4g} (delta {privacy.get('delta', 0):g}, all rounds)"
        )
    if not out:
        return line
    more = summary.get("stopped") and (total is None or summary.get("rounds", 0) < total)
    return line + f" -> {out}" + (" (--resume continues it)" if more else "")


def _line(r: dict) -> str:
    acc = r.get("accuracy")
    return (
        f"round {r['round']} {r['status']}: acc {acc if acc is None else round(acc, 4)} "
        f"recv {r['received']}/{r['selected']} late {r['late']} rejected {r['rejected']} "
        f"up {r['bytes_up']}B down {r['bytes_down']}B"
    )


def client_prefix(job: str, shard: str, indices: str | None) -> str:
    """The fleet process's MQTT client ids start so: one per job, shard and device range, so two
    fleets split by ``--indices`` do not take each other's shared sessions (the broker closes the
    older of two connections with one client id)."""
    span = "-i" + indices.replace(":", "to") if indices else ""
    return f"edgefl-{job}-s{shard.replace('/', 'of')}{span}"


def _parse_indices(indices: str | None, n_devices: int) -> range:
    if indices is None:
        return range(n_devices)
    try:
        first, last = (int(x) for x in indices.split(":"))
    except ValueError:
        fail(f"--indices {indices!r}: use FROM:TO, e.g. 2:50")
    if not 0 <= first < last <= n_devices:
        fail(f"--indices {indices!r}: need 0 <= FROM < TO <= data.devices = {n_devices}")
    return range(first, last)


@click.command()
@common_job_options
@click.option("--shard", default="0/1", show_default=True, help="run devices I, I+N, I+2N, ...")
@click.option(
    "--indices",
    metavar="FROM:TO",
    help="only devices FROM..TO-1, e.g. to leave the first ids to real devices (--shard splits "
    "these)",
)
@click.option(
    "--credentials",
    type=click.Path(dir_okay=False),
    help="NAME<TAB>URL lines (broker/mint-credentials.sh): each device logs in as its own user; "
    "host, port and TLS from --broker, else from the lines",
)
def fleet(shard, indices, credentials, verbose, config, **kw) -> None:
    """Run (a shard of) the simulated device fleet against a broker.

    SIGTERM and SIGINT stop it cleanly: every session publishes its offline status and
    disconnects (no last will), the last line says how many updates it published, exit 0."""
    from edge_fl.server.signals import StopSignals

    signals = StopSignals().install()  # from here on (a signal while the job is built counts too)
    configure_logging(verbose)
    cfg = load_job_config(config, job_overrides(kw))
    users = None
    if credentials:
        from edge_fl.transport.credentials import CredentialsError, read_credentials

        try:
            users = read_credentials(credentials)
        except CredentialsError as exc:
            fail(str(exc))
    if not cfg.broker.url and not users:
        fail("the fleet needs --broker (or broker.url in the config, or --credentials)")
    from edge_fl.fleet.runtime import DeviceConnectError
    from edge_fl.job import build_job
    from edge_fl.transport.credentials import device_specs, without_user
    from edge_fl.transport.url import parse_broker_url

    try:
        job = build_job(cfg)
    except ValueError as exc:  # ConfigError: a name not registered, an unsound combination
        fail(str(exc))
    pool = _parse_indices(indices, cfg.data.devices)
    part = _parse_shard(shard, len(pool))
    if cfg.fleet.virtual and part.step > 1:
        fail(
            f"--shard {shard}: virtual time (fleet.clock) keeps one fleet process in lock-step "
            "with the aggregator; run the fleet unsharded, or use fleet.clock: wall"
        )
    selected = pool[part.start :: part.step]
    if not selected:
        fail(f"--shard {shard} of --indices {indices} holds no device")
    try:
        job.check_device_keys(selected)
    except ValueError as exc:
        fail(str(exc))
    base = parse_broker_url(cfg.broker.url) if cfg.broker.url else None
    if base is not None:
        spec = base
    elif users:
        spec = without_user(next(iter(users.values())))
    else:  # refused above already; said again for the type checker's sake
        fail("the fleet needs --broker (or broker.url in the config, or --credentials)")
    runtime = job.fleet_runtime(spec, selected, prefix=client_prefix(cfg.job, shard, indices))
    # virtual time: connect once the aggregator has subscribed (it counts every status live)
    runtime.wait_for_aggregator = cfg.fleet.virtual
    specs = {}
    if users:
        try:
            specs = device_specs(users, runtime.agents, base, source=f"--credentials {credentials}")
        except CredentialsError as exc:
            fail(str(exc))
        runtime.use_credentials(specs)
    try:  # a missing CA or client certificate file: one line now, not a traceback per device
        tls = {(s.tls, s.ca_file, s.cert_file, s.key_file): s for s in (spec, *specs.values())}
        for checked in tls.values():
            checked.tls_context()
    except (ValueError, OSError) as exc:
        fail(str(exc))

    async def serve() -> None:
        task = asyncio.current_task()
        assert task is not None

        def stop(_name: str) -> None:
            if not task.cancelling():  # once: a second signal must not cut the leaving short
                task.cancel()

        signals.attach(asyncio.get_running_loop(), stop)
        with contextlib.suppress(asyncio.CancelledError):  # run()'s finally: sessions leave
            await runtime.run()

    try:
        asyncio.run(serve())
    except DeviceConnectError as exc:
        _fail_now(f"device {exc.device}: {_broker_problem(exc.spec.to_url(), exc.cause)}")
    except (aiomqtt.MqttError, OSError, RuntimeError) as exc:
        _fail_now(_broker_problem(spec.to_url(), exc))
    finally:
        signals.restore()
    if runtime.broker_lost:  # the aggregator's job stopped there too (its own last line)
        stopped = "stopped by losing the broker under virtual time: "
    else:
        stopped = f"stopped by {signals.received}: " if signals.received else ""
    click.echo(f"fleet shard {shard}: {stopped}{runtime.published} updates published", err=True)
