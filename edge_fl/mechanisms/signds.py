"""SignDS with MagRR step-size estimation (mechanism E, ``docs/specs/signds.md``).

Device: local SGD, then a random sign, h indices drawn by the exponential mechanism around the
signed top-k set, and a MagRR bit (is my top-k magnitude below the server's estimate?) sent
through randomized response. No values leave the device. Server: sample-weighted vote of the
selected indices, step ``step_ratio * N * r_est``, then MagRR moves ``r_est`` from the debiased
bits. The MagRR state is this mechanism's typed state: it travels in the global message (``sd``)
and in checkpoints. Pure eps-DP per upload: ``sign_eps`` for the selection plus ``rr_eps`` for the
bit, local DP (any two updates of a device are neighbours).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import edge_fl.protocol.fields as F
from edge_fl.mechanisms.base import (
    N_IN_THE_CLEAR,
    Device,
    Guarantee,
    JobFacts,
    Mechanism,
    local_update,
    partial_fields,
)
from edge_fl.mechanisms.exact_sum import ExactSum

# the config's sections of this mechanism, importable from here as well as from their own module
from edge_fl.mechanisms.signds_settings import MagRRSettings as MagRRSettings
from edge_fl.mechanisms.signds_settings import SignDSSettings as SignDSSettings
from edge_fl.privacy.magrr import (
    MagRRConfig,
    MagRRState,
    accept_r_est,
    magrr_bit,
    magrr_step,
    randomized_response,
)
from edge_fl.privacy.signds import (
    SETTINGS,
    check_dimension,
    plan,
    select,
    signds_global_update,
    vote_parts,
)
from edge_fl.protocol import GlobalModel, PayloadRejected, Reject, SignDSUpdate, Update
from edge_fl.protocol.params import MAX_DIM, int_param, number_param

if TYPE_CHECKING:
    from edge_fl.privacy.events import PrivacyEvent

log = logging.getLogger("edge_fl.signds")


class SignDS(Mechanism):
    name = "signds"
    wire_kind = "s"
    guarantee = Guarantee("device", "replace_one", "pure", (N_IN_THE_CLEAR,))
    public_schema = (
        int_param(
            "d", True, "model dimension the plan is for (= number of parameters)", 1, MAX_DIM
        ),
        SETTINGS["sign_k"],
        SETTINGS["sign_eps"],
        SETTINGS["sign_thr_ratio"],
        SETTINGS["sign_dim_out"],
        int_param("hmax", True, "max_dim_out: the cap on h", 1, 100_000),
        int_param("K", True, "top-k size K = floor(k d)", 0, MAX_DIM),
        int_param(
            "h",
            True,
            "output dimension h: indices per vote (the plan's, after the cap)",
            1,
            100_000,
        ),
        int_param("nth", True, "threshold nu_th of the exponential mechanism", 1, 100_000),
        number_param("rr", True, "rr_eps: randomized-response epsilon of the MagRR bit", 0),
        number_param(
            "r0",
            True,
            "initial r_est (used when the global message has no 'sd')",
            0,
            1,
            hi_open=True,
        ),
        SETTINGS["sign_global_lr"],
    )

    @classmethod
    def check_public(cls, mp: Mapping[str, Any], n_params: int | None) -> None:
        """The plan's numbers agree with each other and with the model."""
        d, h = mp["d"], mp["h"]
        if n_params is not None and d != n_params:
            raise PayloadRejected(
                Reject.OUT_OF_RANGE,
                f"field 'mp.d' (SignDS plan dimension) = {d}, but the model has {n_params} "
                "parameters",
                field="mp.d",
            )
        if mp["K"] > d:
            raise F.out_of_range("mp.K", "top-k size", mp["K"], f"an int in [0, d = {d}]")
        if h > min(d, mp["hmax"]):
            raise F.out_of_range("mp.h", "output dimension", h, "an int in [1, min(d, hmax)]")
        if mp["hout"] and h != mp["hout"]:
            raise F.out_of_range("mp.h", "output dimension", h, f"= hout = {mp['hout']}")
        if mp["nth"] > h:
            raise F.out_of_range("mp.nth", "threshold nu_th", mp["nth"], f"an int in [1, h = {h}]")

    def __init__(self, cfg: Any, facts: JobFacts) -> None:
        super().__init__(cfg, facts)
        self.params = cfg.signds.params()
        self.magrr = cfg.magrr.config()
        self.plan = plan(self.params, facts.n_params)
        # the step is 3 N r_est with N the configured uploads per round (not the number received)
        self.expected_n = max(1, round(facts.expected_participants))

    def device_update(self, device: Device, msg: GlobalModel, exposure: int) -> Update:
        update = local_update(device, msg)
        if update.size != self.plan.d:
            raise ValueError(f"model has {update.size} parameters, the SignDS plan {self.plan.d}")
        selection = select(update, self.plan, device.rng)
        carried = msg.mechanism_state or {}  # read leniently, as the reference client does
        r_est = accept_r_est(carried.get("r_est", self.magrr.r_est0))
        reached = carried.get("reached") in (1, True)
        bit = magrr_bit(update, selection.sign, self.plan.topk, r_est, reached)
        return SignDSUpdate(
            device=device.device_id,
            round=msg.round,
            base_version=msg.version,
            n_samples=device.n_samples,
            sign=selection.sign,
            indices=selection.indices,
            magrr_bit=randomized_response(bit, self.magrr.rr_eps, device.rng),
            nonce=msg.nonce,
        )

    def new_strategy(self, state: Any, server_lr: float, rng: np.random.Generator) -> Any:
        return SignDSAggregate(
            self.facts.n_params, state, self.magrr, self.params.global_lr, self.expected_n
        )

    def vote_size(self) -> int:
        return self.plan.h

    def initial_state(self) -> MagRRState:
        return MagRRState.initial(self.magrr)

    def encode_state(self, state: MagRRState) -> dict:
        return state.to_dict()

    def decode_state(self, data: Any) -> MagRRState:
        return MagRRState.from_dict(data)

    def release_events(self, n_samples: int, exposure: int) -> list[PrivacyEvent]:
        from edge_fl.privacy.events import pure_privacy_event
        from edge_fl.privacy.randomized_response import rr_privacy_event

        return [
            pure_privacy_event(self.params.eps, "signds"),
            rr_privacy_event(self.magrr.rr_eps, "magrr-bit"),
        ]

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "sign_eps": self.params.eps,
            "rr_eps": self.magrr.rr_eps,
            "epsilon_per_upload": self.params.eps + self.magrr.rr_eps,
            "plan": self.plan.describe(),
            "expected_uploads_per_round": self.expected_n,
        }

    def warnings(self) -> list[str]:
        return check_dimension(self.params, self.facts.n_params)

    def public_extra(self) -> dict[str, Any]:
        p, plan, r = self.params, self.plan, self.magrr
        return {
            "d": plan.d,
            "k": p.k,
            "eps": p.eps,
            "rho": p.thr_ratio,
            "hout": p.dim_out,
            "hmax": p.max_dim_out,
            "K": plan.topk,
            "h": plan.h,
            "nth": plan.nu_th,
            "rr": r.rr_eps,
            "r0": r.r_est0,
            "glr": p.global_lr,
        }


