"""Aggregator checkpoints: the state needed to resume a job after a restart.

Written atomically after every round (temp file, fsync, rename), so a crash leaves the previous
complete checkpoint. The checkpoint is the commit point of a round: it carries the round's record
(``last_record``, so a metrics line lost to a crash or a full disk is restored on resume) and the
sequence number of the last journal record it covers (``journal_seq``; records up to it are never
applied again, see :mod:`edge_fl.server.journal`).

The privacy ledger is not pickled: the releases (device, round, sample count) are stored and
replayed through the same mechanism definitions, so a resumed ledger is exactly the one that was
running. The config digest guards against resuming with different settings.

What grows with the job (the releases, the rounds with central noise, every round's selection) is
not in ``checkpoint.json`` (format 3) but appended to a ledger file beside it,
``checkpoint-ledger-<generation>.jsonl``, fsynced before the checkpoint that covers it is renamed
into place; the checkpoint records the file, the length and SHA-256 of the prefix it covers and
its entry counts (``ledger``), so a round's commit costs the same at round 5 as at round 5,000 and
the checkpoint stays the single commit point (:mod:`edge_fl.server.ledger_file`: crash cases,
format). :func:`read_checkpoint` gives a checkpoint with the lists inline, as format 2 stored them;
a format 2 checkpoint still loads, and the next commit moves its lists into a ledger file.

Generator states are saved only for seeded (``reproducible``) generators, so a resumed reproducible
run selects and draws exactly like an uninterrupted one. The state of the production CSPRNG is never
written to disk: whoever read it could predict every later selection and noise draw. A resumed
production run re-keys it from ``os.urandom``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from edge_fl.storage import OutputError, atomic_write, dumps_record

from .aggregator import AggregatorCore, fleet_view
from .ledger_file import LedgerReader, LedgerWriter, StaleLedger, is_ledger_file, with_ledger
from .policy import field_values, round_fields
from .state import decode_nonces, encode_nonces, generator_state, restore_generator

__all__ = [
    "build_round",
    "decode_nonces",
    "encode_nonces",
    "fleet_view",
    "generator_state",
    "has_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "restore_generator",
    "round_fields",
    "save_checkpoint",
]

STATE = "checkpoint.json"
PARAMS = "checkpoint.npy"  # format 1; format 2 names a content-addressed checkpoint-<sha>.npy
FORMAT = 3  # 3: releases, noised rounds and history in the ledger file; 2: inline

#: each core's ledger writer per checkpoint directory: what it appended so far (a core resumed
#: from a directory gets the one :func:`load_checkpoint` read; any other starts a new file)
_WRITERS: weakref.WeakKeyDictionary[AggregatorCore, dict[str, LedgerWriter]] = (
    weakref.WeakKeyDictionary()
)


def build_round(core: AggregatorCore, data: dict[str, Any], now: float = 0.0) -> Any:
    """The round ``round_fields`` described, opened at ``now`` and with nothing accepted yet."""
    return core.policy.build_round(field_values(data), now)


def save_checkpoint(
    core: AggregatorCore,
    directory: str | Path,
    *,
    journal_seq: int = 0,
    last_record: dict[str, Any] | None = None,
) -> None:
    """Write the core's state between rounds. Raises OutputError if it cannot be written (the
    previous checkpoint is then left as it was)."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(d, exc) from None
    buf = io.BytesIO()
    np.save(buf, core.params, allow_pickle=False)
    state: dict[str, Any] = {
        "format": FORMAT,
        "job": core.settings.job,
        "config_digest": core.settings.config_digest,
        "rounds": core.settings.rounds,  # asked by the latest (re)start: what a resume continues
        **core.snapshot(ledger=False),
        "journal_seq": journal_seq,
        "last_record": last_record,
    }
    key = os.path.abspath(d)
    writers = _WRITERS.setdefault(core, {})
    # the round's ledger lines first (fsynced), then the parameters to a content-addressed file,
    # then the state that covers and names both is renamed into place: a crash before the rename
    # leaves the previous checkpoint, which covers none of the new lines. The writer is kept only
    # once the commit is complete: after a failure, what it appended may be uncovered, and the
    # next commit starts a new ledger file
    writer = _append_ledger(core, d, writers.pop(key, None))
    state["ledger"] = writer.coverage()
    params_bytes = buf.getvalue()
    digest = _sha256(params_bytes)
    params_name = f"checkpoint-{digest[:16]}.npy"
    state["params_file"] = params_name
    state["params_sha256"] = digest
    atomic_write(d / params_name, params_bytes)
    atomic_write(d / STATE, dumps_record(state).encode())
    writers[key] = writer
    # earlier parameters and ledger files, now that the state naming these is in place
    keep = {params_name, writer.name}
    with contextlib.suppress(OSError):  # a stale file costs space, not correctness
        for old in d.iterdir():
            name = old.name
            params = name.startswith("checkpoint") and name.endswith(".npy")
            if (params or is_ledger_file(name)) and name not in keep:
                with contextlib.suppress(OSError):
                    old.unlink()


