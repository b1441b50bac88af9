"""Run records on disk: ``metrics.jsonl`` (one object per round), ``summary.json``, ``run.json``.

JSONL is the primary record: appended and flushed per round, so a run cut short still leaves every
round it finished. CSV and plots are derived from it by ``edge-fl report``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    """JSON has no inf/nan: write them as null rather than as invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, obj: Any) -> None:
    """Standard JSON (no Infinity/NaN tokens: they become null)."""
    path.write_text(json.dumps(_clean(obj), indent=2, allow_nan=False) + "\n")


class RunRecorder:
    """Writes the records of one run into ``out_dir`` (or only keeps them in memory)."""

    def __init__(self, out_dir: str | Path | None, append: bool = False) -> None:
        """``append``: continue a resumed run's records instead of starting a new file."""
        self.out_dir = Path(out_dir) if out_dir else None
        self.records: list[dict[str, Any]] = []
        self._jsonl = None
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / "metrics.jsonl"
            if append and path.exists():
                self.records = [json.loads(x) for x in path.read_text().splitlines() if x]
            self._jsonl = path.open("a" if append else "w")

    def write_meta(self, meta: dict[str, Any]) -> None:
        if self.out_dir is not None:
            write_json(self.out_dir / "run.json", meta)

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(_clean(record)) + "\n")
            self._jsonl.flush()

    def summary(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        closed = [r for r in self.records if r.get("status") != "skipped"]
        last = self.records[-1] if self.records else {}
        return {
            "rounds": len(self.records),
            "rounds_closed": len(closed),
            "rounds_skipped": len(self.records) - len(closed),
            "final_accuracy": last.get("accuracy"),
            "final_loss": last.get("loss"),
            "total_bytes_up": sum(r.get("bytes_up", 0) for r in self.records),
            "total_bytes_down": sum(r.get("bytes_down", 0) for r in self.records),
            "total_received": sum(r.get("received", 0) for r in self.records),
            "total_late": sum(r.get("late", 0) for r in self.records),
            "total_rejected": sum(r.get("rejected", 0) for r in self.records),
            "epsilon": last.get("epsilon"),
            "accountant": last.get("accountant"),
            **(extra or {}),
        }

    def close(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        summary = self.summary(extra)
        privacy = summary.get("privacy")
        if privacy:  # the ledger's final word (it also holds releases after the last round)
            summary["epsilon"], summary["accountant"] = privacy["epsilon"], privacy["accountant"]
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.out_dir is not None:
            write_json(self.out_dir / "summary.json", summary)
        return summary
