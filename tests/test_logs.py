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


def test_dp_accountings_benign_convergence_notices_are_said_once_at_debug_and_dropped():
    """`_compute_log_a_frac failed to converge` (dozens per DP-SGD calibration) never reaches a
    handler; the first is one debug line; any other absl warning still shows."""
    from edge_fl.logs import BenignAccountingNotices

    quiet = BenignAccountingNotices()
    absl = logging.getLogger("absl.test_logs")
    absl.propagate = False
    absl.setLevel(logging.WARNING)  # tests/test_ddg_audit.py sets "absl" to ERROR at import
    debug = logging.getLogger("edge_fl.privacy")
    streams = {"absl": io.StringIO(), "debug": io.StringIO()}
    handlers = {k: logging.StreamHandler(s) for k, s in streams.items()}
    absl.addFilter(quiet)
    absl.addHandler(handlers["absl"])
    debug.addHandler(handlers["debug"])
    level = debug.level
    debug.setLevel(logging.DEBUG)
    try:
        for alpha in (1.1, 1.2, 1.3):
            absl.warning(
                "_compute_log_a_frac failed to converge after %d iterations with q=%f, "
                "sigma=%f, alpha=%f. Excluding this order from the epsilon computation.",
                1000, 0.28, 1.0, alpha,
            )  # fmt: skip
        absl.warning("Negative Renyi divergence of %s", -1.0)
    finally:
        absl.removeHandler(handlers["absl"])
        debug.removeHandler(handlers["debug"])
        debug.setLevel(level)
    assert streams["absl"].getvalue() == "Negative Renyi divergence of -1.0\n"
    said = streams["debug"].getvalue().splitlines()
    assert len(said) == 1 and "alpha=1.100000" in said[0] and "harmless" in said[0], said
    assert quiet.dropped == 3


def test_no_edge_fl_command_prints_them():
    """The README's `privacy plan` of a DP-SGD job printed 72 raw `WARNING:absl:` lines."""
    import subprocess
    import sys
    from pathlib import Path

    edge_fl = str(Path(sys.executable).with_name("edge-fl"))
    args = ["privacy", "plan", "--set", "privacy.mechanism=dpsgd", "--set", "privacy.epsilon=8"]
    done = subprocess.run([edge_fl, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "absl" not in done.stderr and "converge" not in done.stderr, done.stderr[:2000]
