"""SecAgg+ (Bell et al., CCS 2020, on Bonawitz et al., CCS 2017), pure and sans I/O.

Devices mask their integer vectors in Z_2^b with pairwise masks (X25519 agreements with their
neighbours in a random k-regular graph) and a self mask, and share their mask key and seed t-of-k
with their neighbours (Shamir, sealed with ChaCha20-Poly1305 through the aggregator); the
aggregator learns only the sum, even when devices vanish at any phase. Imports nothing of
edge_fl but the wire layer. Specification: docs/specs/secagg.md.
"""

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
