"""Aggregator checkpoints: the state needed to resume a job after a restart.

Written atomically after every round (temp file, fsync, rename), so a crash leaves the previous
complete checkpoint. The checkpoint is the commit point of a round: it carries the round's record
(``last_record``, so a metrics line lost to a crash or a full disk is restored on resume) and the
sequence number of the last journal record it covers (``journal_seq``; records up to it are never
applied again, see :mod:`edge_fl.server.journal`).

The privacy ledger is not pickled: the releases (device, round, sample count) are stored and
replayed through the same mechanism definitions, so a resumed ledger is exactly the one that was
running. The config digest guards against resuming with different settings.

Generator states are saved only for seeded (``reproducible``) generators, so a resumed reproducible
run selects and draws exactly like an uninterrupted one. The state of the production CSPRNG is never
written to disk: whoever read it could predict every later selection and noise draw. A resumed
production run re-keys it from ``os.urandom``.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from edge_fl.storage import OutputError, atomic_write, dumps_record

from .aggregator import AggregatorCore, fleet_view
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
    "restore_generator",
    "round_fields",
    "save_checkpoint",
]

STATE = "checkpoint.json"
PARAMS = "checkpoint.npy"  # format 1; format 2 names a content-addressed checkpoint-<sha>.npy
FORMAT = 2


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
        **core.snapshot(),
        "journal_seq": journal_seq,
        "last_record": last_record,
    }
    # the parameters go to a content-addressed file first, then the state that names them is
    # renamed into place: a crash between the two leaves the previous pair intact
    params_bytes = buf.getvalue()
    digest = _sha256(params_bytes)
    params_name = f"checkpoint-{digest[:16]}.npy"
    state["params_file"] = params_name
    state["params_sha256"] = digest
    atomic_write(d / params_name, params_bytes)
    atomic_write(d / STATE, dumps_record(state).encode())
    for old in d.glob("checkpoint*.npy"):
        if old.name != params_name:
            with contextlib.suppress(OSError):  # a stale file costs space, not correctness
                old.unlink()


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
    core.restore(state, params)
    state.setdefault("devices", {})
    state.setdefault("journal_seq", 0)
    state.setdefault("last_record", None)
    return state
