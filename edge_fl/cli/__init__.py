"""The ``edge-fl`` command line. Heavy imports live inside commands: ``--help`` stays instant."""

from __future__ import annotations

import importlib
import json
import logging
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click

from edge_fl import __version__

if TYPE_CHECKING:
    from edge_fl.config import JobConfig


def fail(message: str) -> NoReturn:
    click.echo(f"edge-fl: error: {message}", err=True)
    sys.exit(2)


def error_text(exc: BaseException) -> str:
    """``exc``'s one line as the command line says it: a refused run directory's (RunDirError)
    in the flags' words (``exc.cli``: --out, --overwrite, --resume), any other's message."""
    cli = getattr(exc, "cli", None)
    return cli if isinstance(cli, str) else str(exc)


def load_job_config(config: str | None, overrides: dict[str, Any]) -> JobConfig:
    from edge_fl.config import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as exc:
        fail(str(exc))


def common_job_options(f):
    """Flags shared by simulate / aggregator / fleet / device; they override the config file."""
    options = [
        click.option("--config", "config", type=click.Path(dir_okay=False), help="YAML or TOML"),
        click.option("--job", help="job id (topic segment)"),
        click.option(
            "--broker",
            "broker_url",
            callback=_checked_broker_url,
            help="mqtt[s]://[user:pass@]host:port",
        ),
        click.option("--devices", type=int, help="number of devices in the fleet"),
        click.option("--rounds", type=int, help="number of rounds"),
        click.option("--clients-per-round", type=float, help="count, or a fraction in (0, 1)"),
        click.option("--dataset", help="digits | synthetic | synthetic-iid | femnist | mnist"),
        click.option("--data-dir", type=click.Path(file_okay=False), help="for femnist/mnist"),
        click.option("--model", "model_name", help="logreg | mlp | lenet | cnn"),
        click.option("--partition", help="iid | dirichlet | natural"),
        click.option("--alpha", type=float, help="Dirichlet concentration"),
        click.option("--epochs", type=int, help="local epochs per round"),
        click.option("--lr", type=float, help="local learning rate"),
        click.option("--batch-size", type=int, help="local minibatch size"),
        click.option("--deadline", type=float, help="round deadline in seconds"),
        click.option("--min-updates", type=int, help="updates needed to close a round"),
        click.option(
            "--round-period",
            type=float,
            help="sync: open a round at most every S (simulated) seconds; default: back to back",
        ),
        click.option(
            "--mechanism",
            help="privacy mechanism (none by default); `edge-fl privacy mechanisms` lists them",
        ),
        click.option("--epsilon", type=float, help="privacy: target total epsilon"),
        click.option("--delta", type=float, help="privacy: delta for reporting/calibration"),
        click.option("--clip", type=float, help="privacy: clipping bound C"),
        click.option("--noise-multiplier", type=float, help="privacy: z or sigma"),
        click.option("--budget", type=float, help="privacy: per-device epsilon budget"),
        click.option(
            "--max-uploads", type=int, help="privacy: L, uploads a device's budget is split over"
        ),
        click.option(
            "--poisson-selection",
            is_flag=True,
            default=None,
            help="privacy: devices select themselves by secret coins (amplification claimed)",
        ),
        click.option("--uplink", help="update codec: f32 | f16 | q8 | q4 | topk | rot1"),
        click.option("--downlink", help="global model broadcast: f32 | f16 | q8"),
        click.option("--sign-k", type=float, help="SignDS top-k fraction (0, 0.25]"),
        click.option("--sign-eps", type=float, help="SignDS epsilon (0, 100]"),
        click.option("--mode", help="sync | fedbuff | fedasync"),
        click.option("--buffer-size", type=int, help="FedBuff: apply every K updates"),
        click.option("--max-staleness", type=int, help="async: drop staler updates"),
        click.option(
            "--concurrency",
            type=int,
            help="async: at most C devices train at once (default: the sync round size; 0: no "
            "limit)",
        ),
        click.option(
            "--profile", help="fleet profile: homogeneous | phone-fleet | raspberry-pi | PATH"
        ),
        click.option(
            "--time-scale",
            type=float,
            help="real seconds per simulated second (scaled wall time, for demonstrations)",
        ),
        click.option(
            "--clock",
            type=click.Choice(["auto", "virtual", "wall"]),
            help="simulated time: virtual (from the profiles, deterministic, idle time free), "
            "wall (--time-scale); auto: virtual with a --profile other than homogeneous",
        ),
        click.option("--dropout", type=float, help="per-round device dropout probability"),
        click.option(
            "--secure-aggregation",
            "secure_aggregation",
            is_flag=True,
            default=None,
            help="SecAgg+: the aggregator learns only each sync round's sum "
            "(secure_aggregation.enabled)",
        ),
        click.option("--seed", type=int),
        click.option(
            "--set",
            "sets",
            multiple=True,
            metavar="KEY=VALUE",
            help="any configuration key, e.g. --set robust.aggregator=trimmed_mean (the value "
            "read as YAML; wins over the flags above)",
        ),
        click.option(
            "--reproducible",
            is_flag=True,
            default=None,
            help="seeded, NON-cryptographic noise (tests and reproducibility only)",
        ),
        click.option("-v", "--verbose", count=True),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _checked_broker_url(_ctx: click.Context, _param: click.Parameter, url: str | None) -> Any:
    """A --broker URL with a mistake (syntax, a TLS file that is missing or unreadable) ends the
    command at once, in one line, before anything else is said or started."""
    if url is not None:
        from edge_fl.transport.url import BrokerUrlError, parse_broker_url

        try:
            parse_broker_url(url).tls_context()
        except BrokerUrlError as exc:
            fail(str(exc))
    return url


def set_overrides(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs as config overrides, each value read as YAML (``0.5``, ``true``,
    ``{z: 2}``); a malformed pair ends the command in one line."""
    if not pairs:
        return {}
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            fail(f"--set {pair!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            reason = str(exc).splitlines()[0]
            fail(f"--set {pair!r}: the value is not YAML ({reason})")
    return out


def job_overrides(kw: dict[str, Any]) -> dict[str, Any]:
    """The flags given (None: not given), then ``--set`` pairs, which win over them."""
    return {
        "job": kw.get("job"),
        "seed": kw.get("seed"),
        "reproducible": kw.get("reproducible"),
        "broker.url": kw.get("broker_url"),
        "data.devices": kw.get("devices"),
        "data.dataset": kw.get("dataset"),
        "data.data_dir": kw.get("data_dir"),
        "data.partition": kw.get("partition"),
        "data.alpha": kw.get("alpha"),
        "model.name": kw.get("model_name"),
        "compression.uplink": kw.get("uplink"),
        "compression.downlink": kw.get("downlink"),
        "rounds.rounds": kw.get("rounds"),
        "rounds.clients_per_round": kw.get("clients_per_round"),
        "rounds.deadline_s": kw.get("deadline"),
        "training.epochs": kw.get("epochs"),
        "training.lr": kw.get("lr"),
        "training.batch_size": kw.get("batch_size"),
        "rounds.mode": kw.get("mode"),
        "rounds.buffer_size": kw.get("buffer_size"),
        "rounds.max_staleness": kw.get("max_staleness"),
        "rounds.concurrency": kw.get("concurrency"),
        "fleet.profile": kw.get("profile"),
        "fleet.time_scale": kw.get("time_scale"),
        "fleet.clock": kw.get("clock"),
        "fleet.dropout": kw.get("dropout"),
        "privacy.mechanism": kw.get("mechanism"),
        "privacy.epsilon": kw.get("epsilon"),
        "privacy.delta": kw.get("delta"),
        "privacy.clip": kw.get("clip"),
        "privacy.noise_multiplier": kw.get("noise_multiplier"),
        "privacy.budget_epsilon": kw.get("budget"),
        "privacy.max_uploads": kw.get("max_uploads"),
        "privacy.poisson_selection": kw.get("poisson_selection"),
        "privacy.signds.sign_k": kw.get("sign_k"),
        "privacy.signds.sign_eps": kw.get("sign_eps"),
        "rounds.min_updates": kw.get("min_updates"),
        "rounds.period_s": kw.get("round_period"),
        "secure_aggregation.enabled": kw.get("secure_aggregation"),
        **set_overrides(kw.get("sets") or ()),
    }


def configure_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose < 2:  # -vv shows every repetition
        from edge_fl.logs import collapse_repeats

        collapse_repeats()


class _LazyGroup(click.Group):
    """Subcommands imported on use, and listed by ``--help`` from :data:`_LAZY`'s one-line
    summaries without importing them: ``edge-fl --help`` must not pay for numpy, dp-accounting or
    scipy, and must work on the device-only install, whose ``audit`` cannot be imported."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *_LAZY])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in _LAZY:
            module, attr, _ = _LAZY[name]
            try:
                command: click.Command = getattr(importlib.import_module(module), attr)
            except ModuleNotFoundError as exc:
                _missing_extra(name, exc)
            return command
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in _LAZY:
                summary = _LAZY[name][2]
            else:
                command = super().get_command(ctx, name)
                if command is None or command.hidden:
                    continue
                summary = command.get_short_help_str(limit=1000)
            rows.append((name, summary))
        limit = formatter.width - 6 - max(len(name) for name, _ in rows)
        with formatter.section("Commands"):
            formatter.write_dl([(name, _shorten(text, limit)) for name, text in rows])

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as exc:
            _missing_extra(ctx.invoked_subcommand or "this command", exc)
        except Exception as exc:
            problem = _operator_error(exc)
            if problem is None:
                raise
            fail(str(problem))


def _shorten(text: str, limit: int) -> str:
    """``text`` cut at a word to at most ``limit`` characters, as click shortens a summary."""
    return click.Command("_", help=text).get_short_help_str(limit=limit)


def _operator_error(exc: BaseException) -> BaseException | None:
    """``exc``, or the first exception in a task group's ``exc``, when its message is the whole
    story for an operator (a configuration that cannot run, a broker URL to fix, a missing CA
    file, an unknown fleet profile): the group prints it as its one error line whichever
    subcommand raised it, from wherever in it."""
    from edge_fl.config import ConfigError
    from edge_fl.fleet.profiles import ProfileError
    from edge_fl.transport.url import BrokerUrlError

    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _operator_error(inner)) is not None:
                return found
        return None
    return exc if isinstance(exc, ConfigError | BrokerUrlError | ProfileError) else None


#: modules of the ``server`` extra (``pip install 'edge-fl[server]'``); the base install is the
#: device agent alone
_SERVER_MODULES = {"dp_accounting", "scipy", "onnx", "onnxruntime", "matplotlib", "amqtt", "rich"}


def require_server(command: str) -> None:
    """Fail now, with one line, if the server extra is not installed (found, not imported:
    importing dp-accounting, scipy and onnx cost an `edge-fl aggregator` or each ingest worker
    ~0.3 s before it did anything, and only what a job uses is imported later)."""
    import importlib.util

    for module in ("dp_accounting", "onnxruntime", "onnx"):
        if importlib.util.find_spec(module) is None:
            _missing_extra(command, ModuleNotFoundError(f"No module named {module!r}", name=module))


def _missing_extra(command: str, exc: ModuleNotFoundError) -> NoReturn:
    """One line instead of a traceback when a base (device-only) install runs a server command."""
    top = (exc.name or "").split(".")[0]
    if top not in _SERVER_MODULES:
        raise exc
    fail(
        f"`edge-fl {command}` needs {top}, part of the server extra: pip install 'edge-fl[server]' "
        "(from a checkout: pip install -e '.[server]'; the base install is the device agent only)"
    )


@click.group(cls=_LazyGroup)
@click.version_option(__version__, prog_name="edge-fl")
def main() -> None:
    """edge-fl: private, bandwidth-frugal federated learning over MQTT."""
    from edge_fl.logs import quiet_dp_accounting

    sys.unraisablehook = _quiet_closed_loop
    quiet_dp_accounting()  # dp-accounting's benign convergence notices, in every command


def _quiet_closed_loop(unraisable: Any, default: Any = sys.__unraisablehook__) -> None:
    """A client abandoned when a command fails (a fleet whose broker refused one device, say) is
    collected after its event loop closed; paho's ``__del__`` then calls aiomqtt's socket-close
    callback, which raises "Event loop is closed". Harmless, and not worth a traceback under the
    command's one-line error; anything else is reported as usual."""
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return
    default(unraisable)


def tracking_options(f):
    """``--track`` and ``--tensorboard`` (simulate, aggregator): edge_fl.tracking, the tracking
    extra, imported only when asked for."""
    f = click.option(
        "--tensorboard",
        "tensorboard_dir",
        metavar="DIR",
        type=click.Path(file_okay=False),
        help="write every round's scalars as TensorBoard events into DIR (tracking extra)",
    )(f)
    return click.option(
        "--track",
        metavar="mlflow[:URI]",
        help="log the run to MLflow while it runs: config, every round, model, plots (tracking "
        "extra; URI default: MLFLOW_TRACKING_URI, else ./mlruns)",
    )(f)


def open_tracking(
    cfg: JobConfig, track: str | None, tensorboard_dir: str | None, out: Any, resumed: bool = False
) -> Any:
    """The run's tracker (None when not asked for), opened before the job starts: a missing
    extra or a store that refuses ends the command with one line."""
    if track is None and tensorboard_dir is None:
        return None
    from pathlib import Path

    from edge_fl.tracking import TrackingError, TrackingTargets, open_tracker, parse_track

    try:
        targets = TrackingTargets(
            None if track is None else parse_track(track),
            None if tensorboard_dir is None else Path(tensorboard_dir),
        )
        return open_tracker(cfg, targets, out_dir=out, resumed=resumed)
    except TrackingError as exc:
        fail(str(exc))


@main.command()
@common_job_options
@click.option("--out", type=click.Path(file_okay=False), help="write metrics.jsonl, summary.json")
@click.option("--embedded-broker", type=click.Choice(["auto", "mosquitto", "amqtt"]))
@click.option("--no-progress", is_flag=True, help="no live progress bar")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
@click.option(
    "--overwrite",
    is_flag=True,
    help="start afresh over an earlier run in --out (its records, model, checkpoint and report "
    "files go)",
)
@click.option("--resume", is_flag=True, help="continue the run in --out that was stopped or killed")
@tracking_options
def simulate(
    out,
    embedded_broker,
    no_progress,
    as_json,
    overwrite,
    resume,
    track,
    tensorboard_dir,
    verbose,
    config,
    **kw,
) -> None:
    """Run a whole federated job (broker, aggregator, fleet) on this machine."""
    configure_logging(verbose)
    cfg = load_job_config(config, {**job_overrides(kw), "broker.embedded": embedded_broker})
    from edge_fl.simulation import refuse_earlier_run
    from edge_fl.simulation import simulate as run
    from edge_fl.tracking import tracked

    if resume and (not out or overwrite):
        fail("--resume continues the run in --out DIR (and cannot be combined with --overwrite)")
    if resume:
        from edge_fl.simulation import resumed_config

        cfg = resumed_config(cfg, out)  # the run's rounds unless --rounds is given
    if out and not overwrite and not resume and (track is not None or tensorboard_dir is not None):
        try:  # the run would refuse the directory: refuse before a tracked run is opened
            refuse_earlier_run(out)
        except ValueError as exc:
            fail(error_text(exc))
    tracker = open_tracking(cfg, track, tensorboard_dir, out)
    try:
        progress = not no_progress and sys.stderr.isatty()
        with tracked(tracker):
            summary = run(cfg, out, progress=progress, overwrite=overwrite, resume=resume)
    except (ValueError, RuntimeError, OSError) as exc:
        fail(error_text(exc))
    if tracker is not None:
        tracker.finish(summary, out)
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
        _exit_if_training_failed(summary)
        return
    acc = summary.get("final_accuracy")
    ran, asked = summary["rounds"], cfg.rounds.rounds
    of_asked = f" ({ran} of the {asked} asked ran)" if ran < asked else ""
    click.echo(
        f"rounds {summary['rounds_closed']}/{ran} closed{of_asked}, final accuracy "
        f"{acc if acc is None else round(acc, 4)}, bytes up {summary['total_bytes_up']:,}, "
        f"bytes down {summary['total_bytes_down']:,}, "
        f"total {summary['timings']['total_s']:.2f}s" + (f" -> {out}" if out else "")
    )
    if summary.get("stopped"):
        at, total = summary["rounds"], cfg.rounds.rounds
        again = (
            " (virtual time cannot be resumed: run it again; with --reproducible, the same records)"
            if cfg.fleet.virtual
            else " (--resume continues it)"
        )
        click.echo(
            f"ended early: stopped by {summary['stopped']} at round {at} of {total}"
            + (again if out and at < total else "")
        )
    elif summary.get("ended_early"):
        click.echo(f"ended early: {summary['ended_early']}")
    privacy = summary.get("privacy")
    if privacy:
        click.echo(
            f"privacy: {summary['mechanism']}, epsilon {privacy['epsilon']:.4g} at delta "
            f"{privacy['delta']:g} ({privacy['accountant']}, {privacy.get('unit')}-level, "
            f"{privacy.get('neighbouring_relation')}, all rounds); "
            f"{summary.get('stopped_devices', 0)} devices stopped on their budget"
        )
    errors = summary.get("device_failure_errors") or {}
    if errors:
        from edge_fl.logs import tally

        click.echo(
            f"training failed on {summary['device_failures']} devices: {tally(errors)} (the first "
            "traceback of each error is in the log)"
        )
    _exit_if_training_failed(summary)


def _exit_if_training_failed(summary: dict[str, Any]) -> None:
    """Exit 1 when the job ended early and devices' trainings failed: the devices stopped on
    those errors (``i.stopped = "training_failed"``) and none was left to contribute, so the
    run's model is not a result; a script or CI job must not take it for one (exit 0 before).
    A job that ran all its rounds despite some failures exits 0: its records count them."""
    if summary.get("device_failures") and summary.get("ended_early") and not summary.get("stopped"):
        sys.exit(1)


@main.command()
@click.option("--port", type=int, default=0, help="0 = a free port")
@click.option("--bind", default="127.0.0.1", show_default=True, help="listen address")
@click.option("--kind", type=click.Choice(["auto", "mosquitto", "amqtt"]), default="auto")
def broker(port: int, bind: str, kind: str) -> None:
    """Run the embedded broker alone until Ctrl-C / SIGTERM, printing its URL."""
    from edge_fl.transport.broker import BrokerError, EmbeddedBroker

    b = EmbeddedBroker(kind=kind, port=port or None, bind=bind)
    try:
        b.start()
    except BrokerError as exc:
        text = str(exc)
        if "Address already in use" in text:
            fail(f"port {port} on {bind} is already in use (--port 0 picks a free one)")
        fail(text.splitlines()[0])
    click.echo(f"{b.kind} broker listening at {b.url}")
    sys.exit(b.run_forever())


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="replace an existing key pair")
@click.option(
    "--devices",
    type=int,
    help="instead: one signing key per device d00000 ... (secure aggregation against a "
    "malicious operator): DIR/devices/<id>.key and the directory DIR/device-keys.json",
)
@click.option("--start", type=int, default=0, show_default=True, help="first device index")
def keygen(directory: str, force: bool, devices: int | None, start: int) -> None:
    """Create the aggregator's Ed25519 signing key (mode 0600) and print its public key."""
    from edge_fl.protocol.signing import SigningKeyError, generate_key_files

    if devices is not None:
        from edge_fl.identity import device_id
        from edge_fl.protocol.device_keys import mint_device_keys

        if devices < 1 or start < 0:
            fail(f"--devices {devices} --start {start}: need at least one device from index 0 up")
        try:
            path = mint_device_keys(
                directory, [device_id(i) for i in range(start, start + devices)], overwrite=force
            )
        except (SigningKeyError, OSError) as exc:
            fail(str(exc))
        click.echo(f"{devices} device keys: {directory}/devices/<id>.key (mode 0600; install each")
        click.echo("on its device only: edge-fl device --signing-key FILE)")
        click.echo(f"directory for every party: {path}  (security.device_keys)")
        return
    try:
        private, public, signer = generate_key_files(directory, overwrite=force)
    except (SigningKeyError, OSError) as exc:
        fail(str(exc))
    click.echo(f"private key: {private}  (aggregator: security.signing_key)")
    click.echo(f"public key:  {public}")
    click.echo(f"security.public_key for devices: {signer.verifier.hex()}")


