"""The config's ``privacy.signds`` and ``privacy.magrr`` sections: the SignDS mechanism's settings.

Their own module, apart from the mechanism (``edge_fl.mechanisms.signds``, which re-exports them),
so that every config carries them without importing the mechanism (``edge_fl.config`` takes them
from here; their docstrings are docs/config.md's). Domains are written once, in
``privacy.signds.SETTINGS`` and ``MagRRConfig``, and checked by building the algorithm's
parameters from the settings.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edge_fl.privacy.magrr import MagRRConfig
from edge_fl.privacy.signds import SignDSParams, setting_domain

__all__ = ["MagRRSettings", "SignDSSettings"]


class SignDSSettings(BaseModel):
    """Domains exactly as the reference (MindSpore Federated); see docs/specs/signds.md section 6."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    sign_k: float = Field(0.01, description=f"top-k fraction, {setting_domain('sign_k')}")
    sign_eps: float = Field(
        100.0, description=f"exponential-mechanism epsilon, {setting_domain('sign_eps')}"
    )
    sign_thr_ratio: float = Field(
        0.6,
        description=f"target top-k fraction of outputs, {setting_domain('sign_thr_ratio')}",
    )
    sign_global_lr: float = Field(0.1, description="step when MagRR falls back, > 0")
    sign_dim_out: int = Field(0, description="output dimension h, [0, 50]; 0 = optimise")
    max_dim_out: int = Field(100, ge=1, le=100_000, description="cap on h (reference: 100)")

    @model_validator(mode="after")
    def _domains(self) -> SignDSSettings:
        self.params()
        return self

    def params(self) -> SignDSParams:
        """The algorithm's parameters (ValueError names the setting out of its domain)."""
        return SignDSParams(
            k=self.sign_k,
            eps=self.sign_eps,
            thr_ratio=self.sign_thr_ratio,
            global_lr=self.sign_global_lr,
            dim_out=self.sign_dim_out,
            max_dim_out=self.max_dim_out,
        )


class MagRRSettings(BaseModel):
    """MagRR step-size estimation; the reference's constants are the defaults."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    r_est0: float = Field(1e-5, gt=0, lt=1, description="the first estimate of the step ratio")
    growth: float = Field(5.0, gt=1, description="fast phase: the estimate grows by this factor")
    shrink: float = Field(1.5, gt=1, description="shrink phase: the estimate shrinks by this")
    reached_threshold: int = Field(
        10, ge=0, description="majority 'yes' rounds before the fast phase ends"
    )
    rr_eps: float = Field(5.0, gt=0, description="epsilon of each device's randomized-response bit")
    step_ratio: float = Field(3.0, gt=0, description="the SignDS step is this x N x the estimate")
    fallback_ratio: float = Field(
        0.05, ge=0, le=1, description="the step when the estimate falls back (MagRR's rule)"
    )

    def config(self) -> MagRRConfig:
        return MagRRConfig(
            self.r_est0, self.growth, self.shrink, self.reached_threshold, self.rr_eps,
            self.step_ratio, self.fallback_ratio,
        )  # fmt: skip
