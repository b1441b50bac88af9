"""A job document's ``cal`` rows are this job's calibrations only (issue 23): the process's table
is shared by every job built in it (the Python API builds several), but a document published for
one job must not carry the noise multipliers of another."""

from __future__ import annotations

from typing import Any

from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.privacy import calibration


def _job(**overrides: Any) -> Any:
    base = {"data.devices": 4, "rounds.rounds": 2, "rounds.clients_per_round": 4}
    return build_job(load_config(None, {"model.name": "logreg", **base, **overrides}))


def test_a_document_carries_only_its_own_jobs_calibrations():
    a = _job(**{"job": "a", "privacy.mechanism": "gaussian", "privacy.epsilon": 7.25})
    b = _job(**{"job": "b", "privacy.mechanism": "gaussian", "privacy.epsilon": 9.5})
    c = _job(**{"job": "c", "privacy.mechanism": "dpsgd", "privacy.epsilon": 6.5})
    rows = {name: job.job_document().calibration for name, job in (("a", a), ("b", b), ("c", c))}
    everything = calibration.table()
    assert len(everything) >= 3  # the process holds all three jobs' values
    assert [r[:2] for r in rows["a"]] == [["gaussian", 7.25]]
    assert [r[:2] for r in rows["b"]] == [["gaussian", 9.5]]
    assert rows["c"] and all(r[0] == "dpsgd" and r[1] == 6.5 for r in rows["c"])
    for job_rows in rows.values():
        assert all(row in everything for row in job_rows)
    none = _job(**{"job": "d", "privacy.mechanism": "laplace", "privacy.epsilon": 2})
    assert none.job_document().calibration == []


def test_a_dpsgd_size_first_calibrated_by_a_device_is_still_in_the_document():
    """A dataset size first met while a device trained (outside any scope of the job) is looked
    up again when the document is made, so its row is published."""
    job = _job(**{"job": "e", "privacy.mechanism": "dpsgd", "privacy.epsilon": 5.75})
    n = job.agent(0).n_samples
    sigma = job.mechanism.params(n).noise_multiplier  # as a device's first update would
    rows = job.job_document().calibration
    assert rows and all(r[0] == "dpsgd" and r[1] == 5.75 for r in rows)
    q, steps = job.mechanism.rate(n), job.mechanism.steps(n)
    assert [r for r in rows if r[3] == q and r[-1] == sigma], (q, steps, rows)
