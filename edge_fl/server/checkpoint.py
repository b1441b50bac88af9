"""Aggregator checkpoints: the state needed to resume a job after a restart.

Written atomically after every round (temp file + rename), so a crash leaves the previous complete
checkpoint. The privacy ledger is not pickled: the releases (device, round, sample count) are
stored and replayed through the same mechanism definitions, so a resumed ledger is exactly the one
that was running. The config digest guards against resuming with different settings.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from .aggregator import AggregatorCore

STATE = "checkpoint.json"
PARAMS = "checkpoint.npy"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(core: AggregatorCore, directory: str | Path) -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.save(buf, core.params, allow_pickle=False)
    _atomic_write(d / PARAMS, buf.getvalue())
    state: dict[str, Any] = {
        "job": core.settings.job,
        "config_digest": core.settings.config_digest,
        "version": core.version,
        "round_number": core.round_number,
        "mechanism_state": core.mechanism.encode_state(core.mechanism_state),
        "releases": core.releases,
        "noised_rounds": core.noised_rounds,
    }
    _atomic_write(d / STATE, json.dumps(state).encode())


def load_checkpoint(core: AggregatorCore, directory: str | Path) -> None:
    """Restore ``core`` (freshly built from the same config) from ``directory``."""
    d = Path(directory)
    try:
        state = json.loads((d / STATE).read_text())
        params = np.load(d / PARAMS, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the checkpoint in {d}: {exc}") from None
    if state.get("config_digest") != core.settings.config_digest:
        raise ValueError(
            f"checkpoint in {d} was written with config digest {state.get('config_digest')}, "
            f"this job's is {core.settings.config_digest}: resume with the same configuration"
        )
    if params.shape != core.params.shape:
        raise ValueError(f"checkpoint parameters {params.shape} != model {core.params.shape}")
    core.params = params.astype(np.float32)
    core.version = int(state["version"])
    core.round_number = int(state["round_number"])
    carried = state.get("mechanism_state")
    core.mechanism_state = (
        core.mechanism.decode_state(carried) if carried is not None else core.mechanism_state
    )
    for device, rnd, n in state["releases"]:
        core.record_release(device, int(rnd), int(n))
    for rnd in state["noised_rounds"]:
        core.record_noised_round(int(rnd))
