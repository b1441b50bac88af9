"""Experiment tracking: a run into MLflow and/or TensorBoard, round by round while it runs.

``--track mlflow[:URI]`` and ``--tensorboard DIR`` (``simulate``, ``aggregator``) open a
:class:`Tracker` before the job starts: the validated config becomes the MLflow run's params and the
mechanism, mode and target epsilon its tags. The tracker is a :class:`edge_fl.metrics.RecordSink`:
every record reaches it right after its ``metrics.jsonl`` line is durable and becomes metrics and
scalars at step = round (sync) or model version (fedbuff, fedasync). When the run ends,
``model.onnx``, ``summary.json``, ``metrics.jsonl``, ``run.json`` and the report's plots become
artifacts and the reported epsilon a tag. docs/tracking.md has the details.

mlflow and tensorboard are the optional ``tracking`` extra and slow to import (seconds): they are
imported only when a tracker is opened, never by ``edge-fl --help``. Writes happen on one
background thread, so a slow tracking server never stalls the aggregator's event loop; a store
that fails mid-run is reported once and dropped, and the job goes on.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import queue
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("edge_fl.tracking")

__all__ = [
    "EXTRA_HINT",
    "Tracker",
    "TrackingError",
    "TrackingTargets",
    "flat_config",
    "numeric_fields",
    "open_tracker",
    "parse_track",
    "tracked",
]

#: both forms: an installed package's extra, and the README's editable install of a checkout
EXTRA_HINT = (
    "pip install 'edge-fl[tracking]' (from a checkout: pip install -e '.[server,tracking]')"
)

#: files of a run directory logged as MLflow artifacts when the run ends (those that exist)
RUN_ARTIFACTS = ("model.onnx", "summary.json", "metrics.jsonl")

# MLflow accepts these characters in metric and param names; anything else becomes "_"
_MLFLOW_NAME = re.compile(r"[^A-Za-z0-9_\-. /:]")
_PARAM_VALUE_MAX = 6000  # MLflow's limit on a param value's length
_PARAMS_PER_BATCH = 100  # and on params per log_batch call
_METRICS_PER_BATCH = 1000


class TrackingError(RuntimeError):
    """Tracking cannot start (the extra is missing, the store refused); one line for the user."""


@dataclass(frozen=True)
class TrackingTargets:
    """Where a run is tracked: an MLflow tracking URI ("" = the default) and/or a TensorBoard
    log directory; both None: not tracked."""

    mlflow_uri: str | None = None
    tensorboard_dir: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.mlflow_uri is not None or self.tensorboard_dir is not None


def parse_track(value: str) -> str:
    """``mlflow`` or ``mlflow:URI`` -> the URI ("" when none was given)."""
    backend, _, uri = value.partition(":")
    if backend != "mlflow":
        raise TrackingError(
            f"--track {value!r}: expected mlflow or mlflow:URI (e.g. mlflow:./mlruns, "
            "mlflow:http://host:5000); TensorBoard is --tensorboard DIR"
        )
    if value.startswith("mlflow:") and not uri:
        raise TrackingError(f"--track {value!r}: give a URI after 'mlflow:', or none at all")
    return uri


def mlflow_uri(uri: str) -> str:
    """A tracking URI for MLflow: the given one; a plain path as an absolute ``file:`` URI (a run
    started elsewhere finds the same store); none: ``MLFLOW_TRACKING_URI``, else ``./mlruns``
    (a directory store, the one local store the lightweight mlflow-skinny can write)."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI", "") or "mlruns"
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", uri):
        return uri
    return Path(uri).expanduser().resolve().as_uri()


