"""SecAgg+ (Bell et al., CCS 2020, on Bonawitz et al., CCS 2017), pure and sans I/O.

Devices mask their integer vectors in Z_2^b with pairwise masks (X25519 agreements with their
neighbours in a random k-regular graph) and a self mask, and share their mask key and seed t-of-k
with their neighbours (Shamir, sealed with ChaCha20-Poly1305 through the aggregator); the
aggregator learns only the sum, even when devices vanish at any phase. Imports nothing of
edge_fl but the wire layer. Specification: docs/specs/secagg.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge_fl.secagg.aggregator import AggregatorSession
    from edge_fl.secagg.calibration import (
        Calibration,
        CalibrationError,
        calibrate,
        check,
        roster_graph,
    )
    from edge_fl.secagg.device import DeviceSession
    from edge_fl.secagg.session import (
        Aborted,
        Deliver,
        Failed,
        Finished,
        Outcome,
        Rejected,
        RoundParams,
        Send,
        Summed,
        params_from_wire,
    )

__all__ = [
    "Aborted",
    "AggregatorSession",
    "Calibration",
    "CalibrationError",
    "Deliver",
    "DeviceSession",
    "Failed",
    "Finished",
    "Outcome",
    "Rejected",
    "RoundParams",
    "Send",
    "Summed",
    "calibrate",
    "check",
    "params_from_wire",
    "roster_graph",
]

#: each public name's module, imported on first use: the package imports none of them itself, so
#: that a pure submodule (calibration, session) costs no cryptography to a job without SecAgg+
_HOMES = {
    "AggregatorSession": "edge_fl.secagg.aggregator",
    "Calibration": "edge_fl.secagg.calibration",
    "CalibrationError": "edge_fl.secagg.calibration",
    "calibrate": "edge_fl.secagg.calibration",
    "check": "edge_fl.secagg.calibration",
    "roster_graph": "edge_fl.secagg.calibration",
    "DeviceSession": "edge_fl.secagg.device",
    "Aborted": "edge_fl.secagg.session",
    "Deliver": "edge_fl.secagg.session",
    "Failed": "edge_fl.secagg.session",
    "Finished": "edge_fl.secagg.session",
    "Outcome": "edge_fl.secagg.session",
    "Rejected": "edge_fl.secagg.session",
    "RoundParams": "edge_fl.secagg.session",
    "Send": "edge_fl.secagg.session",
    "Summed": "edge_fl.secagg.session",
    "params_from_wire": "edge_fl.secagg.session",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