def _append_ledger(core: AggregatorCore, d: Path, writer: LedgerWriter | None) -> LedgerWriter:
    """Append the core's new ledger entries (to a new file with all of them when ``writer`` is
    None or cannot continue its file)."""
    lists = (core.releases, core.noised_rounds, core.history)
    if writer is not None:
        try:
            writer.append(*lists)
            return writer
        except StaleLedger:
            pass
    writer = LedgerWriter.start(d, core.settings.job, core.run_id.hex())
    writer.append(*lists)
    return writer


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def has_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / STATE).exists()


def load_checkpoint(core: AggregatorCore, directory: str | Path) -> dict[str, Any]:
    """Restore ``core`` (freshly built from the same config) from ``directory``; returns the
    checkpoint's state (``journal_seq``, ``last_record``, ...)."""
    d = Path(directory)
    try:
        state = json.loads((d / STATE).read_text())
        raw = (d / state.get("params_file", PARAMS)).read_bytes()
        params = np.load(io.BytesIO(raw), allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the checkpoint in {d}: {exc}") from None
    if state.get("config_digest") != core.settings.config_digest:
        raise ValueError(
            f"checkpoint in {d} was written with config digest {state.get('config_digest')}, "
            f"this job's is {core.settings.config_digest}: resume with the same configuration"
        )
    want = state.get("params_sha256")
    if want is not None and want != _sha256(raw):
        raise ValueError(f"checkpoint in {d}: the parameters file does not match {STATE}")
    if params.shape != core.params.shape:
        raise ValueError(f"checkpoint parameters {params.shape} != model {core.params.shape}")
    reader = LedgerReader()
    try:
        state = with_ledger(d, state, reader)
    except ValueError as exc:
        raise ValueError(f"cannot read the checkpoint in {d}: {exc}") from None
    core.restore(state, params)
    if reader.name is not None:  # the next commit appends to the file it covers
        writer = LedgerWriter.resume(d, reader, core.releases, core.noised_rounds, core.history)
        if writer is not None:
            _WRITERS.setdefault(core, {})[os.path.abspath(d)] = writer
    state.setdefault("devices", {})
    state.setdefault("journal_seq", 0)
    state.setdefault("last_record", None)
    return state


def read_checkpoint(directory: str | Path) -> dict[str, Any]:
    """The checkpoint's state in ``directory`` as plain data, with ``releases``, ``noised_rounds``
    and ``history`` inline whichever format wrote it (what tools and reports read). Read only:
    safe on a running job's directory. ValueError in one line when it cannot be read."""
    d = Path(directory)
    try:
        state = json.loads((d / STATE).read_text())
        if not isinstance(state, dict):
            raise ValueError(f"{STATE} holds no object")
        return with_ledger(d, state)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the checkpoint in {d}: {exc}") from None