def _require(module: str, flag: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top and top != module.split(".")[0]:
            raise  # the extra is there but broken: its own error says more
        raise TrackingError(f"{flag} needs the tracking extra: {EXTRA_HINT}") from None


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as ``section.key`` -> text (lists and nulls as JSON), the broker URL without
    its password: params go to a server others may read."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, f"{name}."))
            continue
        if name == "broker.url" and isinstance(value, str):
            value = _redacted(value)
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        out[name] = text[:_PARAM_VALUE_MAX]
    return out


def _redacted(url: str) -> str:
    from edge_fl.transport.url import BrokerUrlError, parse_broker_url

    try:
        return parse_broker_url(url).redacted()
    except BrokerUrlError:
        return "(unparsable)"


def numeric_fields(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A record's numbers as metric name -> value: nested objects dotted
    (``rejected_by_reason.norm``), booleans 0/1; text, lists, nulls and non-finite values left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(numeric_fields(value, f"{name}."))
        elif isinstance(value, bool | int | float) and math.isfinite(float(value)):
            out[_MLFLOW_NAME.sub("_", name)] = float(value)
    return out


#: while the run is opened, before the job starts: a server that is not there fails in seconds,
#: not after MLflow's default retries (7 with backoff, over 4 minutes measured); the user's own
#: settings win. Later writes (on the tracker's thread) keep MLflow's patient defaults.
_OPENING_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}


@contextlib.contextmanager
def _answer_soon() -> Iterator[None]:
    added = [name for name in _OPENING_ENV if name not in os.environ]
    os.environ.update({name: _OPENING_ENV[name] for name in added})
    retries = logging.getLogger("urllib3.connectionpool")  # its retry warning, said again below
    level = retries.level
    retries.setLevel(logging.ERROR)
    try:
        yield
    finally:
        retries.setLevel(level)
        for name in added:
            os.environ.pop(name, None)


def _one_line(exc: BaseException) -> str:
    """What the store said, short: an unreachable server's reason rather than urllib3's chain."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if text.startswith("API request to") and "failed with exception" in text:
        errno_reason = re.findall(r"\[Errno -?\d+\] ([^'\")]+)", text)
        reason = errno_reason[-1] if errno_reason else "no answer"
        return f"the tracking server did not answer ({reason.strip()})"
    return text


class _MlflowRun:
    """One MLflow run, written through ``MlflowClient`` (no global active-run state)."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, tags: dict[str, str]) -> None:
        if uri.startswith("file:"):
            # MLflow 3 keeps its directory store behind an opt-in; asking for a directory with
            # --track mlflow:PATH is that opt-in (a value the user set is left as it is)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = uri
        try:
            with _answer_soon():
                self.client = MlflowClient(tracking_uri=uri)
                found = self.client.get_experiment_by_name(experiment)
                experiment_id = (
                    found.experiment_id if found else self.client.create_experiment(experiment)
                )
                self.run_id = self.client.create_run(
                    experiment_id, run_name=run_name, tags=tags
                ).info.run_id
        except (MlflowException, OSError, ImportError) as exc:
            raise TrackingError(f"--track mlflow:{uri}: {_one_line(exc)}") from None
        self.experiment_id = experiment_id

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(_MLFLOW_NAME.sub("_", k), v) for k, v in params.items()]
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + _PARAMS_PER_BATCH])

    def metrics(self, step: int, values: dict[str, float], wall_time: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        items = [Metric(k, v, ms, step) for k, v in values.items()]
        for i in range(0, len(items), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + _METRICS_PER_BATCH])

    def tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def artifacts(self, files: list[Path], plots: list[Path]) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path))
        for path in plots:
            self.client.log_artifact(self.run_id, str(path), artifact_path="plots")

    def end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


class _TensorBoardLog:
    """Scalars in a TensorBoard event file (tensorboard's own writer; no TensorFlow, no torch),
    and the config and the final tags as text (the Text tab), so a log directory says what ran."""

    name = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        # tensorboard ships no type information: its names are Any here
        proto = importlib.import_module("tensorboard.compat.proto.event_pb2")
        summary = importlib.import_module("tensorboard.compat.proto.summary_pb2")
        self._tensor = importlib.import_module("tensorboard.compat.proto.tensor_pb2").TensorProto
        self._dt_string = importlib.import_module("tensorboard.compat.proto.types_pb2").DT_STRING
        writer = importlib.import_module("tensorboard.summary.writer.event_file_writer")
        self._event, self._summary = proto.Event, summary.Summary
        self._text_metadata = summary.SummaryMetadata(
            plugin_data=summary.SummaryMetadata.PluginData(plugin_name="text")
        )
        EventFileWriter = writer.EventFileWriter
        try:
            logdir.mkdir(parents=True, exist_ok=True)
            self.writer = EventFileWriter(str(logdir))
        except OSError as exc:
            raise TrackingError(f"--tensorboard {logdir}: {exc.strerror or exc}") from None

    def _text(self, tag: str, rows: dict[str, str]) -> None:
        """A two-column markdown table as a text summary (what TensorBoard's text plugin reads)."""
        table = "| key | value |\n|---|---|\n" + "".join(
            f"| {k} | {v.replace('|', '/')} |\n" for k, v in rows.items()
        )
        value = self._summary.Value(
            tag=tag,
            metadata=self._text_metadata,
            tensor=self._tensor(dtype=self._dt_string, string_val=[table.encode()]),
        )
        summary = self._summary(value=[value])
        self.writer.add_event(self._event(wall_time=time.time(), step=0, summary=summary))
        self.writer.flush()

    def params(self, params: dict[str, str]) -> None:
        self._text("config", params)

    def metrics(self, step: int, values: dict[str, float], wall_time: float) -> None:
        summary = self._summary(
            value=[
                self._summary.Value(tag=k.replace(".", "/"), simple_value=v)
                for k, v in values.items()
            ]
        )
        self.writer.add_event(self._event(wall_time=wall_time, step=step, summary=summary))
        self.writer.flush()  # live: TensorBoard shows the round now, not at the next flush

    def tags(self, tags: dict[str, str]) -> None:
        self._text("run", tags)  # the reported epsilon, accountant, ... at the end

    def artifacts(self, files: list[Path], plots: list[Path]) -> None:
        pass  # TensorBoard has no artifacts: they are in --out and in MLflow

    def end(self, status: str) -> None:
        self.writer.close()


