"""Staleness weighting for asynchronous aggregation (FedBuff, FedAsync).

An update computed on model version ``v`` that arrives when the global model is at version ``t``
has staleness ``s = t - v``. Stale updates point in a direction the model has since moved away
from, so they count less. The three families of Xie et al. (FedAsync, 2019), also used by FedBuff
(Nguyen et al., AISTATS 2022):

* constant:   f(s) = 1
* polynomial: f(s) = (1 + s)^-a
* hinge:      f(s) = 1 if s <= b, else 1 / (a (s - b) + 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StalenessKind = Literal["constant", "polynomial", "hinge"]


@dataclass(frozen=True)
class Staleness:
    kind: StalenessKind = "polynomial"
    a: float = 0.5
    b: int = 4

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "polynomial", "hinge"):
            raise ValueError(f"staleness = {self.kind!r}: use constant, polynomial or hinge")
        if not self.a >= 0:
            raise ValueError(f"staleness a = {self.a!r} must be >= 0")
        if self.b < 0:
            raise ValueError(f"staleness b = {self.b!r} must be >= 0")

    def weight(self, staleness: int) -> float:
        if staleness < 0:
            raise ValueError(f"staleness {staleness} < 0: an update from the future")
        if self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return float((1 + staleness) ** -self.a)
        if staleness <= self.b:
            return 1.0
        return 1.0 / (self.a * (staleness - self.b) + 1.0)
