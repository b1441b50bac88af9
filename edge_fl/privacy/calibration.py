"""Noise multipliers calibrated once, by whoever has dp-accounting, and shipped to devices.

Calibrating a noise multiplier to a target epsilon is a deterministic function of public
parameters (target, delta, sampling rate, steps, accountant) that needs dp-accounting (and scipy).
The aggregator computes every value its job needs and publishes the table in the signed job
document (``edge_fl.protocol.jobdoc``); a device with the base install takes its value from there,
trusting it exactly as much as every other parameter of that signed document. A process that has
dp-accounting computes what is missing itself.

The table is the process's (a value calibrated once is reused by every job that needs it), but a
job publishes only its own rows: whoever asks for a value inside :func:`scope` has its key
recorded there, so a job document never carries another job's calibrations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from edge_fl.privacy._dp import HINT, AccountingUnavailable

Key = tuple[str | float | int, ...]
_TABLE: dict[Key, float] = {}
_SCOPES: ContextVar[tuple[set[Key], ...]] = ContextVar("calibration_scopes", default=())


@contextmanager
def scope(used: set[Key]) -> Iterator[set[Key]]:
    """Record into ``used`` the key of every value asked for inside the block (found or
    computed): the rows one job needs, out of the process's table."""
    token = _SCOPES.set((*_SCOPES.get(), used))
    try:
        yield used
    finally:
        _SCOPES.reset(token)


def calibrated(
    kind: str, args: tuple[str | float | int, ...], compute: Callable[[], float]
) -> float:
    """The noise multiplier for ``(kind, *args)``: from the table, or computed and remembered."""
    key: Key = (kind, *args)
    for used in _SCOPES.get():
        used.add(key)
    if key in _TABLE:
        return _TABLE[key]
    try:
        value = float(compute())
    except ImportError:  # dp-accounting (or scipy under it) is not installed
        raise AccountingUnavailable(
            f"the {kind} noise multiplier for {args} is not in the job document and calibrating "
            f"it needs dp-accounting: {HINT}"
        ) from None
    _TABLE[key] = value
    return value


def table(keys: Iterable[Key] | None = None) -> list[list[str | float | int]]:
    """The values of ``keys`` (default: every value in this process), as ``[kind, *args,
    value]`` rows; a key never calibrated is left out."""
    wanted = set(_TABLE) if keys is None else {tuple(k) for k in keys} & set(_TABLE)
    return [[*key, _TABLE[key]] for key in sorted(wanted, key=repr)]


def load(rows: object) -> int:
    """Take the rows of a (verified) job document; returns how many. ValueError on bad rows."""
    if not isinstance(rows, list):
        raise ValueError("calibration table must be a list of rows")
    loaded = 0
    for row in rows:
        if not (isinstance(row, list) and len(row) >= 2 and isinstance(row[0], str)):
            raise ValueError(f"calibration row {row!r}: expected [kind, *args, value]")
        *key, value = row
        if not all(isinstance(a, str | int | float) and not isinstance(a, bool) for a in key):
            raise ValueError(f"calibration row {row!r}: arguments must be numbers or strings")
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"calibration row {row!r}: value must be a finite number > 0")
        _TABLE[tuple(key)] = float(value)
        loaded += 1
    return loaded
