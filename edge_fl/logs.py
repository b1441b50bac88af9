"""Log hygiene for commands: a warning repeated by thousands of simulated devices is one line.

The first occurrence of each (logger, message template) is printed; later ones are counted and
summarised once at exit ("... repeated 119 more times"). dp-accounting's absl notices about
fractional RDP orders whose series did not converge (it excludes them, and epsilon comes from
the other orders: harmless) are not shown at all: :func:`quiet_dp_accounting` says the first
one at debug level (``-vv``) and drops the rest.
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections import Counter

__all__ = ["BenignAccountingNotices", "RepeatCollapser", "collapse_repeats", "quiet_dp_accounting"]


class RepeatCollapser(logging.Filter):
    """A handler filter that lets the first record of each template through and counts the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()
        self.first: dict[tuple[str, str], str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:  # progress (info) and errors always show
            return True
        # one decision per record: the same filter sits on every root handler, and the second
        # handler must not count the record again (it then dropped every first occurrence)
        decided = getattr(record, "edge_fl_first", None)
        if decided is not None:
            return bool(decided)
        key = (record.name, str(record.msg))
        self.seen[key] += 1
        first = self.seen[key] == 1
        if first:
            self.first[key] = record.getMessage()
        record.edge_fl_first = first
        return first

    def summary(self) -> list[str]:
        return [
            f"{name}: {self.first[(name, msg)][:120]} ... repeated {n - 1} more times"
            for (name, msg), n in self.seen.items()
            if n > 1
        ]


_installed: RepeatCollapser | None = None


def collapse_repeats() -> RepeatCollapser:
    """Install the collapser on the root handlers (and absl's logger), summarise at exit.
    Idempotent: a second call returns the installed one."""
    global _installed
    if _installed is not None:
        return _installed
    collapser = _installed = RepeatCollapser()
    for handler in logging.getLogger().handlers:
        handler.addFilter(collapser)
    logging.getLogger("absl").addFilter(collapser)

    @atexit.register
    def _report() -> None:
        for line in collapser.summary():
            print(f"edge-fl: {line}", file=sys.stderr)

    return collapser


def tally(counts: dict[str, int]) -> str:
    """``"RuntimeError: boom x14; ValueError: shape x1"``: what happened and how often, most
    first (the fleet's log and the CLI's line about failed trainings)."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return "; ".join(f"{what} x{n}" for what, n in ranked)


def uncollapse() -> None:
    """Remove what :func:`collapse_repeats` installed: a process that runs a command in-process
    and then goes on (a test run) must not have its later warnings folded by it."""
    global _installed
    if _installed is None:
        return
    for handler in logging.getLogger().handlers:
        handler.removeFilter(_installed)
    logging.getLogger("absl").removeFilter(_installed)
    _installed = None


class BenignAccountingNotices(logging.Filter):
    """A filter for the ``absl`` logger: dp-accounting's "_compute_log_a_frac failed to converge
    ... Excluding this order from the epsilon computation" warnings (dozens per calibration of a
    subsampled Gaussian: the RDP series of a fractional order did not converge, the order is left
    out and epsilon comes from the others) are dropped; the first is said once at debug level on
    ``edge_fl.privacy``. Every other absl record (a negative Renyi divergence, say) passes."""

    BENIGN = ("_compute_log_a_frac failed to converge",)

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.BENIGN):
            return True
        self.dropped += 1
        if self.dropped == 1:
            logging.getLogger("edge_fl.privacy").debug(
                "dp-accounting: %s (harmless: that order is left out and epsilon comes from the "
                "others; later notices like it are not shown)",
                record.getMessage(),
            )
        return False


_quiet: BenignAccountingNotices | None = None


def quiet_dp_accounting() -> BenignAccountingNotices:
    """Install :class:`BenignAccountingNotices` on the ``absl`` logger, first among its filters
    (the repeat collapser then never counts them). Idempotent: every ``edge-fl`` command calls
    it before it runs."""
    global _quiet
    if _quiet is None:
        _quiet = BenignAccountingNotices()
        absl = logging.getLogger("absl")
        absl.filters.insert(0, _quiet)
    return _quiet
