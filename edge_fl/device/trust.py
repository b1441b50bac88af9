"""Which global messages a device takes as the aggregator's word, per downlink connection.

A device's own session and the fleet's one shared downlink run this same check before any device
reacts (:mod:`edge_fl.device.policy`): the signature (when a key is configured), the model's
parameter count, the job id, the round/version window (:class:`edge_fl.protocol.GlobalWindow`),
end-of-job markers and the config digest. What passes becomes one event for the device policy:
:class:`~edge_fl.device.policy.ModelArrived` or :class:`~edge_fl.device.policy.JobEnded`.

A done marker never moves the window: a previous run's marker, still retained on the broker when a
fleet connects before the new aggregator clears it, would otherwise make the new run's round 1
"stale" and stall every device (docs/protocol.md, settled question 17).

Run id: a signature proves origin, not which run of a job id a message belongs to, so every global
message and job document carries the aggregator run's ``run`` (docs/protocol.md, "Run id"). A
device that joined from a job document is bound to its run; one provisioned by hand learns the
run from the first round it accepts. A message of another run, the done marker above all, is
refused: a recorded done marker of run 1 replayed in run 2 ends nothing.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edge_fl.device.policy import JobEnded, ModelArrived
from edge_fl.protocol import (
    GlobalModel,
    GlobalWindow,
    PayloadRejected,
    Reject,
    Topics,
    decode_global,
)

if TYPE_CHECKING:
    from edge_fl.protocol.signing import Verifier

log = logging.getLogger("edge_fl.device")

#: the counter key of global messages refused for another config digest
DIGEST_MISMATCH = "config_digest"
#: the counter key of global messages refused for carrying another run's id (or none)
WRONG_RUN = "wrong_run"
#: a round without secure parameters (``sa``) in a job that runs secure aggregation: training
#: on it would put this device's update on the broker in the clear (a downgrade)
NOT_SECURE = "not_secure"
#: no device trains from a model with a parameter beyond this: a finite but extreme one (a forged
#: q8 block with lo = 3e38) overflows training into a non-finite update. Real models stay far
#: below it; the bound keeps float32 training of every shipped model finite (issue 24, item 10)
MAX_GLOBAL_ABS = 1e6


def digest_agrees(mine: str, theirs: str) -> bool:
    """The one config-digest rule (docs/protocol.md, "Config digest"): ``""`` on either side
    means "not checked"; otherwise the two must be equal."""
    return not mine or not theirs or mine == theirs


@dataclass
class Trust:
    """What a device accepts as the aggregator's word: a signature (when a key is configured),
    the model's parameter count, and a round/version window (``edge_fl.protocol.window``)."""

    verifier: Verifier | None = None
    window: GlobalWindow = field(default_factory=GlobalWindow)
    rejected: Counter = field(default_factory=Counter)
    #: a round of this run was seen: a retained end-of-job marker is then this run's end (the
    #: device was away when it was published), not an earlier run's left on the broker
    joined: bool = False
    #: the run this device takes part in (docs/protocol.md, "Run id"); None: not known yet
    run: bytes | None = None
    #: ``run`` came from the job document the device joined with: it never changes
    run_bound: bool = False
    #: the job runs secure aggregation: a round must carry its signed ``sa`` map
    secure: bool = False

    def bind_run(self, run: bytes | None) -> None:
        """Take part in ``run`` only (the job document's); None: learn it from the first round."""
        self.run, self.run_bound = run, run is not None

    def admit(
        self, payload: bytes, topics: Topics, expected_dim: int, *, retained: bool = False
    ) -> GlobalModel | None:
        """The decoded global message, or None (counted, logged) if it must be ignored.

        ``retained``: the broker delivered a stored message (on subscribe), not a live one. A
        done marker is checked against the window but never moves it; a retained one before any
        round of this run is an earlier run's and is ignored."""
        try:
            msg = decode_global(payload, verifier=self.verifier, expected_dim=expected_dim)
            if msg.job != topics.job:
                return None
            if not self._same_run(msg):
                return None
            if msg.done:
                if retained and not self.joined:
                    return None  # an earlier run's end marker, left on the broker
                rejection = self.window.check(msg)
            else:
                _check_plausible(msg)
                rejection = self.window.accept(msg)
            if rejection is not None:
                raise rejection
        except PayloadRejected as exc:
            self._count(exc.reason, exc.detail)
            return None
        if not msg.done:
            self.joined = True
            if self.run is None:
                self.run = msg.run  # a device provisioned by hand learns its run here
        return msg

    def _same_run(self, msg: GlobalModel) -> bool:
        """Whether ``msg`` belongs to this device's run (counted and logged if not)."""
        if self.run is None or msg.run == self.run:
            return True
        if not self.run_bound and not msg.done and msg.run is not None and self.window.rejoining:
            # after a reconnect a learned run gives way to a new run of the job (its aggregator
            # was restarted afresh): its rounds start again, so the window does too
            log.info("a new run %s of job %s: following it", msg.run.hex()[:8], msg.job)
            self.window.reset()
            self.window.rejoin()
            self.run = None
            return True
        theirs = "no run id" if msg.run is None else f"run {msg.run.hex()[:8]}"
        self._count(
            WRONG_RUN,
            f"{'done marker' if msg.done else f'round {msg.round}'} of {theirs}; this device "
            f"takes part in run {self.run.hex()[:8]} (a replay of another run's message)",
        )
        return False

    def receive(
        self,
        payload: bytes,
        topics: Topics,
        expected_dim: int,
        *,
        retained: bool = False,
        digest: str = "",
    ) -> ModelArrived | JobEnded | None:
        """The policy event a global payload makes, or None if no device should react to it.

        ``digest``: this side's config digest (``""``: not checked); a model of another config
        is admitted (it moves the window: it is the aggregator's) and then refused for training.
        """
        msg = self.admit(payload, topics, expected_dim, retained=retained)
        if msg is None:
            return None
        if msg.done:
            return JobEnded(msg)
        if not digest_agrees(digest, msg.config_digest):
            self._count(
                DIGEST_MISMATCH,
                f"round {msg.round}: the aggregator's config digest {msg.config_digest} differs "
                f"from this device's {digest} (model, data, training or privacy settings "
                "disagree); not training",
                level=logging.ERROR,
            )
            return None
        if self.secure and msg.secure is None:
            self._count(
                NOT_SECURE,
                f"round {msg.round}: this job runs secure aggregation but the global message "
                "carries no secure parameters (sa): a downgrade that would publish this "
                "device's update in the clear; not training",
                level=logging.ERROR,
            )
            return None
        return ModelArrived(msg)

    def _count(self, reason: str, detail: str, level: int = logging.WARNING) -> None:
        self.rejected[reason] += 1
        seen = self.rejected[reason]
        if seen <= 3 or seen % 1000 == 0:  # a flood is a count, not a flood of log lines
            log.log(level, "ignoring a global model (%s, %d so far): %s", reason, seen, detail)


def _check_plausible(msg: GlobalModel) -> None:
    """PayloadRejected (``implausible``) for a model no device should train from."""
    peak = float(abs(msg.params).max()) if len(msg.params) else 0.0
    if not peak <= MAX_GLOBAL_ABS or not math.isfinite(peak):
        raise PayloadRejected(
            Reject.IMPLAUSIBLE,
            f"round {msg.round}: a parameter of magnitude {peak:.3g} exceeds {MAX_GLOBAL_ABS:g} "
            "(training from it would overflow); not training",
            field="w",
        )
