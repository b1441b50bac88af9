"""Durable files: written whole or not at all, fsynced, and one process per run directory.

Every output of a run (records, checkpoints, the journal, summaries, exports) goes through these
helpers, so a failed write is one :class:`OutputError` sentence naming the file and the OS's
reason, and a crash never leaves a half-written file under a final name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from pathlib import Path
from typing import Any


class OutputError(RuntimeError):
    """An output file could not be written: disk full, read-only or unwritable directory."""

    def __init__(self, path: str | os.PathLike[str], exc: OSError) -> None:
        self.path = Path(path)
        self.errno = exc.errno
        reason = exc.strerror or str(exc) or type(exc).__name__
        super().__init__(f"cannot write {self.path}: {reason}")


def clean_json(value: Any) -> Any:
    """JSON has no inf/nan: write them as null rather than as invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v) for v in value]
    return value


def _default(value: Any) -> Any:
    """numpy scalars and anything else a record may carry."""
    if hasattr(value, "item"):
        return clean_json(value.item())
    return str(value)


def dumps_record(record: dict[str, Any]) -> str:
    """One record as one line of strict JSON (also what checkpoints store). The walk that
    replaces inf/nan runs only when the record holds one: over a checkpoint of 10,000 devices it
    was half of the round commit's time."""
    try:
        return json.dumps(record, allow_nan=False, default=_default)
    except ValueError:
        return json.dumps(clean_json(record), allow_nan=False, default=_default)


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in ``directory`` durable (best effort where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (temp file, fsync, rename); OutputError on failure."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # give back the space a partial temp file holds
        raise OutputError(path, exc) from None
    fsync_dir(path.parent)


def write_json(path: Path, obj: Any) -> None:
    """Standard JSON (no Infinity/NaN tokens: they become null), written atomically."""
    text = json.dumps(clean_json(obj), indent=2, allow_nan=False, default=_default) + "\n"
    atomic_write(Path(path), text.encode())


LOCK_FILE = ".edge-fl.lock"


def lock_run_dir(out_dir: str | Path | None) -> Any:
    """Hold ``out_dir`` for this process (an open file with an exclusive flock; released when the
    process ends): two runs writing one directory interleave their ``metrics.jsonl`` into garbage.
    OutputError names the holder when another process has it."""
    if out_dir is None:
        return None
    import fcntl

    path = Path(out_dir) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a+")
    except OSError as exc:
        raise OutputError(getattr(exc, "filename", None) or path, exc) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise OutputError(
            Path(out_dir), OSError(errno.EBUSY, f"in use by another edge-fl run (pid {holder})")
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
