"""Epsilon per device, round by round, from a run directory's checkpoint.

The metrics records carry the job's epsilon: the worst device's. The checkpoint lists every
release the aggregator charged, ``(device, round, n)`` in charging order, and each record says how
many had been charged when it closed (``device_updates``). A device's epsilon depends only on its
``n``, how many releases it made and the job-level events (central noise) so far, so each distinct
``(n, releases, noised rounds)`` is composed once, by the same ledger and the same tightest-bound
rule as the aggregator's (:class:`edge_fl.privacy.ledger.PrivacyLedger.best`): the maximum over
devices is the record's ``epsilon``, which the tests check.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

__all__ = ["DeviceEpsilon", "nearest_rank"]


def nearest_rank(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of sorted ``values`` (a value some device has)."""
    return values[max(0, math.ceil(q * len(values)) - 1)]


class DeviceEpsilon:
    """Per-round p50/p95/max of the devices' epsilon for one run's config."""

    def __init__(self, config: dict[str, Any]) -> None:
        from edge_fl.config import validate_config
        from edge_fl.job import build_job

        cfg = validate_config(config, "run.json")
        self.mechanism = build_job(cfg).mechanism
        self.delta = float(cfg.privacy.delta)
        self._cache: dict[tuple[int, int, int], float] = {}

    @property
    def accounts(self) -> bool:
        return bool(self.mechanism.accounts)

    def epsilon(self, n: int, releases: int, noised: int) -> float:
        """One device's epsilon after ``releases`` uploads of ``n`` examples and ``noised``
        rounds of job-level (central) noise."""
        key = (n, releases, noised)
        if key not in self._cache:
            from edge_fl.privacy.ledger import PrivacyLedger

            ledger = PrivacyLedger()
            for i in range(releases):
                for event in self.mechanism.release_events(n, i):
                    ledger.add(event, device="d", round=i)
            for r in range(noised):
                for event in self.mechanism.round_events():
                    ledger.add(event, device=None, round=r)
            if not ledger.entries:
                self._cache[key] = 0.0
            else:
                self._cache[key] = float(ledger.best(self.delta, "d")[0].epsilon)
        return self._cache[key]

    def per_round(
        self, records: list[dict[str, Any]], checkpoint: dict[str, Any]
    ) -> dict[int, dict[str, float]]:
        """round -> ``epsilon_device_p50/_p95/_max`` over every device the run knows, for each
        record the checkpoint covers."""
        releases = checkpoint.get("releases") or []
        noised_rounds = sorted(int(r) for r in checkpoint.get("noised_rounds") or [])
        devices = set(checkpoint.get("devices") or {}) | {str(d) for d, _, _ in releases}
        if not devices:
            return {}
        through = int(checkpoint.get("round_number") or 0)
        counts: Counter[str] = Counter()
        sizes: dict[str, int] = {}
        taken = 0
        out: dict[int, dict[str, float]] = {}
        for record in records:
            rnd = record.get("round")
            if not isinstance(rnd, int) or rnd > through:
                continue
            upto = record.get("device_updates")
            if not isinstance(upto, int):  # an older record: the releases of rounds <= rnd
                upto = taken + sum(1 for _, r, _ in releases[taken:] if int(r) <= rnd)
            for device, _, n in releases[taken:upto]:
                counts[str(device)] += 1
                sizes[str(device)] = int(n)
            taken = max(taken, upto)
            noised = sum(1 for r in noised_rounds if r <= rnd)
            values = sorted(
                self.epsilon(sizes.get(d, 0), counts.get(d, 0), noised) for d in devices
            )
            out[rnd] = {
                "epsilon_device_p50": nearest_rank(values, 0.50),
                "epsilon_device_p95": nearest_rank(values, 0.95),
                "epsilon_device_max": values[-1],
            }
        return out
