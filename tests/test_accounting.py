"""The privacy ledger and its reference values (dp-accounting 0.6.0), plus the privacy CLI."""

from __future__ import annotations

import json
import math
import shlex

import dp_accounting as dpa
import numpy as np
import pytest
from click.testing import CliRunner
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

from edge_fl.cli.privacy_cmds import privacy_group
from edge_fl.privacy.accountants import (
    DP_ACCOUNTING_VERSION,
    RDP_ORDERS,
    best_epsilon,
    compose_epsilon,
)
from edge_fl.privacy.dpsgd import DpSgdConfig, dpsgd_epsilon
from edge_fl.privacy.events import (
    IncompatibleEventsError,
    NeighboringRelation,
    PrivacyEvent,
    pure_dp_event,
    pure_privacy_event,
)
from edge_fl.privacy.gaussian import CentralGaussianConfig, LocalGaussianConfig
from edge_fl.privacy.laplace import LaplaceConfig
from edge_fl.privacy.ledger import PrivacyLedger
from edge_fl.privacy.randomized_response import rr_privacy_event

AR = NeighboringRelation.ADD_OR_REMOVE_ONE
R1 = NeighboringRelation.REPLACE_ONE
Q = 256 / 60000

DPSGD_REFERENCE = [  # steps, RDP eps, PLD eps (spec section 0)
    (234, 0.925847, 0.392781),
    (2343, 1.352157, 1.099695),
    (14062, 3.078673, 2.822621),
]


@pytest.mark.parametrize(("steps", "rdp", "pld"), DPSGD_REFERENCE)
def test_dpsgd_reference_values(steps, rdp, pld):
    assert dpsgd_epsilon(1.0, Q, steps, 1e-5, "rdp") == pytest.approx(rdp, abs=1e-5)
    assert dpsgd_epsilon(1.0, Q, steps, 1e-5, "pld") == pytest.approx(pld, abs=1e-5)


