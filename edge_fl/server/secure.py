"""A job's secure rounds: the SecAgg+ parameters every round of the job uses (calibrated or
checked once, when the job is assembled), the ``sa`` map that carries them to devices, and the
round's :class:`~edge_fl.secagg.RoundParams`, and :class:`SecureRound`: one open round's SecAgg+
session on the aggregator's clock. Pure: the caller passes ``now`` and carries out the inbox
messages the round returns (the service publishes them; tests read them).

Specification: docs/protocol.md, "Secure aggregation"; docs/specs/secagg.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edge_fl.mechanisms.secure import SecureJob, SecureLayout, SecureSum, secure_job_from
from edge_fl.protocol.secure import SA_KEYS, round_seed
from edge_fl.secagg import (
    AggregatorSession,
    CalibrationError,
    Deliver,
    Failed,
    Finished,
    Rejected,
    RoundParams,
    calibrate,
    check,
    roster_graph,
)

__all__ = ["SecurePlan", "SecureRound", "plan_secure", "round_seed"]


@dataclass(frozen=True)
class SecurePlan:
    """The job's secure-aggregation parameters, for ``selected`` devices per round."""

    mechanism: SecureSum
    job: SecureJob
    layout: SecureLayout
    selected: int
    neighbours: int
    threshold: int
    min_survivors: int
    phase_timeout_s: float
    dropout: float
    collude: float
    #: the devices' signing keys (``security.device_keys``: ``edge_fl.protocol.device_keys.
    #: DeviceKeys``), or None: SecAgg+ messages unsigned
    device_keys: Any = None

    @property
    def device_key(self) -> Any:
        """A device id -> its public signing key (None: nothing is signed)."""
        return None if self.device_keys is None else self.device_keys.key_of

    def for_roster(self, n: int) -> tuple[int, int]:
        """(k, t) for a round of ``n`` devices (``edge_fl.secagg.roster_graph``)."""
        return roster_graph(self.neighbours, self.threshold, n)

    def wire(self, n: int) -> dict[str, Any]:
        """The global message's ``sa`` map for a roster of ``n`` devices."""
        k, t = self.for_roster(n)
        lay = self.layout
        values = {
            "b": lay.bits,
            "k": k,
            "md": lay.modular,
            "ms": self.min_survivors,
            "n": lay.length,
            "q": lay.max_int,
            "t": t,
        }
        return {key: values[key] for key in SA_KEYS}

    def params(self, job: str, rnd: int, nonce: bytes, roster: tuple[str, ...]) -> RoundParams:
        k, t = self.for_roster(len(roster))
        lay = self.layout
        return RoundParams(
            job=job,
            round=rnd,
            nonce=nonce,
            roster=tuple(sorted(roster)),
            neighbours=k,
            threshold=t,
            bits=lay.bits,
            dim=lay.length,
            max_int=0 if lay.modular else lay.max_int,
            min_survivors=self.min_survivors,
            noise_floor=self.noise_floor,
        )

    @property
    def noise_floor(self) -> int:
        """The noise shares a sum keeps (``RoundParams.noise_floor``): the survivors floor when
        the layout's noise is removable and no device keys are in use (device keys mean a
        possibly malicious aggregator, which could ask every survivor; their devices refuse)."""
        if self.layout.removable_noise and self.device_keys is None:
            return self.min_survivors
        return 0


