"""The repeat collapser (edge_fl/logs.py): the first warning of each template shows on every
handler, the rest are counted once."""

from __future__ import annotations

import io
import logging

from edge_fl.logs import RepeatCollapser


def test_every_handler_shows_the_first_occurrence_and_repeats_are_counted_once():
    collapser = RepeatCollapser()
    logger = logging.getLogger("edge_fl.test_logs")
    logger.propagate = False
    streams = [io.StringIO(), io.StringIO()]
    handlers = [logging.StreamHandler(s) for s in streams]
    for h in handlers:
        h.addFilter(collapser)
        logger.addHandler(h)
    try:
        for i in range(3):
            logger.warning("device %s refused", i)
    finally:
        for h in handlers:
            logger.removeHandler(h)
    assert [s.getvalue() for s in streams] == ["device 0 refused\n"] * 2
    assert collapser.summary() == ["edge_fl.test_logs: device 0 refused ... repeated 2 more times"]
