"""``edge-fl privacy plan`` shows the calibration a secure FedBuff job runs: its cohort of K'
devices (an auditor found the plan calibrated for the sync selection instead: sigma^2 4,291, 14
bits, against the 12,880 and 13 bits the job's cohorts carried)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from edge_fl.cli.privacy_cmds import privacy_group
from edge_fl.config import load_config
from edge_fl.job import build_job

JOB = {
    "data.devices": 16,
    "model.name": "logreg",
    "rounds.mode": "fedbuff",
    "rounds.buffer_size": 3,
    "rounds.rounds": 6,
    "rounds.concurrency": 10,
    "privacy.mechanism": "distributed-gaussian",
    "privacy.epsilon": 8,
    "secure_aggregation.enabled": True,
}


def test_the_plan_of_a_secure_fedbuff_job_is_the_calibration_its_cohorts_carry():
    args = ["plan", "--json"] + [f"--set={k}={json.dumps(v)}" for k, v in JOB.items()]
    res = CliRunner().invoke(privacy_group, args)
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output.splitlines()[0])
    job = build_job(load_config(None, JOB))
    secure = job.secure_plan
    assert plan["secure_aggregation"]["selected"] == job.secure_selected == 5  # ceil(3 / 0.7)
    assert plan["secure_aggregation"]["bits"] == secure.layout.bits == 13
    mp = job.mechanism.public_params()
    assert plan["sigma2"] == float(mp["s2"]) and plan["noise_shares"] == mp["nmin"] == 4
    assert plan["worst_case_total"]["epsilon"] <= 8
