"""No privacy: plain local SGD on the device, sample-weighted FedAvg on the server."""

from __future__ import annotations

from edge_fl.mechanisms.base import Mechanism


class NoPrivacy(Mechanism):
    name = "none"
