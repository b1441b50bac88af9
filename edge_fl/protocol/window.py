"""Which global messages a device accepts: monotonic and bounded round/version.

A signature proves who made a message, not that it is current: anyone who recorded a signed
message can publish it again (as a retained message, even). And without signatures, anyone who can
publish on the global topic of a broker without ACLs can send ``rnd = 2**40``. If a device simply
followed the highest round it has seen, that one message would make it treat every later real round
as old and ignore it for good. So a device accepts a global message only if

1. its round and version are at most ``max_round`` / ``max_version`` (absolute caps a device can
   know from its job config, e.g. the configured number of rounds), and
2. once a message has been accepted: its round and version are not below the last accepted ones
   (monotonic: a replayed older message is ``STALE``; an *equal* one is allowed, since QoS 1
   redelivers and the aggregator republishes the open round after a reconnect, and the ``done``
   marker carries the last round), and
3. neither is more than ``max_ahead`` beyond the last accepted one (``FUTURE``): a connected
   device sees every round, so a legitimate step is +1; a forged or misissued jump is refused
   instead of freezing the device.

A device that was disconnected may legitimately have missed many rounds: the runtime calls
:meth:`GlobalWindow.rejoin` after every (re)connection, which lifts rule 3 (never rules 1-2) for the
next accepted message, the broker's retained current model. With a :class:`~.signing.Verifier`,
only the aggregator can have produced that message. The ``done`` marker obeys the same rules, so an
old ``done`` cannot end a later round.

An aggregator restarted from scratch under the same job id starts again at round 0: a device
process that outlived it would reject the new run as ``STALE`` until :meth:`GlobalWindow.reset`.
Signatures give origin, not freshness across runs of the same job id and key: that is the run
id's job (every signed message carries the aggregator run's ``run``; a device refuses another
run's, ``edge_fl.device.trust``).

A dispatch message (who trains on a published version, :mod:`edge_fl.protocol.dispatch`) is
checked against the same window but never moves it: only a global message does. Its version may
not be below the last accepted one (its model is gone: ``STALE``) nor further ahead than a global
message could be (``FUTURE``); it may be ahead at all because a dispatch can arrive before the
global message it adds to (another topic: the broker orders each topic, not the two together).

The window is pure state (two integers and a flag); :func:`check_global` is the rule itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_fl.protocol.messages import GlobalModel, PayloadRejected, Reject

__all__ = ["DEFAULT_MAX_AHEAD", "GlobalWindow", "check_dispatch", "check_global"]

DEFAULT_MAX_AHEAD = 64


def check_global(
    msg: GlobalModel,
    last_round: int | None,
    last_version: int | None,
    *,
    max_ahead: int | None = DEFAULT_MAX_AHEAD,
    max_round: int | None = None,
    max_version: int | None = None,
) -> PayloadRejected | None:
    """None if a device that last accepted (last_round, last_version) may accept ``msg``.

    Otherwise the rejection (reason ``STALE`` or ``FUTURE`` with the numbers), returned, not raised,
    so a caller can count it. ``last_*`` None: nothing accepted yet (only the caps apply);
    ``max_ahead`` None: no bound on the step.
    """
    checks = (
        ("round", msg.round, last_round, max_round),
        ("version", msg.version, last_version, max_version),
    )
    for what, value, last, cap in checks:
        if cap is not None and value > cap:
            return PayloadRejected(
                Reject.FUTURE, f"{what} {value} exceeds the job's maximum of {cap}"
            )
        if last is None:
            continue
        if value < last:
            return PayloadRejected(
                Reject.STALE, f"{what} {value} is older than the last accepted {what} {last}"
            )
        if max_ahead is not None and value - last > max_ahead:
            return PayloadRejected(
                Reject.FUTURE,
                f"{what} {value} is more than {max_ahead} ahead of the last accepted {what} {last}",
            )
    return None


def check_dispatch(
    version: int,
    last_version: int | None,
    *,
    max_ahead: int | None = DEFAULT_MAX_AHEAD,
    max_version: int | None = None,
) -> PayloadRejected | None:
    """None if a device that last accepted a global message of ``last_version`` may take a
    dispatch for ``version``; otherwise the rejection (``STALE`` or ``FUTURE``), returned."""
    if max_version is not None and version > max_version:
        return PayloadRejected(
            Reject.FUTURE, f"dispatch version {version} exceeds the job's maximum of {max_version}"
        )
    if last_version is None:
        return None
    if version < last_version:
        return PayloadRejected(
            Reject.STALE,
            f"dispatch version {version} is older than the last accepted version {last_version}",
        )
    if max_ahead is not None and version - last_version > max_ahead:
        return PayloadRejected(
            Reject.FUTURE,
            f"dispatch version {version} is more than {max_ahead} ahead of the last accepted "
            f"version {last_version}",
        )
    return None


@dataclass
class GlobalWindow:
    """A device's memory of the last accepted global message; see the module docstring."""

    max_ahead: int | None = DEFAULT_MAX_AHEAD
    max_round: int | None = None
    max_version: int | None = None
    last_round: int | None = None
    last_version: int | None = None
    rejoining: bool = False  # the next accepted message may jump ahead (after a reconnect)

    def __post_init__(self) -> None:
        for name in ("max_ahead", "max_round", "max_version"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name} = {value!r} must be None or an integer >= 0")

    def check(self, msg: GlobalModel) -> PayloadRejected | None:
        """The rejection ``msg`` would get, without changing the window."""
        return check_global(
            msg,
            self.last_round,
            self.last_version,
            max_ahead=None if self.rejoining else self.max_ahead,
            max_round=self.max_round,
            max_version=self.max_version,
        )

    def check_dispatch(self, version: int) -> PayloadRejected | None:
        """The rejection a dispatch for ``version`` gets; the window never moves for one."""
        return check_dispatch(
            version,
            self.last_version,
            max_ahead=None if self.rejoining else self.max_ahead,
            max_version=self.max_version,
        )

    def accept(self, msg: GlobalModel) -> PayloadRejected | None:
        """Check ``msg`` and, if acceptable, remember it; returns the rejection or None."""
        rejection = self.check(msg)
        if rejection is None:
            self.last_round, self.last_version = msg.round, msg.version
            self.rejoining = False
        return rejection

    def rejoin(self) -> None:
        """After a (re)connection: the next message may be any number of rounds ahead."""
        self.rejoining = True

    def reset(self) -> None:
        """Forget the last accepted message (a new run of the job restarts at round 0).

        Only on evidence of a new run, e.g. the aggregator clearing the retained model at job
        start: after a reset a replayed signed message of an earlier run is accepted again
        (signatures prove origin, not freshness), bounded only by the caps."""
        self.last_round = self.last_version = None
        self.rejoining = False