#: name -> (module, attribute, the one-line summary ``edge-fl --help`` lists without importing
#: the module; tests/test_cli_errors.py checks each against the command's own docstring)
_LAZY = {
    "aggregator": (
        "edge_fl.cli.runtime_cmds",
        "aggregator",
        "Run the aggregator against a broker (devices run elsewhere).",
    ),
    "fleet": (
        "edge_fl.cli.runtime_cmds",
        "fleet",
        "Run (a shard of) the simulated device fleet against a broker.",
    ),
    "ingest": (
        "edge_fl.cli.ingest_cmd",
        "ingest",
        "Run ingest worker wI of a job whose aggregator has ingest.workers = N (docs/scale.md).",
    ),
    "device": (
        "edge_fl.cli.device_cmd",
        "device",
        "Join the job announced on the broker and serve its rounds until it ends.",
    ),
    "privacy": (
        "edge_fl.cli.privacy_cmds",
        "privacy_group",
        "Privacy accounting and noise calibration (dp-accounting).",
    ),
    "audit": (
        "edge_fl.cli.privacy_cmds",
        "audit_group",
        "Empirical lower bounds on eps for the production mechanisms (Clopper-Pearson).",
    ),
    "comm-cost": (
        "edge_fl.cli.comm_cmds",
        "comm_cost",
        "Bytes of one update (dense f32 / f16, SignDS, every uplink codec per mechanism) and of "
        "the global model, by the real encoders.",
    ),
    "dashboard": (
        "edge_fl.cli.dashboard_cmd",
        "dashboard",
        "Serve a live page of a job (--broker, --job) or of a run directory (RUN_DIR).",
    ),
    "report": (
        "edge_fl.cli.report_cmds",
        "report",
        "Plot accuracy, bytes up/down and epsilon per round of one or more runs (overlaid).",
    ),
}
