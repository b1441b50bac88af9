"""Privacy end to end over Mosquitto: the ledger's total over all rounds, and devices that spend
their budget stop uploading while the run reports it."""

from __future__ import annotations

import itertools
import json
import uuid

import pytest

from edge_fl.config import load_config
from edge_fl.simulation import simulate

pytestmark = pytest.mark.broker


def run(tmp_path, **overrides):
    cfg = load_config(
        None,
        {
            "job": f"p-{uuid.uuid4().hex[:6]}",
            "data.devices": 10,
            "rounds.clients_per_round": 5,
            "rounds.min_updates": 2,
            "rounds.deadline_s": 10,
            **overrides,
        },
    )
    summary = simulate(cfg, tmp_path)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def test_budget_exhausted_devices_stop_and_are_reported(tmp_path):
    # Laplace: eps 0.5 per round (3 / 6 rounds); a budget of 1.0 affords two releases per device
    summary, records = run(
        tmp_path,
        **{
            "rounds.rounds": 6,
            "privacy.mechanism": "laplace",
            "privacy.epsilon": 3.0,
            "privacy.budget_epsilon": 1.0,
        },
    )
    assert summary["stopped_devices"] > 0
    assert records[-1]["stopped_devices"] > 0
    # no device released more than its budget: the reported worst-device epsilon stays <= 1
    assert all(r["epsilon"] <= 1.0 + 1e-9 for r in records)
    assert 0.99 <= summary["privacy"]["epsilon"] <= 1.0 + 1e-9  # PLD may be a hair tighter
    assert summary["privacy"]["unit"] == "example"
    # stopped devices never upload again: accepted updates <= 2 per device
    assert summary["total_received"] <= 2 * 10


def test_epsilon_is_cumulative_never_per_round(tmp_path):
    summary, records = run(
        tmp_path,
        **{"rounds.rounds": 4, "privacy.mechanism": "gaussian", "privacy.noise_multiplier": 2.0},
    )
    eps = [r["epsilon"] for r in records]
    assert all(b >= a for a, b in itertools.pairwise(eps))
    assert eps[-1] > eps[0] * 1.3  # more rounds spent more: the total, not one round's value
    p = summary["privacy"]
    assert p["delta"] == 1e-5 and p["neighbouring_relation"] == "replace_one"
    assert p["composition"].startswith("all recorded releases")


def test_poisson_selection_runs_hides_participation_and_accounts_exactly(mosquitto, tmp_path):
    """Central DP-FedAvg with secret Poisson coins: rounds close with whoever flipped heads (also
    nobody), the metrics topic devices can read carries no participation counts, and the reported
    epsilon is dp-accounting's for the realised events: one PoissonSampled Gaussian per round."""
    from dp_accounting import dp_event
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant
    from mqtt_tap import UpdateTap

    from edge_fl.protocol import Topics

    job = f"poisson-{uuid.uuid4().hex[:6]}"
    cfg = load_config(
        None,
        {
            "job": job,
            "broker.url": mosquitto.url,
            "data.devices": 20,
            "model.name": "logreg",
            "rounds.rounds": 4,
            "rounds.clients_per_round": 5,
            "rounds.deadline_s": 1.5,
            "privacy.mechanism": "gaussian-central",
            "privacy.noise_multiplier": 1.0,
            "privacy.poisson_selection": True,
        },
    )
    with UpdateTap(mosquitto.url, Topics(job), topic=Topics(job).metrics) as tap:
        summary = simulate(cfg, tmp_path)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds_closed"] == 4 and len(records) == 4
    # private output keeps participation; the public topic does not
    assert all("received" in r and "bytes_up" in r for r in records)
    public = [json.loads(p) for _, p in tap.payloads]
    assert len(public) == 4
    hidden = {"received", "selected", "target", "late", "rejected", "bytes_up", "messages_up"}
    assert all(hidden.isdisjoint(r) for r in public)
    # the fleet's own counts depend on who uploaded too: wire_up / a device's bytes per upload
    # gave the received count of every round (issue 23 F3)
    assert all("wire_up" in r and "dropouts" in r for r in records)
    assert not [k for r in public for k in r if k.startswith("wire_") or k == "dropouts"]
    # the devices' epsilon quantiles count releases too: in the records, never on the topic
    assert all(r["epsilon_device_max"] == r["epsilon"] for r in records)
    assert not [k for r in public for k in r if k.startswith("epsilon_device_")]
    assert all(r["epsilon"] == rec["epsilon"] for r, rec in zip(public, records, strict=True))
    # devices really flipped coins: 4 rounds x 20 devices x q = 0.25 -> 20 expected uploads
    assert 0 < summary["total_received"] < 60
    q = 5 / 20
    event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(1.0))
    pld = PLDAccountant().compose(event, 4).get_epsilon(1e-5)
    rdp = RdpAccountant().compose(event, 4).get_epsilon(1e-5)
    p = summary["privacy"]
    assert p["epsilon_by_accountant"]["pld"] == pytest.approx(pld, rel=1e-3)
    assert p["epsilon_by_accountant"]["rdp"] == pytest.approx(rdp, rel=1e-3)
    assert p["epsilon"] == pytest.approx(min(pld, rdp), rel=1e-3)
    assert p["sampling"].startswith("poisson") and p["unit"] == "device"
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["privacy"]["sampling_rate"] == q and meta["privacy"]["poisson_selection"]


