"""``edge-fl aggregator | fleet | device``: the parts of a job as separate processes."""

from __future__ import annotations

import asyncio
import sys

import click

from edge_fl.cli import _common_job_options, _fail, _load, _logging, _overrides


def _parse_shard(shard: str, n_devices: int) -> range:
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise click.BadParameter(f"--shard {shard!r}: use I/N, e.g. 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise click.BadParameter(f"--shard {shard!r}: need N >= 1 and 0 <= I < N")
    return range(i, n_devices, n)


@click.command()
@_common_job_options
@click.option("--out", type=click.Path(file_okay=False), help="records, checkpoints, model.onnx")
@click.option("--resume", is_flag=True, help="continue from the checkpoint in --out")
def aggregator(out, resume, verbose, config, **kw) -> None:
    """Run the aggregator against a broker (devices run elsewhere)."""
    _logging(verbose or 1)
    cfg = _load(config, _overrides(kw))
    if not cfg.broker.url:
        _fail("the aggregator needs --broker (or broker.url in the config)")
    from edge_fl.job import build_job
    from edge_fl.metrics import RunRecorder
    from edge_fl.server.service import AggregatorService
    from edge_fl.transport.url import parse_broker_url

    job = build_job(cfg)
    recorder = RunRecorder(out, append=resume)
    if not resume:
        recorder.write_meta(job.metadata())
    core = job.aggregator_core()
    if resume:
        if not out:
            _fail("--resume needs --out DIR (where the checkpoint is)")
        from edge_fl.server.checkpoint import load_checkpoint

        try:
            load_checkpoint(core, out)
        except ValueError as exc:
            _fail(str(exc))
        click.echo(f"resumed at round {core.round_number}, model version {core.version}")
    service = AggregatorService(
        core,
        parse_broker_url(cfg.broker.url),
        job.topics,
        wait_for_devices_s=cfg.rounds.wait_for_devices_s,
        expected_devices=cfg.data.devices,
        on_record=lambda r: (recorder.add(r), click.echo(_line(r))),
        checkpoint_dir=out,
    )
    try:
        asyncio.run(service.run())
    except (RuntimeError, ValueError) as exc:
        _fail(str(exc))
    finally:
        recorder.close({"privacy": core.privacy.report() if core.privacy else None})
        if out:
            job.export_model(core.params, recorder.out_dir / "model.onnx")


def _line(r: dict) -> str:
    acc = r.get("accuracy")
    return (
        f"round {r['round']} {r['status']}: acc {acc if acc is None else round(acc, 4)} "
        f"recv {r['received']}/{r['selected']} late {r['late']} rejected {r['rejected']} "
        f"up {r['bytes_up']}B down {r['bytes_down']}B"
    )


@click.command()
@_common_job_options
@click.option("--shard", default="0/1", show_default=True, help="run devices I, I+N, I+2N, ...")
def fleet(shard, verbose, config, **kw) -> None:
    """Run (a shard of) the simulated device fleet against a broker."""
    _logging(verbose)
    cfg = _load(config, _overrides(kw))
    if not cfg.broker.url:
        _fail("the fleet needs --broker (or broker.url in the config)")
    from edge_fl.job import build_job
    from edge_fl.transport.url import parse_broker_url

    job = build_job(cfg)
    indices = _parse_shard(shard, cfg.data.devices)
    runtime = job.fleet_runtime(
        parse_broker_url(cfg.broker.url),
        indices,
        prefix=f"edgefl-{cfg.job}-s{shard.replace('/', 'of')}",
    )
    asyncio.run(runtime.run())
    click.echo(f"fleet shard {shard}: {runtime.published} updates published", err=True)


@click.command()
@_common_job_options
@click.option("--device-index", type=int, help="which partition of the dataset this device holds")
@click.option("--device-id", help="device id (default d<index>); must match its broker username")
def device(device_index, device_id, verbose, config, **kw) -> None:
    """Run one device agent (e.g. on a Raspberry Pi) against a broker."""
    _logging(verbose or 1)
    cfg = _load(config, _overrides(kw))
    if not cfg.broker.url:
        _fail("a device needs --broker (or broker.url in the config)")
    index = device_index if device_index is not None else cfg.device.index
    if index is None:
        _fail("which device is this? give --device-index (or device.index in the config)")
    if not 0 <= index < cfg.data.devices:
        _fail(f"device index {index} is outside [0, data.devices = {cfg.data.devices})")
    device_id = device_id or cfg.device.id
    from edge_fl.device.runtime import run_device
    from edge_fl.job import build_job
    from edge_fl.transport.url import parse_broker_url

    job = build_job(cfg)
    agent = job.agent(index)
    if device_id:
        agent.device_id = device_id
    try:
        sent = asyncio.run(
            run_device(agent, parse_broker_url(cfg.broker.url), job.topics, cfg.digest())
        )
    except RuntimeError as exc:
        _fail(str(exc))
    click.echo(f"device {agent.device_id}: {sent} updates sent", err=True)
    sys.exit(0)
