"""Which dispatch messages a device takes as the aggregator's word, per downlink connection.

The companion of :mod:`edge_fl.device.trust` for the ``dispatch`` topic (docs/protocol.md,
"Dispatch message"), with the same connection state: the signature under the same key, the job
id, and the round/version window, which a dispatch is checked against but never moves (only a
global message does: :meth:`edge_fl.protocol.GlobalWindow.check_dispatch`). What passes becomes a
:class:`~edge_fl.device.policy.DispatchArrived` event for the device policy, which binds it to a
model by the version's nonce: a dispatch left on the broker by an earlier run, or forged without
the key, names a nonce no model of this run carries and asks nothing.
"""

from __future__ import annotations

import logging

from edge_fl.device.policy import DispatchArrived
from edge_fl.device.trust import Trust
from edge_fl.protocol import PayloadRejected, Reject, Topics
from edge_fl.protocol.dispatch import decode_dispatch

__all__ = ["receive_dispatch"]

log = logging.getLogger("edge_fl.device")


def receive_dispatch(trust: Trust, payload: bytes, topics: Topics) -> DispatchArrived | None:
    """The policy event a dispatch payload makes, or None (counted in ``trust.rejected`` under
    ``dispatch_<reason>``, logged) if no device should react to it."""
    try:
        dispatch = decode_dispatch(payload, verifier=trust.verifier)
        if dispatch.job != topics.job:
            return None
        rejection = trust.window.check_dispatch(dispatch.version)
        if rejection is not None:
            raise rejection
    except PayloadRejected as exc:
        key = f"dispatch_{exc.reason.value}"
        trust.rejected[key] += 1
        seen = trust.rejected[key]
        # an older version's dispatch is routine: it stays retained after the next version's
        # model went out, and a device that (re)subscribes receives both
        level = logging.DEBUG if exc.reason is Reject.STALE else logging.WARNING
        if seen <= 3 or seen % 1000 == 0:  # a flood is a count, not a flood of log lines
            log.log(level, "ignoring a dispatch (%s, %d so far): %s", exc.reason, seen, exc.detail)
        return None
    return DispatchArrived(dispatch)
