"""FedBuff buffers under secure aggregation: each buffer is a SecAgg+ cohort fixed at dispatch.

A device masks its input against neighbours it must know before it trains, so a secure buffer
cannot be "the first K updates to arrive": the aggregator dispatches a cohort of K' devices at
once (``K' = ceil(K / (1 - dropout))``, the secure plan's ``selected``), with the cohort's own
nonce, a cohort counter as its round number, the model version it trains on (its base version)
and the signed ``sa`` map, all in one global message (docs/protocol.md, "Secure FedBuff
cohorts"). The cohort runs the four SecAgg+ phases exactly as a sync round
(:class:`~edge_fl.server.secure.SecureRound`); its unmasked sum is applied as one buffer with the
staleness weight of (version now - base version), the same for every member, so no per-device
weight is needed and none leaks. Several cohorts run at once, each keyed by its nonce; a device is
in at most one open cohort (a device holds one SecAgg+ session).

Pure: the engine (:class:`~edge_fl.server.aggregator.AggregatorCore`) opens and closes cohorts on
the ``now`` it is given; the service publishes their messages. docs/specs/secagg.md, section 11.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edge_fl.protocol import GlobalModel, Reject, Update

from .rounds import Decision
from .secure import SecureRound

if TYPE_CHECKING:
    from .aggregator import AggregatorCore

__all__ = ["Cohort", "CohortPolicy", "cohort_size"]


def cohort_size(buffer_size: int, dropout: float) -> int:
    """K' = ceil(K / (1 - dropout)): devices dispatched so that K survive the calibrated
    dropout (floating point rounding must not add a device: K / (1 - d) is computed exactly
    enough for d with few decimals, and the ceiling is taken with a small tolerance)."""
    exact = buffer_size / (1.0 - dropout)
    nearest = round(exact)
    return nearest if abs(exact - nearest) < 1e-9 else int(exact) + 1


@dataclass
class Cohort:
    """One dispatched cohort: the round-like facts its record reads (number, selection,
    target, ...) and its SecAgg+ session (None when rebuilt after a restart: it cannot sum)."""

    number: int
    base_version: int
    selected: frozenset[str]
    nonce: bytes
    target: int  # K, the buffer size
    min_updates: int  # the plan's min_survivors
    opened_at: float
    deadline_s: float
    extended: bool = False
    session: SecureRound | None = field(default=None, repr=False)
    #: U2 once the ingest workers were told it (they may charge masked inputs from then on):
    #: what a resume charges if the cohort dies with the process
    handed_to_workers: frozenset[str] = frozenset()
    contributors: tuple[str, ...] = ()
    staleness: int | None = None  # set when the cohort closes: version then - base version

    @property
    def deadline(self) -> float:
        return self.opened_at + self.deadline_s

    @property
    def count(self) -> int:
        return len(self.contributors)

    def staleness_stats(self) -> dict[str, Any]:
        """Every member has the cohort's staleness (one buffer, one weight)."""
        s, n = self.staleness, self.count
        if s is None or n == 0:
            return {"staleness_mean": None, "staleness_max": None, "staleness_hist": {}}
        return {"staleness_mean": float(s), "staleness_max": s, "staleness_hist": {str(s): n}}


