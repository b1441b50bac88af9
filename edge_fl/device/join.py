"""Joining a job from the broker: read the aggregator's retained job document, build the device.

A device started as ``edge-fl device --broker URL --id d00007`` knows no job settings; the
aggregator publishes them (signed) on ``<prefix>/<job>/job`` and keeps them retained while the job
runs. Devices therefore always train with exactly the aggregator's settings.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiomqtt

from edge_fl.protocol import PayloadRejected
from edge_fl.protocol.jobdoc import JobDocument, decode_job_document

if TYPE_CHECKING:
    from edge_fl.config import JobConfig
    from edge_fl.protocol.signing import Verifier
    from edge_fl.transport.url import BrokerSpec

log = logging.getLogger("edge_fl.device")

#: after the first retained document arrives, how long to wait for others (other jobs)
SETTLE_S = 0.3


class NoJob(RuntimeError):
    """No job (or more than one, and none was named) is announced on the broker."""


@dataclass
class Announcements:
    """The job documents seen on ``<prefix>/+/job``; pure, so the choice is testable."""

    verifier: Verifier | None = None
    docs: dict[str, JobDocument] = field(default_factory=dict)
    refused: int = 0

    def add(self, topic: str, payload: bytes) -> None:
        job = topic.split("/")[-2] if topic.count("/") >= 2 else ""
        if not payload:  # a cleared retained message: that job ended
            self.docs.pop(job, None)
            return
        try:
            doc = decode_job_document(payload, self.verifier)
        except PayloadRejected as exc:
            self.refused += 1
            log.warning("ignoring the job document on %s (%s): %s", topic, exc.reason, exc.detail)
            return
        if doc.job != job:
            self.refused += 1
            log.warning("ignoring the job document on %s: it describes job %r", topic, doc.job)
            return
        self.docs[job] = doc

    def choose(self, job: str | None) -> JobDocument | None:
        """The document of ``job``, or the only one announced; NoJob if several and none named."""
        if job is not None:
            return self.docs.get(job)
        if len(self.docs) > 1:
            raise NoJob(
                f"several jobs are announced ({', '.join(sorted(self.docs))}): choose one with --job"
            )
        return next(iter(self.docs.values()), None)


async def fetch_job_document(
    spec: BrokerSpec,
    *,
    prefix: str = "edgefl",
    job: str | None = None,
    verifier: Verifier | None = None,
    identifier: str | None = None,
    wait_s: float | None = None,
) -> JobDocument:
    """Wait for the job document (retained, so it arrives at once if the job runs).

    ``wait_s``: give up with :class:`NoJob` after that long (None: wait until one appears)."""
    seen = Announcements(verifier)
    topic = f"{prefix}/{job or '+'}/job"
    async with aiomqtt.Client(**spec.aiomqtt_kwargs(), identifier=identifier) as client:
        await client.subscribe(topic, qos=1)
        log.info("waiting for a job document on %s at %s", topic, spec.redacted())
        loop = asyncio.get_running_loop()
        give_up = None if wait_s is None else loop.time() + wait_s
        settle_until = None
        messages = client.messages
        while True:
            now = loop.time()
            ends = [t for t in (give_up, settle_until) if t is not None]
            timeout = max(0.0, min(ends) - now) if ends else None
            try:
                message = await asyncio.wait_for(anext(messages), timeout)
            except TimeoutError:
                found = seen.choose(job)
                if found is not None:
                    return found
                if give_up is not None and loop.time() >= give_up:
                    why = "is the aggregator running, with the same topic prefix?"
                    if seen.refused:
                        why = (
                            f"{seen.refused} job document(s) refused: is --public-key the "
                            "aggregator's?"
                        )
                    raise NoJob(
                        f"no job is announced on {topic} at {spec.redacted()} ({why})"
                    ) from None
                settle_until = None
                continue
            payload = message.payload
            seen.add(
                str(message.topic),
                bytes(payload) if isinstance(payload, bytes | bytearray) else b"",
            )
            if seen.choose(job) is not None and settle_until is None:
                settle_until = loop.time() + (0.0 if job else SETTLE_S)


def device_config(doc: JobDocument, local: dict[str, Any]) -> JobConfig:
    """The device's config: the job document's settings plus this process's own sections
    (``broker``, ``security``, ``device``, ``data.data_dir``). ConfigError names a bad value."""
    from edge_fl import __version__
    from edge_fl.config import ConfigError, JobConfig, validate_config
    from edge_fl.privacy import calibration

    known = set(JobConfig.model_fields)
    # a section this version does not know (a newer aggregator's feature, e.g. a population
    # model) is left out with a warning; an unknown key inside a known section is an error below
    unknown = sorted(set(doc.config) - known)
    if unknown:
        log.warning(
            "the job document has sections edge-fl %s does not know (%s): ignored; upgrade "
            "edge-fl on this device if the job needs them",
            __version__,
            ", ".join(unknown),
        )
    shared = {k: v for k, v in doc.config.items() if k in known}
    merged = {**shared, **{k: v for k, v in local.items() if k != "data_dir"}}
    merged["data"] = {**doc.config.get("data", {}), "data_dir": local.get("data_dir")}
    try:
        cfg = validate_config(merged, f"job document of {doc.job!r}")
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}\n  (this device runs edge-fl {__version__}: if the aggregator runs a newer "
            "version, upgrade edge-fl here)"
        ) from None
    try:
        calibration.load(doc.calibration)
    except ValueError as exc:
        raise ConfigError(f"job document of {doc.job!r}: {exc}") from None
    return cfg
