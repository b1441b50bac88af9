"""Run records on disk: ``metrics.jsonl`` (one object per round), ``summary.json``, ``run.json``.

JSONL is the primary record: appended, flushed and fsynced per round, so a run cut short still
leaves every round it finished. CSV and plots are derived from it by ``edge-fl report``.

A write that fails (disk full, read-only or unwritable directory) raises :class:`OutputError`, one
clear sentence naming the file and the OS's reason; a failed append is cut back to the last whole
line, so ``metrics.jsonl`` never ends in half a record. When a run is resumed the file is read back,
a torn last line (a crash mid-write) is dropped, and :meth:`RunRecorder.reconcile` makes it agree
with the checkpoint (whose last record is the commit point of a round).

Record sinks (:class:`RecordSink`, e.g. the experiment trackers of ``edge_fl.tracking``) receive
each record right after its line is durable, so what they show never runs ahead of the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Protocol

from edge_fl.storage import OutputError, atomic_write, dumps_record, write_json

log = logging.getLogger("edge_fl.metrics")

# Per-round wire byte fields summed into the summary (see edge_fl.transport.wire): MQTT-layer
# bytes of every device's session, and the link model's IP-level estimate (TLS, TCP/IP).
WIRE_TOTALS = ("wire_up", "wire_down", "wire_up_ip", "wire_down_ip")


def _read_records(path: Path) -> tuple[list[dict[str, Any]], int, int]:
    """Records of an existing metrics.jsonl, the byte length of its whole lines and its size.

    Reading stops at the first line that is not a whole JSON object (a write torn by a crash)."""
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    good = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            obj = json.loads(line)
        except ValueError:
            break
        if not isinstance(obj, dict):
            break
        records.append(obj)
        good += len(line)
    return records, good, len(data)


class RecordSink(Protocol):
    """Somewhere else a run's records go as they are committed (MLflow, TensorBoard, ...).

    ``record`` is called on the aggregator's event loop: it must return at once (queue the work).
    A sink that raises is dropped with a warning; the run goes on."""

    def record(self, record: dict[str, Any]) -> None: ...


_SINKS: ContextVar[tuple[RecordSink, ...]] = ContextVar("edge_fl_record_sinks", default=())


@contextlib.contextmanager
def record_sinks(*sinks: RecordSink) -> Iterator[None]:
    """Every :class:`RunRecorder` made inside the block feeds ``sinks``: a command wraps a run
    whose recorder is built deep inside it (``open_run``) without threading sinks through every
    layer. Nested blocks add to the enclosing one's sinks."""
    token = _SINKS.set(_SINKS.get() + sinks)
    try:
        yield
    finally:
        _SINKS.reset(token)


