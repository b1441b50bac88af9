"""The aggregator's journal: nothing it accepted between two checkpoints is lost to a crash.

A checkpoint is written after every round. Between two checkpoints the aggregator journals, in
order, every input that changed its state:

``open``     the round (async: window) it opened: every field of the round (number, selection,
             target, base version, nonce), async versions' nonces, the global message as
             published and, for a seeded run, the selection generator's state after the draw, so
             the round is rebuilt exactly as it was instead of being drawn again;
``accept``   an update it accepted, with its payload bytes and the sample count its device had
             declared: replaying them through ``AggregatorCore.on_update`` rebuilds the round's
             running sums, admission state and the release in the ledger exactly (an async update
             held for the next window too);
``dispatch`` devices selected mid-window (async with a concurrency limit): the version, the
             devices and the dispatch message as published (``d``; journals written before
             dispatch messages existed hold the re-published global message, ``g``);
``cohort``   a secure FedBuff cohort it dispatched (number, nonce, selection, base version,
             survivors floor): its session is never resumed, so the resumed aggregator records
             it skipped and still charges the masked inputs that reach it;
``release``  a ledger release of an update it did not accept (late, duplicate key, not selected,
             budget-stopped device, wrong mechanism): (device, round, samples).

File format (``journal.bin`` next to ``checkpoint.json``): records framed as ``<u32 length><u32
crc32><msgpack body>``; the first is a header (``k = "head"``: job, config digest, and ``after``,
the checkpoint sequence number the journal follows). Every other record carries a sequence number
``s`` that continues across checkpoints. A record is written with one ``write(2)`` on an
``O_APPEND`` descriptor; the service fsyncs before it acknowledges the MQTT messages concerned
(group commit: one fsync per burst of queued messages). A torn or corrupt tail (a crash or a full
disk mid-write) fails its length or CRC check and is dropped on reading; an append that fails is
cut back at once.

Commit of a round, in this order: ``close_round`` -> checkpoint (atomic; ``journal_seq`` = the
last journal record it covers, ``last_record`` = the round's record) -> metrics line -> journal
rotated once it holds :data:`ROTATE_BYTES` (a fresh file whose header says ``after = journal_seq``;
until then the records the checkpoint covers stay in the file and are skipped). Resume = checkpoint + the journal
records with ``s > journal_seq``; a record the checkpoint already covers is never applied twice,
whether the crash came before or after the rotation. Noised rounds need no journal record: they are
recorded by ``close_round`` and committed by the checkpoint that follows it synchronously; a round
closed but not yet checkpointed is rebuilt from the journal and closed again (its first noise draw
was never published).

What the journal cannot see: an update the broker delivered but the aggregator had not journaled.
The service acknowledges an update (MQTT PUBACK) only after its record is on disk, and keeps a
persistent session (``clean_session=False``), so the broker re-delivers every unacknowledged update
to the restarted aggregator; the ledger's (device, round) key and the round's admission make that
re-delivery a no-op when the record did reach the journal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from edge_fl.protocol import GlobalModel
from edge_fl.storage import OutputError, fsync_dir

from .aggregator import AggregatorCore, DeviceRecord, fleet_view
from .checkpoint import has_checkpoint, load_checkpoint

log = logging.getLogger("edge_fl.aggregator")

JOURNAL = "journal.bin"
FORMAT = 1
_FRAME = struct.Struct("<II")  # body length, crc32(body)
_MAX_BODY = 1 << 30
#: a journal is replaced by an empty one at a round's commit once it holds this many bytes (what
#: a resume reads at most beyond the records it replays)
ROTATE_BYTES = 8 << 20


def _frame(record: dict[str, Any]) -> bytes:
    body = msgpack.packb(record, use_bin_type=True)
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Journal:
    """An open journal file: ``append`` records, ``sync`` them, ``rotate`` after a checkpoint."""

    def __init__(
        self, path: Path, fd: int, seq: int, size: int, job: str, digest: str, durable: bool
    ) -> None:
        self.path = path
        self.seq = seq  # the last sequence number written
        self.job = job
        self.digest = digest
        self.durable = durable
        self.appended = 0
        self.syncs = 0
        self._fd: int | None = fd
        self._size = size  # bytes on disk (what a failed write is cut back to)
        self._pending: list[bytes] = []  # appended, not yet written: one write per sync
        self._dirty = False
        self.rotate_bytes = ROTATE_BYTES
        # write_now's bytes, not yet fsynced; fsync_written (another thread) and everything that
        # closes or replaces the descriptor hold the lock, so no fsync meets a closed descriptor
        self._written = False
        self._fsync_lock = threading.Lock()

    @classmethod
    def start(
        cls,
        directory: str | Path,
        *,
        job: str,
        digest: str,
        after: int = 0,
        records: list[dict[str, Any]] | None = None,
        durable: bool = True,
    ) -> Journal:
        """A new journal following the checkpoint at sequence ``after`` (carrying ``records``
        already newer than it), atomically replacing any previous journal file."""
        records = records or []
        path = Path(directory) / JOURNAL
        tmp = path.with_name(JOURNAL + ".tmp")
        head = {"k": "head", "v": FORMAT, "job": job, "digest": digest, "after": after}
        data = b"".join(_frame(r) for r in (head, *records))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise OutputError(path, exc) from None
        if durable:
            fsync_dir(path.parent)
        seq = int(records[-1]["s"]) if records else after
        return cls(path, fd, seq, len(data), job, digest, durable)

    def append(self, kind: str, **fields: Any) -> int:
        """Add one record; it reaches the file at the next :meth:`sync` (nothing may rely on it
        before: the service acknowledges a message only after the sync that holds its effects).
        Returns its sequence number."""
        if self._fd is None:
            raise ValueError("the journal is closed")
        self._pending.append(_frame({"s": self.seq + 1, "k": kind, **fields}))
        self.seq += 1
        self.appended += 1
        self._dirty = True
        return self.seq

    def _write_pending(self) -> None:
        """Every pending record in one write (one system call per burst, not per record: the
        per-record writes cost more than the fsync, BENCHMARKS.md section 2)."""
        if not self._pending or self._fd is None:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        try:
            _write_all(self._fd, data)
        except OSError as exc:
            # no torn record left behind for a later write to follow
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise OutputError(self.path, exc) from None
        self._size += len(data)

    def sync(self) -> None:
        """Write and make durable every appended record (one write and one fsync for however
        many were appended). On a failed write nothing of them is on disk."""
        if (self._dirty or self._written) and self._fd is not None:
            self._write_pending()
            with self._fsync_lock:
                self._fsync_held()
            self._dirty = False

    def write_now(self) -> None:
        """Write every appended record now (one write), for :meth:`fsync_written` to make
        durable on another thread while the caller's event loop goes on."""
        if self._dirty and self._fd is not None:
            self._write_pending()
            self._dirty = False
            with self._fsync_lock:
                self._written = True

    def fsync_written(self) -> None:
        """Make what :meth:`write_now` wrote durable (any thread; one fsync). Nothing to do when
        a :meth:`sync` or a checkpoint (:meth:`rotate`) has covered it since. Raises OutputError
        if it cannot be made durable (the journal was closed with it unsynced, or fsync failed)."""
        with self._fsync_lock:
            if not self._written:
                return
            if self._fd is None:
                raise OutputError(self.path, OSError("journal closed before its fsync"))
            self._fsync_held()

    def _fsync_held(self) -> None:
        """One fsync of the open file (the caller holds ``_fsync_lock``): what was written is
        durable, or OutputError."""
        if self.durable and self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                raise OutputError(self.path, exc) from None
            self.syncs += 1
        self._written = False

    def rotate(self) -> None:
        """After a checkpoint that covers every record so far: start an empty journal once this
        one holds :data:`ROTATE_BYTES`. Below that the file is kept, since resuming skips the
        records a checkpoint covers (``s <= journal_seq``) and a fresh file costs two fsyncs and
        a rename on every round's commit, in the path of the next round."""
        self._pending.clear()  # the checkpoint holds their effects
        self._dirty = False
        with self._fsync_lock:
            self._written = False  # written ones too: an fsync in flight has nothing to add
        if self._size < self.rotate_bytes:
            return
        self.close()
        fresh = Journal.start(
            self.path.parent, job=self.job, digest=self.digest, after=self.seq, durable=self.durable
        )
        self._fd, self._size, self._dirty = fresh._fd, fresh._size, False
        fresh._fd = None

    def close(self) -> None:
        """Write what is pending (not fsynced: a clean stop syncs first) and close."""
        if self._fd is not None:
            with contextlib.suppress(OutputError):  # unacknowledged: the broker has them
                self._write_pending()
            with self._fsync_lock:  # an fsync in flight finishes first
                os.close(self._fd)
                self._fd = None


