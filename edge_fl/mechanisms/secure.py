"""How a mechanism's update enters secure aggregation, and how the secure sum leaves it.

Under ``secure_aggregation`` (SecAgg+, ``edge_fl/secagg/``, docs/specs/secagg.md) the aggregator
never sees one device's update: it learns the sum, in the ring Z_2^bits, of integer vectors the
devices built. A mechanism that can run that way implements :class:`SecureSum` beside
:class:`~edge_fl.mechanisms.base.Mechanism`: it says how long and how large the integers are
(:class:`SecureLayout`), turns a device's training into its integers (``secure_encode``: clip,
quantise, and for distributed DP add the device's share of the noise), turns the sum back into the
update the server applies (``secure_decode``), and names what one contribution costs a device in
privacy (``secure_events``). The engine and the device runtimes only ever call these four; which
mechanisms offer them is :func:`secure_sum`'s answer, checked when the job is assembled.

``round_seed`` is public: derived by the engine from the round's signed nonce (both sides compute
it the same way), for what a mechanism needs every device to agree on (the distributed discrete
Gaussian's random rotation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from edge_fl.mechanisms.base import Device
    from edge_fl.privacy.events import PrivacyEvent
    from edge_fl.protocol.messages import GlobalModel

__all__ = [
    "DEFAULT_DROPOUT",
    "SecureInput",
    "SecureJob",
    "SecureLayout",
    "SecureSum",
    "secure_job",
    "secure_job_from",
    "secure_plan",
    "secure_sum",
    "survivors_floor",
]

#: the dropout fraction a job plans for when it names no floor (SecAgg+'s calibration default,
#: docs/specs/secagg.md section 5)
DEFAULT_DROPOUT = 0.3


@dataclass(frozen=True)
class SecureJob:
    """What the job tells a mechanism about its secure rounds: the model's length, how many
    devices a round selects, the fewest contributors whose sum still counts (a round with fewer
    fails; distributed DP calibrates its noise for that floor), and the quantisation step the
    job asks for (``secure_aggregation.step``; None: the mechanism's own choice). ``colluders``:
    how many of a round's devices may pool their state with the aggregator
    (``secure_aggregation.collude`` of the selection, rounded down); each knows its own noise
    share, so distributed DP counts only on ``min_survivors - colluders`` honest shares."""

    n_params: int
    selected: int
    min_survivors: int
    step: float | None = None
    colluders: int = 0

    def __post_init__(self) -> None:
        if not (
            type(self.n_params) is int
            and self.n_params >= 1
            and type(self.selected) is int
            and type(self.min_survivors) is int
            and 1 <= self.min_survivors <= self.selected
        ):
            raise ValueError(
                f"a secure job has n_params >= 1 and 1 <= min_survivors <= selected, got "
                f"n_params {self.n_params!r}, selected {self.selected!r}, "
                f"min_survivors {self.min_survivors!r}"
            )
        if type(self.colluders) is not int or not 0 <= self.colluders < self.min_survivors:
            raise ValueError(
                f"{self.colluders!r} colluders leave no honest share among the "
                f"{self.min_survivors} survivors a round needs: lower secure_aggregation.collude "
                "or raise min_survivors"
            )
        if self.step is not None and not (math.isfinite(self.step) and self.step > 0):
            raise ValueError(f"a secure job's quantisation step must be > 0, got {self.step!r}")


@dataclass(frozen=True)
class SecureLayout:
    """The integers one device submits to a secure round.

    ``length`` integers per device; each at most ``max_int`` in absolute value, unless
    ``modular`` (distributed DP: the noise is unbounded, values are submitted reduced mod
    2^bits and a wrap costs accuracy, never privacy); the sum lives in Z_2^``bits``, wide enough
    for ``selected`` devices' values (SecAgg's ``RoundParams`` checks it when not modular; a
    modular layout's ``max_int`` bounds the values before noise only, so its rounds are built
    with ``max_int`` 0: a noisy sum beyond selected x ``max_int`` is legitimate)."""

    length: int
    max_int: int
    bits: int
    modular: bool = False
    #: the integers carry distributed-DP noise calibrated for the survivors floor: a round asks
    #: the survivors beyond the floor for their own noise (``SecureInput.noise``) and removes it
    #: from the sum, which then keeps the floor's noise shares, not more (an honest-but-curious
    #: aggregator; never with device keys: docs/specs/secagg.md section 12)
    removable_noise: bool = False

    def __post_init__(self) -> None:
        if self.length < 1 or self.max_int < 0 or not 2 <= self.bits <= 64:
            raise ValueError("a secure layout has length >= 1, max_int >= 0, bits in [2, 64]")


@dataclass(frozen=True)
class SecureInput:
    """A device's integers for one secure round and the noise inside them, which the device
    reveals if the aggregator asks (``SecureLayout.removable_noise``)."""

    values: np.ndarray
    noise: np.ndarray | None = None


@runtime_checkable
class SecureSum(Protocol):
    """What a mechanism offers to run under secure aggregation (see the module docstring)."""

    def secure_layout(self, job: SecureJob) -> SecureLayout:
        """The integers each device of a round submits (the same for every round of a job)."""
        ...

    def secure_encode(
        self, device: Device, msg: GlobalModel, layout: SecureLayout, round_seed: bytes
    ) -> np.ndarray | SecureInput:
        """Train on ``msg`` and return the device's ``layout.length`` integers (int64), or a
        :class:`SecureInput` holding them and the removable noise they include."""
        ...

    def secure_decode(
        self, total: np.ndarray, contributors: int, layout: SecureLayout, round_seed: bytes
    ) -> np.ndarray:
        """The float32 update (the mean over ``contributors``, length = the model's) from the
        sum of their integers (int64, lifted to signed)."""
        ...

    def secure_events(self, job: SecureJob) -> list[PrivacyEvent]:
        """What one device's contribution to one secure round costs it (empty: no guarantee)."""
        ...


def secure_sum(mechanism: Any) -> SecureSum | None:
    """The mechanism as a :class:`SecureSum`, or None when it cannot run under secure
    aggregation (the job refuses the combination in one line)."""
    return mechanism if isinstance(mechanism, SecureSum) else None


def survivors_floor(selected: int, dropout: float = DEFAULT_DROPOUT) -> int:
    """The fewest contributors a round of ``selected`` devices accepts when a ``dropout``
    fraction may vanish: ceil((1 - dropout) selected), at least 2 (a sum of one device is that
    device's input), at most ``selected``."""
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout is a fraction in [0, 1), got {dropout!r}")
    return min(selected, max(2, math.ceil((1 - dropout) * selected - 1e-9)))


def secure_job(
    n_params: int,
    selected: int,
    *,
    min_survivors: int | None = None,
    dropout: float = DEFAULT_DROPOUT,
    step: float | None = None,
    collude: float = 0.0,
) -> SecureJob:
    """A :class:`SecureJob`; without ``min_survivors`` the floor is :func:`survivors_floor`;
    ``collude`` is the fraction of the selection that may collude (floor(collude selected),
    the SecAgg+ calibration's count)."""
    floor = survivors_floor(selected, dropout) if min_survivors is None else min_survivors
    return SecureJob(n_params, selected, floor, step, math.floor(collude * selected + 1e-9))


def secure_job_from(section: Any, n_params: int, selected: int) -> SecureJob | None:
    """The secure rounds a ``secure_aggregation`` config section asks for, or None when there
    is none or it is disabled (``enabled`` false): its ``min_survivors`` (``auto`` or absent:
    the :func:`survivors_floor` of its ``dropout``, default :data:`DEFAULT_DROPOUT`) and
    ``step``. The one rule for the floor: the engine (``edge_fl.server.secure``) and ``edge-fl
    privacy plan`` both take it from here."""
    if section is None or not getattr(section, "enabled", True):
        return None
    dropout = getattr(section, "dropout", None)
    floor = getattr(section, "min_survivors", None)
    return secure_job(
        n_params,
        selected,
        min_survivors=None if floor == "auto" else floor,
        dropout=DEFAULT_DROPOUT if dropout is None else dropout,
        step=getattr(section, "step", None),
        collude=getattr(section, "collude", None) or 0.0,
    )


def secure_plan(mechanism: Any, job: SecureJob) -> dict[str, Any]:
    """What a secure round of ``job`` costs on the wire with ``mechanism`` (``edge-fl privacy
    plan``): its layout, the bytes of one device's values bit-packed at ``bits`` each against
    plain float32, and the mechanism's own account of its grid (``secure_describe``, if any).
    ValueError when the mechanism cannot run under secure aggregation."""
    secure = secure_sum(mechanism)
    if secure is None:
        raise ValueError(
            f"privacy.mechanism = {getattr(mechanism, 'name', mechanism)!r} cannot run under "
            "secure aggregation (it offers no secure sum)"
        )
    layout = secure.secure_layout(job)
    packed = math.ceil(layout.length * layout.bits / 8)
    out: dict[str, Any] = {
        "selected": job.selected,
        "min_survivors": job.min_survivors,
        "length": layout.length,
        "bits": layout.bits,
        "max_int": layout.max_int,
        "modular": layout.modular,
        "packed_bytes": packed,
        "vs_float32": packed / (4 * job.n_params),
        "events_per_round": len(secure.secure_events(job)),
    }
    describe = getattr(mechanism, "secure_describe", None)
    if describe is not None:
        out.update(describe(job))
    return out
