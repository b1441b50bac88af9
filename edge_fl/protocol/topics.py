"""MQTT topic names. One place, so ACLs, the aggregator and devices cannot disagree.

Normative table (QoS, retain, who publishes, who may read): docs/protocol.md, section "Topics".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SEGMENT = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_segment(kind: str, value: str) -> str:
    """Job and device ids become topic levels: forbid wildcards, separators and empties."""
    if not isinstance(value, str) or not _SEGMENT.fullmatch(value):
        raise ValueError(
            f"{kind} {value!r} is not a valid topic segment: use 1-64 characters from "
            "A-Z a-z 0-9 _ . -"
        )
    return value


@dataclass(frozen=True)
class Topics:
    job: str
    prefix: str = "edgefl"

    def __post_init__(self) -> None:
        check_segment("job id", self.job)
        for part in self.prefix.split("/"):
            check_segment("topic prefix level", part)

    @property
    def base(self) -> str:
        return f"{self.prefix}/{self.job}"

    @property
    def global_model(self) -> str:
        return f"{self.base}/global"

    @property
    def dispatch(self) -> str:
        """Retained: who trains on the current model version, without the model (async modes
        with a concurrency limit; ``edge_fl.protocol.dispatch``)."""
        return f"{self.base}/dispatch"

    @property
    def job_document(self) -> str:
        """Retained: the job's device-side settings (``edge_fl.protocol.jobdoc``)."""
        return f"{self.base}/job"

    @property
    def metrics(self) -> str:
        return f"{self.base}/metrics"

    def update(self, device: str) -> str:
        return f"{self.base}/up/{device}"

    def status(self, device: str) -> str:
        return f"{self.base}/status/{device}"

    def ack(self, device: str) -> str:
        """The aggregator's optional per-update answers to ``device`` (only it may read them)."""
        return f"{self.base}/ack/{device}"

    def inbox(self, device: str) -> str:
        """The aggregator's SecAgg+ messages to ``device`` (only it may read them)."""
        return f"{self.base}/inbox/{device}"

    @property
    def all_updates(self) -> str:
        return f"{self.base}/up/+"

    @property
    def all_status(self) -> str:
        return f"{self.base}/status/+"

    @property
    def ingest_control(self) -> str:
        """Coordinator -> ingest workers: open / freeze / commit a round (edge_fl.server.sharding)."""
        return f"{self.base}/ingest/ctl"

    def ingest(self, kind: str, worker: str) -> str:
        """Worker -> coordinator: ``progress``, ``partial``; ``worker`` is its retained liveness."""
        return f"{self.base}/ingest/{kind}/{worker}"

    def all_ingest(self, kind: str) -> str:
        return f"{self.base}/ingest/{kind}/+"

    def shared_updates(self, group: str) -> str:
        """The update stream dealt among a group of ingest workers (MQTT 5 shared subscription)."""
        check_segment("shared subscription group", group)
        return f"$share/{group}/{self.base}/up/+"

    def device_of(self, topic: str, kind: str) -> str | None:
        """The device id of an ``up``/``status``/``ack`` topic of this job, or None if not one."""
        head = f"{self.base}/{kind}/"
        if not topic.startswith(head):
            return None
        device = topic[len(head) :]
        return device if _SEGMENT.fullmatch(device) else None
