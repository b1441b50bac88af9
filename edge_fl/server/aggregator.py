"""The aggregator core: fleet view, device selection, round control, aggregation and round records.

Sans-I/O: the service feeds it payload bytes, status changes and the time, and publishes what it
returns. Everything here is deterministic given its inputs and the injected generator.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from edge_fl.identity import in_population
from edge_fl.mechanisms import GuaranteeMismatch, Mechanism, Strategy
from edge_fl.mechanisms.none import NoPrivacy
from edge_fl.mechanisms.secure import secure_sum
from edge_fl.protocol import (
    NONCE_BYTES,
    REJECT_MEANING,
    RUN_BYTES,
    GlobalModel,
    PayloadRejected,
    Reject,
    UpdateLimits,
    decode_global,
    decode_status,
    decode_update,
    new_nonce,
)
from edge_fl.protocol.secure import round_seed

from .ledger_file import ChangeTracked
from .policy import RoundPolicy, SyncPolicy, field_values, round_fields
from .rounds import Decision
from .state import generator_state, restore_generator

log = logging.getLogger("edge_fl.aggregator")

#: the sample count of a release charged for a secure round's masked input (``releases`` and the
#: journal's ``release`` records): the mechanism's ``secure_events``, not its ``release_events``
SECURE_RELEASE = -1

INTERNAL_ERROR = "internal_error"  # a payload hit a bug of ours: counted, logged, never fatal
#: a sharded worker's answer for an update naming a round it never mirrored (it joined or
#: restarted later): not judged nor counted here, the coordinator judges it (``judge_deferred``)
DEFERRED = "deferred"
#: closed secure rounds (cohorts) whose seed commitments are kept for their late masked inputs
COMMITMENTS_KEPT = 64

Evaluator = Callable[[np.ndarray], tuple[float, float]]  # params -> (accuracy, loss)

#: record fields that reveal who or how many took part in a round; with amplification by Poisson
#: sampling claimed they must not reach anything devices can read (docs/specs/privacy.md pitfall 8)
PARTICIPATION_FIELDS = (
    "selected",
    "target",
    "received",
    "late",
    "rejected",
    "rejected_by_reason",
    "extended",
    "bytes_up",
    "messages_up",
    "staleness_mean",
    "staleness_max",
    "staleness_hist",
    "update_norm",
    "online",
    "capped_samples",
    "bad_status",
    "foreign_status",
    "device_updates",
)
#: record fields a runtime adds that depend on who uploaded too: the simulated fleet's wire bytes
#: (every PUBLISH and PUBACK of a device's session), its dropouts and failed trainings; and the
#: devices' epsilon quantiles (``epsilon_device_p50/_p95/_max``), which count releases
PARTICIPATION_PREFIXES = ("wire_", "dropouts", "device_failures", "epsilon_device_")
#: record fields for the operator only, never on the metrics topic (they name devices)
PRIVATE_FIELDS = ("rejection_samples",)


@dataclass(frozen=True)
class AggregatorSettings:
    job: str
    rounds: int
    target: int
    min_updates: int
    deadline_s: float
    #: sync: a round opens at most every ``period_s`` (the deadline's clock), counted from the
    #: previous round's opening; None: back to back
    period_s: float | None = None
    extend_when_short: bool = True
    over_selection: float = 1.0
    server_lr: float = 1.0
    wire_dtype: str = "f4"
    config_digest: str = ""
    mechanism: str = "none"
    sample_rate: float | None = None  # Poisson: every available device self-selects w.p. q
    mode: str = "sync"  # sync | fedbuff | fedasync
    buffer_size: int = 10  # FedBuff K (FedAsync: 1)
    max_staleness: int = 20
    staleness: Any = None  # edge_fl.server.staleness.Staleness (async modes)
    #: the job's devices (``data.devices``): a status of a device outside them (another job's,
    #: edge_fl.identity.in_population) is ignored and counted; None: every device is taken
    population: int | None = None

    @property
    def n_select(self) -> int:
        return math.ceil(self.target * self.over_selection)


class PrivacyAccounting:
    """The aggregator's ledger: records every release it sees and reports the running total.

    Local mechanisms: one event set per (device, round) received (a late update was still
    released); central DP-FedAvg: the job-level event of every round that applied noise. Every
    event is checked against the mechanism's guarantee before it is charged
    (``Mechanism.check_events``: the report prints that guarantee next to the epsilon). The
    epsilon is always the tightest valid bound (``best_epsilon``), the same one devices check
    their budgets with, so console, metrics, summary and plots cannot disagree.
    """

    def __init__(self, mechanism: Mechanism, delta: float) -> None:
        from edge_fl.privacy.ledger import PrivacyLedger

        if secure_sum(mechanism) is None and not (
            mechanism.release_events(1, 0) or mechanism.round_events()
        ):
            # an epsilon of 0 for a mechanism that says it is private would be a false claim
            g = mechanism.guarantee
            raise ValueError(
                f"privacy.mechanism = {mechanism.name!r} claims {g.kind} DP per {g.unit} but "
                "charges nothing: its release_events (an update's cost) and round_events (a "
                "round's central noise) both return no event; define the one it releases, or "
                "declare Guarantee('none', 'none', 'none')"
            )
        self.mechanism = mechanism
        self.delta = delta
        self.ledger = PrivacyLedger()
        self.exposures: Counter = Counter()

    def record_upload(self, device: str, n_samples: int, round_number: int) -> None:
        events = self.mechanism.release_events(n_samples, self.exposures[device])
        self.mechanism.check_events(events)  # first: a refused event changes nothing
        self.exposures[device] += 1
        for event in events:
            self.ledger.add(event, device=device, round=round_number)

    def record_secure(self, device: str, round_number: int, events: list) -> None:
        """A masked input the aggregator accepted in a secure round: its secure events."""
        self.mechanism.check_events(events)
        self.exposures[device] += 1
        for event in events:
            self.ledger.add(event, device=device, round=round_number)

    def record_round(self, round_number: int) -> None:
        for event in self.mechanism.check_events(self.mechanism.round_events()):
            self.ledger.add(event, device=None, round=round_number)

    def metrics(self) -> dict[str, Any]:
        """Cumulative epsilon (worst device, all rounds, all mechanisms) at the job's delta, the
        accountant that proved it, and every accountant's value."""
        bound, _ = self.ledger.best(self.delta)
        return {
            "epsilon": bound.epsilon,
            "delta": bound.delta,
            "accountant": bound.accountant,
            "epsilon_by_accountant": bound.values,
        }

    def device_metrics(self, devices: Iterable[str] = ()) -> dict[str, float]:
        """The devices' epsilon (each its own releases and the job-level ones, the tightest
        bound, as the ledger composes it for the job's): nearest-rank p50 and p95 and the
        maximum over every device the ledger holds and every one of ``devices`` (the fleet
        view: devices that never uploaded count at the job-level events alone). The maximum is
        the job's ``epsilon``."""
        dist = self.ledger.device_distribution(self.delta, devices)
        return {
            "epsilon_device_p50": weighted_rank(dist, 0.50),
            "epsilon_device_p95": weighted_rank(dist, 0.95),
            "epsilon_device_max": dist[-1][0],
        }

    def report(self) -> dict[str, Any]:
        """The ledger's report (summary.json's ``privacy``) with the job's mechanism named as
        everywhere else: ``mechanisms`` holds the registered name (the summary's ``mechanism``,
        every record's, the global message's ``m``); the labels of the events charged (e.g.
        ``gaussian-local``; SignDS: ``signds`` and ``magrr-bit``) are ``release_kinds``."""
        out = self.ledger.report(self.delta)
        out["release_kinds"] = out.pop("mechanisms")
        out["mechanisms"] = [self.mechanism.name]
        out["guarantee"] = self.mechanism.guarantee.text()
        return out


