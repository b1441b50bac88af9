"""The round's neighbour graph: a random Harary graph H(n, k) derived from the public round seed.

Positions 0..n-1 on a circle, each adjacent to the k/2 positions on either side; devices are
placed on the circle by a permutation of the sorted roster drawn from the seed (Fisher-Yates over
the ChaCha20 keystream, unbiased by rejection). Every device and the aggregator compute the same
graph from (job, round, nonce, roster, k); nothing about it travels. With k >= n - 1 it is the
complete graph (the original SecAgg of Bonawitz et al.). Why Harary: a device's neighbours are
then a uniformly random k-subset of the others, and the survivors stay connected unless two runs
of k/2 consecutive positions are all gone, which makes calibration's bounds exact (calibration.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from edge_fl.secagg.primitives import context, hkdf


def graph_seed(job: str, rnd: int, nonce: bytes) -> bytes:
    return hkdf(nonce, b"", context("graph", job, rnd))


def permutation(seed: bytes, n: int) -> list[int]:
    """A uniformly random permutation of range(n) from ``seed``: Fisher-Yates from the top,
    j uniform in [0, i] from little-endian 64-bit words by rejection below the largest multiple
    of i + 1."""
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    order = list(range(n))
    buf: list[int] = []
    for i in range(n - 1, 0, -1):
        bound = i + 1
        limit = (1 << 64) - ((1 << 64) % bound)
        while True:
            if not buf:
                buf = np.frombuffer(stream.update(bytes(8 * 64)), dtype="<u8").tolist()[::-1]
            word = buf.pop()
            if word < limit:
                break
        j = word % bound
        order[i], order[j] = order[j], order[i]
    return order


class Graph:
    """Neighbours of each device of ``roster`` (sorted, distinct) in H(n, k)."""

    def __init__(self, roster: Sequence[str], k: int, seed: bytes) -> None:
        self.roster = tuple(roster)
        self.k = k
        n = len(self.roster)
        self.complete = k >= n - 1
        if not self.complete and k % 2:
            raise ValueError(f"a Harary graph of {n} devices needs an even degree, got {k}")
        perm = permutation(seed, n)
        self._circle = [self.roster[i] for i in perm]
        self._pos = {dev: p for p, dev in enumerate(self._circle)}

    @cached_property
    def index(self) -> dict[str, int]:
        """Roster index; a device's Shamir point is its index + 1."""
        return {dev: i for i, dev in enumerate(self.roster)}

    def neighbours(self, device: str) -> tuple[str, ...]:
        """The device's neighbours, sorted (every per-neighbour array on the wire follows it)."""
        if self.complete:
            return tuple(d for d in self.roster if d != device)
        n, p, half = len(self._circle), self._pos[device], self.k // 2
        near = {self._circle[(p + j) % n] for j in range(1, half + 1)}
        near |= {self._circle[(p - j) % n] for j in range(1, half + 1)}
        return tuple(sorted(near))

    def point(self, device: str) -> int:
        return self.index[device] + 1