def plan_secure(
    cfg: Any,  # edge_fl.config.SecureAggregationConfig
    mechanism: SecureSum,
    n_params: int,
    selected: int,
    against_lying: bool = False,
) -> SecurePlan:
    """Calibrate (``auto``) or check the job's setting; ValueError with one line if unsound.
    ``against_lying``: an aggregator that lies about who dropped must not collect t shares of
    both of a device's secrets (2t > k, ``edge_fl.secagg.calibrate``): a job with device keys."""
    if selected < 2:
        raise ValueError(f"secure aggregation needs at least 2 devices per round, got {selected}")
    ms = cfg.min_survivors
    if ms != "auto" and not 2 <= ms <= selected:
        raise ValueError(f"min_survivors = {ms} must be in [2, {selected}] (devices per round)")
    sjob = secure_job_from(cfg, n_params, selected)
    assert sjob is not None  # enabled: the job asked for secure rounds
    ms = sjob.min_survivors
    layout = mechanism.secure_layout(sjob)
    # the core's bounds take (clip, step) with Q = ceil(clip / step): the layout's Q is max_int
    clip, step = (1.0, 1.0) if layout.modular else (float(max(layout.max_int, 1)), 1.0)
    kw = {"dropout": cfg.dropout, "collude": cfg.collude, "against_lying": against_lying}
    try:
        if cfg.neighbours == "auto" or cfg.threshold == "auto":
            cal = calibrate(selected, clip, step, **kw)
            k = cal.neighbours if cfg.neighbours == "auto" else cfg.neighbours
            t = cal.threshold if cfg.threshold == "auto" else cfg.threshold
            if cfg.neighbours != "auto" or cfg.threshold != "auto":
                t = min(t, k)
        else:
            k, t = cfg.neighbours, cfg.threshold
        check(selected, k, t, layout.bits, clip, step, **kw)
    except CalibrationError as exc:
        raise ValueError(f"secure_aggregation: {exc}") from None
    return SecurePlan(
        mechanism=mechanism,
        job=sjob,
        layout=layout,
        selected=selected,
        neighbours=k,
        threshold=t,
        min_survivors=ms,
        phase_timeout_s=cfg.phase_timeout_s,
        dropout=cfg.dropout,
        collude=cfg.collude,
    )


def masked_signed(plan: SecurePlan, job: str, device: str, payload: bytes, bh: bytes) -> bool:
    """Whether ``payload`` (an ``mx``) carries ``device``'s valid signature over ``bh`` and its
    masked vector (``security.device_keys``; True without a directory: nothing is signed)."""
    if plan.device_key is None:
        return True
    import edge_fl.secagg.messages as M
    from edge_fl.protocol import PayloadRejected

    try:
        msg = M.decode(payload, len(payload))
    except PayloadRejected:
        return False
    b = msg.body
    if msg.kind != "mx" or b.get("sig") is None:
        return False
    body = M.masked_body(job, msg.round, msg.nonce, device, bh, b["m"], b["y"])
    return bool(plan.device_key(device).verify(body, b["sig"]))


