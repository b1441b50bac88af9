"""Noise multipliers calibrated once, by whoever has dp-accounting, and shipped to devices.

Calibrating a noise multiplier to a target epsilon is a deterministic function of public
parameters (target, delta, sampling rate, steps, accountant) that needs dp-accounting (and scipy).
The aggregator computes every value its job needs and publishes the table in the signed job
document (``edge_fl.protocol.jobdoc``); a device with the base install takes its value from there,
trusting it exactly as much as every other parameter of that signed document. A process that has
dp-accounting computes what is missing itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from edge_fl.privacy._dp import HINT, AccountingUnavailable

Key = tuple[str | float | int, ...]
_TABLE: dict[Key, float] = {}


def calibrated(
    kind: str, args: tuple[str | float | int, ...], compute: Callable[[], float]
) -> float:
    """The noise multiplier for ``(kind, *args)``: from the table, or computed and remembered."""
    key: Key = (kind, *args)
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


def table() -> list[list[str | float | int]]:
    """Every value calibrated in this process, as ``[kind, *args, value]`` rows."""
    return [[*key, value] for key, value in sorted(_TABLE.items(), key=repr)]


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