def test_dpsgd_ledger_per_step_equals_self_composed():
    cfg = DpSgdConfig(1.0, 1.0, Q)
    ledger = PrivacyLedger()
    for step in range(234):
        ledger.add(cfg.privacy_event(), device="d0", round=step // 10)
    assert ledger.epsilon(1e-5, "rdp") == pytest.approx(0.925847, abs=1e-5)
    assert ledger.epsilon(1e-5, "pld") == pytest.approx(0.392781, abs=1e-5)
    # the orders in use give the same result as dp-accounting's defaults
    default = RdpAccountant().compose(cfg.dp_event(234)).get_epsilon(1e-5)
    assert default == pytest.approx(ledger.epsilon(1e-5, "rdp"), abs=1e-9)


def test_rr_composition_and_dp_accounting_count_bug_workaround():
    rr = rr_privacy_event(0.1)
    assert compose_epsilon([rr] * 100, 1e-5, "pld").epsilon == pytest.approx(4.314041, abs=1e-5)
    ledger = PrivacyLedger()
    for r in range(100):
        ledger.add(rr, device=7, round=r)
    assert ledger.epsilon(1e-5, "pld") == pytest.approx(4.314041, abs=1e-5)
    assert ledger.epsilon(1e-5, "rdp") >= ledger.epsilon(1e-5, "pld")
    assert ledger.epsilon(0, "basic") == pytest.approx(10.0)
    # Tripwire on the upstream bug the ledger works around (spec 1.4): if this starts failing,
    # dp-accounting fixed `count` for randomized response and the work-around can go.
    buggy = PLDAccountant(R1).compose(rr.event, count=100).get_epsilon(1e-5)
    assert buggy == pytest.approx(0.100081, abs=1e-5)


def test_gaussian_per_round_versus_total_pitfall_6():
    ev = PrivacyEvent(dpa.GaussianDpEvent(1.1), AR, "device", "gaussian")
    ledger = PrivacyLedger()
    ledger.add(ev, round=0)
    one = ledger.epsilon(1e-5, "pld")
    for r in range(1, 50):
        ledger.add(ev, round=r)
    total = ledger.epsilon(1e-5, "pld")
    # The spec's numbers are the exact (analytic / PLD) ones; RDP is looser (4.240 / 49.926).
    assert one == pytest.approx(3.921, abs=5e-4)
    assert total == pytest.approx(47.31, abs=5e-3)
    assert total == pytest.approx(dpa.get_epsilon_gaussian(1.1 / math.sqrt(50), 1e-5), abs=1e-6)
    assert ledger.epsilon(1e-5, "rdp") > total > one
    rep = ledger.report(1e-5)
    assert rep["epsilon_by_accountant"]["pld"] == total
    assert rep["epsilon"] == min(v for v in rep["epsilon_by_accountant"].values() if v is not None)
    assert rep["events"] == 50 and rep["rounds"] == 50


def test_ledger_total_strictly_greater_than_per_round_for_every_mechanism():
    events = [
        LaplaceConfig(1.0, 0.1, 2.0, 10).privacy_event(0),
        LocalGaussianConfig(1.0, 4.0).privacy_event(),
        CentralGaussianConfig(1.0, 1.0, 10, 100).privacy_event(),
        DpSgdConfig(1.0, 1.0, 0.01).privacy_event(20),
        rr_privacy_event(0.5),
        pure_privacy_event(0.7, "signds"),
    ]
    for ev in events:
        for acc in ("rdp", "pld"):
            ledger = PrivacyLedger()
            ledger.add(ev, device="a", round=0)
            per_round = ledger.epsilon(1e-5, acc)
            for r in range(1, 5):
                ledger.add(ev, device="a", round=r)
            assert ledger.epsilon(1e-5, acc) > per_round, (ev.mechanism, acc)


def test_pure_dp_event_is_the_tight_generic_representation():
    orders = np.array(RDP_ORDERS)
    for eps in (0.1, 1.0, 5.0):
        rr = RdpAccountant(list(orders), R1).compose(pure_dp_event(eps)).rdp
        lap = RdpAccountant(list(orders), R1).compose(dpa.LaplaceDpEvent(1 / eps)).rdp
        assert np.all(rr >= lap - 1e-12)  # Laplace's curve would understate a generic eps-DP
        assert np.all(rr > lap)
        assert np.all(rr <= orders * eps**2 / 2 + 1e-12)  # Bun-Steinke zCDP bound is looser
        assert np.all(rr <= eps + 1e-12)
        one = compose_epsilon([pure_privacy_event(eps, "x")], 0.0, "pld").epsilon
        assert one == pytest.approx(eps, abs=1e-3)
        assert pure_privacy_event(eps, "x").pure_epsilon == pytest.approx(eps)


def test_advanced_composition_is_valid_and_labelled():
    for eps0, k in ((0.05, 400), (0.3, 50), (1.0, 10)):
        evs = [pure_privacy_event(eps0, "x")] * k
        basic = compose_epsilon(evs, 1e-6, "basic").epsilon
        adv = compose_epsilon(evs, 1e-6, "advanced").epsilon
        optimal = compose_epsilon(evs, 1e-6, "pld").epsilon  # RR dominates: the optimum
        assert basic == pytest.approx(eps0 * k)
        assert optimal <= adv + 1e-3 and adv <= basic
    mixed = [pure_privacy_event(0.1, "x")] * 20 + [pure_privacy_event(0.5, "y")] * 5
    assert (
        compose_epsilon(mixed, 1e-6, "pld").epsilon
        <= compose_epsilon(mixed, 1e-6, "advanced").epsilon
    )
    with pytest.raises(ValueError, match="pure eps-DP events only"):
        compose_epsilon([DpSgdConfig(1.0, 1.0, 0.1).privacy_event()], 1e-5, "basic")


def test_laplace_ledger_basic_pld_rdp():
    cfg = LaplaceConfig(1.0, 0.1, epsilon=1.0, rounds=20)
    ledger = PrivacyLedger()
    for r in range(20):
        ledger.add(cfg.privacy_event(r), device="d", round=r)
    assert ledger.epsilon(0.0, "basic") == pytest.approx(1.0)
    assert ledger.epsilon(1e-5, "pld") < 1.0
    assert ledger.epsilon(1e-5, "rdp") < 1.0
    by = ledger.report(1e-5)["epsilon_by_accountant"]
    assert by["basic"] == pytest.approx(1.0) and by["pld"] == ledger.epsilon(1e-5, "pld")


def test_replace_one_gaussian_read_relative_to_declared_sensitivity():
    ev = PrivacyEvent(dpa.GaussianDpEvent(1.1), R1, "device", "gaussian-local")
    assert compose_epsilon([ev], 1e-5, "pld").epsilon == pytest.approx(3.921250, abs=1e-5)
    assert compose_epsilon([ev], 1e-5, "rdp").epsilon == pytest.approx(4.239641, abs=1e-5)
    # Tripwire: dp-accounting's own PLD accountant reads the multiplier relative to the
    # add/remove sensitivity under REPLACE_ONE (doubling the shift), its RDP accountant does not.
    assert PLDAccountant(R1).compose(ev.event).get_epsilon(1e-5) == pytest.approx(8.895, abs=1e-3)


def test_relation_and_unit_mixing():
    dpsgd = DpSgdConfig(1.0, 1.0, 0.01).privacy_event(10)
    signds = pure_privacy_event(1.0, "signds")  # local DP: implies example-level guarantees
    res = compose_epsilon([dpsgd, signds], 1e-5, "rdp")
    assert res.relation == NeighboringRelation.REPLACE_SPECIAL and res.unit == "example"
    alone = compose_epsilon([dpsgd], 1e-5, "rdp").epsilon
    assert res.epsilon > alone
    laplace = LaplaceConfig(1.0, 0.1, 1.0, 1).privacy_event(0)  # replace-one, example
    with pytest.raises(IncompatibleEventsError, match="replace_special/example"):
        compose_epsilon([dpsgd, laplace], 1e-5, "rdp")
    g_dev = PrivacyEvent(dpa.GaussianDpEvent(2.0), R1, "device")
    g_ex = PrivacyEvent(dpa.GaussianDpEvent(2.0), R1, "example")
    both = compose_epsilon([g_dev, g_ex], 1e-5, "pld")
    assert both.unit == "example"
    assert both.epsilon == pytest.approx(
        dpa.get_epsilon_gaussian(2.0 / math.sqrt(2), 1e-5), abs=1e-4
    )
    central = CentralGaussianConfig(1.0, 1.0, 10, 100).privacy_event()
    local = LocalGaussianConfig(1.0, 1.0).privacy_event()
    with pytest.raises(IncompatibleEventsError):
        compose_epsilon([central, local], 1e-5, "pld")


def test_per_device_and_job_level_composition():
    central = CentralGaussianConfig(1.0, 1.0, 10, 100)
    ledger = PrivacyLedger()
    for r in range(30):
        ledger.add(central.privacy_event(), device=None, round=r)  # aggregator noise: job level
    job_only = ledger.epsilon(1e-5)
    assert ledger.devices == []
    sig = pure_privacy_event(0.2, "signds")
    ledger2 = PrivacyLedger()
    for r in range(10):
        ledger2.add(sig, device="a", round=r)
    for r in range(4):
        ledger2.add(sig, device="b", round=r)
    by_dev = ledger2.epsilon_by_device(1e-5, "pld")
    assert by_dev["a"] > by_dev["b"]
    assert ledger2.epsilon(1e-5, "pld") == by_dev["a"]
    rep = ledger2.report(1e-5)
    assert rep["worst_device"] == "a" and rep["events"] == 10
    by = rep["epsilon_by_accountant"]
    assert by["basic"] == pytest.approx(2.0)
    assert rep["epsilon"] <= by["advanced"] <= by["basic"]
    assert ledger2.epsilon(1e-5, "pld", device="never-seen") == 0.0
    assert job_only > 0 and ledger.epsilon(1e-5, device="x") == job_only


def test_best_epsilon_is_the_smallest_applicable_and_names_it():
    lap = [LaplaceConfig(1.0, 0.1, epsilon=1.0, rounds=10).privacy_event(r) for r in range(10)]
    bound = best_epsilon(lap, 1e-5)
    values = {k: v for k, v in bound.values.items() if v is not None}
    assert set(values) == {"rdp", "pld", "basic", "advanced"} and not bound.skipped
    assert bound.epsilon == min(values.values()) and values[bound.accountant] == bound.epsilon
    assert values["basic"] == pytest.approx(1.0)
    # approximate-DP events: basic/advanced do not apply and say why
    dp = [DpSgdConfig(1.0, 1.0, Q).privacy_event(78)] * 3
    b2 = best_epsilon(dp, 1e-5)
    assert b2.values["basic"] is None and "pure" in b2.skipped["basic"]
    assert b2.accountant == "pld" and b2.epsilon == pytest.approx(0.392781, abs=2e-3)
    # a very wide pure release: PLD skipped with a reason, never reported as infinite
    b3 = best_epsilon([pure_privacy_event(100.0, "signds")] * 3, 1e-5)
    assert b3.values["pld"] is None and "too wide" in b3.skipped["pld"]
    assert b3.epsilon == pytest.approx(300.0) and b3.accountant == "basic"
    assert best_epsilon([], 1e-5).epsilon == 0.0


def test_report_states_what_the_number_means():
    ledger = PrivacyLedger()
    cfg = DpSgdConfig(1.0, 1.0, Q)
    for r in range(3):
        ledger.add(cfg.privacy_event(78), device="phone-1", round=r)
    rep = ledger.report(1e-5)
    assert rep["epsilon_by_accountant"]["rdp"] == pytest.approx(0.925847, abs=1e-5)
    assert rep["epsilon"] == pytest.approx(0.392781, abs=2e-3) and rep["accountant"] == "pld"
    assert rep["delta"] == 1e-5
    assert DP_ACCOUNTING_VERSION in rep["accountant_impl"] and DP_ACCOUNTING_VERSION == "0.6.0"
    assert rep["neighbouring_relation"] == "replace_special" and rep["unit"] == "example"
    assert rep["sampling"].startswith("poisson")
    assert rep["rdp_order_at_grid_edge"] is False
    assert rep["mechanisms"] == ["dpsgd"] and rep["rounds"] == 3


def test_ledger_input_validation():
    ledger = PrivacyLedger()
    with pytest.raises(ValueError, match="relation= and unit="):
        ledger.add(dpa.GaussianDpEvent(1.0))
    ledger.add(dpa.GaussianDpEvent(1.0), relation=AR, unit="example")
    with pytest.raises(ValueError, match=r"round must be an integer >= 0 or None, got -1"):
        ledger.add(rr_privacy_event(1.0), round=-1)
    with pytest.raises(ValueError, match=r"delta must be in \[0, 1\), got 1.5"):
        ledger.epsilon(1.5)
    with pytest.raises(ValueError, match="accountant must be one of"):
        ledger.epsilon(1e-5, "moments")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unit must be one of"):
        PrivacyEvent(dpa.GaussianDpEvent(1.0), AR, "user")  # type: ignore[arg-type]
    nonpriv = PrivacyEvent(dpa.NonPrivateDpEvent(), AR, "example", "leak")
    assert compose_epsilon([nonpriv], 1e-5, "pld").epsilon == math.inf
    assert compose_epsilon([nonpriv], 1e-5, "rdp").epsilon == math.inf
    assert compose_epsilon([], 1e-5).epsilon == 0.0


# ----------------------------------------------------------------------------------------------
# CLI


def _json(args: list[str]) -> dict:
    res = CliRunner().invoke(privacy_group, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_cli_dpsgd_reference():
    out = _json(
        shlex.split(
            "dpsgd --sigma 1.0 --q 0.0042666666666666667 --steps 14062 --delta 1e-5 "
            "--accountant rdp --json"
        )
    )
    assert out["epsilon"] == pytest.approx(3.078673, abs=1e-5)
    assert out["delta"] == 1e-5 and out["accountant"] == "rdp"
    table = CliRunner().invoke(
        privacy_group,
        shlex.split("dpsgd --sigma 1.0 --q 0.0042666666666666667 --steps 14062 --delta 1e-5"),
    )
    assert table.exit_code == 0 and "3.078673" in table.output


def test_cli_other_accountings():
    rr = _json(shlex.split("rr --eps 0.1 --rounds 100 --delta 1e-5 --accountant pld --json"))
    assert rr["epsilon"] == pytest.approx(4.314041, abs=1e-5)
    fed = _json(
        shlex.split("fedavg --z 1.1 --q 1 --rounds 50 --delta 1e-5 --accountant pld --json")
    )
    assert fed["epsilon"] == pytest.approx(47.31, abs=5e-3)
    lap = _json(
        shlex.split("laplace --eps-round 0.1 --rounds 100 --delta 1e-5 --accountant basic --json")
    )
    assert lap["epsilon"] == pytest.approx(10.0)
    cal = _json(
        shlex.split(
            "calibrate dpsgd --target-eps 3.078673 --delta 1e-5 --q 0.0042666666666666667 "
            "--steps 14062 --json"
        )
    )
    assert cal["noise_multiplier"] == pytest.approx(1.0, abs=1e-4)
    assert cal["epsilon"] <= 3.078673
    calf = _json(
        shlex.split("calibrate fedavg --target-eps 2 --delta 1e-5 --q 0.01 --rounds 500 --json")
    )
    assert calf["epsilon"] <= 2.0 and calf["epsilon"] == pytest.approx(2.0, abs=1e-4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("dpsgd --sigma -1 --q 0.5 --steps 3 --delta 1e-5", "'-1' is not in (0, inf)"),
        ("dpsgd --sigma 1 --q 1.5 --steps 3 --delta 1e-5", "'1.5' is not in (0, 1]"),
        ("dpsgd --sigma 1 --q 0.5 --steps 0 --delta 1e-5", "'0' is not an integer >= 1"),
        ("fedavg --z 1 --q 0.5 --rounds 3 --delta 0", "'0' is not in (0, 1)"),
        ("rr --eps nan --rounds 3 --delta 1e-5", "'nan' is not in (0, inf)"),
    ],
)
def test_cli_domain_errors(args, message):
    res = CliRunner().invoke(privacy_group, args.split())
    assert res.exit_code == 2
    assert "Invalid value" in res.output and message in res.output
