"""The checkpoint's ledger file: the job's releases and selections, appended round by round.

Every release (device, round, sample count), every round with central noise and every round's
selection (async: every version's) must outlive a restart: a committed release is charged again on
resume, never forgotten, and a straggler's late answer to any closed round is still admitted and
charged. Inside ``checkpoint.json``, these lists made each round's commit rewrite the whole job's
history (O(rounds) bytes a round, O(rounds^2) over a job). They live instead in
``checkpoint-ledger-<generation>.jsonl`` beside it, one JSON line per entry, and a round's commit
appends only that round's lines:

1. append the new lines to the ledger file and fsync it (the directory too when the file is new);
2. write the parameters file and ``checkpoint.json`` atomically (temp, fsync, rename), the state
   naming the ledger file with how many bytes of it it covers, their SHA-256 and how many entries
   of each kind they hold (``ledger``: :func:`Coverage`).

``checkpoint.json`` stays the single commit point. A reader takes exactly the covered prefix:
bytes past it (a crash between the append and the rename, or an append cut short, which leaves a
torn last line) belong to no commit and are ignored, and a resumed writer truncates them before it
appends (the journal holds every release since the checkpoint and replays them). A ledger file
shorter than the covered length, or whose covered bytes do not hash to the recorded digest or do
not hold the recorded counts, is refused in one line: a resume never under-counts a committed
release. Readers (``edge-fl dashboard``, tools) never write the file, so they may read a running
job's directory: the covered prefix of a generation only ever grows.

Lines, JSON arrays (the first is the header)::

    ["edge-fl ledger", 1, job, run]           header (run: the run id, hex)
    ["r", device, round, n]                   a release (n: samples, or the secure-release mark)
    ["z", round]                              a round with central noise (a job-level event)
    ["h", round, nonce | null, [device, ..]]  a round's selection, nonce in base64; a later line
                                              for the same round replaces an earlier one (an
                                              asynchronous version's selection grows)

Generations: a writer that cannot continue the file the checkpoint covers (the first checkpoint of
a run, a checkpoint of the older format that listed everything inline, a commit that failed half
way, a history that was cleared) starts a new file holding everything; the one before is removed
once a checkpoint naming the new one is in place, so a crash in between leaves the previous pair.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from edge_fl.storage import OutputError, fsync_dir

__all__ = [
    "HEADER",
    "PREFIX",
    "ChangeTracked",
    "LedgerReader",
    "LedgerWriter",
    "StaleLedger",
    "is_ledger_file",
    "with_ledger",
]

PREFIX = "checkpoint-ledger-"
SUFFIX = ".jsonl"
HEADER = "edge-fl ledger"
VERSION = 1

K = TypeVar("K")
V = TypeVar("V")


class ChangeTracked(dict[K, V]):
    """A dict that logs the keys it sets (``changes``, in order, repeats included) and counts the
    times it lost entries (``epoch``: a clear, a deletion, which empty ``changes``), so a writer
    appends what changed since its last commit without comparing the whole dict."""

    __slots__ = ("changes", "epoch")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.changes: list[K] = list(self)
        self.epoch = 0

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.changes.append(key)

    def __delitem__(self, key: K) -> None:
        super().__delitem__(key)
        self._lost()

    def clear(self) -> None:
        super().clear()
        self._lost()

    def pop(self, *args: Any) -> Any:
        had = len(self)
        value = super().pop(*args)
        if len(self) != had:
            self._lost()
        return value

    def popitem(self) -> tuple[K, V]:
        item = super().popitem()
        self._lost()
        return item

    def setdefault(self, key: K, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def __ior__(self, other: Any) -> ChangeTracked[K, V]:  # type: ignore[override,misc]
        self.update(other)
        return self

    def _lost(self) -> None:
        self.epoch += 1
        self.changes = []


def is_ledger_file(name: str) -> bool:
    return name.startswith(PREFIX) and name.endswith(SUFFIX)


def _line(entry: list[Any]) -> bytes:
    return (json.dumps(entry, separators=(",", ":"), ensure_ascii=True) + "\n").encode()


def _history_line(rnd: int, facts: tuple[bytes | None, Iterable[str]]) -> bytes:
    nonce, selected = facts
    encoded = None if nonce is None else base64.b64encode(nonce).decode()
    return _line(["h", int(rnd), encoded, sorted(selected)])


class StaleLedger(Exception):
    """The writer cannot continue its file: start a new generation."""


class LedgerWriter:
    """Appends one core's new entries to one directory's ledger file, commit after commit.

    It remembers how far it wrote (entries of each kind, bytes, the running SHA-256), so a commit
    costs the round's new lines, whatever the job's length. :meth:`append` raises
    :class:`StaleLedger` when the core's lists are no continuation of what it wrote."""

    def __init__(self, directory: str | Path, name: str, job: str, run: str) -> None:
        self.dir = Path(directory)
        self.name = name
        self.job, self.run = job, run
        self.size = 0  # bytes written and synced
        self.sha = hashlib.sha256()
        self.releases = self.noised = self.history_lines = 0
        self.last_release: Any = None  # the last release written (the very object)
        self.history_epoch = 0
        self.history_seen = 0  # entries of the history's ``changes`` written

    @classmethod
    def start(cls, directory: str | Path, job: str, run: str) -> LedgerWriter:
        """A new generation: the first commit writes the header and every entry."""
        return cls(directory, f"{PREFIX}{os.urandom(8).hex()}{SUFFIX}", job, run)

    @classmethod
    def resume(
        cls,
        directory: str | Path,
        reader: LedgerReader,
        releases: list[Any],
        noised: list[int],
        history: Mapping[int, Any],
    ) -> LedgerWriter | None:
        """Continue the file ``reader`` read (its covered prefix) for a core just restored from
        it; None when the core's lists are not exactly what the file holds."""
        if reader.name is None or reader.header is None:
            return None
        if not isinstance(history, ChangeTracked):
            return None
        if len(releases) != len(reader.releases) or len(noised) != len(reader.noised_rounds):
            return None
        w = cls(directory, reader.name, str(reader.header[2]), str(reader.header[3]))
        w.size, w.sha = reader.offset, reader.sha.copy()
        w.releases, w.noised, w.history_lines = len(releases), len(noised), reader.history_lines
        w.last_release = releases[-1] if releases else None
        w.history_epoch, w.history_seen = history.epoch, len(history.changes)
        return w

    @property
    def path(self) -> Path:
        return self.dir / self.name

    def pending(
        self, releases: list[Any], noised: list[int], history: Mapping[int, Any]
    ) -> tuple[bytes, int, int, int]:
        """The lines to append: (bytes, releases, noised rounds, history lines) added."""
        if not isinstance(history, ChangeTracked):
            raise StaleLedger("the history does not log its changes")
        n = self.releases
        if self.size == 0:
            pass  # a new file: everything goes in
        elif len(releases) < n or (n and releases[n - 1] is not self.last_release):
            raise StaleLedger("the releases are no continuation of the file")
        elif len(noised) < self.noised:
            raise StaleLedger("the noised rounds are no continuation of the file")
        elif history.epoch != self.history_epoch or len(history.changes) < self.history_seen:
            raise StaleLedger("the history lost entries")
        parts: list[bytes] = []
        if self.size == 0:
            parts.append(_line([HEADER, VERSION, self.job, self.run]))
            changed: Iterable[int] = history  # a new file: every round, in the dict's order
        else:
            changed = dict.fromkeys(history.changes[self.history_seen :])
        parts.extend(_line(["r", str(d), int(r), int(k)]) for d, r, k in releases[n:])
        parts.extend(_line(["z", int(r)]) for r in noised[self.noised :])
        lines = 0
        for rnd in changed:
            parts.append(_history_line(rnd, history[rnd]))
            lines += 1
        return b"".join(parts), len(releases) - n, len(noised) - self.noised, lines

    def append(
        self, releases: list[Any], noised: list[int], history: Mapping[int, Any]
    ) -> dict[str, Any]:
        """Append and fsync the entries not written yet; the coverage a checkpoint records.
        OutputError when the file cannot be written (the writer is then unusable)."""
        data, added_r, added_z, added_h = self.pending(releases, noised, history)
        path = self.path
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(path, exc) from None
        try:
            on_disk = os.fstat(fd).st_size
            if on_disk < self.size:
                raise StaleLedger(f"{path} holds {on_disk} bytes, {self.size} were written")
            if on_disk > self.size:  # a tail no checkpoint covers: an interrupted commit's
                os.ftruncate(fd, self.size)
            view = memoryview(data)
            offset = self.size
            while view:
                done = os.pwrite(fd, view, offset)
                view, offset = view[done:], offset + done
            if data or on_disk != self.size:
                os.fsync(fd)
        except OSError as exc:
            raise OutputError(path, exc) from None
        finally:
            os.close(fd)
        if self.size == 0:
            fsync_dir(self.dir)  # the new file's name is durable before a checkpoint names it
        self.sha.update(data)
        self.size += len(data)
        self.releases += added_r
        self.noised += added_z
        self.history_lines += added_h
        self.last_release = releases[-1] if releases else None
        self.history_epoch = history.epoch  # type: ignore[attr-defined]
        self.history_seen = len(history.changes)  # type: ignore[attr-defined]
        return self.coverage()

    def coverage(self) -> dict[str, Any]:
        """What ``checkpoint.json`` records under ``ledger``."""
        return {
            "file": self.name,
            "bytes": self.size,
            "sha256": self.sha.hexdigest(),
            "releases": self.releases,
            "noised_rounds": self.noised,
            "history_lines": self.history_lines,
        }


