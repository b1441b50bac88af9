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
    """Whether ``device`` is one of a job's ``devices`` devices: its id ends in an index in
    [0, devices). A device of another job (``d00011`` where ``data.devices`` is 6), or an id
    outside the scheme, is not: an aggregator never selects it."""
    index = device_index(device)
    return index is not None and index < devices
