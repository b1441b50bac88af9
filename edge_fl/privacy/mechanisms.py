"""One import point for the privacy mechanisms (each lives in its own module).

A: :mod:`~edge_fl.privacy.laplace`, B: :mod:`~edge_fl.privacy.gaussian`,
C: :mod:`~edge_fl.privacy.dpsgd`, D: :mod:`~edge_fl.privacy.nbafl`, and the randomized-response
bit of MagRR: :mod:`~edge_fl.privacy.randomized_response`. Every config exposes ``dp_event(...)``
(the dp-accounting event one release realises) and ``privacy_event(...)`` (the same with its
neighbouring relation and unit, for :class:`~edge_fl.privacy.accounting.PrivacyLedger`).
"""

from edge_fl.privacy.dpsgd import (
    DpSgdConfig,
    DpSgdStep,
    calibrate_dpsgd_noise_multiplier,
    dpsgd_epsilon,
)
from edge_fl.privacy.gaussian import (
    CentralGaussianConfig,
    GaussianRelease,
    LocalGaussianConfig,
    calibrate_central_noise_multiplier,
    calibrate_local_noise_multiplier,
    central_dp_event,
    central_privacy_event,
)
from edge_fl.privacy.laplace import LaplaceConfig, LaplaceRelease
from edge_fl.privacy.nbafl import NbAflCalibrationWarning, NbAflConfig, nbafl_constant
from edge_fl.privacy.randomized_response import (
    RrEstimate,
    clip_count,
    debias_count,
    randomized_response,
    rr_dp_event,
    rr_privacy_event,
    truth_probability,
)

__all__ = [
    "CentralGaussianConfig",
    "DpSgdConfig",
    "DpSgdStep",
    "GaussianRelease",
    "LaplaceConfig",
    "LaplaceRelease",
    "LocalGaussianConfig",
    "NbAflCalibrationWarning",
    "NbAflConfig",
    "RrEstimate",
    "calibrate_central_noise_multiplier",
    "calibrate_dpsgd_noise_multiplier",
    "calibrate_local_noise_multiplier",
    "central_dp_event",
    "central_privacy_event",
    "clip_count",
    "debias_count",
    "dpsgd_epsilon",
    "nbafl_constant",
    "randomized_response",
    "rr_dp_event",
    "rr_privacy_event",
    "truth_probability",
]
