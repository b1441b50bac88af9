"""Which global messages a device takes as the aggregator's word, per downlink connection.

A device's own session and the fleet's one shared downlink run this same check before any device
reacts (:mod:`edge_fl.device.policy`): the signature (when a key is configured), the model's
parameter count, the job id, the round/version window (:class:`edge_fl.protocol.GlobalWindow`),
end-of-job markers and the config digest. What passes becomes one event for the device policy:
:class:`~edge_fl.device.policy.ModelArrived` or :class:`~edge_fl.device.policy.JobEnded`.

A done marker never moves the window: a previous run's marker, still retained on the broker when a
fleet connects before the new aggregator clears it, would otherwise make the new run's round 1
"stale" and stall every device (docs/protocol.md, settled question 17).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edge_fl.device.policy import JobEnded, ModelArrived
from edge_fl.protocol import GlobalModel, GlobalWindow, PayloadRejected, Topics, decode_global

if TYPE_CHECKING:
    from edge_fl.protocol.signing import Verifier

log = logging.getLogger("edge_fl.device")

#: the counter key of global messages refused for another config digest
DIGEST_MISMATCH = "config_digest"


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
            if msg.done:
                if retained and not self.joined:
                    return None  # an earlier run's end marker, left on the broker
                rejection = self.window.check(msg)
            else:
                rejection = self.window.accept(msg)
            if rejection is not None:
                raise rejection
        except PayloadRejected as exc:
            self._count(exc.reason, exc.detail)
            return None
        if not msg.done:
            self.joined = True
        return msg

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
        return ModelArrived(msg)

    def _count(self, reason: str, detail: str, level: int = logging.WARNING) -> None:
        self.rejected[reason] += 1
        seen = self.rejected[reason]
        if seen <= 3 or seen % 1000 == 0:  # a flood is a count, not a flood of log lines
            log.log(level, "ignoring a global model (%s, %d so far): %s", reason, seen, detail)
