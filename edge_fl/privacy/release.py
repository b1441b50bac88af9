"""A job's privacy mechanisms, built once from its config, and what each release costs.

The device and the aggregator build the same :class:`Mechanisms` from the same config, so the
device's own budget check and the aggregator's ledger record exactly the same events for a release:
for local mechanisms one event set per (device, upload), for central DP-FedAvg one job-level event
per round (every round counts for every device, whether or not it took part: pitfall 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from edge_fl.config import PrivacyConfig
from edge_fl.privacy.accounting import PrivacyEvent, pure_privacy_event
from edge_fl.privacy.dpsgd import DpSgdConfig, calibrate_dpsgd_noise_multiplier
from edge_fl.privacy.gaussian import (
    CentralGaussianConfig,
    LocalGaussianConfig,
    calibrate_central_noise_multiplier,
    calibrate_local_noise_multiplier,
)
from edge_fl.privacy.laplace import LaplaceConfig
from edge_fl.privacy.magrr import MagRRConfig
from edge_fl.privacy.nbafl import NbAflConfig
from edge_fl.privacy.randomized_response import rr_privacy_event
from edge_fl.privacy.signds import SignDSParams

LOCAL_DENSE = ("laplace", "gaussian", "dpsgd", "nbafl")


@dataclass(frozen=True)
class JobFacts:
    """What the mechanisms need to know about the job besides the privacy config."""

    rounds: int
    n_devices: int
    expected_participants: float
    local_lr: float
    local_epochs: int
    batch_size: int
    min_dataset_size: int


@dataclass
class Mechanisms:
    cfg: PrivacyConfig
    facts: JobFacts
    laplace: LaplaceConfig | None = None
    local_gaussian: LocalGaussianConfig | None = None
    central_gaussian: CentralGaussianConfig | None = None
    nbafl: NbAflConfig | None = None
    signds: SignDSParams | None = None
    magrr: MagRRConfig | None = None
    notes: list[str] = field(default_factory=list)
    _dpsgd_cache: dict = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.cfg.mechanism

    # ------------------------------------------------------------------ DP-SGD (per data size)

    def dpsgd_rate(self, n_samples: int) -> float:
        return self.cfg.sample_rate or min(1.0, self.facts.batch_size / max(1, n_samples))

    def dpsgd_steps(self, n_samples: int) -> int:
        """Steps per round: ``epochs`` expected passes over the data at rate q."""
        return max(1, round(self.facts.local_epochs / self.dpsgd_rate(n_samples)))

    def dpsgd(self, n_samples: int) -> DpSgdConfig:
        """DP-SGD for a device of this size; sigma calibrated once per (q, steps) when needed."""
        key = (self.dpsgd_rate(n_samples), self.dpsgd_steps(n_samples))
        if key not in self._dpsgd_cache:
            self._dpsgd_cache[key] = _dpsgd_config(self.cfg, self.facts, *key)
        return self._dpsgd_cache[key]

    # ------------------------------------------------------------------ events

    def device_events(self, n_samples: int, exposure: int) -> list[PrivacyEvent]:
        """The events of one upload by a device holding ``n_samples``, its ``exposure``-th (0-based)."""
        m = self.name
        if m == "laplace":
            assert self.laplace is not None
            return [self.laplace.privacy_event(exposure)]
        if m == "gaussian":
            assert self.local_gaussian is not None
            return [self.local_gaussian.privacy_event()]
        if m == "dpsgd":
            return [self.dpsgd(n_samples).privacy_event(self.dpsgd_steps(n_samples))]
        if m == "nbafl":
            assert self.nbafl is not None
            return [self.nbafl.privacy_event()]
        if m == "signds":
            assert self.signds is not None and self.magrr is not None
            return [
                pure_privacy_event(self.signds.eps, "signds"),
                rr_privacy_event(self.magrr.rr_eps, "magrr-bit"),
            ]
        return []

    def job_events_per_round(self) -> list[PrivacyEvent]:
        if self.name == "gaussian-central":
            assert self.central_gaussian is not None
            return [self.central_gaussian.privacy_event(1)]
        return []

    def max_exposures(self) -> int | None:
        """Uploads a device may make before its schedule is spent (Laplace, NbAFL)."""
        if self.name in ("laplace", "nbafl"):
            return self.facts.rounds
        return None

    def describe(self) -> dict:
        out: dict = {"mechanism": self.name, "delta": self.cfg.delta}
        if self.laplace is not None:
            out["laplace_epsilon_round_0"] = self.laplace.epsilon_round(0)
        if self.local_gaussian is not None:
            out["noise_multiplier"] = self.local_gaussian.noise_multiplier
        if self.central_gaussian is not None:
            out["noise_multiplier"] = self.central_gaussian.noise_multiplier
            out["sampling_rate"] = self.central_gaussian.sampling_rate
        if self.nbafl is not None:
            out["sigma_uplink"] = self.nbafl.sigma_uplink
            out["sigma_downlink"] = self.nbafl.sigma_downlink
        if self.signds is not None:
            out["sign_eps"] = self.signds.eps
            out["rr_eps"] = self.magrr.rr_eps if self.magrr else None
        if self.notes:
            out["notes"] = self.notes
        return out


def _dpsgd_config(cfg: PrivacyConfig, facts: JobFacts, q: float, steps: int) -> DpSgdConfig:
    sigma = cfg.noise_multiplier
    if sigma is None:
        assert cfg.epsilon is not None
        sigma = calibrate_dpsgd_noise_multiplier(
            cfg.epsilon, cfg.delta, q, steps * facts.rounds, cfg.accountant
        )
    return DpSgdConfig(cfg.clip, sigma, q, facts.local_lr)


def build_mechanisms(cfg: PrivacyConfig, facts: JobFacts) -> Mechanisms:
    """Instantiate (and calibrate) the configured mechanism. Raises ValueError on bad domains."""
    mech = Mechanisms(cfg, facts)
    m = cfg.mechanism
    T = facts.rounds
    if m == "laplace":
        assert cfg.epsilon is not None
        mech.laplace = LaplaceConfig(
            cfg.clip, facts.local_lr, cfg.epsilon, T, cfg.schedule, cfg.schedule_decay
        )
        mech.notes.append(
            "laplace: one full-batch local step per round (sensitivity 2*lr*C/|D| holds only for "
            "one step); training.epochs and batch_size are not used"
        )
    elif m == "gaussian":
        z = cfg.noise_multiplier or calibrate_local_noise_multiplier(cfg.epsilon, cfg.delta, T)
        mech.local_gaussian = LocalGaussianConfig(cfg.clip, z)
    elif m == "gaussian-central":
        q = min(1.0, facts.expected_participants / facts.n_devices)
        amplified_q = q if cfg.poisson_selection else 1.0
        z = cfg.noise_multiplier or calibrate_central_noise_multiplier(
            cfg.epsilon, cfg.delta, amplified_q, T, cfg.accountant
        )
        mech.central_gaussian = CentralGaussianConfig(
            cfg.clip,
            z,
            facts.expected_participants,
            facts.n_devices,
            poisson_selection=cfg.poisson_selection,
        )
        if not cfg.poisson_selection:
            mech.notes.append(
                "gaussian-central: no amplification by sampling claimed (selection is not secret "
                "Poisson sampling); set privacy.poisson_selection to select by Poisson sampling"
            )
    elif m == "nbafl":
        assert cfg.epsilon is not None
        mech.nbafl = NbAflConfig(
            cfg.clip, cfg.epsilon, cfg.delta, T, T, facts.n_devices, facts.min_dataset_size
        )
    elif m == "signds":
        s = cfg.signds
        mech.signds = SignDSParams(
            k=s.sign_k,
            eps=s.sign_eps,
            thr_ratio=s.sign_thr_ratio,
            global_lr=s.sign_global_lr,
            dim_out=s.sign_dim_out,
            max_dim_out=s.max_dim_out,
        )
        r = cfg.magrr
        mech.magrr = MagRRConfig(
            r.r_est0,
            r.growth,
            r.shrink,
            r.reached_threshold,
            r.rr_eps,
            r.step_ratio,
            r.fallback_ratio,
        )
    elif (
        m == "dpsgd" and cfg.noise_multiplier is None and not math.isfinite(cfg.epsilon or math.inf)
    ):
        raise ValueError("privacy.epsilon must be finite to calibrate DP-SGD")
    return mech