def weighted_rank(dist: list[tuple[float, int]], q: float) -> float:
    """The nearest-rank ``q`` quantile of sorted (value, how many) pairs: the value at rank
    ceil(q * N), 1-based (the dashboard's rule for a run directory)."""
    total = sum(n for _, n in dist)
    rank = max(1, math.ceil(q * total))
    seen = 0
    for value, n in dist:
        seen += n
        if seen >= rank:
            return value
    return dist[-1][0]


@dataclass
class DeviceRecord:
    online: bool = False
    n_samples: int = 0
    stopped: str | None = None


@dataclass
class RoundTally:
    """What happened on the wire during one round, for its metrics record."""

    bytes_up: int = 0
    messages_up: int = 0
    bytes_down: int = 0
    late: int = 0
    rejected: Counter = field(default_factory=Counter)
    capped_samples: int = 0  # updates whose sample count exceeded the device's declared one
    samples: dict = field(default_factory=dict)  # reason -> "device: detail" of its first case
    bad_status: Counter = field(default_factory=Counter)
    foreign_status: int = 0  # statuses of devices outside the job's population, ignored


def public_fields(record: dict[str, Any], poisson: bool) -> dict[str, Any]:
    """The fields of a round's record that may go where devices (or a public page) read them:
    never the rejection samples (they name devices); with Poisson selection nothing that counts
    who took part, the devices' epsilon quantiles included."""
    if not poisson:
        return {k: v for k, v in record.items() if k not in PRIVATE_FIELDS}
    hidden = (*PARTICIPATION_FIELDS, *PRIVATE_FIELDS)
    return {
        k: v
        for k, v in record.items()
        if k not in hidden and not k.startswith(PARTICIPATION_PREFIXES)
    }


