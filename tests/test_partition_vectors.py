"""tests/vectors/partition.json is the reference digits split row for row (docs/protocol.md, "A
device's data and |D|"): a device in another language takes its rows from it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

from edge_fl.data.digits import load_digits_federated

VECTORS = Path(__file__).parent / "vectors"


def _maker():
    spec = importlib.util.spec_from_file_location("make_partition", VECTORS / "make_partition.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_partition_vector_is_what_the_reference_devices_hold():
    stored = json.loads((VECTORS / "partition.json").read_text())
    assert stored == _maker().build()


def test_rows_index_the_bundled_table_in_order():
    """The rows named by the vector give exactly the reference devices' data (table order)."""
    stored = json.loads((VECTORS / "partition.json").read_text())
    raw = _maker()._read_digits()
    for job in stored["jobs"]:
        fed = load_digits_federated(job["data.devices"], seed=job["seed"])
        np.testing.assert_array_equal(raw[job["test_rows"], :-1] / 16.0, fed.X_test)
        for i, rows in enumerate(job["device_rows"]):
            X, y = fed.device_data(i)
            np.testing.assert_array_equal(raw[rows, :-1] / 16.0, X)
            np.testing.assert_array_equal(raw[rows, -1], y)
        sizes = [len(r) for r in job["device_rows"]]
        assert sum(sizes) + len(job["test_rows"]) == 1797