@dataclass
class SignDSAggregate:
    """Sample-weighted vote of the selections, step by MagRR's 3 N r_est, then update MagRR."""

    n_params: int
    start: MagRRState  # the MagRR state at the start of the round
    magrr: MagRRConfig
    global_lr: float
    expected_n: int
    _votes: ExactSum = field(init=False)
    _weight: int = field(default=0, init=False)
    _bits: list[int] = field(default_factory=list, init=False)
    _next: MagRRState | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._votes = ExactSum(self.n_params)

    def add(self, update: Update, weight: float) -> None:
        if not isinstance(update, SignDSUpdate):
            raise TypeError(f"SignDS takes SignDS updates, got {type(update).__name__}")
        idx, value = vote_parts(self.n_params, update.sign, update.indices,
                                weight * update.n_samples)  # fmt: skip
        self._votes.add_at(idx, value)
        self._weight += int(update.n_samples)
        self._bits.append(update.magrr_bit)

    def remove(self, update: Update, weight: float) -> None:
        assert isinstance(update, SignDSUpdate)
        idx, value = vote_parts(self.n_params, update.sign, update.indices,
                                weight * update.n_samples)  # fmt: skip
        self._votes.add_at(idx, -value)
        self._weight -= int(update.n_samples)
        self._bits.remove(update.magrr_bit)

    def partial(self) -> dict[str, Any]:
        """Vote sums, weight and the MagRR bits (their order does not matter: MagRR counts)."""
        return {"s": self._votes.to_bytes(), "w": self._weight, "b": bytes(self._bits)}

    def merge(self, data: dict[str, Any]) -> None:
        bits = data.get("b") if isinstance(data, dict) else None
        if not isinstance(bits, bytes) or any(b > 1 for b in bits):
            raise ValueError("a SignDS partial's 'b' must be bytes of 0/1 MagRR bits")
        votes, weight, _ = partial_fields(
            {"s": data.get("s"), "w": data.get("w"), "c": len(bits)}, self.n_params
        )
        if set(data) != {"s", "w", "b"}:
            raise ValueError("a SignDS partial is a map with exactly the keys s, w and b")
        self._votes.merge(votes)
        self._weight += weight
        self._bits.extend(bits)

    @property
    def count(self) -> int:
        return len(self._bits)

    @property
    def state(self) -> MagRRState:
        """After ``finish``: the state for the next round."""
        return self._next or self.start

    def finish(self, params: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        step = self.start.step(self.expected_n, self.magrr)
        new = params.copy()
        if self._weight > 0:
            new = signds_global_update(
                params.astype(np.float64), self._votes.value(), self._weight, step
            )
            new = new.astype(np.float32)
        self._next, info = magrr_step(
            self.start, np.asarray(self._bits, dtype=np.int64), self.expected_n, self.global_lr,
            self.magrr,
        )  # fmt: skip
        if self._next.r_est >= 1:
            log.warning(
                "MagRR r_est = %.3g >= 1: devices clamp it to 1.0 and the server step "
                "3 N r_est = %.3g is running away; use smaller local steps (e.g. --lr 0.05 "
                "--epochs 1)",
                self._next.r_est,
                self._next.step(self.expected_n, self.magrr),
            )
        return new, {
            "signds_step": step,
            "magrr_action": info.action,
            "magrr_r_est": info.r_est,
            "magrr_reached": self._next.is_reached,
            "magrr_ones": info.ones,
        }
