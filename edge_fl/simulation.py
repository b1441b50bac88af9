"""``edge-fl simulate``: broker + aggregator + fleet in one process, over real MQTT sockets.

The embedded broker is a private Mosquitto (or amqtt as a slow fallback) on a free loopback port;
with ``broker.url`` set the same run goes to an external broker instead.

Every round record carries the fleet's wire bytes (``edge_fl.transport.wire``): ``wire_up`` /
``wire_down`` (all devices' MQTT packets, exact), ``wire_up_ip`` / ``wire_down_ip`` (the link
model's estimate with TLS records and TCP/IP headers and ACKs) and the per-device distribution
(``wire_up_p50`` / ``_p95`` / ``_max``, same for down). Payload ``bytes_up`` / ``bytes_down`` are
unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from edge_fl.config import JobConfig
from edge_fl.job import Job, build_job
from edge_fl.metrics import OutputError, RunRecorder, lock_run_dir, write_json
from edge_fl.server.service import AggregatorService, StopSignals
from edge_fl.transport.broker import EmbeddedBroker
from edge_fl.transport.url import BrokerSpec, parse_broker_url
from edge_fl.transport.wire import DEFAULT_LINK, LinkModel

log = logging.getLogger("edge_fl.simulate")


class _ProgressBar:
    def __init__(self, total: int, enabled: bool) -> None:
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
        self.task = None

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
    """Aggregator and fleet on one event loop; returns the run summary.

    With ``signals``, SIGTERM/SIGINT stop the job cleanly: the open round is decided, the fleet is
    told the job ended (and leaves), and the summary says ``stopped``. ``link``: the model of the
    wire IP estimate (default: Ethernet MSS 1448); ``device_downlink``: every device receives
    the global model on its own session (measured rather than charged; N copies on the wire)."""
    cfg = job.cfg
    core = job.aggregator_core()
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    bar = _ProgressBar(cfg.rounds.rounds, progress)

    def on_record(record: dict[str, Any]) -> None:
        record["elapsed_s"] = round(time.perf_counter() - t0, 4)
        record["sim_time_s"] = round(job.clock.now() - job.clock.start_s, 3)
        record["dropouts"] = fleet.dropouts
        record.update(fleet.wire_round())
        if "first_round_s" not in timings:
            timings["first_round_s"] = record["elapsed_s"]
        recorder.add(record)
        bar.update(record)
        if fleet_hook is not None:
            fleet_hook(record, fleet)

    # one simulation = one key: every global message is signed and every device verifies it
    from edge_fl.protocol.signing import Signer

    signer = job.signer or Signer.generate()
    service = AggregatorService(
        core,
        spec,
        job.topics,
        wait_for_devices_s=cfg.rounds.wait_for_devices_s,
        expected_devices=job.expected_devices,
        on_record=on_record,
        signals=signals,
        signer=signer,
        acks=cfg.security.acks,
    )
    fleet = job.fleet_runtime(spec, trust=job.trust(signer.verifier))
    fleet.link = link or DEFAULT_LINK
    fleet.device_downlink = device_downlink
    with bar:
        aggregator = asyncio.create_task(service.run(), name="aggregator")
        await asyncio.wait(
            {aggregator, asyncio.create_task(service.connected.wait())},
            return_when=asyncio.FIRST_COMPLETED,
        )
        job.clock.reset()
        fleet_task = asyncio.create_task(fleet.run(), name="fleet")
        await fleet.connected.wait() if not aggregator.done() else None
        timings["fleet_connected_s"] = round(time.perf_counter() - t0, 4)
        try:
            await aggregator
        except BaseException:
            fleet_task.cancel()  # no done marker was published: the fleet would wait for one
            with contextlib.suppress(BaseException):
                await fleet_task
            raise
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(fleet_task, timeout=10)
        if not fleet_task.done():
            fleet_task.cancel()
    timings["run_s"] = round(time.perf_counter() - t0, 4)
    wire = _wire_summary(recorder, fleet)
    if recorder.out_dir is not None:
        path = recorder.out_dir / "model.onnx"
        try:
            job.export_model(core.params, path)
        except OSError as exc:
            raise OutputError(path, exc) from None
    return recorder.close(
        {
            "mechanism": cfg.privacy.mechanism,
            "devices": cfg.data.devices,
            "model": job.model.name,
            "n_params": job.model.n_params,
            "dataset": cfg.data.dataset,
            "timings": timings,
            "fleet_published": fleet.published,
            "fleet_publish_failures": fleet.publish_failures,
            "stopped_devices": sum(1 for a in fleet.agents.values() if a.state.stopped_reason),
            "privacy": core.privacy.report() if core.privacy is not None else None,
            "ended_early": core.ended_early,
            "stopped": service.stopped,
            "after_last_round": core.after_last_round(),
            **wire,
        }
    )


def _wire_summary(recorder: RunRecorder, fleet: Any) -> dict[str, Any]:
    """Run totals of the fleet's wire bytes: every record's plus what came after the last one
    (the end-of-job model, statuses, DISCONNECT), and the link model the estimate used."""
    after = fleet.wire_round()
    link = fleet.link
    totals = {
        key: sum(r.get(key, 0) for r in recorder.records) + after[key]
        for key in ("wire_up", "wire_down", "wire_up_ip", "wire_down_ip")
    }
    return {
        **{f"total_{key}": value for key, value in totals.items()},
        "wire": {
            "after_last_round": {k: after[k] for k in totals},
            "device_downlink": fleet.device_downlink,
            "shared_downlink": {
                k: v for k, v in fleet.downlink_wire.totals().items() if k in ("up", "down")
            },
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


def simulate(
    cfg: JobConfig,
    out_dir: str | Path | None = None,
    *,
    progress: bool = False,
    fleet_hook: Any = None,
) -> dict[str, Any]:
    """Run a whole simulation; the embedded broker unless ``cfg.broker.url`` is set.

    SIGTERM and SIGINT (from the main thread's point of view) stop it cleanly: the summary and
    model are written, the fleet leaves, and the summary's ``stopped`` names the signal."""
    signals = StopSignals().install()
    try:
        return _simulate(cfg, out_dir, progress=progress, fleet_hook=fleet_hook, signals=signals)
    finally:
        signals.restore()


def _simulate(
    cfg: JobConfig,
    out_dir: str | Path | None,
    *,
    progress: bool,
    fleet_hook: Any,
    signals: StopSignals,
) -> dict[str, Any]:
    t_start = time.perf_counter()
    job = build_job(cfg)
    run_lock = lock_run_dir(out_dir)  # noqa: F841 (held until this process ends)
    recorder = RunRecorder(out_dir)
    meta = job.metadata()
    timings = {"build_s": round(time.perf_counter() - t_start, 4)}
    with contextlib.ExitStack() as stack:
        if cfg.broker.url:
            spec = parse_broker_url(cfg.broker.url)
            meta["broker"] = {"kind": "external", "url": spec.redacted()}
        else:
            broker = stack.enter_context(EmbeddedBroker(kind=cfg.broker.embedded))
            spec = parse_broker_url(broker.url)
            if broker.max_devices is not None and cfg.data.devices > broker.max_devices:
                raise ValueError(
                    f"data.devices = {cfg.data.devices} exceeds the {broker.kind} fallback "
                    f"broker's cap of {broker.max_devices}; install mosquitto (apt-get install mosquitto) "
                    "or pass --broker mqtt://HOST:PORT"
                )
            meta["broker"] = {"kind": f"embedded-{broker.kind}", "url": broker.url}
            timings["broker_ready_s"] = round(time.perf_counter() - t_start, 4)
        recorder.write_meta(meta)
        summary = asyncio.run(
            run_job(job, spec, recorder, progress=progress, fleet_hook=fleet_hook, signals=signals)
        )
    summary["timings"] = {**timings, **summary.get("timings", {})}
    summary["timings"]["total_s"] = round(time.perf_counter() - t_start, 4)
    if out_dir:
        write_json(Path(out_dir) / "summary.json", summary)
    return summary