class AggregatorCore:
    """The engine: fleet view, admission, ledger and round records, with the way rounds are
    run (sync, FedBuff, FedAsync) delegated to a :class:`~edge_fl.server.policy.RoundPolicy`.

    ``policy``: built from ``settings.mode`` when not given (``concurrency`` and
    ``dispatch_timeout_s`` configure the asynchronous one: C devices training at once, 0 or None
    for no limit, and how long a selected device may take before its slot goes to another)."""

    def __init__(
        self,
        settings: AggregatorSettings,
        params: np.ndarray,
        limits: UpdateLimits,
        rng: np.random.Generator,
        evaluate: Evaluator | None = None,
        mechanism: Mechanism | None = None,
        noise_rng: np.random.Generator | None = None,
        privacy: PrivacyAccounting | None = None,
        *,
        concurrency: int | None = None,
        dispatch_timeout_s: float | None = None,
        policy: Callable[[AggregatorCore], RoundPolicy] | None = None,
    ) -> None:
        self.settings = settings
        self.params = params.astype(np.float32, copy=True)
        self.limits = limits
        self.rng = rng
        self.evaluate = evaluate
        self.mechanism = mechanism or _plain(len(self.params))
        self.noise_rng = noise_rng if noise_rng is not None else rng
        #: --reproducible: round nonces derived from this key (the job's seed), so a job whose
        #: results depend on them (distributed-gaussian's rotation) reproduces; None: the OS
        #: CSPRNG, as a deployment must (a predictable nonce lets an earlier run's update replay)
        self.nonce_key: bytes | None = None
        self.version = 0
        self.round_number = 0  # rounds opened so far; the open round's number when one is open
        self.devices: dict[str, DeviceRecord] = {}
        self.current: Any = None  # the open Round (SyncRound or AsyncWindow), or None
        #: when the last round was opened (``now``'s clock), for the settings' ``period_s``; not
        #: in a checkpoint: a resumed run's clock starts again, so its first round opens at once
        self.last_opened_at: float | None = None
        self.previous: Any = None  # the round that closed last
        # every closed round's nonce and selection: a straggler's late answer to any of them is
        # still a release (charged once); O(rounds x selected) memory. It logs the rounds it
        # sets, so a checkpoint appends only the changed ones to its ledger file
        self.history: ChangeTracked[int, tuple[bytes | None, frozenset[str]]] = ChangeTracked()
        self.ever_selected: set[str] = set()
        self.refused: set[str] = set()  # devices of the open round whose update was refused
        self.last_rejection: PayloadRejected | None = None  # its detail, for logs and acks
        self.public_params: dict[str, Any] = self.mechanism.public_params()
        self.strategy: Strategy | None = None
        self.tally = RoundTally()
        self.records: list[dict[str, Any]] = []
        self.privacy = privacy
        #: a sharded worker sets this: updates naming a round it knows nothing of are left to the
        #: coordinator, (device, round, base version, samples, nonce) in ``last_deferred``
        self.defer_unknown_rounds = False
        self.last_deferred: tuple[str, int, int, int, bytes | None] | None = None
        self.mechanism_state: Any = self.mechanism.initial_state()  # e.g. SignDS's MagRR state
        self.ended_early: str | None = None
        self._released: set[tuple[str, int]] = set()  # (device, round) already in the ledger
        self.releases: list[tuple[str, int, int]] = []  # (device, round, n): for checkpoints
        self.noised_rounds: list[int] = []
        #: this run's id, in every global message (and the job document): a device refuses a
        #: signed message of another run, e.g. an earlier run's done marker replayed; random per
        #: run, restored with the run's state on a resume (docs/protocol.md, "Run id")
        self.run_id = os.urandom(RUN_BYTES)
        self.foreign_seen = 0  # statuses of devices outside the population, over the job
        #: the wall clock (Unix seconds) for the global messages' ``ts``, set by the service: the
        #: core reads no clock (deadlines run on the ``now`` it is given, a monotonic clock)
        self.wall: Callable[[], float] = no_wall_clock
        if policy is None:
            policy = policy_for(settings, concurrency, dispatch_timeout_s)
        self.policy: RoundPolicy = policy(self)
        #: the job's secure aggregation (``edge_fl.server.secure.SecurePlan``), or None: every
        #: sync round is then a SecAgg+ round; plain updates are refused
        self.secure: Any = None
        #: the open secure round's session (``edge_fl.server.secure.SecureRound``), or None
        self.secure_round: Any = None
        #: sync secure rounds whose U2 the ingest workers were told (journal replay): what a
        #: resume charges when the round died with the process (``restore_masked``)
        self.handed_to_workers: dict[int, frozenset[str]] = {}
        #: with device keys: the last COMMITMENTS_KEPT secure rounds' accepted seed commitments
        #: (round -> device -> bh), so a late masked input is charged only if its device signed
        #: it; one for an older round is charged as after a restart (conservatively)
        self.secure_commitments: dict[int, dict[str, bytes]] = {}

    def configure_as_worker(self) -> None:
        """A sharded ingest worker: the coordinator keeps the ledger (this core only lists the
        releases it sees) and judges updates naming rounds this core never mirrored."""
        self.privacy = None
        self.defer_unknown_rounds = True

    # ----------------------------------------------------------- fleet view

    def on_status(self, device: str, payload: bytes) -> None:
        """Track availability from retained status messages (and last wills)."""
        population = self.settings.population
        if population is not None and not in_population(device, population):
            # another job's device (the broker's ACL lets it write status/<id> under any job id):
            # never selectable here, or rounds wait for one that never answers
            self.tally.foreign_status += 1
            self.foreign_seen += 1
            if self.foreign_seen <= 3 or self.foreign_seen % 1000 == 0:
                log.warning(
                    "ignoring the status of %r (%d so far): not one of this job's %d devices "
                    "(ids ending in 0-%d)",
                    device,
                    self.foreign_seen,
                    population,
                    population - 1,
                )
            return
        plan = self.secure
        if plan is not None and plan.device_keys is not None and device not in plan.device_keys:
            # not in the device-key directory: its keys would be refused, so a round that
            # selected it could only lose a slot (a broker could fill rosters with such ids)
            self.tally.foreign_status += 1
            self.foreign_seen += 1
            if self.foreign_seen <= 3 or self.foreign_seen % 1000 == 0:
                log.warning("ignoring the status of %r (%d so far): not in security.device_keys",
                            device, self.foreign_seen)  # fmt: skip
            return
        if not payload:  # a cleared retained message
            self.devices.pop(device, None)
            self.policy.on_status(device)
            return
        try:
            status = decode_status(payload, topic_device=device)
        except PayloadRejected as exc:  # a broken status cannot make a device selectable
            self.tally.bad_status[exc.reason] += 1
            if sum(self.tally.bad_status.values()) <= 10:  # a few per round, not a flood
                log.warning("status of %r rejected (%s): %s", device, exc.reason, exc.detail)
            return
        except Exception:
            log.exception("status of %r: unexpected error; ignored", device)
            self.tally.bad_status[INTERNAL_ERROR] += 1
            return
        rec = self.devices.setdefault(device, DeviceRecord())
        rec.online = status.online
        rec.n_samples = status.n_samples
        rec.stopped = status.info.get("stopped") if status.info else None
        self.policy.on_status(device)

    def available(self) -> list[str]:
        return sorted(d for d, r in self.devices.items() if r.online and r.stopped is None)

    def is_online(self, device: str) -> bool:
        """Whether ``device``'s last status said online (an unknown device is not)."""
        rec = self.devices.get(device)
        return rec is not None and rec.online

    @property
    def online_count(self) -> int:
        return sum(1 for r in self.devices.values() if r.online)

    @property
    def cohorts(self) -> Any:
        """The secure FedBuff cohorts (``edge_fl.server.cohorts.CohortPolicy``, whose ``kind``
        is ``"cohort"``), or None."""
        policy: Any = self.policy
        return policy if policy.kind == "cohort" else None

    @property
    def finished(self) -> bool:
        cohorts = self.cohorts
        if cohorts is not None and (cohorts.cohorts or cohorts.abandoned):
            return False  # every dispatched cohort gets its record, a stop included
        if self.ended_early is not None:
            return True
        return self.round_number >= self.settings.rounds and self.current is None

    def hopeless(self) -> str | None:
        """Why no further round can ever close (devices that stopped never come back)."""
        live = sum(1 for r in self.devices.values() if r.stopped is None)
        stopped = len(self.devices) - live
        need = 1 if self.settings.sample_rate is not None else self.settings.min_updates
        if stopped and live < need:
            reasons = Counter(r.stopped for r in self.devices.values() if r.stopped is not None)
            why = (
                "stopped on their privacy budget"
                if set(reasons) == {"budget_exhausted"}
                else "stopped: " + ", ".join(f"{n} {why}" for why, n in reasons.most_common())
            )
            return (
                f"only {live} devices can still contribute ({stopped} {why}); a round needs {need}"
            )
        return None

    def may_send(self, device: str) -> bool:
        """Whether ``device`` is online and has not stopped (it may still send)."""
        rec = self.devices.get(device)
        return rec is not None and rec.online and rec.stopped is None

    def can_answer(self, devices: Iterable[str]) -> int:
        """How many of ``devices`` may still send."""
        return sum(1 for device in devices if self.may_send(device))

    def any_can_answer(self, devices: Iterable[str]) -> bool:
        """Whether one of ``devices`` may still send."""
        return any(self.may_send(device) for device in devices)

    # ----------------------------------------------------------- rounds

    def opens_at(self) -> float:
        """The earliest ``now`` at which :meth:`open_round` may open the next round: the
        settings' ``period_s`` after the previous opening (-inf: at once)."""
        period = self.settings.period_s
        if period is None or self.last_opened_at is None:
            return -math.inf
        return self.last_opened_at + period

    def open_round(self, now: float, paced: bool = True) -> GlobalModel | None:
        """Open the next round (async: window); None if too few devices are available or the
        round period has not passed (:meth:`opens_at`; ``paced=False``: a round opened only to
        carry the final record on a stop, never published)."""
        if paced and now < self.opens_at():
            return None
        msg = self.policy.open(now)
        if msg is not None:
            self.last_opened_at = now
        return msg

    def reopen(self, spec: dict[str, Any], now: float = 0.0) -> None:
        """Rebuild the round a journal's ``open`` record describes (``round_spec``), as
        ``open_round`` left it, without drawing a new selection."""
        rnd = self.policy.build_round(field_values(spec), now)
        published = spec.get("g")
        if isinstance(published, bytes | bytearray) and published:
            # the round as published names its run: a resume without a checkpoint keeps it
            try:
                run = decode_global(bytes(published)).run
            except PayloadRejected:
                run = None  # never: this process published it
            if run is not None:
                self.run_id = run
        self.round_number = int(rnd.number)
        self.tally = RoundTally()
        self.policy.reopen(rnd, spec)
        restore_generator(self.rng, spec.get("rng"))

    def round_spec(self, payload: bytes | None = None) -> dict[str, Any]:
        """What a journal's ``open`` record of the just-opened round holds: the round's fields,
        the selection generator's state after the draw (seeded runs only), the policy's own
        (async: the versions' nonces) and the global message as published (``payload``)."""
        assert self.current is not None
        return {
            **round_fields(self.policy.kind, self.current),
            "rng": generator_state(self.rng),
            "g": payload,
            **self.policy.open_spec(),
        }

    def open_message(self) -> GlobalModel:
        """The global model of the open round, rebuilt (when a journal lacks its bytes)."""
        return self.policy.open_message()

    def global_message(
        self,
        selected: tuple[str, ...] | None = None,
        done: bool = False,
        wall: float | None = None,
        round_number: int | None = None,
        nonce: bytes | None = None,
    ) -> GlobalModel:
        """The global message of the open round (or the done marker); ``ts`` is ``wall``, by
        default :attr:`wall`'s reading: Unix seconds, what docs/protocol.md promises.
        ``nonce``: a secure FedBuff cohort's own (default: the open round's)."""
        return GlobalModel(
            job=self.settings.job,
            version=self.version,
            round=self.round_number if round_number is None else round_number,
            params=self.params,
            mode=self.settings.mode,
            selected=selected,
            deadline_s=self.settings.deadline_s,
            config_digest=self.settings.config_digest,
            wire_dtype=self.settings.wire_dtype,
            mechanism_state=self.mechanism.encode_state(self.mechanism_state),
            sample_rate=self.settings.sample_rate,
            done=done,
            issued_at=self.wall() if wall is None else wall,
            nonce=None if done else (nonce or self.current_nonce()),
            mechanism_params=self.public_params,
            run=self.run_id,
            secure=None
            if done or self.secure is None or not selected
            else self.secure.wire(len(selected)),
        )

    def dispatch(self, now: float) -> GlobalModel | None:
        """A global message selecting devices mid-round (async with a concurrency limit: the
        replacements of those that answered, timed out or left), or None."""
        return self.policy.dispatch(now)

    def restore_dispatch(self, version: int, sent: list[str] | tuple[str, ...]) -> None:
        """Replay of a journaled ``dispatch`` record."""
        self.policy.restore_dispatch(version, sent)

    def current_nonce(self) -> bytes | None:
        return self.policy.current_nonce()

    def nonce_of(self, round_number: int) -> bytes | None:
        """The nonce of the round (async: version) an update names (None: no such round)."""
        return self.policy.nonce_of(round_number)

    def remember(self, rnd: Any) -> None:
        """Keep a closed round's nonce and selection for late answers."""
        self.policy.remember(rnd)

    # ----------------------------------------------------------- updates

    def on_update(self, device: str, payload: bytes, *, counted: bool = False) -> Reject | None:
        """Decode, validate, admit and fold in one update. Returns the rejection reason, if any.

        Never raises: whatever a payload does, it ends as a counted reason (a bug of ours as
        ``internal_error``, logged), so no device can stop the aggregator.
        ``counted``: its bytes were already tallied (an update held back and replayed)."""
        if not counted:
            self.tally.bytes_up += len(payload)
            self.tally.messages_up += 1
        policy = self.policy
        if policy.holds() and policy.known(device):  # async: no window has room; strangers
            self.last_rejection = None  # are refused now, not held
            before = len(self.releases)
            held = policy.hold(device, payload)
            if held is not None:
                self.count_rejection(held)
                if str(held) not in self.tally.samples:
                    self._sample(device, held)
            if len(self.releases) > before:
                policy.answered(device, self.releases[before:])
            return held
        before = len(self.releases)
        try:
            reason = self._on_update(device, payload)
            if reason == DEFERRED:
                return reason
            if reason is not None and str(reason) not in self.tally.samples:
                self._sample(device, reason)
        except GuaranteeMismatch:
            # the mechanism's fault, not the payload's: the device released it, and the ledger
            # cannot charge it under the guarantee the job reports; the job stops rather than
            # leave the release out of its epsilon
            raise
        except Exception:
            log.exception("update from %r: unexpected error; counted as internal_error", device)
            self.tally.rejected[INTERNAL_ERROR] += 1
            reason = INTERNAL_ERROR  # type: ignore[assignment]
        if len(self.releases) > before:
            policy.answered(device, self.releases[before:])
        return reason

    def _on_update(self, device: str, payload: bytes) -> Reject | None:
        self.last_rejection = None
        policy = self.policy
        if not policy.known(device):  # never announced nor selected: cannot be asked, O(1)
            self.tally.rejected[Reject.NOT_SELECTED] += 1
            return Reject.NOT_SELECTED
        try:
            update = decode_update(payload, self.limits, topic_device=device)
        except PayloadRejected as exc:
            if exc.reason is Reject.IMPLAUSIBLE:
                self.charge_refused(device, payload)
            self.tally.rejected[exc.reason] += 1
            self.last_rejection = exc
            return exc.reason
        if self.defer_unknown_rounds and self.round_facts(update.round) is None:
            self.last_deferred = (
                device,
                update.round,
                update.base_version,
                update.n_samples,
                update.nonce,
            )
            return DEFERRED  # type: ignore[return-value]
        expected = policy.nonce_of(update.round)
        if expected is not None and update.nonce != expected:
            # an old update re-stamped with another round, or a forgery: no release of this round
            self.tally.rejected[Reject.WRONG_NONCE] += 1
            return Reject.WRONG_NONCE
        capped = self.samples_cap(device, update.n_samples)
        if capped != update.n_samples:
            update = replace(update, n_samples=capped)
            self.tally.capped_samples += 1
        # admission before accounting: only a release this device could have made for a round it
        # was asked for costs privacy; anything else is rejected below at O(1) and never charged
        chargeable = policy.chargeable(device, update)
        if chargeable and (device, update.round) not in self._released:
            self.record_release(device, update.round, update.n_samples)
        if self.current is None and self.cohorts is None:
            reason = Reject.LATE if chargeable else Reject.NOT_SELECTED
            self.count_rejection(reason)
            return reason
        if self.secure is not None:  # a secure round takes masked inputs only (charged above)
            self.count_rejection(Reject.WRONG_MECHANISM)
            return Reject.WRONG_MECHANISM
        rnd = self.current
        reason = rnd.admit(device, update.round, update.base_version)
        if reason is None and self.devices.get(device, DeviceRecord()).stopped:
            reason = Reject.BUDGET_EXHAUSTED
        if reason is not None:
            self.count_rejection(reason)
            return reason
        assert self.strategy is not None
        try:
            self.strategy.add(update, rnd.weight(update.base_version))
        except PayloadRejected as exc:  # e.g. the norm bound: the device answered, refused
            self.tally.rejected[exc.reason] += 1
            self.last_rejection = exc
            self.refused.add(device)  # the round need not wait for it
            return exc.reason
        except (TypeError, ValueError):
            self.tally.rejected[Reject.WRONG_MECHANISM] += 1
            return Reject.WRONG_MECHANISM
        rnd.accept(device, update.base_version)
        return None

    def round_facts(self, round_number: int) -> tuple[bytes | None, frozenset[str]] | None:
        """A synchronous round's nonce and selection, open or closed (None: no such round)."""
        facts = getattr(self.policy, "round_facts", None)
        return None if facts is None else facts(round_number)

    def charge_refused(self, device: str, payload: bytes) -> bool:
        """Charge an update the decoder refused for its values (implausible): the device made
        the release all the same, so once it is that device's (its header decodes, it echoes the
        nonce of a round it was selected for) it is charged, never folded. True if charged."""
        try:
            update = decode_update(payload, replace(self.limits, max_abs=None), topic_device=device)
        except PayloadRejected:
            return False
        if update.nonce != self.nonce_of(update.round):
            return False
        if (device, update.round) in self._released or not self.policy.chargeable(device, update):
            return False
        self.record_release(device, update.round, self.samples_cap(device, update.n_samples))
        return True

    def samples_cap(self, device: str, n_samples: int) -> int:
        """A claim beyond the device's status cannot buy weight: the smaller of the two."""
        declared = self.devices.get(device, DeviceRecord()).n_samples
        return declared if 0 < declared < n_samples else n_samples

    def new_nonce(self, kind: str, number: int) -> bytes:
        """The nonce of round (async: version; secure FedBuff: cohort) ``number``: fresh from
        the OS CSPRNG, or under --reproducible keyed from the seed by ``kind`` and ``number``
        (the same on a resume: no generator state to keep)."""
        if self.nonce_key is None:
            return new_nonce()
        data = f"{kind}:{number}".encode()
        return hashlib.blake2b(data, key=self.nonce_key, digest_size=NONCE_BYTES).digest()

    def charge_held(self) -> int:
        """Charge updates held for later that no round will take (the job ended); returns how
        many. A synchronous round holds nothing: late answers are charged as they arrive."""
        return self.policy.charge_held()

    def outstanding(self) -> frozenset[str]:
        """Devices asked for an update by the last round (async: the last published version),
        not yet heard from, that can still send one (online, not stopped). After the last
        round the service keeps listening until this is empty (or a deadline): what they publish
        is a release and must be charged before the job's final epsilon is written and the done
        marker stops them."""
        return self.policy.outstanding()

    def settle(self, record: dict[str, Any]) -> dict[str, Any]:
        """The job's last record, made final: charge what is held for a round that will never
        come, and bring the record's ledger fields (epsilon, device work) up to date, so the last
        metrics line, the summary and the console carry the same total. Call once the service
        has stopped taking updates (after the drain), before the record is committed."""
        self.charge_held()
        record["device_updates"] = len(self.releases)
        if self.privacy is not None:
            record.update(self.privacy.metrics())
            record.update(self.privacy.device_metrics(self.devices))
        return record

    def judge_deferred(
        self, device: str, round_number: int, base_version: int, n_samples: int,
        nonce: bytes | None,
    ) -> Reject:  # fmt: skip
        """An update a sharded worker decoded for a round it never mirrored, judged and charged
        as :meth:`on_update` would (its delta stays on the worker: it is never folded)."""
        facts = self.round_facts(round_number)
        if facts is not None and nonce != facts[0]:
            self.tally.rejected[Reject.WRONG_NONCE] += 1
            return Reject.WRONG_NONCE
        capped = self.samples_cap(device, n_samples)
        if capped != n_samples:
            n_samples = capped
            self.tally.capped_samples += 1
        chargeable = facts is not None and device in facts[1]
        if chargeable and (device, round_number) not in self._released:
            self.record_release(device, round_number, n_samples)
        rnd = self.current
        if rnd is None:
            reason = Reject.LATE if chargeable else Reject.NOT_SELECTED
        else:
            reason = rnd.admit(device, round_number, base_version) or Reject.LATE
            if round_number == rnd.number:
                log.warning("round %d: %s's update reached a worker that had not yet mirrored "
                            "the round: charged, not folded", round_number, device)  # fmt: skip
        self.count_rejection(reason)
        return reason

    def _sample(self, device: str, reason: Reject | str) -> None:
        """The first rejection of each reason in a round: its detail goes to the log and to the
        round's record (``rejection_samples``), so an operator sees why, not only how many."""
        rejection = self.last_rejection
        if rejection is not None and rejection.reason == reason:
            detail = rejection.detail
        else:
            detail = REJECT_MEANING.get(reason, str(reason)) if isinstance(reason, Reject) else ""
        self.tally.samples[str(reason)] = f"{device}: {detail}"
        log.info("round %d: update from %r rejected (%s): %s", self.round_number, device, reason,
                 detail)  # fmt: skip

    def count_rejection(self, reason: Reject) -> None:
        """Count a refused update in the open round's tally (late ones apart)."""
        if reason is Reject.LATE:
            self.tally.late += 1
        else:
            self.tally.rejected[reason] += 1

    def new_strategy(self) -> Strategy:
        """A fresh aggregation for the round (or async window) being opened."""
        return self.mechanism.new_strategy(
            self.mechanism_state, self.settings.server_lr, self.noise_rng
        )

    # ----------------------------------------------------------- the ledger

    def is_released(self, device: str, round_number: int) -> bool:
        """Whether (device, round) is in the ledger already (it is charged once)."""
        return (device, round_number) in self._released

    def record_release(self, device: str, round_number: int, n_samples: int) -> None:
        if self.privacy is not None and n_samples == SECURE_RELEASE:
            assert self.secure is not None, "a secure release in a job without secure rounds"
            events = self.secure.mechanism.secure_events(self.secure.job)
            self.privacy.record_secure(device, round_number, events)
        elif self.privacy is not None:  # first: if charging fails, nothing below has changed
            self.privacy.record_upload(device, n_samples, round_number)
        self._released.add((device, round_number))
        self.releases.append((device, round_number, n_samples))

    def charge_secure(self, device: str, round_number: int, payload: bytes = b"") -> bool:
        """A masked input of ``device`` for a round that selected it: charged once (True if it
        was now). With device keys, only one its device signed (a forgery under its name, which
        the round refuses, is no release of that device); a round whose commitments this
        process no longer holds (a restart) is charged as before, conservatively."""
        if (device, round_number) in self._released:
            return False
        plan = self.secure
        if plan is not None and plan.device_key is not None:
            from edge_fl.server.secure import masked_signed

            sr = self.secure_round
            current = self.current
            cohort = self.cohorts.by_number(round_number) if self.cohorts is not None else None
            known: dict[str, bytes] | None
            if sr is not None and current is not None and current.number == round_number:
                known = sr.commitments()
            elif cohort is not None and cohort.session is not None:  # an open cohort's
                known = cohort.session.commitments()
            else:  # a closed round's; None after a restart: then charged, conservatively
                known = self.secure_commitments.get(round_number)
            if known is not None:
                bh = known.get(device)
                if bh is None or not masked_signed(plan, self.settings.job, device, payload, bh):
                    return False
        self.record_release(device, round_number, SECURE_RELEASE)
        return True

    def keep_commitments(self, round_number: int, commitments: dict[str, bytes]) -> None:
        """A closed secure round's (or cohort's) commitments, for its late masked inputs; the
        oldest go beyond COMMITMENTS_KEPT (they were kept for the whole job: 32 bytes per device
        and round)."""
        kept = self.secure_commitments
        kept[round_number] = commitments
        while len(kept) > COMMITMENTS_KEPT:
            del kept[min(kept)]

    def record_noised_round(self, round_number: int) -> None:
        self.noised_rounds.append(round_number)
        if self.privacy is not None:
            self.privacy.record_round(round_number)

    # ----------------------------------------------------------- deciding and closing

    def decide(self, now: float) -> Decision:
        return self.policy.decide(now)

    def arrivals_to_decide(self) -> int | None:
        """How many more updates can arrive before one may change :meth:`decide`'s answer
        (statuses aside), or None: any arrival may (virtual time's lookahead)."""
        if self.secure_round is not None:
            return None
        return self.policy.arrivals_to_decide()

    @property
    def deadline(self) -> float | None:
        """When to decide next: the round's deadline, or an earlier policy timer."""
        return self.policy.deadline()

    def open_secure(self, now: float, observer: Callable[[str, Any], None] | None = None) -> Any:
        """The SecAgg+ session of the round just opened (``SecureRound``): its keys phase
        starts at ``now``; ``observer(label, vector)`` sees every vector the session holds."""
        from edge_fl.server.secure import SecureRound

        rnd, plan = self.current, self.secure
        assert rnd is not None and plan is not None and rnd.nonce is not None
        params = plan.params(self.settings.job, rnd.number, rnd.nonce, tuple(rnd.selected))
        self.secure_round = SecureRound(plan, params, now, rnd.deadline, observer)
        return self.secure_round

    def close_secure(
        self, now: float, wall_time_s: float, why: str | None = None
    ) -> dict[str, Any]:
        """Close the open secure round on its session's outcome (``why``: it ends unfinished,
        e.g. a stop or a restart: the model is unchanged); its record, not yet committed."""
        from edge_fl.secagg import Failed

        sr, self.secure_round = self.secure_round, None
        if sr is not None:
            outcome, info = sr.result(why)
            if self.secure is not None and self.secure.device_key is not None:
                assert self.current is not None
                self.keep_commitments(self.current.number, sr.commitments())
        else:  # rebuilt from a journal: its session died with the process
            outcome = Failed("keys", why or "the round ended unfinished")
            info = {"phases": {}, "outcome": "failed", "rejected_by_reason": {},
                    "failed": {"phase": outcome.phase, "reason": outcome.reason}}  # fmt: skip
        return self.close_secure_round(now, wall_time_s, outcome, info)

    def close_secure_round(
        self, now: float, wall_time_s: float, outcome: Any, info: dict[str, Any]
    ) -> dict[str, Any]:
        """Close the open secure round on its session's outcome (``edge_fl.secagg.Summed`` or
        ``Failed``, or None: it never finished): the decoded mean of the contributors applied
        with the server learning rate, or the model unchanged and the round skipped."""
        assert self.current is not None and self.secure is not None
        rnd, plan = self.current, self.secure
        total = getattr(outcome, "total", None)
        contributors = tuple(getattr(outcome, "contributors", ()))
        new_params = None
        if total is not None and contributors:
            for device in contributors:
                rnd.accept(device)
            seed = round_seed(self.settings.job, rnd.number, rnd.nonce or b"")
            mean = plan.mechanism.secure_decode(total, len(contributors), plan.layout, seed)
            mean = np.asarray(mean, dtype=np.float32)
            if mean.shape != self.params.shape:
                raise ValueError(
                    f"secure_decode gave {mean.shape}, the model is {self.params.shape}"
                )
            new_params = self.params + np.float32(self.settings.server_lr) * mean
        return self.close_round(now, wall_time_s, skipped=new_params is None,
                                secure=(new_params, info))  # fmt: skip

    def close_round(
        self,
        now: float,
        wall_time_s: float,
        skipped: bool = False,
        secure: tuple[np.ndarray | None, dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Apply the round's aggregate (unless skipped), evaluate, and return its record.
        ``secure``: a secure round's new parameters (None: unchanged) and record fields."""
        assert self.current is not None and self.strategy is not None
        rnd, strategy = self.current, self.strategy
        self.policy.closing(rnd)
        info: dict[str, Any] = {}
        applies = strategy.count > 0 or self.mechanism.acts_on_empty_round
        if secure is not None:
            new_params, info = secure[0], {"secure": secure[1]}
            applies = new_params is not None
        if not skipped and applies and secure is None:
            new_params, info = strategy.finish(self.params)
            if not np.isfinite(new_params).all():
                # a diverging setting (e.g. MagRR's step grown too large) must not corrupt the
                # model every later round builds on: keep the last good one and say so
                log.error("round %d: aggregate is not finite; model left unchanged", rnd.number)
                skipped = True
                info = {**info, "diverged": True}
        if not skipped and applies and secure is not None:
            assert new_params is not None  # applies: a secure round's sum was decoded
            if np.isfinite(new_params).all():
                self.params = new_params.astype(np.float32)
                self.version += 1
            else:
                log.error("round %d: secure aggregate is not finite; model left unchanged",
                          rnd.number)  # fmt: skip
                skipped = True
                info["diverged"] = True
        elif not skipped and applies:
            assert new_params is not None
            self.params = new_params
            self.version += 1
            self.record_noised_round(rnd.number)
            self.mechanism_state = strategy.state
        record = self._record(rnd, skipped, info, wall_time_s)
        self.retire()
        self.refused = set()
        self.strategy = None
        self.tally = RoundTally()
        self.policy.closed(record)
        return record

    def _record(
        self, rnd: Any, skipped: bool, info: dict[str, Any], wall_time_s: float
    ) -> dict[str, Any]:
        """The record of a round (or cohort) just closed, evaluated now; kept in ``records``."""
        accuracy = loss = None
        if self.evaluate is not None:
            accuracy, loss = self.evaluate(self.params)
        t = self.tally
        record: dict[str, Any] = {
            "round": rnd.number,
            "version": self.version,
            "status": "skipped" if skipped else "closed",
            "accuracy": accuracy,
            "loss": loss,
            "selected": len(rnd.selected),
            "target": rnd.target,
            "received": rnd.count,
            "late": t.late,
            "rejected": sum(t.rejected.values()),
            "rejected_by_reason": {str(k): v for k, v in sorted(t.rejected.items())},
            "rejection_samples": dict(t.samples),
            "capped_samples": t.capped_samples,
            "bad_status": sum(t.bad_status.values()),
            "foreign_status": t.foreign_status,
            "extended": rnd.extended,
            "bytes_up": t.bytes_up,
            "messages_up": t.messages_up,
            "bytes_down": t.bytes_down,
            "online": self.online_count,
            "mechanism": self.settings.mechanism,
            "epsilon": None,
            "stopped_devices": sum(1 for r in self.devices.values() if r.stopped),
            # device work: updates devices computed for the job that reached the aggregator, one
            # per (device, round), admitted or not (late and refused ones too), cumulative
            "device_updates": len(self.releases),
            "wall_time_s": wall_time_s,
            **rnd.staleness_stats(),
            **info,
        }
        if self.privacy is not None:
            record.update(self.privacy.metrics())
            record.update(self.privacy.device_metrics(self.devices))
        self.records.append(record)
        return record

    # ----------------------------------------------------------- secure FedBuff cohorts

    def open_cohort(self, now: float) -> tuple[Any, GlobalModel] | None:
        """Dispatch the next secure FedBuff cohort (``CohortPolicy.open_cohort``): the cohort
        and its global message, or None (no room, no cohorts left, too few devices)."""
        cohorts = self.cohorts
        assert cohorts is not None, "not a secure FedBuff job"
        return cohorts.open_cohort(now)

    def close_cohort(
        self, cohort: Any, now: float, wall_time_s: float, why: str | None = None
    ) -> dict[str, Any]:
        """Close a cohort on its session's outcome (``why``: it ends unfinished, a stop or a
        restart): its unmasked mean applied as one buffer with the staleness weight of
        (version now - base version), the same for every member; or the model unchanged and
        the cohort skipped (failed, stale beyond ``max_staleness``, not finite). Its record."""
        from edge_fl.secagg import Failed

        from .staleness import Staleness

        cohorts, plan = self.cohorts, self.secure
        assert cohorts is not None and plan is not None
        cohorts.drop(cohort)
        if cohort in cohorts.abandoned:
            cohorts.abandoned.remove(cohort)
        sr = cohort.session
        if sr is not None:
            outcome, info = sr.result(why)
            if plan.device_key is not None:
                self.keep_commitments(cohort.number, sr.commitments())
        else:  # rebuilt after a restart: its session died with the process
            outcome = Failed("keys", why or "the cohort ended unfinished")
            info = {"phases": {}, "outcome": "failed", "rejected_by_reason": {},
                    "failed": {"phase": outcome.phase, "reason": outcome.reason}}  # fmt: skip
        staleness = self.version - cohort.base_version
        info["base_version"] = cohort.base_version
        cohort.staleness = staleness
        total = getattr(outcome, "total", None)
        contributors = tuple(getattr(outcome, "contributors", ()))
        cohort.contributors = contributors
        skipped = True
        if total is not None and contributors:
            s = self.settings
            if staleness > s.max_staleness:
                info["stale"] = f"staleness {staleness} > max_staleness {s.max_staleness}"
            else:
                weight = (s.staleness or Staleness()).weight(staleness)
                info["weight"] = weight
                seed = round_seed(s.job, cohort.number, cohort.nonce)
                mean = plan.mechanism.secure_decode(total, len(contributors), plan.layout, seed)
                mean = np.asarray(mean, dtype=np.float32)
                if mean.shape != self.params.shape:
                    raise ValueError(
                        f"secure_decode gave {mean.shape}, the model is {self.params.shape}"
                    )
                new_params = self.params + np.float32(s.server_lr * weight) * mean
                if np.isfinite(new_params).all():
                    self.params = new_params.astype(np.float32)
                    self.version += 1
                    skipped = False
                else:
                    log.error("cohort %d: secure aggregate is not finite; model left unchanged",
                              cohort.number)  # fmt: skip
                    info["diverged"] = True
        record = self._record(cohort, skipped, {"secure": info}, wall_time_s)
        self.tally = RoundTally()
        self.policy.closed(record)
        return record

    def restore_cohort(self, rec: dict[str, Any]) -> None:
        """Replay of a journaled ``cohort`` record: skipped on resume, its inputs charged."""
        cohorts = self.cohorts
        if cohorts is None:
            raise ValueError("a cohort record belongs to a secure FedBuff job")
        cohorts.restore_cohort(rec)

    def restore_masked(self, number: int, devices: list[str]) -> None:
        """Replay of a journaled ``masked`` record: the ingest workers were told U2 of this
        secure round or cohort, so they may have charged its masked inputs (what a resume
        charges: ``handed_to_workers``)."""
        if self.cohorts is not None:
            self.cohorts.restore_masked(number, devices)
        else:
            self.handed_to_workers[number] = frozenset(devices)

    def retire(self) -> None:
        """The open round stops admitting (its strategy stays until the caller drops it): it
        is remembered, so its late answers are still charged."""
        rnd = self.current
        assert rnd is not None
        self.previous, self.current = rnd, None
        self.remember(rnd)

    def mirror(self, msg: GlobalModel, wrap: Callable[[Strategy], Any]) -> None:
        """Open the round a coordinator's global message describes (a sharded worker): its
        version, mechanism state, selection and nonce; the coordinator enforces the target and
        the deadline. ``wrap`` wraps the round's fresh strategy (a worker records what it
        folds)."""
        assert msg.selected is not None
        selected = frozenset(msg.selected)
        self.version, self.round_number = msg.version, msg.round
        self.mechanism_state = self.mechanism.decode_state(msg.mechanism_state)
        fields = {
            "number": msg.round,
            "base_version": msg.version,
            "selected": selected,
            "target": len(selected),
            "min_updates": 0,
            "deadline_s": float("inf"),
            "nonce": msg.nonce,
        }
        self.current = self.policy.build_round(fields, 0.0)
        self.strategy = wrap(self.new_strategy())
        self.refused = set()

    def after_last_round(self) -> dict[str, Any]:
        """What arrived after the last round closed (late answers, re-deliveries, strays): it
        belongs to no round's record, so the summary carries it."""
        t = self.tally
        return {
            "messages_up": t.messages_up,
            "bytes_up": t.bytes_up,
            "late": t.late,
            "rejected_by_reason": {str(k): v for k, v in sorted(t.rejected.items())},
            "rejection_samples": dict(t.samples),
            "device_updates": len(self.releases),  # the job's total device work (see records)
            **self.policy.summary(),
        }

    def public_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """What may go on the metrics topic, which devices can read: without participation
        counts when amplification by Poisson sampling is claimed (they would void it)."""
        return public_fields(record, poisson=self.settings.sample_rate is not None)

    # ----------------------------------------------------------- state

    def snapshot(self, *, ledger: bool = True) -> dict[str, Any]:
        """The engine's state between rounds as plain data (JSON-able; the parameters apart):
        the ledger's releases, the selection history, the fleet view and the policy's own.
        ``ledger=False``: without the three lists that grow with the job (``releases``,
        ``noised_rounds``, ``history``), which a checkpoint appends to its ledger file instead
        (:mod:`edge_fl.server.ledger_file`); :meth:`restore` wants them back in ``state``."""
        state: dict[str, Any] = {
            "run": self.run_id.hex(),
            "version": self.version,
            "round_number": self.round_number,
            "mechanism_state": self.mechanism.encode_state(self.mechanism_state),
            "rng": generator_state(self.rng),
            "noise_rng": generator_state(self.noise_rng),
            # the fleet view when the round closed, for replaying the journal's admissions
            # (declared sample counts, known devices); live retained statuses replace it
            "devices": {
                dev: [rec.online, rec.n_samples, rec.stopped]
                for dev, rec in sorted(self.devices.items())
            },
        }
        if ledger:
            state["releases"] = self.releases
            state["noised_rounds"] = self.noised_rounds
            # every closed round's nonce and selection: a straggler's late answer is charged
            state["history"] = {
                str(r): [None if n is None else base64.b64encode(n).decode(), sorted(sel)]
                for r, (n, sel) in sorted(self.history.items())
            }
        if self.previous is not None:  # a late update for it is still charged
            state["previous"] = round_fields(self.policy.kind, self.previous)
        state.update(self.policy.snapshot())
        return state

    def restore(self, state: dict[str, Any], params: np.ndarray) -> None:
        """The inverse of :meth:`snapshot` on a core freshly built from the same config (the
        fleet view is left alone: see :func:`fleet_view`)."""
        self.params = params.astype(np.float32)
        if isinstance(state.get("run"), str):  # checkpoints before run ids had none
            self.run_id = bytes.fromhex(state["run"])
        self.version = int(state["version"])
        self.round_number = int(state["round_number"])
        carried = state.get("mechanism_state")
        if carried is not None:
            self.mechanism_state = self.mechanism.decode_state(carried)
        for device, rnd, n in state["releases"]:
            self.record_release(device, int(rnd), int(n))
        for rnd in state["noised_rounds"]:
            self.record_noised_round(int(rnd))
        if state.get("previous") is not None:
            self.previous = self.policy.build_round(field_values(state["previous"]), 0.0)
        for r, (nonce, selected) in state.get("history", {}).items():
            self.history[int(r)] = (
                None if nonce is None else base64.b64decode(nonce),
                frozenset(selected),
            )
            self.ever_selected.update(selected)
        restore_generator(self.rng, state.get("rng"))
        restore_generator(self.noise_rng, state.get("noise_rng"))
        self.policy.restore(state)

    def forget(self) -> None:
        """Back to a fresh run's state (a sharded worker whose coordinator started a new run of
        the job: the earlier run's round numbers come again)."""
        self.current = self.previous = self.strategy = self.secure_round = None
        self.last_opened_at = None
        self.history.clear()
        self.ever_selected.clear()
        self._released.clear()
        self.releases.clear()
        self.refused = set()
        self.tally = RoundTally()
        self.version = self.round_number = 0
        self.policy.forget()

    def take_tally(self) -> RoundTally:
        """The open round's tally, replaced by a fresh one (a worker reports its share)."""
        t, self.tally = self.tally, RoundTally()
        return t


def no_wall_clock() -> float:
    """A core without a service has no wall clock: its messages' ``ts`` is 0 (informational)."""
    return 0.0


def fleet_view(state: dict[str, Any]) -> dict[str, DeviceRecord]:
    """A snapshot's fleet view as the core's ``devices``."""
    return {
        dev: DeviceRecord(online=bool(o), n_samples=int(n), stopped=st)
        for dev, (o, n, st) in state.get("devices", {}).items()
    }


def policy_for(
    settings: AggregatorSettings, concurrency: int | None, dispatch_timeout_s: float | None
) -> Callable[[AggregatorCore], RoundPolicy]:
    """The round policy of ``settings.mode``."""
    if settings.mode == "sync":
        if concurrency:
            raise ValueError("a concurrency limit is for the asynchronous modes")
        return SyncPolicy
    from .asynchronous import AsyncPolicy

    return lambda core: AsyncPolicy(core, concurrency, dispatch_timeout_s)


def _plain(n_params: int) -> Mechanism:
    """Plain FedAvg for a core built without a job (tests, tools): only n_params matters."""
    from edge_fl.config import PrivacyConfig
    from edge_fl.mechanisms import JobFacts

    facts = JobFacts(
        rounds=1,
        n_devices=1,
        expected_participants=1.0,
        n_params=n_params,
        local_lr=0.1,
        local_epochs=1,
        batch_size=1,
        min_dataset_size=1,
        max_uploads=1,
    )
    return NoPrivacy(PrivacyConfig(), facts)
