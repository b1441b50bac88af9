"""Random generators: a CSPRNG for production, seeded ones only behind an explicit switch.

Noise, sampling and selection randomness decide privacy, so the default generator is ChaCha20
(randomgen) keyed from ``os.urandom``: its outputs cannot be predicted or its state recovered, unlike
numpy's PCG64 or Python's Mersenne Twister (``docs/specs/privacy.md``, pitfall 3). A seeded PCG64 is
available only when the caller passes ``reproducible=True`` with a seed; the run metadata records it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RngInfo:
    """What kind of generator a run used, for the run metadata."""

    kind: str  # "chacha20-urandom" or "pcg64-seeded"
    seed: int | None

    @property
    def secure(self) -> bool:
        return self.kind == "chacha20-urandom"


def secure_generator() -> np.random.Generator:
    """A numpy Generator over ChaCha20 with a 256-bit key from the OS entropy pool."""
    from randomgen import ChaCha  # here: importing this module (a seeded run) needs no randomgen

    key = int.from_bytes(os.urandom(32), "little")
    return np.random.Generator(ChaCha(key=key, counter=0, rounds=20))


def seeded_generator(seed: int, *stream: int) -> np.random.Generator:
    """A reproducible PCG64 generator; for tests and reproducibility runs only."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *stream])))


def make_generator(
    seed: int | None, *stream: int, reproducible: bool = False
) -> tuple[np.random.Generator, RngInfo]:
    """Production CSPRNG unless ``reproducible`` is set explicitly (then ``seed`` is required)."""
    if reproducible:
        if seed is None:
            raise ValueError("reproducible=True needs a seed")
        return seeded_generator(seed, *stream), RngInfo("pcg64-seeded", seed)
    return secure_generator(), RngInfo("chacha20-urandom", None)
