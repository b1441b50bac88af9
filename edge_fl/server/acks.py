"""Which updates get an ack on ``ack/<device>``, and what it says (docs/protocol.md, Ack).

Why a module of its own: the reply policy (``security.acks``: off, rejections, all), its flood
cap, and matching each reply to the update it answers (the round ``r``) are protocol decisions
that do not depend on how the service moves bytes; kept apart they are testable without a broker.

Every ack carries the update's ``r`` when the payload had a readable one (accepted, the
aggregator's own rejections such as ``wrong_nonce``, ``duplicate``, ``future``, and the decoder's
after the key check), so a device can match it to the update it sent. An async update held for a
later window gets no ack while held; its verdict is acked when a window takes or refuses it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgpack

from edge_fl.protocol import Reject, ack_for, encode_ack

__all__ = ["AckPolicy", "round_of"]

#: the largest round an ack carries (the protocol's range of ``r``)
MAX_ROUND = 2**40


def round_of(payload: bytes) -> int | None:
    """The ``r`` an update's payload names, if it is a msgpack map with an int ``r`` in range.

    Read only to address an ack (the decoder has judged the update already); never raises."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception:
        return None
    r = obj.get("r") if isinstance(obj, dict) else None
    if isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= MAX_ROUND:
        return r
    return None


class AckPolicy:
    """Decides, per judged update, whether an ack goes out and builds its payload.

    ``mode``: ``off`` (none), ``rejections`` (negative acks only) or ``all``. A device that never
    announced itself (no status) gets nothing, and at most :attr:`MAX_PER_ROUND` per device and
    round: a flooding device gets its reason, not a flood back."""

    #: replies per device and round at most
    MAX_PER_ROUND = 5

    def __init__(self, mode: str = "off") -> None:
        self.mode = mode
        self._sent: Counter = Counter()
        self._round = -1
        #: async updates held for a later window, not yet acked: (device, r)
        self.held: set[tuple[str, int]] = set()

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def wants(self, reason: Reject | str | None) -> bool:
        """Whether an update with this verdict is acked at all under the mode."""
        return self.mode == "all" or (self.mode == "rejections" and reason is not None)

    def reply(
        self,
        core: Any,  # edge_fl.server.aggregator.AggregatorCore
        device: str,
        payload: bytes,
        reason: Reject | str | None,
        *,
        held: bool = False,
    ) -> bytes | None:
        """The ack for ``device``'s update ``payload`` judged ``reason`` (None: accepted, or
        ``held`` for a later window), or None when none goes out."""
        if not self.enabled or device not in core.devices:
            return None
        if held:  # its verdict comes when a window takes it: acked then
            rnd = round_of(payload)
            if rnd is not None and self.mode == "all":
                self.held.add((device, rnd))
            return None
        if not self.wants(reason):
            return None
        rejection = core.last_rejection if reason is not None else None
        detail = rejection.detail if rejection is not None and rejection.reason == reason else None
        rnd = getattr(rejection, "round", None) if detail is not None else None
        if rnd is None:
            rnd = round_of(payload)
        return self._capped(core, device, rnd, reason, detail)

    def held_verdicts(self, core: Any) -> list[tuple[str, bytes]]:
        """Acks for held updates whose window has now judged them (after a window opened):
        ``ok`` for those it took, its reason for those it refused as a window does (``stale``,
        ``duplicate``, ``future``, ``not_selected``). Those held again (the window is full) wait."""
        window = core.current
        if not self.held or window is None:
            return []
        out: list[tuple[str, bytes]] = []
        full = window.count >= window.target
        for device, rnd in sorted(self.held):
            if (device, rnd) in window.accepted:
                reason = None
            else:
                reason = window.admit(device, rnd, rnd)
                if reason is None:
                    if full:
                        continue  # held again for the next window
                    self.held.discard((device, rnd))
                    continue  # refused by the strategy or the ledger: that reason is not kept
            self.held.discard((device, rnd))
            payload = self._capped(core, device, rnd, reason, None)
            if payload is not None:
                out.append((device, payload))
        return out

    def _capped(
        self, core: Any, device: str, rnd: int | None, reason: Reject | str | None,
        detail: str | None,
    ) -> bytes | None:  # fmt: skip
        if core.round_number != self._round:
            self._round, self._sent = core.round_number, Counter()
        self._sent[device] += 1
        if self._sent[device] > self.MAX_PER_ROUND:
            return None
        return encode_ack(ack_for(device, reason, detail, rnd))
