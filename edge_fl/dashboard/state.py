"""What the dashboard page shows, as plain data, fed by a source (the broker or a run directory).

No I/O here: :class:`DashboardState` folds the job's messages (metrics records, retained
statuses, global messages, acks, ingest workers' liveness) into counters, and :meth:`view` renders
the JSON the page draws. ``view(operator=False)`` is what someone without operator rights may
see: only what the ``metrics`` topic already tells every device (the aggregator's public record,
which with Poisson selection omits whatever counts who took part), no device table, no
rejections.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from edge_fl.server.aggregator import public_fields

__all__ = ["ROUND_FIELDS", "DashboardState", "DeviceView", "public_fields"]

#: per-round fields the page draws (everything else of a record stays on disk)
ROUND_FIELDS = (
    "round",
    "version",
    "status",
    "accuracy",
    "loss",
    "epsilon",
    "delta",
    "accountant",
    "selected",
    "received",
    "late",
    "rejected",
    "online",
    "stopped_devices",
    "bytes_up",
    "bytes_down",
    "wire_up",
    "wire_down",
    "wire_up_p50",
    "wire_up_p95",
    "wire_up_max",
    "wire_down_p50",
    "wire_down_p95",
    "wire_down_max",
    "epsilon_device_p50",
    "epsilon_device_p95",
    "epsilon_device_max",
    "workers",
    "workers_missing",
    "device_updates",
    "wall_time_s",
)

#: rejection details kept per reason (the newest)
SAMPLES_PER_REASON = 5


@dataclass
class DeviceView:
    """One device as its retained status says (``None`` fields: never seen)."""

    online: bool = False
    stopped: str | None = None
    n_samples: int = 0


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity (a record read back with Python's json may hold them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclass
class DashboardState:
    """The job as the dashboard knows it. ``seq`` grows with every change (the relay's cue)."""

    job: str = ""
    source: str = "live"  # "live" (a broker) or "run" (a run directory)
    config: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    devices: dict[str, DeviceView] = field(default_factory=dict)
    workers: dict[str, str] = field(default_factory=dict)  # worker -> online | offline
    selected: set[str] = field(default_factory=set)  # the open round's (or version's) selection
    current: dict[str, Any] = field(default_factory=dict)  # the newest global message's facts
    rejections: Counter[str] = field(default_factory=Counter)
    samples: dict[str, deque[str]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    devices_as_of: str = "retained statuses"
    notes: dict[str, str] = field(default_factory=dict)  # what the page cannot show, and why
    connected: bool | None = None  # live: whether the relay holds a broker session
    rows_epoch: int = 0  # grows when rows a page already holds change: it must take them all again
    seq: int = 0
    messages: int = 0  # every message folded in (statuses included): the relay's load

    # ------------------------------------------------------------------ folding in

    def touch(self) -> None:
        self.seq += 1
        self.messages += 1

    def set_config(self, config: dict[str, Any]) -> None:
        """The job's validated config (the job document's, or run.json's)."""
        self.config = dict(config)
        self.job = str(config.get("job") or self.job)
        self.touch()

    def add_record(self, record: dict[str, Any]) -> None:
        """One round's record (metrics topic or metrics.jsonl); a repeated round replaces."""
        row = {k: _finite(record[k]) for k in ROUND_FIELDS if k in record}
        key = (row.get("round"), row.get("version"))
        if self.records and (self.records[-1].get("round"), self.records[-1].get("version")) == key:
            self.records[-1] = row
        else:
            self.records.append(row)
        for reason, count in (record.get("rejected_by_reason") or {}).items():
            if isinstance(count, int):
                self.rejections[str(reason)] += count
        for reason, detail in (record.get("rejection_samples") or {}).items():
            self._sample(str(reason), f"round {record.get('round')}: {detail}")
        self.touch()

    def set_device_epsilon(self, by_round: dict[int, dict[str, float]]) -> None:
        """Per-device epsilon quantiles of each round replayed from a run directory's checkpoint,
        for the records that do not carry the aggregator's own (runs before it wrote them)."""
        for row in self.records:
            extra = by_round.get(row.get("round"))  # type: ignore[arg-type]
            if extra and "epsilon_device_max" not in row:
                row.update(extra)
        self.rows_epoch += 1
        self.touch()

    def set_status(self, device: str, online: bool, stopped: str | None, n_samples: int) -> None:
        self.devices[device] = DeviceView(online, stopped, n_samples)
        self.touch()

    def forget_device(self, device: str) -> None:
        """An empty retained status: the broker holds nothing for it any more."""
        if self.devices.pop(device, None) is not None:
            self.touch()

    def set_global(
        self,
        *,
        round_: int,
        version: int,
        mode: str,
        deadline_s: float,
        issued_at: float,
        selected: tuple[str, ...] | None,
        sample_rate: float | None,
        done: bool,
    ) -> None:
        """A global message: progress, the round's deadline and who was asked to train."""
        fresh = (round_, version) != (self.current.get("round"), self.current.get("version"))
        if selected is None or (fresh and mode == "sync"):
            self.selected = set()
        if fresh and mode != "sync":  # async: a new version re-deals the slots
            self.selected = set()
        self.selected.update(selected or ())
        self.current = {
            "round": round_,
            "version": version,
            "mode": mode,
            "deadline_s": deadline_s,
            "issued_at": issued_at or None,
            "ends_at": (issued_at + deadline_s) if issued_at else None,
            "selection": "poisson" if sample_rate is not None else "list" if selected else "all",
            "done": done,
        }
        self.touch()

    def add_ack(self, device: str, round_: int | None, reason: str, detail: str | None) -> None:
        """A negative ack: the live source of rejection details (metrics carry only counts)."""
        where = f"round {round_}" if round_ is not None else "round ?"
        self._sample(reason, f"{where}: {device}: {detail or ''}".rstrip(": "))
        self.touch()

    def set_worker(self, worker: str, state: str | None) -> None:
        if state is None:
            self.workers.pop(worker, None)
        else:
            self.workers[worker] = state
        self.touch()

    def _sample(self, reason: str, text: str) -> None:
        self.samples.setdefault(reason, deque(maxlen=SAMPLES_PER_REASON)).append(text[:300])

    # ------------------------------------------------------------------ rendering

    @property
    def poisson(self) -> bool:
        privacy = self.config.get("privacy") or {}
        return bool(privacy.get("poisson_selection")) or self.current.get("selection") == "poisson"

    def device_counts(self) -> dict[str, Any]:
        """Counts of the device table, from the retained statuses alone (``training``: online,
        not stopped, and in the open round's selection list; None when selection is secret)."""
        online = stopped = budget = training = 0
        reasons: Counter[str] = Counter()
        for dev, view in self.devices.items():
            if view.stopped:
                stopped += 1
                reasons[view.stopped] += 1
                if view.stopped == "budget_exhausted":
                    budget += 1
            elif view.online:
                online += 1
                if dev in self.selected:
                    training += 1
        secret = self.current.get("selection") == "poisson"
        done = bool(self.current.get("done"))
        return {
            "known": len(self.devices),
            "online": online,
            "offline": len(self.devices) - online - stopped,
            "training": None if secret else 0 if done else training,
            "stopped": stopped,
            "out_of_budget": budget,
            "stopped_by_reason": dict(reasons),
            "as_of": self.devices_as_of,
        }

    def _job(self) -> dict[str, Any]:
        cfg = self.config
        privacy = cfg.get("privacy") or {}
        rounds = cfg.get("rounds") or {}
        ingest = cfg.get("ingest") or {}
        return {
            "job": self.job,
            "source": self.source,
            "mode": self.current.get("mode") or rounds.get("mode"),
            "rounds": rounds.get("rounds"),
            "mechanism": privacy.get("mechanism"),
            "target_epsilon": _num(privacy.get("epsilon")),
            "budget": _num(privacy.get("budget_epsilon")),
            "delta": _num(privacy.get("delta")),
            "poisson": self.poisson,
            "workers_configured": ingest.get("workers"),
            "devices_configured": (cfg.get("data") or {}).get("devices"),
        }

    def view(self, operator: bool) -> dict[str, Any]:
        """The page's data. Without operator rights: what every device of the job may read anyway
        (the metrics topic's record, which omits participation with Poisson selection; the
        global message's progress and deadline); no device table, no rejection details."""
        redact = not operator
        rows = (
            [public_fields(r, self.poisson) for r in self.records] if redact else list(self.records)
        )
        out: dict[str, Any] = {
            "seq": self.seq,
            "operator": operator,
            "redacted": redact,
            "connected": self.connected,
            "rows_epoch": self.rows_epoch,
            "job": self._job(),
            "current": dict(self.current),
            "records": rows,
            "summary": {k: self.summary[k] for k in ("epsilon", "accountant") if k in self.summary},
            "notes": dict(self.notes),
        }
        if redact:
            return out
        out["devices"] = self.device_counts()
        out["relay"] = {"messages": self.messages}
        out["rejections"] = {
            "by_reason": dict(self.rejections.most_common()),
            "samples": {k: list(v) for k, v in sorted(self.samples.items())},
        }
        last = self.records[-1] if self.records else {}
        out["ingest"] = {
            "workers": dict(sorted(self.workers.items())),
            "missing": last.get("workers_missing") or [],
            "missing_rounds": sum(1 for r in self.records if r.get("workers_missing")),
        }
        return out
