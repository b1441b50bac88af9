"""What a simulated fleet counts, in parts that add up across processes.

A fleet split over processes (``fleet.processes``) is one fleet to its records: each process
takes its own share's counts and the aggregator's process merges them here, so a round's record
and the summary read the same whether one process ran the devices or four. Plain data and pure
functions: the parts cross a pipe between processes (pickled), nothing here does I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from edge_fl.transport.wire import percentiles


@dataclass(frozen=True)
class RoundCounts:
    """One share's counts since its previous take: every device's wire bytes that moved (MQTT
    bytes, and the link model's TCP/IP estimate summed), trainings that failed, and the
    share's dropouts so far (a running total, as the record has it)."""

    ups: tuple[int, ...] = ()
    downs: tuple[int, ...] = ()
    up_ip: int = 0
    down_ip: int = 0
    failures: int = 0
    dropouts: int = 0


def round_fields(parts: Iterable[RoundCounts]) -> dict[str, int]:
    """A round's record fields from every share's counts: ``dropouts``, ``device_failures``, the
    wire sums and IP estimates, and the per-device distribution over all shares' devices."""
    parts = list(parts)
    ups = [u for p in parts for u in p.ups]
    downs = [d for p in parts for d in p.downs]
    up_dist, down_dist = percentiles(ups), percentiles(downs)
    return {
        "dropouts": sum(p.dropouts for p in parts),
        "device_failures": sum(p.failures for p in parts),
        "wire_up": sum(ups),
        "wire_down": sum(downs),
        "wire_up_ip": sum(p.up_ip for p in parts),
        "wire_down_ip": sum(p.down_ip for p in parts),
        "wire_devices": len(ups),
        **{f"wire_up_{k}": v for k, v in up_dist.items()},
        **{f"wire_down_{k}": v for k, v in down_dist.items()},
    }


@dataclass(frozen=True)
class FleetTotals:
    """One share's run totals, for the summary: updates published and publishes that failed,
    devices that stopped on their own account (a spent budget; not a failed training), failed
    trainings in all and per error, and the shared downlink session's MQTT bytes."""

    published: int = 0
    publish_failures: int = 0
    stopped_devices: int = 0
    device_failures: int = 0
    failure_errors: dict[str, int] = field(default_factory=dict)
    downlink_up: int = 0
    downlink_down: int = 0


def merge_totals(parts: Iterable[FleetTotals]) -> FleetTotals:
    """Every share's totals added up (the shared downlink: one session per process)."""
    parts = list(parts)
    errors: dict[str, int] = {}
    for p in parts:
        for what, n in p.failure_errors.items():
            errors[what] = errors.get(what, 0) + n
    return FleetTotals(
        published=sum(p.published for p in parts),
        publish_failures=sum(p.publish_failures for p in parts),
        stopped_devices=sum(p.stopped_devices for p in parts),
        device_failures=sum(p.device_failures for p in parts),
        failure_errors=errors,
        downlink_up=sum(p.downlink_up for p in parts),
        downlink_down=sum(p.downlink_down for p in parts),
    )
