"""Writes tests/vectors/partition.json: the reference digits split, row for row, for a device
written in another language (numpy's PCG64 shuffles cannot be reproduced without numpy).

    .venv/bin/python tests/vectors/make_partition.py     # tests/test_partition_vectors.py checks it
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from edge_fl.data.digits import _read_digits, load_digits_federated, stratified_split

HERE = Path(__file__).parent


def table_sha256() -> str:
    """SHA-256 of the 1797 x 65 table (64 pixels 0..16, then the label) as uint8, row major."""
    return hashlib.sha256(_read_digits().astype(np.uint8).tobytes()).hexdigest()


def build() -> dict:
    out: dict = {"dataset": "digits", "table_sha256": table_sha256(), "jobs": []}
    for seed, devices in ((0, 4), (0, 50)):
        raw = _read_digits()
        y = raw[:, -1].astype(np.int64)
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))  # as load_digits_split
        train_rows, test_rows = stratified_split(y, 0.2, rng)
        fed = load_digits_federated(devices, seed=seed)
        assert np.array_equal(fed.y_test, y[test_rows])
        shares = [train_rows[idx].tolist() for idx in fed.device_indices]
        out["jobs"].append(
            {
                "seed": seed,
                "data.devices": devices,
                "partition": "iid",
                "test_rows": test_rows.tolist(),
                "device_rows": shares,
            }
        )
    return out


if __name__ == "__main__":
    (HERE / "partition.json").write_text(json.dumps(build(), separators=(",", ":")) + "\n")