class LedgerReader:
    """Reads the prefix of a ledger file a checkpoint covers, verified (length, digest, counts);
    again and again as the job goes on, reading only what was appended since (the dashboard)."""

    def __init__(self) -> None:
        self._reset(None)

    def _reset(self, name: str | None) -> None:
        self.name = name
        self.offset = 0
        self.sha = hashlib.sha256()
        self.header: list[Any] | None = None
        self.releases: list[list[Any]] = []
        self.noised_rounds: list[int] = []
        self.history: dict[int, tuple[str | None, list[str]]] = {}
        self.history_lines = 0

    def read(self, directory: str | Path, coverage: Mapping[str, Any], run: Any = None) -> None:
        """Bring the reader to ``coverage`` (a checkpoint's ``ledger``). ValueError, in one line,
        when the file does not hold what the checkpoint says it covers (the reader then starts
        over at the next call)."""
        try:
            self._read(Path(directory), coverage, run)
        except (OSError, ValueError, TypeError, KeyError, IndexError) as exc:
            self._reset(None)
            if isinstance(exc, ValueError):
                raise
            raise ValueError(f"the checkpoint's ledger file: {exc}") from None

    def _read(self, d: Path, coverage: Mapping[str, Any], run: Any) -> None:
        name = str(coverage["file"])
        if "/" in name or not is_ledger_file(name):
            raise ValueError(f"the checkpoint names no ledger file: {name!r}")
        want = int(coverage["bytes"])
        if name != self.name or want < self.offset:
            self._reset(name)
        path = d / name
        with open(path, "rb") as f:
            f.seek(self.offset)
            data = f.read(want - self.offset)
        if len(data) < want - self.offset:
            raise ValueError(
                f"{path} holds {self.offset + len(data)} bytes, the checkpoint covers {want}: "
                "committed releases are missing (restore the file, or start the job again)"
            )
        if data and not data.endswith(b"\n"):
            raise ValueError(f"{path}: the checkpoint's {want} bytes end inside a line")
        sha = self.sha.copy()
        sha.update(data)
        if sha.hexdigest() != coverage["sha256"]:
            raise ValueError(
                f"{path}: its first {want} bytes do not match the checkpoint's digest "
                "(the file was changed or replaced)"
            )
        for raw in data.splitlines():
            self._entry(json.loads(raw), path)
        self.sha, self.offset = sha, want
        counts = (len(self.releases), len(self.noised_rounds), self.history_lines)
        expected = (
            int(coverage["releases"]),
            int(coverage["noised_rounds"]),
            int(coverage["history_lines"]),
        )
        if counts != expected:
            raise ValueError(f"{path} holds {counts} entries, the checkpoint says {expected}")
        if run is not None and self.header is not None and self.header[3] != run:
            raise ValueError(f"{path} is the ledger of run {self.header[3]}, not of run {run}")

    def _entry(self, entry: list[Any], path: Path) -> None:
        kind = entry[0]
        if self.header is None:
            if kind != HEADER or entry[1] != VERSION:
                raise ValueError(f"{path}: no ledger header of version {VERSION}")
            self.header = entry
        elif kind == "r":
            self.releases.append([str(entry[1]), int(entry[2]), int(entry[3])])
        elif kind == "z":
            self.noised_rounds.append(int(entry[1]))
        elif kind == "h":
            self.history[int(entry[1])] = (entry[2], [str(x) for x in entry[3]])
            self.history_lines += 1
        else:
            raise ValueError(f"{path}: unknown ledger entry {kind!r}")


def with_ledger(
    directory: str | Path, state: dict[str, Any], reader: LedgerReader | None = None
) -> dict[str, Any]:
    """``state`` (a checkpoint's JSON) with ``releases``, ``noised_rounds`` and ``history`` as
    checkpoints before the ledger file listed them inline (``[device, round, n]``,
    ``{"round": [nonce, selected]}``); a checkpoint of that older format is returned as it is.
    ``reader``: one kept across calls reads only what was appended since. ValueError as
    :meth:`LedgerReader.read`."""
    coverage = state.get("ledger")
    if not isinstance(coverage, dict):
        return state
    r = reader if reader is not None else LedgerReader()
    r.read(directory, coverage, run=state.get("run"))
    return {
        **state,
        "releases": list(r.releases),
        "noised_rounds": list(r.noised_rounds),
        "history": {str(k): [n, sel] for k, (n, sel) in sorted(r.history.items())},
    }
