"""Log hygiene for commands: a warning repeated by thousands of simulated devices is one line.

The first occurrence of each (logger, message template) is printed; later ones are counted and
summarised once at exit ("... repeated 119 more times"). dp-accounting's absl notices about
fractional RDP orders it excludes (harmless: epsilon comes from the other orders) are collapsed
the same way instead of flooding the terminal.
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections import Counter

__all__ = ["RepeatCollapser", "collapse_repeats"]


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