@dataclass
class JournalContents:
    header: dict[str, Any] | None
    records: list[dict[str, Any]]
    good_bytes: int
    size: int

    @property
    def torn_bytes(self) -> int:
        return self.size - self.good_bytes


def read_journal(path: str | Path) -> JournalContents:
    """Every whole record of a journal file; reading stops at the first torn or corrupt one."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return JournalContents(None, [], 0, 0)
    except OSError as exc:
        raise ValueError(f"cannot read the journal {path}: {exc}") from None
    pos, header, records = 0, None, []
    while pos + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, pos)
        end = pos + _FRAME.size + length
        if length > _MAX_BODY or end > len(data):
            break
        body = data[pos + _FRAME.size : end]
        if zlib.crc32(body) != crc:
            break
        try:
            record = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.UnpackException):
            break
        if not isinstance(record, dict):
            break
        if header is None:
            if record.get("k") != "head":
                break
            header = record
        else:
            records.append(record)
        pos = end
    return JournalContents(header, records, pos if header is not None else 0, len(data))


# ------------------------------------------------------------------ rounds


def round_spec(core: AggregatorCore, payload: bytes | None = None) -> dict[str, Any]:
    """What the ``open`` record of the core's just-opened round holds (``core.round_spec``): the
    round's fields, the selection generator's state after the draw (seeded runs only), the
    policy's own (async: the versions' nonces) and the global message as published
    (``payload``), so a resumed round republishes the same bytes."""
    return core.round_spec(payload)


def reopen_round(core: AggregatorCore, spec: dict[str, Any], now: float = 0.0) -> None:
    """Rebuild the round an ``open`` record describes, as ``open_round`` left it, without drawing
    a new selection (``core.reopen``: the round policy mirrors its own ``open``)."""
    core.reopen(spec, now)


def open_message(core: AggregatorCore) -> GlobalModel:
    """The global model of the open round, rebuilt (when the journal lacks its bytes)."""
    return core.open_message()


# ------------------------------------------------------------------ resume


@dataclass
class Resumed:
    """What ``resume`` restored, for the console and the chaos tool."""

    checkpoint_round: int | None  # None: there was no checkpoint (the job resumed from its start)
    journal_seq: int  # the sequence number the checkpoint covers
    last_record: dict[str, Any] | None
    records: list[dict[str, Any]] = field(default_factory=list)  # replayed (kept in the journal)
    releases: int = 0  # ledger releases restored from the journal
    accepted: int = 0  # accepted updates re-folded
    mismatched: int = 0  # journaled as accepted, not re-accepted on replay (should be 0)
    open_round: int | None = None
    open_payload: bytes | None = None  # the reopened round's global message as published
    dispatch_payload: bytes | None = None  # the last dispatch message published since
    torn_bytes: int = 0

    @property
    def seq(self) -> int:
        return int(self.records[-1]["s"]) if self.records else self.journal_seq

    def describe(self) -> str:
        text = (
            f"journal: {len(self.records)} records replayed ({self.accepted} accepted updates, "
            f"{self.releases} ledger releases"
        )
        if self.open_round is not None:
            text += f", round {self.open_round} reopened"
        text += ")"
        if self.torn_bytes:
            text += f"; dropped a torn tail of {self.torn_bytes} bytes"
        if self.mismatched:
            text += f"; {self.mismatched} updates NOT re-accepted"
        return text


def _admit_as_then(core: AggregatorCore, device: str, payload: bytes, declared: int | None):
    """``on_update`` with the device's fleet-view entry as it was when the update arrived: its
    declared sample count (the cap on what the update may claim), or unknown (``None``)."""
    if declared is None:
        saved = core.devices.pop(device, None)
        try:
            return core.on_update(device, payload)
        finally:
            if saved is not None:
                core.devices[device] = saved
    core.devices.setdefault(device, DeviceRecord()).n_samples = int(declared)
    return core.on_update(device, payload)


def replay(core: AggregatorCore, records: list[dict[str, Any]], resumed: Resumed) -> None:
    released = {(d, int(r)) for d, r, _ in core.releases}
    for rec in records:
        kind = rec.get("k")
        before = len(core.releases)
        if kind == "open":
            reopen_round(core, rec)
            resumed.open_round = core.round_number
            resumed.open_payload = rec.get("g")
            resumed.dispatch_payload = None  # an earlier window's
        elif kind == "accept":
            reason = _admit_as_then(core, str(rec["d"]), bytes(rec["p"]), rec.get("dn", 0))
            if reason is None:
                resumed.accepted += 1
            else:  # cannot happen with the same core and order; say so if it does
                resumed.mismatched += 1
                log.warning("journal replay: update from %s not re-accepted (%s)", rec["d"], reason)
        elif kind == "dispatch":  # replacements sent mid-window (async concurrency limit)
            core.restore_dispatch(int(rec["v"]), list(rec["sel"]))
            if rec.get("d") is not None:  # a dispatch message: the retained model is unchanged
                resumed.dispatch_payload = rec["d"]
            elif rec.get("g") is not None:  # an older journal: the model was re-published
                resumed.open_payload = rec["g"]
        elif kind == "cohort":  # a secure FedBuff cohort dispatched: skipped on resume
            core.restore_cohort(rec)
        elif kind == "masked":  # a secure round's U2, handed to the ingest workers
            core.restore_masked(int(rec["r"]), [str(d) for d in rec["u"]])
        elif kind == "release":
            key = (str(rec["d"]), int(rec["r"]))
            if key not in released:
                core.record_release(key[0], key[1], int(rec["n"]))
        else:
            raise ValueError(f"journal record {rec.get('s')}: unknown kind {kind!r}")
        for d, r, _ in core.releases[before:]:
            released.add((d, int(r)))
        resumed.releases += len(core.releases) - before


def resume(core: AggregatorCore, directory: str | Path) -> Resumed:
    """Restore ``core`` (freshly built from the same config) from the checkpoint in ``directory``
    (if there is one) and the journal records newer than it."""
    d = Path(directory)
    state = load_checkpoint(core, d) if has_checkpoint(d) else None
    after = int(state["journal_seq"]) if state is not None else 0
    contents = read_journal(d / JOURNAL)
    resumed = Resumed(
        checkpoint_round=int(state["round_number"]) if state is not None else None,
        journal_seq=after,
        last_record=state["last_record"] if state is not None else None,
        torn_bytes=contents.torn_bytes,
    )
    head = contents.header
    if head is not None:
        if head.get("digest") != core.settings.config_digest:
            raise ValueError(
                f"the journal in {d} was written with config digest {head.get('digest')}, this "
                f"job's is {core.settings.config_digest}: resume with the same configuration"
            )
        if state is None and int(head.get("after", 0)) > 0:
            raise ValueError(
                f"the journal in {d} continues a checkpoint (sequence {head['after']}) that is "
                f"missing: restore {d / 'checkpoint.json'} or start the job again"
            )
    fresh = [r for r in contents.records if int(r["s"]) > after]
    for expected, rec in enumerate(fresh, start=after + 1):
        if int(rec["s"]) != expected:
            raise ValueError(
                f"the journal in {d} has a gap: record {rec['s']} where {expected} was expected "
                "(it does not belong to this checkpoint)"
            )
    resumed.records = fresh
    live = core.devices
    core.devices = fleet_view(state) if state is not None else {}
    try:
        replay(core, fresh, resumed)
    finally:
        core.devices = live  # live retained statuses rebuild the fleet view after a resume
    return resumed
