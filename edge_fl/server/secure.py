"""A job's secure rounds: the SecAgg+ parameters every round of the job uses (calibrated or
checked once, when the job is assembled), the ``sa`` map that carries them to devices, and the
round's :class:`~edge_fl.secagg.RoundParams`. Pure: the service runs the sessions.

Specification: docs/protocol.md, "Secure aggregation"; docs/specs/secagg.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_fl.mechanisms.secure import SecureJob, SecureLayout, SecureSum, secure_job_from
from edge_fl.protocol.secure import SA_KEYS, round_seed
from edge_fl.secagg import CalibrationError, RoundParams, calibrate, check

__all__ = ["SecurePlan", "plan_secure", "round_seed"]


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
    #: a device id -> its public signing key (``security.device_keys``), or None: unsigned
    device_key: Any = None

    def for_roster(self, n: int) -> tuple[int, int]:
        """(k, t) for a round of ``n`` devices: the job's, with the graph capped at the
        complete one when fewer than ``selected`` were available."""
        k = min(self.neighbours, n - 1)
        return k, min(self.threshold, k)

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
        )


def plan_secure(
    cfg: Any,  # edge_fl.config.SecureAggregationConfig
    mechanism: SecureSum,
    n_params: int,
    selected: int,
) -> SecurePlan:
    """Calibrate (``auto``) or check the job's setting; ValueError with one line if unsound."""
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
    kw = {"dropout": cfg.dropout, "collude": cfg.collude}
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