class RunRecorder:
    """Writes the records of one run into ``out_dir`` (or only keeps them in memory)."""

    def __init__(
        self,
        out_dir: str | Path | None,
        append: bool = False,
        sinks: tuple[RecordSink, ...] | None = None,
    ) -> None:
        """``append``: continue a resumed run's records instead of starting a new file.
        ``sinks``: where each committed record also goes (default: those of the enclosing
        :func:`record_sinks` block). A resumed run's earlier records reach them first, once the
        records agree with the checkpoint (at the first new record, or at ``close``)."""
        self.out_dir = Path(out_dir) if out_dir else None
        self.records: list[dict[str, Any]] = []
        #: what the summary says of the job (:func:`job_facts`), before the runner's ``extra``
        self.facts: dict[str, Any] = {}
        self.sinks: list[RecordSink] = list(_SINKS.get() if sinks is None else sinks)
        self._replayed = False  # earlier records (a resumed run's) not yet given to the sinks
        self._jsonl = None
        if self.out_dir is None:
            return
        path = self.path = self.out_dir / "metrics.jsonl"
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if append and path.exists():
                self.records, good, size = _read_records(path)
                if good < size:
                    log.warning(
                        "%s: dropped %d bytes after the last whole record (a torn write)",
                        path,
                        size - good,
                    )
                    os.truncate(path, good)
            self._jsonl = path.open("ab" if append else "wb", buffering=0)
        except OSError as exc:
            raise OutputError(getattr(exc, "filename", None) or path, exc) from None

    def write_meta(self, meta: dict[str, Any]) -> None:
        if self.out_dir is not None:
            write_json(self.out_dir / "run.json", meta)

    def add(self, record: dict[str, Any]) -> None:
        self._replay()
        self.records.append(record)
        if self._jsonl is not None:
            self._append_line(self._jsonl.fileno(), record)
        self._notify(record)

    def _replay(self) -> None:
        if not self._replayed:
            self._replayed = True
            for earlier in self.records:
                self._notify(earlier)

    def _notify(self, record: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            try:
                sink.record(record)
            except Exception as exc:  # a tracking store's failure never stops a job
                log.warning("record sink %r failed (%s): it gets no more records", sink, exc)
                self.sinks.remove(sink)

    def _append_line(self, fd: int, record: dict[str, Any]) -> None:
        start = os.fstat(fd).st_size  # append mode: the line goes at the end
        data = memoryview((dumps_record(record) + "\n").encode())
        try:
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        except OSError as exc:
            self.records.pop()
            with contextlib.suppress(OSError):  # no half record left behind
                os.ftruncate(fd, start)
            raise OutputError(self.path, exc) from None

    def reconcile(self, through_round: int, last_record: dict[str, Any] | None) -> list[str]:
        """Make the records agree with a checkpoint that covers rounds up to ``through_round``.

        A round is committed when its checkpoint is written (the checkpoint carries the round's
        record); its metrics line follows. A crash or a full disk between the two leaves the line
        missing: it is restored from the checkpoint. Lines beyond the checkpoint (not written by
        this version's order) are dropped: those rounds are replayed from the journal."""
        notes: list[str] = []
        if self._jsonl is None:
            return notes
        ahead = [r for r in self.records if int(r.get("round", 0)) > through_round]
        if ahead:
            keep = [r for r in self.records if int(r.get("round", 0)) <= through_round]
            self._jsonl.close()
            text = "".join(dumps_record(r) + "\n" for r in keep)
            atomic_write(self.path, text.encode())
            self._jsonl = self.path.open("ab", buffering=0)
            self.records = keep
            notes.append(f"dropped {len(ahead)} metrics records beyond checkpointed round")
        have = int(self.records[-1].get("round", 0)) if self.records else 0
        if last_record is not None and have < through_round == int(last_record.get("round", -1)):
            self.add(dict(last_record))
            notes.append(
                f"restored the metrics record of round {through_round} from the checkpoint"
            )
        return notes

    def summary(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run totals; ``extra`` (the runner's own facts) is added last and wins."""
        closed = [r for r in self.records if r.get("status") != "skipped"]
        last = self.records[-1] if self.records else {}
        wire: dict[str, Any] = {}
        if any("wire_up" in r for r in self.records):  # a fleet counted its wire bytes
            wire = {f"total_{key}": sum(r.get(key, 0) for r in self.records) for key in WIRE_TOTALS}
        return {
            "rounds": len(self.records),
            "rounds_closed": len(closed),
            "rounds_skipped": len(self.records) - len(closed),
            "final_accuracy": last.get("accuracy"),
            "final_loss": last.get("loss"),
            "total_bytes_up": sum(r.get("bytes_up", 0) for r in self.records),
            "total_bytes_down": sum(r.get("bytes_down", 0) for r in self.records),
            "total_received": sum(r.get("received", 0) for r in self.records),
            "total_late": sum(r.get("late", 0) for r in self.records),
            "total_rejected": sum(r.get("rejected", 0) for r in self.records),
            "epsilon": last.get("epsilon"),
            "accountant": last.get("accountant"),
            **wire,
            **self.facts,
            **(extra or {}),
        }

    def close(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        self._replay()
        summary = self.summary(extra)
        privacy = summary.get("privacy")
        if privacy:  # the ledger's final word (it also holds releases after the last round)
            summary["epsilon"], summary["accountant"] = privacy["epsilon"], privacy["accountant"]
        if self._jsonl is not None:
            try:
                self._jsonl.close()
            except OSError as exc:
                raise OutputError(self.path, exc) from None
            finally:
                self._jsonl = None
        if self.out_dir is not None:
            write_json(self.out_dir / "summary.json", summary)
        return summary


def job_facts(job: Any) -> dict[str, Any]:
    """What every run's summary says of its job (``edge_fl.job.Job``), `simulate`'s and
    `aggregator`'s alike: the registered mechanism name (as in every record and the global
    message's ``m``), the devices, the model and the dataset."""
    return {
        "mechanism": job.cfg.privacy.mechanism,
        "devices": job.cfg.data.devices,
        "model": job.model.name,
        "n_params": job.model.n_params,
        "dataset": job.dataset.name,
    }
