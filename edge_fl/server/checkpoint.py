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

import base64
import contextlib
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from edge_fl.metrics import OutputError, atomic_write, dumps_record

from .aggregator import AggregatorCore, DeviceRecord
from .rounds import SyncRound

STATE = "checkpoint.json"
PARAMS = "checkpoint.npy"  # format 1; format 2 names a content-addressed checkpoint-<sha>.npy
FORMAT = 2


def generator_state(rng: np.random.Generator) -> str | None:
    """A seeded PCG64's state as JSON text (its integers exceed 64 bits); None for a CSPRNG."""
    if isinstance(rng.bit_generator, np.random.PCG64):
        return json.dumps(rng.bit_generator.state)
    return None


def restore_generator(rng: np.random.Generator, state: str | None) -> None:
    if state is not None and isinstance(rng.bit_generator, np.random.PCG64):
        rng.bit_generator.state = json.loads(state)


#: round fields rebuilt rather than stored: the clock (a resumed round gets a fresh deadline),
#: what replayed updates re-create, and the staleness function (from the settings)
_REBUILT = frozenset(
    {"opened_at", "extended", "accepted", "earlier", "staleness_seen", "staleness"}
)


def round_fields(rnd: Any) -> dict[str, Any]:
    """A round (``SyncRound`` / ``AsyncWindow``) as plain data: every init field (number,
    selection, target, base version, any nonce, ...) but those rebuilt on restore."""
    out: dict[str, Any] = {"type": "sync" if isinstance(rnd, SyncRound) else "async"}
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(rnd):
        if f.name in _REBUILT or not f.init:
            continue
        value = getattr(rnd, f.name)
        if isinstance(value, set | frozenset):
            value = {"frozenset": sorted(value)}
        elif isinstance(value, bytes):
            value = {"bytes": base64.b64encode(value).decode()}
        fields[f.name] = value
    out["fields"] = fields
    return out


def build_round(core: AggregatorCore, data: dict[str, Any], now: float = 0.0) -> Any:
    """The round ``round_fields`` described, opened at ``now`` and with nothing accepted yet."""

    def value(v: Any) -> Any:
        if isinstance(v, dict) and "frozenset" in v:
            return frozenset(v["frozenset"])
        if isinstance(v, dict) and "bytes" in v:
            return base64.b64decode(v["bytes"])
        return v

    fields = {k: value(v) for k, v in data["fields"].items()}
    if data["type"] == "sync":
        return SyncRound(**fields, opened_at=now)
    from .asynchronous import AsyncWindow
    from .staleness import Staleness

    return AsyncWindow(**fields, opened_at=now, staleness=core.settings.staleness or Staleness())


def encode_nonces(nonces: dict[int, bytes]) -> dict[str, str]:
    return {str(v): base64.b64encode(n).decode() for v, n in sorted(nonces.items())}


def decode_nonces(data: dict[str, str]) -> dict[int, bytes]:
    return {int(v): base64.b64decode(n) for v, n in data.items()}


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
        "version": core.version,
        "round_number": core.round_number,
        "mechanism_state": core.mechanism.encode_state(core.mechanism_state),
        "releases": core.releases,
        "noised_rounds": core.noised_rounds,
        "journal_seq": journal_seq,
        "last_record": last_record,
        "rng": generator_state(core.rng),
        "noise_rng": generator_state(core.noise_rng),
    }
    # every closed round's nonce and selection: a straggler's late answer is still charged
    state["history"] = {
        str(r): [None if n is None else base64.b64encode(n).decode(), sorted(sel)]
        for r, (n, sel) in sorted(getattr(core, "history", {}).items())
    }
    # the round that closed last: a late update for it is still charged (core.previous)
    previous = getattr(core, "previous", None)
    if previous is not None:
        state["previous"] = round_fields(previous)
    # the fleet view when the round closed, for replaying the journal's admissions (declared
    # sample counts, known devices); live retained statuses replace it after a resume
    state["devices"] = {
        dev: [rec.online, rec.n_samples, rec.stopped] for dev, rec in sorted(core.devices.items())
    }
    # asynchronous modes: updates held for the next window, and what was applied (duplicates)
    held = getattr(core, "_held", None)
    if held is not None:
        state["held"] = [[dev, base64.b64encode(p).decode()] for dev, p in held]
    applied = getattr(core, "_applied", None)
    if applied is not None:
        state["applied"] = sorted([dev, int(v)] for dev, v in applied)
    nonces = getattr(core, "nonces", None)  # async: the nonce of every admissible version
    if nonces is not None:
        state["nonces"] = encode_nonces(nonces)
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


def fleet_view(state: dict[str, Any]) -> dict[str, DeviceRecord]:
    """The checkpoint's fleet view as the core's ``devices``."""
    return {
        dev: DeviceRecord(online=bool(o), n_samples=int(n), stopped=st)
        for dev, (o, n, st) in state.get("devices", {}).items()
    }


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
    if state.get("previous") is not None and hasattr(core, "previous"):
        core.previous = build_round(core, state["previous"])
    for r, (nonce, selected) in state.get("history", {}).items():
        core.history[int(r)] = (
            None if nonce is None else base64.b64decode(nonce),
            frozenset(selected),
        )
        core.ever_selected.update(selected)
    restore_generator(core.rng, state.get("rng"))
    restore_generator(core.noise_rng, state.get("noise_rng"))
    if "held" in state and hasattr(core, "_held"):
        core._held = [(dev, base64.b64decode(p)) for dev, p in state["held"]]
    if "applied" in state and hasattr(core, "_applied"):
        core._applied = {(dev, int(v)) for dev, v in state["applied"]}
    if "nonces" in state and hasattr(core, "nonces"):
        core.nonces = decode_nonces(state["nonces"])
    state.setdefault("devices", {})
    state.setdefault("journal_seq", 0)
    state.setdefault("last_record", None)
    return state