@pytest.mark.parametrize(
    "privacy",
    [
        {"privacy.mechanism": "laplace", "privacy.epsilon": 8.0},
        {"privacy.mechanism": "gaussian", "privacy.noise_multiplier": 3.0},
        {"privacy.mechanism": "gaussian-central", "privacy.noise_multiplier": 1.0},
        {"privacy.mechanism": "dpsgd", "privacy.noise_multiplier": 1.5},
        {"privacy.mechanism": "nbafl", "privacy.epsilon": 4.0, "privacy.clip": 5.0},
        {"privacy.mechanism": "signds", "privacy.signds.sign_k": 0.1},
    ],
    ids=lambda p: p["privacy.mechanism"],
)
def test_one_epsilon_everywhere(tmp_path, privacy):
    """Console, summary (top level and privacy block), the last metrics record and the plotted
    series all carry the same number: the tightest valid accountant's, named the same way."""
    from click.testing import CliRunner

    from edge_fl.cli import main
    from edge_fl.report import read_run

    args = ["simulate", "--devices", "8", "--rounds", "3", "--clients-per-round", "4"]
    args += ["--model", "logreg", "--no-progress", "--out", str(tmp_path)]
    args += ["--job", f"eps-{uuid.uuid4().hex[:6]}"]
    mech = privacy["privacy.mechanism"]
    cfg = tmp_path / "job.yaml"
    section = {k.split(".", 1)[1]: v for k, v in privacy.items()}
    lines = ["privacy:"] + [
        f"  {k}: {v}" for k, v in section.items() if not k.startswith("signds.")
    ]
    if "signds.sign_k" in section:
        lines += ["  signds:", f"    sign_k: {section['signds.sign_k']}"]
    cfg.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(main, [*args, "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    eps, acc = summary["privacy"]["epsilon"], summary["privacy"]["accountant"]
    assert summary["mechanism"] == mech and summary["privacy"]["mechanisms"] == [mech]
    assert summary["epsilon"] == eps and summary["accountant"] == acc
    assert records[-1]["epsilon"] == eps and records[-1]["accountant"] == acc
    assert records[-1]["epsilon_device_max"] == eps  # the worst device's is the job's
    assert all(r["epsilon_device_p50"] <= r["epsilon_device_p95"] <= r["epsilon"] for r in records)
    by = summary["privacy"]["epsilon_by_accountant"]
    assert eps == min(v for v in by.values() if v is not None)
    for name, value in by.items():  # a skipped accountant is null, with its reason
        assert value is not None or summary["privacy"]["skipped_accountants"][name]
    assert f"epsilon {eps:.4g} at delta" in result.output and f"({acc}," in result.output
    plotted = read_run(tmp_path).records[-1]["epsilon"]
    assert plotted == eps
    assert "Infinity" not in (tmp_path / "summary.json").read_text()


def test_a_job_ended_on_budgets_says_how_many_of_its_rounds_ran(tmp_path):
    """The console's count is of the rounds that ran, and says so when they are fewer than
    asked (a newcomer read "rounds 13/15 closed" of a 20-round job as a miscount)."""
    from click.testing import CliRunner

    from edge_fl.cli import main

    args = ["simulate", "--devices", "10", "--clients-per-round", "5", "--rounds", "10"]
    args += ["--model", "logreg", "--mechanism", "laplace", "--epsilon", "5", "--budget", "1"]
    args += ["--no-progress", "--out", str(tmp_path), "--job", f"ran-{uuid.uuid4().hex[:6]}"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    ran = json.loads((tmp_path / "summary.json").read_text())["rounds"]
    assert ran < 10
    assert f"/{ran} closed ({ran} of the 10 asked ran)" in result.output
    assert "ended early: only" in result.output
