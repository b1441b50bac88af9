"""Plain-data encodings of engine state that checkpoints and journals store (JSON / msgpack).

Generator states are saved only for seeded (``reproducible``) generators, so a resumed reproducible
run selects and draws exactly like an uninterrupted one. The state of the production CSPRNG is never
written to disk: whoever read it could predict every later selection and noise draw. A resumed
production run re-keys it from ``os.urandom``.
"""

from __future__ import annotations

import base64
import json

import numpy as np


def generator_state(rng: np.random.Generator) -> str | None:
    """A seeded PCG64's state as JSON text (its integers exceed 64 bits); None for a CSPRNG."""
    if isinstance(rng.bit_generator, np.random.PCG64):
        return json.dumps(rng.bit_generator.state)
    return None


def restore_generator(rng: np.random.Generator, state: str | None) -> None:
    if state is not None and isinstance(rng.bit_generator, np.random.PCG64):
        rng.bit_generator.state = json.loads(state)


def encode_nonces(nonces: dict[int, bytes]) -> dict[str, str]:
    return {str(v): base64.b64encode(n).decode() for v, n in sorted(nonces.items())}


def decode_nonces(data: dict[str, str]) -> dict[int, bytes]:
    return {int(v): base64.b64decode(n) for v, n in data.items()}