class CohortPolicy:
    """The round policy of a secure FedBuff job (``rounds.mode: fedbuff`` with secure
    aggregation): up to ``in_flight`` cohorts of ``size`` devices at once, each a
    :class:`Cohort`. The engine's ``current`` stays None: there is no window to fill; a record
    is written per cohort (applied, or skipped with its reason). Plain updates are never
    admitted (a plain update naming a cohort is still a release in the clear: charged)."""

    kind = "cohort"

    def __init__(self, engine: AggregatorCore, in_flight: int, size: int) -> None:
        if in_flight < 1 or size < 2:
            raise ValueError(f"cohorts: {in_flight} in flight of {size} devices each")
        self.engine = engine
        self.in_flight = in_flight
        self.size = size
        self.cohorts: dict[bytes, Cohort] = {}  # nonce -> open cohort
        #: devices that advertised no keys in the last cohort that selected them (online, yet
        #: silent): picked for a new cohort only when too few others are free, so one silent
        #: device does not hold every cohort it lands in to the keys phase's timeout (while a
        #: cohort is in its keys phase no other is dispatched). A hint, not a verdict: it
        #: leaves the set the next time it advertises, and a restart forgets it
        self.silent: set[str] = set()
        #: devices ever silent, or late (they advertised more than twice as late as the rest of
        #: their cohort and by more than a tenth of the phase timeout): in every later cohort,
        #: once all other members advertised, the keys phase waits for them only as long again
        #: (``SecureRound.probation``). Kept for the process: a device that alternates silent
        #: and punctual cohorts, or advertises just before the timeout, holds at most one
        #: cohort to it (a red team's two ways round a forgiving rule)
        self.probation: set[str] = set()
        self._keys_seen: set[int] = set()  # cohorts whose keys phase was noted in ``silent``
        #: cohorts that were open when the process died (checkpoint or journal): each gets a
        #: skipped record on resume, never a sum (its session died with the process)
        self.abandoned: list[Cohort] = []
        #: ``SecureRound``'s observer for every cohort's session (the test hook)
        self.observer: Callable[[str, Any], None] | None = None

    # ----------------------------------------------------------- cohorts

    def busy(self) -> set[str]:
        """Devices in an open cohort (each holds one SecAgg+ session at a time)."""
        return {d for c in self.cohorts.values() for d in c.selected}

    def can_open(self) -> bool:
        """Room for another cohort, cohorts left in the job, and no open cohort still in its
        keys phase (but one waiting only for members on probation): the global topic retains one
        message, so a cohort is dispatched only once the one before it was taken (a device that
        subscribes late, or reconnects, finds the newest cohort's message there, never a cohort
        it would miss for good)."""
        e = self.engine
        return (
            e.ended_early is None
            and len(self.cohorts) < self.in_flight
            and e.round_number < e.settings.rounds
            and not any(self._holds_dispatch(c) for c in self.cohorts.values())
        )

    @classmethod
    def _holds_dispatch(cls, cohort: Cohort) -> bool:
        """A cohort in its keys phase holds the next dispatch back, unless it waits only for
        members on probation (every other member advertised: what a late subscriber could miss
        on the retained topic is then only theirs). Else one late device, or a silent one beside
        a late one where cutting both would leave the cohort below its floor, held every
        dispatch to the keys phase's timeout (a red team's finding)."""
        if not cls._keys_phase(cohort):
            return False
        sr = cohort.session
        assert sr is not None
        return not (sr.probation and sr.session.waiting <= sr.probation)

    @staticmethod
    def _keys_phase(cohort: Cohort) -> bool:
        return cohort.session is not None and cohort.session.phase == "keys"

    def open_cohort(self, now: float) -> tuple[Cohort, GlobalModel] | None:
        """Dispatch the next cohort on the current version: min(K', available and not busy)
        devices, at least the plan's ``min_survivors``; None if there is no room or too few."""
        e = self.engine
        plan = e.secure
        assert plan is not None, "a cohort job without secure aggregation"
        if not self.can_open():
            return None
        for open_cohort in self.cohorts.values():
            self._note_keys(open_cohort)
        busy = self.busy()
        pool = [d for d in e.available() if d not in busy]
        if len(pool) < max(2, plan.min_survivors):
            return None
        n = min(self.size, len(pool))
        selected = frozenset(self._choose(pool, n, plan.min_survivors))
        e.round_number += 1
        s = e.settings
        cohort = Cohort(
            number=e.round_number,
            base_version=e.version,
            selected=selected,
            nonce=e.new_nonce("cohort", e.round_number),
            target=min(s.buffer_size, n),
            min_updates=min(plan.min_survivors, n),
            opened_at=now,
            deadline_s=s.deadline_s,
        )
        params = plan.params(s.job, cohort.number, cohort.nonce, tuple(sorted(selected)))
        cohort.session = SecureRound(plan, params, now, cohort.deadline, self.observer,
                                     probation=frozenset(selected & self.probation))  # fmt: skip
        self.cohorts[cohort.nonce] = cohort
        self.remember(cohort)
        msg = e.global_message(
            selected=tuple(sorted(selected)), round_number=cohort.number, nonce=cohort.nonce
        )
        return cohort, msg

    def _choose(self, pool: list[str], n: int, floor: int) -> list[str]:
        """``n`` of the free devices ``pool``: devices on probation that answer are spread over
        the cohorts (their share of the pool, at most ``n - floor`` a cohort, so cutting them
        still leaves a cohort its floor: two late devices in one cohort of 6 with a floor of 5
        held it to the timeout), the others drawn at random, and silent devices only to fill."""
        rng = self.engine.rng
        silent = [d for d in pool if d in self.silent]
        late = [d for d in pool if d in self.probation and d not in self.silent]
        rest = [d for d in pool if d not in self.probation and d not in self.silent]
        k = min(len(late), max(0, n - floor), math.ceil(n * len(late) / len(pool)))
        k = max(k, min(len(late), n - len(rest)))  # too few others: more of them
        chosen: list[str] = []
        for group, count in ((rest, n - k), (late, k), (silent, n)):
            count = min(count, len(group), n - len(chosen))
            if count == len(group):  # all of them (no draw: the same stream as before)
                chosen += group
            elif count > 0:
                chosen += [group[i] for i in rng.choice(len(group), size=count, replace=False)]
        return chosen

    def route(self, round_number: int, nonce: bytes) -> Cohort | None:
        """The open cohort a SecAgg+ message names by its ``r`` and ``nc``, or None."""
        cohort = self.cohorts.get(nonce)
        return cohort if cohort is not None and cohort.number == round_number else None

    def by_number(self, round_number: int) -> Cohort | None:
        for cohort in self.cohorts.values():
            if cohort.number == round_number:
                return cohort
        return None

    def finished_cohorts(self) -> list[Cohort]:
        """Open cohorts whose session ended (summed or failed), oldest first."""
        done = [c for c in self.cohorts.values() if c.session is None or c.session.finished]
        return sorted(done, key=lambda c: c.number)

    def open_cohorts(self) -> list[Cohort]:
        return sorted(self.cohorts.values(), key=lambda c: c.number)

    def drop(self, cohort: Cohort) -> None:
        self._note_keys(cohort)
        self.cohorts.pop(cohort.nonce, None)
        self._keys_seen.discard(cohort.number)

    def _note_keys(self, cohort: Cohort) -> None:
        """Once a cohort's keys phase is over: its members that advertised keys leave
        ``silent``, the others join it."""
        sr = cohort.session
        if sr is None or (sr.phase == "keys" and not sr.finished):
            return
        if cohort.number in self._keys_seen:
            return
        self._keys_seen.add(cohort.number)
        advertised = sr.commitments()
        for device in cohort.selected:
            if device in advertised:
                self.silent.discard(device)
            else:
                self.silent.add(device)
                self.probation.add(device)
        late = sr.late_advertiser()
        if late is not None:
            self.probation.add(late)

    def restore_cohort(self, rec: dict[str, Any]) -> None:
        """A journaled ``cohort`` record (dispatched after the last checkpoint): remembered for
        charging its masked inputs, and abandoned (skipped on resume)."""
        self._abandon(rec)

    def restore_masked(self, number: int, devices: list[str]) -> None:
        """A journaled ``masked`` record of an abandoned cohort: its U2 was handed to workers."""
        for cohort in self.abandoned:
            if cohort.number == number:
                cohort.handed_to_workers = frozenset(devices)

    def _abandon(self, rec: dict[str, Any]) -> None:
        e = self.engine
        number = int(rec["n"])
        if any(c.number == number for c in self.abandoned):
            return
        cohort = Cohort(
            number=number,
            base_version=int(rec["bv"]),
            selected=frozenset(str(d) for d in rec["sel"]),
            nonce=bytes(rec["nc"]),
            target=min(e.settings.buffer_size, len(rec["sel"])),
            min_updates=int(rec.get("ms", 0)),
            opened_at=0.0,
            deadline_s=e.settings.deadline_s,
            handed_to_workers=frozenset(str(d) for d in rec.get("u2", ())),
        )
        e.round_number = max(e.round_number, number)
        self.remember(cohort)
        self.abandoned.append(cohort)
        self.abandoned.sort(key=lambda c: c.number)

    @staticmethod
    def cohort_record(cohort: Cohort) -> dict[str, Any]:
        """What the journal and a checkpoint keep of an open cohort."""
        return {
            "n": cohort.number,
            "nc": cohort.nonce,
            "sel": sorted(cohort.selected),
            "bv": cohort.base_version,
            "ms": cohort.min_updates,
            **({"u2": sorted(cohort.handed_to_workers)} if cohort.handed_to_workers else {}),
        }

    # ----------------------------------------------------------- RoundPolicy

    def open(self, now: float) -> GlobalModel | None:
        return None  # cohorts are opened with open_cohort (the engine has no current round)

    def reopen(self, rnd: Any, spec: dict[str, Any]) -> None:
        raise ValueError("a secure FedBuff job journals cohorts, not rounds")

    def open_message(self) -> GlobalModel:
        raise ValueError("a secure FedBuff job has no open round")

    def open_spec(self) -> dict[str, Any]:
        return {}

    def build_round(self, fields: dict[str, Any], now: float) -> Any:
        raise ValueError("a secure FedBuff job has no rounds to rebuild")

    def round_facts(self, round_number: int) -> tuple[bytes | None, frozenset[str]] | None:
        """A cohort's nonce and selection, open or closed (None: no such cohort)."""
        return self.engine.history.get(round_number)

    def known(self, device: str) -> bool:
        e = self.engine
        return device in e.devices or device in e.ever_selected

    def nonce_of(self, round_number: int) -> bytes | None:
        facts = self.round_facts(round_number)
        return None if facts is None else facts[0]

    def current_nonce(self) -> bytes | None:
        return None

    def chargeable(self, device: str, update: Update) -> bool:
        """A plain update naming a cohort that selected the device: a release in the clear."""
        facts = self.round_facts(update.round)
        return facts is not None and device in facts[1]

    def holds(self) -> bool:
        return False

    def hold(self, device: str, payload: bytes) -> Reject | None:
        raise AssertionError("a cohort job holds nothing")

    def answered(self, device: str, releases: list[tuple[str, int, int]]) -> None:
        return None

    def on_status(self, device: str) -> None:
        return None

    def decide(self, now: float) -> Decision:
        return Decision.WAIT  # each cohort ends on its session (the service closes it)

    def arrivals_to_decide(self) -> int | None:
        return None

    def deadline(self) -> float | None:
        """The earliest phase deadline of an open cohort (None: none open)."""
        deadlines = [c.session.deadline for c in self.cohorts.values() if c.session is not None]
        return min(deadlines) if deadlines else None

    def dispatch(self, now: float) -> GlobalModel | None:
        return None  # every cohort goes out with its own global message

    def restore_dispatch(self, version: int, sent: list[str] | tuple[str, ...]) -> None:
        raise ValueError("a dispatch record belongs to a plain asynchronous job")

    def closing(self, rnd: Any) -> None:
        return None

    def remember(self, cohort: Any) -> None:
        """A cohort's nonce and selection, kept from its dispatch: a masked input that reaches
        the aggregator for it is charged, whenever it comes."""
        e = self.engine
        e.history[cohort.number] = (cohort.nonce, frozenset(cohort.selected))
        e.ever_selected |= cohort.selected

    def closed(self, record: dict[str, Any]) -> None:
        record["cohorts_in_flight"] = len(self.cohorts)

    def charge_held(self) -> int:
        return 0

    def outstanding(self) -> frozenset[str]:
        return frozenset()  # a masked input after its cohort closed is unreadable: no release

    def summary(self) -> dict[str, Any]:
        return {}

    def snapshot(self) -> dict[str, Any]:
        """The open cohorts (a checkpoint written while they ran): skipped on resume."""
        return {
            "cohorts": [
                {**self.cohort_record(c), "nc": base64.b64encode(c.nonce).decode()}
                for c in [*self.open_cohorts(), *self.abandoned]
            ]
        }

    def restore(self, state: dict[str, Any]) -> None:
        for rec in state.get("cohorts", []):
            self._abandon({**rec, "nc": base64.b64decode(rec["nc"])})

    def forget(self) -> None:
        self.cohorts.clear()
        self.abandoned.clear()
        self.silent.clear()
        self.probation.clear()
        self._keys_seen.clear()