_STOP = object()


class Tracker:
    """A :class:`~edge_fl.metrics.RecordSink` writing each record to MLflow and/or TensorBoard.

    ``record`` only queues; one thread does the writing. :meth:`finish` (or :meth:`fail`) drains
    the queue, logs the artifacts and the final tags and ends the run."""

    def __init__(self, backends: list[Any], step_key: str, *, keep_records: bool = True) -> None:
        """``keep_records``: hold every record for the artifacts (a run without an output
        directory, whose metrics.jsonl is made from them); else only the last is held."""
        self.backends = backends
        self.step_key = step_key
        self.keep_records = keep_records
        self.records: list[dict[str, Any]] = []
        self.last: dict[str, Any] | None = None
        self.count = 0
        self.ended = False
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name="edge-fl-tracking", daemon=True)
        self._thread.start()

    @property
    def mlflow_run_id(self) -> str | None:
        return next((b.run_id for b in self.backends if isinstance(b, _MlflowRun)), None)

    def record(self, record: dict[str, Any]) -> None:
        from edge_fl.storage import dumps_record

        plain = json.loads(dumps_record(record))  # a copy, numpy scalars and NaN made plain
        self.last, self.count = plain, self.count + 1
        if self.keep_records:
            self.records.append(plain)
        self._queue.put(plain)

    def flush(self) -> None:
        """Return once every record queued so far is written (or its store dropped)."""
        if self._thread.is_alive():
            self._queue.join()

    def _drain(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            try:
                step = item.get(self.step_key, item.get("round"))
                self._each("metrics", int(step or 0), numeric_fields(item), time.time())
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _each(self, method: str, *args: Any) -> None:
        for backend in list(self.backends):
            try:
                getattr(backend, method)(*args)
            except Exception as exc:  # the store failed: say so once, the job goes on
                log.warning("tracking: %s failed (%s); no more is sent to it", backend.name, exc)
                self.backends.remove(backend)

    def _join(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def finish(self, summary: dict[str, Any] | None, out_dir: str | Path | None) -> None:
        """The run ended: every queued record written, then the artifacts (the run directory's
        files, or the summary alone without one; the report's plots either way), the reported
        epsilon as a tag, and the run marked finished."""
        if self.ended:
            return
        self._join()
        summary = summary or {}
        from edge_fl.storage import OutputError

        try:
            with tempfile.TemporaryDirectory(prefix="edge-fl-tracking-") as tmp:
                files, plots = _artifacts(Path(tmp), summary, self, out_dir)
                self._each("artifacts", files, plots)
        except (OSError, ValueError, OutputError) as exc:  # no room for the temporary copies
            log.warning("tracking: the artifacts were not logged (%s)", exc)
        self._each("tags", _final_tags(summary, self.last or {}))
        self._end("FINISHED")

    def fail(self, status: str = "FAILED") -> None:
        """The run did not end normally: what was recorded stays, the run is marked ``status``."""
        if not self.ended:
            self._join()
            self._end(status)

    def _end(self, status: str) -> None:
        self.ended = True
        self._each("end", status)


def _final_tags(summary: dict[str, Any], last: dict[str, Any]) -> dict[str, str]:
    privacy = summary.get("privacy") or {}
    tags = {
        "edge_fl.epsilon": privacy.get("epsilon", summary.get("epsilon", last.get("epsilon"))),
        "edge_fl.delta": privacy.get("delta", last.get("delta")),
        "edge_fl.accountant": privacy.get("accountant", last.get("accountant")),
        "edge_fl.stopped": summary.get("stopped"),
        "edge_fl.ended_early": summary.get("ended_early"),
        "edge_fl.rounds_closed": summary.get("rounds_closed"),
    }
    return {k: str(v) for k, v in tags.items() if v is not None}


def _artifacts(
    tmp: Path,
    summary: dict[str, Any],
    tracker: Tracker,
    out_dir: str | Path | None,
) -> tuple[list[Path], list[Path]]:
    """(files, plots) to log: the run directory's files (run.json without the broker password)
    or, without one, summary.json and metrics.jsonl made here; plots drawn into ``tmp``."""
    from edge_fl.storage import dumps_record, write_json

    run_dir = Path(out_dir) if out_dir is not None else None
    if run_dir is None or not (run_dir / "metrics.jsonl").exists():
        run_dir = tmp / "run"
        run_dir.mkdir()
        write_json(run_dir / "summary.json", summary)
        lines = (dumps_record(r) + "\n" for r in tracker.records)
        (run_dir / "metrics.jsonl").write_text("".join(lines))
    files = [run_dir / name for name in RUN_ARTIFACTS if (run_dir / name).exists()]
    meta = run_dir / "run.json"
    if meta.exists():
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(meta.read_text())
            broker = (data.get("config") or {}).get("broker") or {}
            if isinstance(broker.get("url"), str):
                broker["url"] = _redacted(broker["url"])
            write_json(tmp / "run.json", data)
            files.append(tmp / "run.json")
    plots: list[Path] = []
    if tracker.count:
        from edge_fl.report import make_report

        try:
            plots = make_report([run_dir], tmp / "plots").written
        except (ValueError, OSError) as exc:
            log.warning("tracking: the plots were not drawn (%s)", exc)
    return files, plots


def open_tracker(
    config: Any,
    targets: TrackingTargets,
    *,
    out_dir: str | Path | None = None,
    run_name: str | None = None,
    resumed: bool = False,
) -> Tracker | None:
    """A :class:`Tracker` for a run of ``config`` (a validated JobConfig), or None when
    ``targets`` asks for no tracking. The extra and the stores are checked here, before the job
    starts: TrackingError names what is missing or what the store said. ``resumed``: the run
    continues one in ``out_dir``; it is a new MLflow run (tagged) that receives the earlier
    rounds first, so it too holds every round."""
    if not targets.enabled:
        return None
    if targets.mlflow_uri is not None:
        _require("mlflow", "--track mlflow")
    if targets.tensorboard_dir is not None:
        _require("tensorboard", "--tensorboard")
    mode = config.rounds.mode
    privacy = config.privacy
    tags = {
        "edge_fl.mechanism": privacy.mechanism,
        "edge_fl.mode": mode,
        "edge_fl.job": config.job,
        "edge_fl.config_digest": config.digest(),
    }
    if privacy.epsilon is not None:
        tags["edge_fl.target_epsilon"] = str(privacy.epsilon)
    if out_dir is not None:
        tags["edge_fl.out"] = str(Path(out_dir).resolve())
    if resumed:
        tags["edge_fl.resumed"] = "true"
    name = run_name or (
        Path(out_dir).name if out_dir else f"{config.job}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    backends: list[Any] = []
    try:
        if targets.mlflow_uri is not None:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or config.job
            backends.append(_MlflowRun(mlflow_uri(targets.mlflow_uri), experiment, name, tags))
        if targets.tensorboard_dir is not None:
            backends.append(_TensorBoardLog(Path(targets.tensorboard_dir)))
        params = flat_config(config.model_dump(mode="json"))
        params["config_digest"] = config.digest()
        for backend in backends:
            backend.params(params)
    except TrackingError:
        for backend in backends:
            with contextlib.suppress(Exception):
                backend.end("FAILED")
        raise
    return Tracker(backends, "round" if mode == "sync" else "version", keep_records=out_dir is None)


@contextlib.contextmanager
def tracked(tracker: Tracker | None) -> Iterator[None]:
    """Records of runs made inside the block go to ``tracker`` (nothing when None); a block that
    raises ends the tracked run FAILED (KILLED on Ctrl-C). The caller calls ``finish``."""
    if tracker is None:
        yield
        return
    from edge_fl.metrics import record_sinks

    try:
        with record_sinks(tracker):
            yield
    except KeyboardInterrupt:
        tracker.fail("KILLED")
        raise
    except BaseException:
        tracker.fail()
        raise
