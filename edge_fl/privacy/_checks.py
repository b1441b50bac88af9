"""Parameter validation shared by the mechanisms: messages name the parameter, value and domain."""

from __future__ import annotations

import math
import numbers


def real(name: str, value: object, domain: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {domain}, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be {domain}, got {value!r}")
    return v


def positive(name: str, value: object) -> float:
    v = real(name, value, "a finite number > 0")
    if v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def non_negative(name: str, value: object) -> float:
    v = real(name, value, "a finite number >= 0")
    if v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def probability(name: str, value: object, *, allow_zero: bool = False) -> float:
    domain = "a probability in [0, 1]" if allow_zero else "a probability in (0, 1]"
    v = real(name, value, domain)
    if v > 1 or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be {domain}, got {value!r}")
    return v


def delta(name: str, value: object) -> float:
    v = real(name, value, "in [0, 1)")
    if not 0 <= v < 1:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return v


def open_delta(name: str, value: object) -> float:
    v = real(name, value, "in (0, 1)")
    if not 0 < v < 1:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return v


def integer(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