class SecureRound:
    """The open sync round's SecAgg+ session, its phase deadlines and what it refused.

    A phase ends when the session has every answer it waits for, or at its deadline
    (:meth:`tick`): ``phase_timeout_s`` after it began, and the masked phase no sooner than the
    round's own deadline (devices train from the round's opening, beside the keys and shares
    phases: a device slower than a phase timeout but within the round's deadline contributes).
    Not checkpointed: a restart skips the round (docs/specs/secagg.md, section 9)."""

    def __init__(
        self,
        plan: SecurePlan,
        params: RoundParams,
        now: float,
        round_deadline: float,
        observer: Callable[[str, Any], None] | None = None,
        probation: frozenset[str] = frozenset(),
    ) -> None:
        self.plan = plan
        self.session = AggregatorSession(params, observer=observer, device_key=plan.device_key)
        self.round_deadline = round_deadline
        self.deadline = self._phase_deadline("keys", now)
        #: members that were silent in their last round (advertised no keys): once every other
        #: member has advertised, the keys phase waits for them only as long again as it took
        #: so far, not to its timeout (a silent device held every cohort it was in to it)
        self.probation = probation & set(params.roster)
        self._began = now
        #: when each member's keys were accepted, seconds into the keys phase
        self.advertised_at: dict[str, float] = {}
        self.rejected: Counter = Counter()
        self.finished = False  # the session ended (summed or failed)

    @property
    def phase(self) -> str:
        return self.session.phase

    @property
    def outcome(self) -> Any:
        """``edge_fl.secagg.Summed`` or ``Failed``, or None while the round runs."""
        return self.session.outcome

    def receive(self, device: str, payload: bytes, now: float) -> list[Deliver]:
        """A SecAgg+ message from ``device``; the inbox messages to publish."""
        before = self.phase
        keys = self.session.counts["keys"] if before == "keys" else 0
        out = self._take(self.session.receive(device, payload), before, now)
        if before == "keys" and self.session.counts["keys"] > keys:
            self.advertised_at[device] = now - self._began
        if self.probation and self.phase == "keys" and self.outcome is None:
            waiting = self.session.waiting
            if waiting <= self.probation and self.session.counts["keys"] >= self.plan.min_survivors:
                self.deadline = min(self.deadline, now + (now - self._began))
        return out

    def shorten_if_gone(self, online: Callable[[str], bool], now: float, settle: float) -> bool:
        """Every device the phase still waits for is offline (its last will, or it left): the
        phase ends ``settle`` seconds from now rather than at its timeout (a status may flap)."""
        waiting = self.session.waiting
        if self.outcome is not None or not waiting or any(online(d) for d in waiting):
            return False
        if now + settle < self.deadline:
            self.deadline = now + settle
            return True
        return False

    def late_advertiser(self) -> str | None:
        """The member whose keys came last, if more than twice as late as any other's and by
        more than a tenth of the phase timeout (what a device holding cohorts back does)."""
        if len(self.advertised_at) < 2:
            return None
        *_, (_, t2), (last, t1) = sorted(self.advertised_at.items(), key=lambda kv: kv[1])
        if t1 > 2 * t2 and t1 - t2 > 0.1 * self.plan.phase_timeout_s:
            return last
        return None

    def tick(self, now: float) -> list[Deliver]:
        """Close the phase whose deadline has passed (nothing before it)."""
        if self.outcome is not None or now < self.deadline:
            return []
        before = self.phase
        out = self._take(self.session.close_phase(), before, now)
        if self.outcome is None and self.phase == before:
            self.deadline = self._phase_deadline(self.phase, now)  # never: a closed phase moves
        return out

    @property
    def number(self) -> int:
        """The round's number (a FedBuff cohort's: its cohort number)."""
        return self.session.params.round

    @property
    def forwarded(self) -> frozenset[str]:
        """U2 from the masked phase on: the devices whose masked inputs the round waits for."""
        return self.session.forwarded

    def merge_masked(self, devices: list[str], total: Any, now: float) -> list[Deliver]:
        """Sharded ingest: the masked inputs the workers summed (``total``, in Z_2^b), merged
        into the session, which then ends its masked phase (the workers' shares are taken
        once, when the phase ends); the unmask requests to publish. ValueError: nothing merged."""
        before = self.phase
        out = self._take(self.session.merge_masked(devices, total), before, now)
        if self.outcome is None and self.phase == "masked":
            out += self._take(self.session.close_phase(), "masked", now)
        return out

    def late(self) -> None:
        self.rejected["late"] += 1

    def commitments(self) -> dict[str, bytes]:
        """The seed commitments of the devices whose keys the round accepted."""
        return self.session.commitments()

    def result(self, why: str | None = None) -> tuple[Any, dict[str, Any]]:
        """The outcome (a ``Failed`` one with ``why`` if the round ends unfinished: a stop, a
        restart) and the record's ``secure`` map."""
        outcome = self.outcome
        if outcome is None:
            outcome = Failed(self.phase, why or "the round ended unfinished")
        info: dict[str, Any] = {
            "phases": self.session.counts,
            "outcome": "summed" if not isinstance(outcome, Failed) else "failed",
            "rejected_by_reason": dict(sorted(self.rejected.items())),
        }
        if isinstance(outcome, Failed):
            info["failed"] = {"phase": outcome.phase, "reason": outcome.reason}
        else:
            if outcome.altered:  # unmask answers with shares off their polynomial: summed around
                info["altered"] = list(outcome.altered)
            if self.plan.layout.removable_noise:  # distributed DP: whose noise protects the sum
                # the contributors never asked for their noise (an asked device's late answer
                # still reveals it, so it does not count), and whose noise was removed
                info["noise_shares"] = len(outcome.contributors) - len(outcome.noise_asked)
                info["noise_removed"] = list(outcome.denoised)
        return outcome, info

    def _take(self, effects: list, before: str, now: float) -> list[Deliver]:
        out: list[Deliver] = []
        for effect in effects:
            if isinstance(effect, Deliver):
                out.append(effect)
            elif isinstance(effect, Rejected):
                self.rejected[effect.reason] += 1
            elif isinstance(effect, Finished):
                self.finished = True
        if self.phase != before:
            self.deadline = self._phase_deadline(self.phase, now)
        return out

    def _phase_deadline(self, phase: str, now: float) -> float:
        deadline = now + self.plan.phase_timeout_s
        if phase == "masked":
            deadline = max(deadline, self.round_deadline)
        return deadline
