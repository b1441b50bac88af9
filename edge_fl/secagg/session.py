"""What both sides of one SecAgg+ round share: its public parameters and the effects the state
machines return (the runtime carries them out; the cores never touch I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from edge_fl.protocol import NONCE_BYTES
from edge_fl.protocol.fields import NAME

if TYPE_CHECKING:  # the graph needs cryptography: imported when a round first asks for it
    from edge_fl.secagg.graph import Graph


@dataclass(frozen=True)
class RoundParams:
    """The public parameters of one round (from the signed global message and the job's
    calibration): who is in it (``roster``, sorted), the graph degree, the threshold t, the ring
    Z_2^bits, the vector length and the bound ``max_int`` every device's integers respect."""

    job: str
    round: int
    nonce: bytes
    roster: tuple[str, ...]
    neighbours: int
    threshold: int
    bits: int
    dim: int
    max_int: int
    min_survivors: int = 2
    noise_floor: int = 0

    def __post_init__(self) -> None:
        if len(self.nonce) != NONCE_BYTES:
            raise ValueError(f"a round nonce is {NONCE_BYTES} bytes")
        if list(self.roster) != sorted(set(self.roster)) or len(self.roster) < 2:
            raise ValueError("the roster is at least 2 distinct device ids, sorted")
        if not all(NAME.fullmatch(d) for d in self.roster) or not NAME.fullmatch(self.job):
            raise ValueError("device and job ids are 1-64 characters of A-Z a-z 0-9 _ . -")
        if not 1 <= self.neighbours <= len(self.roster) - 1:
            raise ValueError(f"neighbours {self.neighbours} is not in [1, {len(self.roster) - 1}]")
        if not 1 <= self.threshold <= self.neighbours:
            raise ValueError(f"threshold {self.threshold} is not in [1, {self.neighbours}]")
        if not 2 <= self.bits <= 64 or self.dim < 1 or self.max_int < 0:
            raise ValueError("bits in [2, 64], dim >= 1 and max_int >= 0")
        if self.noise_floor and self.noise_floor < self.min_survivors:
            raise ValueError(f"noise_floor {self.noise_floor} is 0 or at least min_survivors")
        if len(self.roster) * self.max_int >= 1 << (self.bits - 1):
            raise ValueError(
                f"{len(self.roster)} x {self.max_int} does not fit Z_2^{self.bits} as a signed sum"
            )

    @cached_property
    def graph(self) -> Graph:
        from edge_fl.secagg.graph import Graph, graph_seed

        return Graph(self.roster, self.neighbours, graph_seed(self.job, self.round, self.nonce))

    @property
    def vector_bytes(self) -> int:
        return self.dim * ((self.bits + 7) // 8)

    @property
    def max_bytes(self) -> int:
        """Largest secagg payload of this round (the masked vector plus headroom)."""
        return self.vector_bytes + 200 * (len(self.roster) + 8)


def params_from_wire(
    job: str, rnd: int, nonce: bytes, roster: tuple[str, ...], sa: dict
) -> RoundParams:
    """A device's round parameters, every one from the signed global message (its ``sa`` map,
    docs/protocol.md "Secure aggregation"; ``roster`` = its ``sel``)."""
    return RoundParams(
        job=job,
        round=rnd,
        nonce=nonce,
        roster=tuple(sorted(roster)),
        neighbours=sa["k"],
        threshold=sa["t"],
        bits=sa["b"],
        dim=sa["n"],
        max_int=0 if sa["md"] else sa["q"],
        min_survivors=sa["ms"],
    )


@dataclass(frozen=True)
class Send:
    """Device effect: publish ``payload`` (on the device's uplink topic)."""

    payload: bytes


@dataclass(frozen=True)
class Deliver:
    """Aggregator effect: publish ``payload`` on ``device``'s inbox."""

    device: str
    payload: bytes


@dataclass(frozen=True)
class Rejected:
    """A message that changed nothing: who sent it (the device's, or None on a device), why."""

    device: str | None
    reason: str
    detail: str


@dataclass(frozen=True)
class Aborted:
    """Device effect: the device left the round (it sends nothing more for it)."""

    reason: str


@dataclass(frozen=True)
class Summed:
    """The round's sum: the devices' integers added, exactly, lifted to signed int64.
    ``altered``: devices whose unmask answer held a share that was not their target's (the sum
    was recovered from the other shares; see ``AggregatorSession.altered``). ``denoised``:
    contributors whose own noise was removed from the sum (``RoundParams.noise_floor``);
    ``noise_asked``: those asked for it (a late answer still reveals it, so the guarantee counts
    only the contributors never asked)."""

    total: np.ndarray
    contributors: tuple[str, ...]
    altered: tuple[str, ...] = ()
    denoised: tuple[str, ...] = ()
    noise_asked: tuple[str, ...] = ()


@dataclass(frozen=True)
class Failed:
    """The round cannot be unmasked: one line saying why (never a partial or wrong sum)."""

    phase: str
    reason: str


Outcome = Summed | Failed


@dataclass(frozen=True)
class Finished:
    """Aggregator effect: the round is over."""

    outcome: Outcome
