"""Names and random streams every process of a job agrees on: device ids and generator streams.

Kept apart from :mod:`edge_fl.job` so that the fleet's population (which builds agents for a job)
and the job's assembly can both use them without importing each other.
"""

from __future__ import annotations

# generator streams, so that the aggregator and each device draw independent randomness
STREAM_INIT, STREAM_SELECT, STREAM_DEVICE, STREAM_NOISE, STREAM_PROFILE = 1, 2, 3, 4, 5


def device_id(index: int) -> str:
    """The one device-id convention: ``d`` + 5 digits of the device's index (its MQTT username,
    what ``broker/mint-credentials.sh -n`` mints)."""
    return f"d{index:05d}"


def device_index(device: str) -> int | None:
    """The index in a device id that ends in digits (``d00007`` -> 7), else None."""
    digits = len(device) - len(device.rstrip("0123456789"))
    return int(device[-digits:]) if digits else None


def in_population(device: str, devices: int) -> bool:
    """Whether the aggregator of a job with ``devices`` devices may select ``device``.

    An id of the minted scheme (``d`` + 5 or more digits) must name an index in [0, devices): a
    device minted for another job on the same broker (``d00011`` where ``data.devices`` is 6) is
    not selected. Any other id (a named device such as ``pi-kitchen``, provisioned with its own
    credentials and data) is taken: the broker's credentials and ACL decide who it is."""
    if not (device.startswith("d") and len(device) >= 6 and device[1:].isdigit()):
        return True
    return int(device[1:]) < devices
