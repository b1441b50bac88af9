"""Distributed DP under secure aggregation: every device adds a share of discrete Gaussian noise.

The distributed discrete Gaussian (Kairouz, Liu, Steinke, ICML 2021; ``edge_fl/secagg/ddg.py``,
docs/specs/secagg.md section 12): each device clips its update to L2 ``privacy.clip``, rotates it
(public seed: the round's), scales it by 1/gamma, rounds it conditionally to integers of L2 norm at
most Delta_2 and adds N_Z(0, sigma^2) per coordinate; SecAgg+ reveals only the sum, which carries
the noise of every device that delivered. sigma^2 is calibrated (``ddg.calibrate``) so that
``min_survivors`` shares alone reach ``privacy.epsilon`` over ``rounds.rounds`` rounds; a round
with fewer is skipped by the engine, and from a round with more the aggregator removes the noise
the survivors beyond the floor reveal (``SecureInput.noise``; never with device keys), so the
sum carries the floor's noise shares, not more. The aggregator, the broker
and anyone reading them see no individual update and no noise-free sum.

Guarantee: (eps, delta)-DP per device under zero-out neighbours (its update replaced by zero, its
noise share kept: REPLACE_SPECIAL), accounted per round as the best of Proposition 14's three zCDP
curves at the job's rounds (one ``ZCDpEvent``; dp-accounting's RDP accountant composes it).
Assumed public: who contributed to each round and how many (no amplification by sampling is
claimed), and that no device colluding with the aggregator subtracts its own noise share.
Sync rounds, or FedBuff cohorts (one secure round per buffer, ``edge_fl/server/cohorts.py``: the
same calibration for a cohort of K' devices and its survivors floor, over ``rounds.rounds``
cohorts, the most a device can join); it cannot run without secure aggregation (its plain update
would carry a 1/min_survivors share of the noise, in the clear).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

import edge_fl.protocol.fields as F
from edge_fl.mechanisms.base import Device, Guarantee, JobFacts, Mechanism, local_update
from edge_fl.mechanisms.secure import SecureInput, SecureJob, SecureLayout, secure_job
from edge_fl.privacy.calibration import calibrated
from edge_fl.protocol import PayloadRejected, Reject, Update
from edge_fl.protocol.params import MAX_COUNT, MAX_DIM, int_param, number_param
from edge_fl.secagg import ddg
from edge_fl.secagg.calibration import MAX_BITS

if TYPE_CHECKING:
    from edge_fl.privacy.events import PrivacyEvent
    from edge_fl.protocol.messages import GlobalModel

NAME = "distributed-gaussian"
#: conditional rounding's per-attempt failure bound (Kairouz et al.'s default; ``ddg.calibrate``'s):
#: beta = e^-LN_INV_BETA, so sqrt(2 ln(1/beta)) = 1 exactly and the default grid step below takes
#: only correctly rounded operations: the aggregator and a device on another platform's libm
#: compute the same gamma to the bit (it is a key of the calibration table and checked in ``mp``)
LN_INV_BETA = 0.5
BETA = math.exp(-LN_INV_BETA)
#: the default grid step gamma keeps Delta_2 within this fraction above clip / gamma: rounding then
#: costs at most 1% more noise standard deviation for the same epsilon, and a coarser grid saves
#: little (one bit per halving of gamma) while a finer one only widens the ring
ROUNDING_SLACK = 0.01
SURVIVORS = (
    "who contributed to each round and how many (at least secure_aggregation's min_survivors, "
    "the count the noise is calibrated for)"
)
NO_COLLUSION = "no device colluding with the aggregator removes its own noise share"
SECURE_ONLY = (
    f"privacy.mechanism = {NAME!r} runs only under secure aggregation (secure_aggregation: "
    "enabled): a device's update carries only its share of the noise and must never be sent "
    "in the clear"
)
#: the curves of Proposition 14, in ``ddg.zcdp_curves``'s order
CURVES = ("xi-tau", "rho-tau", "sqrt-tau")


def default_gamma(clip: float, padded: int) -> float:
    """The largest grid step gamma whose rounding keeps Delta_2 <= (1 + ROUNDING_SLACK) c/gamma.

    With x = c/gamma and s = sqrt(2 ln(1/beta)), Delta_2^2 = x^2 + D'/4 + s (x + sqrt(D')/2)
    (``ddg.rounded_bound``), so the bound holds from the positive root of
    a x^2 - s x - (D'/4 + s sqrt(D')/2) = 0, a = (1 + slack)^2 - 1."""
    s = math.sqrt(2 * LN_INV_BETA)
    a = (1 + ROUNDING_SLACK) ** 2 - 1
    rest = padded / 4 + s * math.sqrt(padded) / 2
    x = (s + math.sqrt(s * s + 4 * a * rest)) / (2 * a)
    return clip / x


def grid_variance(value: float) -> Fraction:
    """A per-device variance as ``ddg.calibrate`` returns one: an integer from 1 up (the
    vectorised exact sampler's domain), else thousandths; rounded up (more noise, never less)."""
    if value >= 1:
        return Fraction(math.ceil(value))
    return Fraction(max(1, math.ceil(value * 1000)), 1000)


@dataclass(frozen=True)
class DdgCalibration:
    """One secure job's calibration: the public parameters and the integers devices submit."""

    job: SecureJob
    params: ddg.DdgParams
    layout: SecureLayout
    rounds: int
    delta: float

    @property
    def noise_multiplier(self) -> float:
        """sigma_sum / Delta_2 with min_survivors shares: the central Gaussian's z it matches."""
        p = self.params
        return math.sqrt(p.n_min * float(p.sigma2)) / p.l2

    @property
    def noise_std(self) -> float:
        """The summed noise's standard deviation per model coordinate, min_survivors shares."""
        p = self.params
        return p.gamma * math.sqrt(p.n_min * float(p.sigma2))


class DistributedGaussian(Mechanism):
    name = NAME
    guarantee = Guarantee("device", "replace_special", "approximate", (SURVIVORS, NO_COLLUSION))
    public_schema = (
        number_param("clip", True, "L2 clip bound c of the delta", 0),
        number_param("g", True, "grid step gamma of the rotated delta", 0),
        number_param("s2", True, "per-device discrete Gaussian variance sigma^2 (grid units)", 0),
        int_param(
            "nmin",
            True,
            "noise shares the guarantee counts on (min_survivors less colluders)",
            1,
            MAX_COUNT,
        ),
        int_param("dp", True, "padded dimension D' (a power of two)", 1, MAX_DIM),
        int_param("b", True, "bit width of the secure sum's ring", 2, MAX_BITS),
    )

    @classmethod
    def check_public(cls, mp: Mapping[str, Any], n_params: int | None) -> None:
        dp = int(mp["dp"])
        if dp & (dp - 1) or (n_params is not None and dp != ddg.padded(n_params)):
            want = "a power of two" if n_params is None else f"{ddg.padded(n_params)}"
            raise F.out_of_range("mp.dp", "padded dimension D'", dp, want)

    @classmethod
    def accepts_codec(cls, codec: str) -> str | None:
        return (
            f"{NAME} submits integers through secure aggregation, which has its own wire "
            "format; no uplink codec applies to it: leave compression.uplink unset"
        )

    def __init__(self, cfg: Any, facts: JobFacts) -> None:
        super().__init__(cfg, facts)
        if cfg is None or facts is None:
            raise ValueError(f"privacy.mechanism = {NAME!r} needs the job's privacy config")
        if facts.mode not in ("sync", "fedbuff"):
            raise ValueError(
                f"privacy.mechanism = {NAME!r} needs rounds.mode = 'sync' or 'fedbuff' (its "
                f"noise is calibrated per secure round or cohort), got {facts.mode!r}"
            )
        if cfg.noise_multiplier is None and cfg.epsilon is None:
            raise ValueError(
                f"privacy.mechanism = {NAME!r} needs privacy.epsilon or privacy.noise_multiplier"
            )
        self._calibrations: dict[SecureJob, DdgCalibration] = {}
        self._chosen: dict[SecureJob, tuple[int, float, float]] = {}
        selected = max(2, math.ceil(facts.expected_participants - 1e-9))
        #: the secure job the public parameters and the report describe: a 30%-dropout floor
        #: until :meth:`secure_layout` is told the job's own
        self.job: SecureJob = secure_job(facts.n_params, selected)
        self.job_source = "default (30% dropout of the expected participants)"
        self.calibration(self.job)
        self.notes.append(
            f"{NAME}: no amplification by sampling claimed (who contributes is public)"
        )

    # --- calibration -------------------------------------------------------------------------
    def calibration(self, job: SecureJob) -> DdgCalibration:
        """sigma^2, gamma and the ring for ``job`` (computed once per job; sigma^2 through the
        calibration table, so a device without dp-accounting takes it from the job document)."""
        cached = self._calibrations.get(job)
        if cached is not None:
            return cached
        if job.n_params != self.facts.n_params:
            raise ValueError(
                f"the secure job has {job.n_params} parameters, the model {self.facts.n_params}"
            )
        cfg, rounds = self.cfg, self.facts.rounds
        # the noise shares the guarantee counts on: the survivors floor less the devices that
        # may collude with the aggregator (each knows, so removes, its own share)
        clip, dim, n_min = float(cfg.clip), job.n_params, job.min_survivors - job.colluders
        gamma = job.step if job.step is not None else default_gamma(clip, ddg.padded(dim))
        if cfg.noise_multiplier is not None:
            unit = ddg.DdgParams(clip, gamma, Fraction(1), BETA, dim, n_min)
            sigma2 = grid_variance(cfg.noise_multiplier**2 * unit.l2**2 / n_min)
        else:
            args = (float(cfg.epsilon), float(cfg.delta), rounds, clip, gamma, dim, n_min)
            value = calibrated(NAME, args, lambda: float(ddg.calibrate(*args, beta=BETA).sigma2))
            sigma2 = Fraction(value).limit_denominator(1000)
        params = ddg.DdgParams(clip, gamma, sigma2, BETA, dim, n_min)
        max_int = math.ceil(params.l2)  # the signal's bound (the noise is unbounded)
        bits = max(ddg.ring_bits(params, job.selected), (job.selected * max_int).bit_length() + 1)
        if bits > MAX_BITS:
            raise ValueError(
                f"{NAME}: {job.selected} devices' integers need a {bits}-bit ring (> {MAX_BITS}); "
                "raise secure_aggregation.step"
            )
        layout = SecureLayout(params.padded, max_int, bits, modular=True, removable_noise=True)
        cal = DdgCalibration(job, params, layout, rounds, float(cfg.delta))
        self._calibrations[job] = cal
        return cal

    def _for_layout(self, layout: SecureLayout, msg: GlobalModel) -> ddg.DdgParams:
        """The parameters behind ``layout``: this mechanism's own calibration (the device ran
        :meth:`secure_layout` for the job), checked against the signed global message's."""
        own = [c for c in self._calibrations.values() if c.layout == layout]
        if not own:
            raise ValueError(
                f"{NAME}: no calibration of this mechanism gives the layout {layout}; "
                "call secure_layout(job) first"
            )
        p = own[-1].params
        mp = msg.mechanism_params
        if mp is not None and mp.get("m") == NAME:
            theirs = (mp.get("clip"), mp.get("g"), mp.get("s2"), mp.get("nmin"))
            if theirs != (p.clip, p.gamma, float(p.sigma2), p.n_min):
                raise ValueError(
                    f"{NAME}: the global message's parameters {theirs} differ from this "
                    f"device's calibration {(p.clip, p.gamma, float(p.sigma2), p.n_min)}"
                )
        return p

    # --- secure sum --------------------------------------------------------------------------
    def secure_layout(self, job: SecureJob) -> SecureLayout:
        """D' integers a device, reduced mod 2^bits (the noise is unbounded: a wrap costs
        accuracy, never privacy); ``job`` becomes the one the report and ``mp`` describe."""
        cal = self.calibration(job)
        if job != self.job:
            self.job, self.job_source = job, "secure_aggregation"
        return cal.layout

    def secure_encode(
        self, device: Device, msg: GlobalModel, layout: SecureLayout, round_seed: bytes
    ) -> SecureInput:
        """Train, then clip, rotate (``round_seed``: 32 public bytes), scale, round and add this
        device's noise share from its CSPRNG (``ddg.device_parts``); the noise is kept apart
        too, for the aggregator's request when more than the floor survive."""
        p = self._for_layout(layout, msg)
        _check_seed(round_seed)
        delta = local_update(device, msg)
        rounded, noise = ddg.device_parts(delta, p, round_seed, device.rng.bytes)
        return SecureInput(rounded + noise, noise)

    def secure_decode(
        self, total: np.ndarray, contributors: int, layout: SecureLayout, round_seed: bytes
    ) -> np.ndarray:
        """The noisy mean: the sum times gamma, rotated back, over the contributors."""
        cal = [c for c in self._calibrations.values() if c.layout == layout]
        if not cal:
            raise ValueError(f"{NAME}: no calibration of this mechanism gives the layout {layout}")
        p, floor = cal[-1].params, cal[-1].job.min_survivors
        total = np.asarray(total)
        if total.shape != (layout.length,):
            raise ValueError(f"a secure sum of {layout.length} values, got shape {total.shape}")
        if contributors < floor:
            raise ValueError(
                f"{NAME}: {contributors} contributors < min_survivors {floor}: the sum does "
                "not carry the calibrated noise (skip the round)"
            )
        _check_seed(round_seed)
        mean = ddg.server_decode(total, p, round_seed) / contributors
        return mean.astype(np.float32)

    def secure_events(self, job: SecureJob) -> list[PrivacyEvent]:
        """One contribution's cost: the zCDP curve (of Proposition 14's three) that proves the
        smallest epsilon over the job's rounds, for ``min_survivors`` noise shares."""
        from dp_accounting import dp_event

        from edge_fl.privacy.events import NeighboringRelation, PrivacyEvent

        cal = self.calibration(job)
        index = self._best_curve(cal)[0]
        xi, rho = ddg.zcdp_curves(cal.params)[index]
        return [
            PrivacyEvent(
                dp_event.ZCDpEvent(rho=rho, xi=xi),
                NeighboringRelation.REPLACE_SPECIAL,
                "device",
                NAME,
            )
        ]

    def _best_curve(self, cal: DdgCalibration) -> tuple[int, float, float]:
        """(curve index, epsilon of one round, epsilon of the job's rounds) at the job's delta,
        through the same accountant as the ledger."""
        found = self._chosen.get(cal.job)
        if found is not None:
            return found
        from dp_accounting import dp_event

        from edge_fl.privacy.accountants import compose_epsilon
        from edge_fl.privacy.events import NeighboringRelation, PrivacyEvent

        best: tuple[int, float, float] | None = None
        for i, (xi, rho) in enumerate(ddg.zcdp_curves(cal.params)):
            ev = PrivacyEvent(
                dp_event.ZCDpEvent(rho=rho, xi=xi), NeighboringRelation.REPLACE_SPECIAL, "device"
            )
            total = compose_epsilon([ev] * cal.rounds, cal.delta).epsilon
            if best is None or total < best[2]:
                best = (i, compose_epsilon([ev], cal.delta).epsilon, total)
        assert best is not None
        self._chosen[cal.job] = best
        return best

    # --- the plain path refuses --------------------------------------------------------------
    def device_update(self, device: Device, msg: GlobalModel, exposure: int) -> Update:
        raise ValueError(SECURE_ONLY)

    def new_strategy(self, state: Any, server_lr: float, rng: np.random.Generator) -> Any:
        return SecureOnly()

    def robust_support(self) -> frozenset[str]:
        """Nothing: the aggregator holds only the noisy sum, never an update to bound."""
        return frozenset()

    # --- accounting and reporting ------------------------------------------------------------
    def release_events(self, n_samples: int, exposure: int) -> list[PrivacyEvent]:
        """One contribution to a secure round of the job (what a device's budget counts)."""
        return self.secure_events(self.job)

    def describe(self) -> dict[str, Any]:
        cal = self.calibration(self.job)
        p = cal.params
        out: dict[str, Any] = {
            **super().describe(),
            "clip_l2": p.clip,
            "gamma": p.gamma,
            "sigma2": float(p.sigma2),
            "beta": p.beta,
            "padded_dim": p.padded,
            "l2_sensitivity": p.l2,
            "noise_multiplier": cal.noise_multiplier,
            "noise_std": cal.noise_std,
            "tau": ddg.tau(float(p.sigma2), p.n_min),
            "ring_bits": cal.layout.bits,
            "selected": cal.job.selected,
            "min_survivors": cal.job.min_survivors,
            "colluders": cal.job.colluders,
            "noise_shares": p.n_min,  # the survivors floor less the colluders
            "secure_job": self.job_source,
            "rounds": cal.rounds,
            "target_epsilon": self.cfg.epsilon if self.cfg.noise_multiplier is None else None,
        }
        try:
            index, one, total = self._best_curve(cal)
        except ImportError:  # a device without dp-accounting: the numbers are the server's
            return out
        xi, rho = ddg.zcdp_curves(p)[index]
        out.update(
            zcdp={"curve": CURVES[index], "xi": xi, "rho": rho},
            epsilon_per_round=one,
            epsilon_total=total,
        )
        return out

    def warnings(self) -> list[str]:
        p = self.calibration(self.job).params
        if p.n_min >= 10:
            return []
        return [
            f"{NAME}: the noise is calibrated for {p.n_min} honest shares (min_survivors less "
            f"secure_aggregation.collude's colluders); each further device that colludes with "
            f"the aggregator removes 1/{p.n_min} of it"
        ]

    def public_extra(self) -> dict[str, Any]:
        cal = self.calibration(self.job)
        p = cal.params
        return {
            "clip": p.clip,
            "g": p.gamma,
            "s2": float(p.sigma2),
            "nmin": p.n_min,
            "dp": p.padded,
            "b": cal.layout.bits,
        }


def _check_seed(seed: bytes) -> None:
    if not isinstance(seed, bytes) or len(seed) != 32:
        raise ValueError(f"{NAME}: the round seed is 32 bytes (a ChaCha20 key), got {seed!r:.40}")


class SecureOnly:
    """The strategy of a mechanism whose updates only ever arrive as a secure sum: it folds
    nothing (a plain update is refused), so a mis-wired job fails loudly, never silently."""

    def add(self, update: Update, weight: float) -> None:
        raise PayloadRejected(Reject.WRONG_MECHANISM, SECURE_ONLY)

    def remove(self, update: Update, weight: float) -> None:
        raise PayloadRejected(Reject.WRONG_MECHANISM, SECURE_ONLY)

    def partial(self) -> dict[str, Any]:
        return {"s": b"", "w": 0, "c": 0}

    def merge(self, data: dict[str, Any]) -> None:
        raise ValueError(SECURE_ONLY)

    @property
    def count(self) -> int:
        return 0

    @property
    def state(self) -> None:
        return None

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        return params.copy(), {}
