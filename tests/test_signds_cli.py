"""``edge-fl privacy signds``, ``edge-fl audit signds`` and ``edge-fl comm-cost`` (CliRunner)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from edge_fl.cli.comm_cmds import comm_cost
from edge_fl.cli.privacy_cmds import audit_group, privacy_group


def run(cmd, args: list[str], ok: bool = True):
    result = CliRunner().invoke(cmd, args)
    if ok:
        assert result.exit_code == 0, result.output
        return json.loads(result.output)
    assert result.exit_code == 2, result.output
    return result.output


def plan(*args: str) -> dict:
    return run(privacy_group, ["signds", *args, "--json"])


# ------------------------------------------------------------------------- privacy signds


@pytest.mark.parametrize(
    ("d", "k", "eps", "topk", "h", "nu_th", "p_topk"),
    [
        (1000, "0.05", "1", 50, 1, 1, 0.12516),
        (66404, "0.01", "100", 664, 43, 26, 0.99831),
        (66404, "0.2", "10", 13280, 14, 9, 0.8936),
    ],
)
def test_spec_reference_rows(d, k, eps, topk, h, nu_th, p_topk):
    out = plan("--d", str(d), "--k", k, "--eps", eps, "--thr", "0.6")
    assert (out["topk"], out["h"], out["nu_th"]) == (topk, h, nu_th)
    assert out["p_topk_threshold"] == pytest.approx(p_topk, abs=5e-5)
    assert out["capped"] is False and out["h_uncapped"] == h
    assert 0 < out["expected_topk_fraction"] <= 1


def test_reference_row_one_misses_the_ratio_and_warns():
    out = plan("--d", "1000", "--k", "0.05", "--eps", "1", "--thr", "0.6")
    assert out["expected_topk_fraction"] < 0.6  # h = 1 even though rho is not met (spec 3)
    assert any("k*d > 50" in w for w in out["warnings"])


def test_cap_binds_and_is_reported():
    out = plan("--d", "266084", "--k", "0.2", "--eps", "100")
    assert out["capped"] is True
    assert out["h"] == 100 and out["h_uncapped"] > 100
    out = plan("--d", "266084", "--k", "0.2", "--eps", "100", "--max-dim-out", "300")
    assert out["capped"] is False and out["h"] == out["h_uncapped"]


def test_fixed_dim_out_is_used():
    out = plan("--d", "66404", "--k", "0.01", "--eps", "100", "--dim-out", "20")
    assert out["h"] == 20 and out["h_uncapped"] == 20


@pytest.mark.parametrize(
    ("args", "flag", "text"),
    [
        (["--d", "1000", "--k", "0.3"], "--k", "signds.sign_k = 0.3 is out of domain (0, 0.25]"),
        (["--d", "1000", "--k", "0"], "--k", "signds.sign_k = 0.0 is out of domain (0, 0.25]"),
        (["--d", "1000", "--eps", "101"], "--eps", "signds.sign_eps = 101.0 is out of domain"),
        (["--d", "1000", "--eps", "nan"], "--eps", "signds.sign_eps = nan is out of domain"),
        (
            ["--d", "1000", "--thr", "0.4"],
            "--thr",
            "sign_thr_ratio = 0.4 is out of domain [0.5, 1]",
        ),
        (["--d", "1000", "--dim-out", "51"], "--dim-out", "sign_dim_out = 51 is out of domain"),
        (["--d", "10", "--dim-out", "20"], "--dim-out", "exceeds the model dimension d = 10"),
        (["--d", "0"], "--d", "model dimension d = 0 is out of domain integer [1, 2**32 - 1]"),
        (
            ["--d", "1000", "--max-dim-out", "0"],
            "--max-dim-out",
            "max_dim_out = 0 is out of domain",
        ),
    ],
)
def test_plan_domain_errors_name_flag_key_value_domain(args, flag, text):
    out = run(privacy_group, ["signds", *args, "--json"], ok=False)
    assert f"'{flag}'" in out
    assert text in " ".join(out.split())  # the terminal may wrap the message


# ------------------------------------------------------------------------- audit signds


def test_audit_lower_bound_stays_below_claimed_eps():
    out = run(audit_group, ["signds", "--eps", "1", "--n", "20000", "--seed", "7", "--json"])
    assert out["mechanism"] == "signds" and out["passed"] is True
    assert out["epsilon_lower_bound"] <= 1.0
    # not vacuous: with n = 20000 the exact test gets close to the claim (SE ~ 0.02)
    assert out["epsilon_lower_bound"] > 0.85
    assert abs(out["epsilon_estimate"] - 1.0) < 5 * out["epsilon_estimate_se"]
    assert out["rng"].startswith("pcg64-seeded")


SEEDED = ["--seed", "1", "--json"]


def test_audit_with_explicit_shape():
    out = run(
        audit_group,
        ["signds", "--eps", "2", "--n", "5000", "--d", "30", "--k-count", "5", "--h", "3", *SEEDED],
    )
    assert out["h"] == 3 and out["epsilon_lower_bound"] <= 2.0


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--eps", "0", "--n", "10"], "'0' is not in (0, inf)"),
        (["--eps", "1", "--n", "0"], "'0' is not an integer >= 1"),
        (["--eps", "1", "--n", "10", "--k-count", "20"], "k_count = 20 is out of domain"),
    ],
)
def test_audit_errors(args, text):
    out = run(audit_group, ["signds", *args], ok=False)
    assert text in " ".join(out.split())


# ------------------------------------------------------------------------- comm-cost

ANCHOR = ["--dim", "66404", "--k", "0.01", "--eps", "100", "--seed", "3", "--json"]


@pytest.fixture(scope="module")
def anchor() -> dict:
    return run(comm_cost, ANCHOR)


def test_comm_cost_dense_is_four_bytes_per_parameter_plus_a_small_header(anchor):
    d = 66404
    f32, f16 = anchor["updates"]["dense_f32"], anchor["updates"]["dense_f16"]
    assert 0 < f32 - 4 * d < 100
    assert 0 < f16 - 2 * d < 100
    assert f32 - 4 * d == f16 - 2 * d  # same header, only the vector differs
    assert 0 < anchor["global_model"]["f4"] - 4 * d < 200
    assert 0 < anchor["global_model"]["f2"] - 2 * d < 200


def test_comm_cost_signds_anchor_far_below_reference(anchor):
    sd = anchor["signds"]
    assert sd["h"] == 43 and sd["index_bits"] == 17
    assert sd["bitpack_bytes"] == 92  # ceil(43 * 17 / 8)
    assert sd["index_bytes_mean"] <= 92  # the encoder never sends more than bit-packing
    assert sd["bytes_max"] <= 92 + 60  # indices + msgpack header (device id, round, sign, bit)
    mean = anchor["updates"]["signds"]
    assert sd["bytes_min"] <= mean <= sd["bytes_max"]
    assert mean <= 656 / 4  # MindSpore's LeNet SignDS upload is 656 bytes
    assert anchor["ratios"]["dense_f32_over_signds"] > 1500


def test_comm_cost_signds_anchor_within_120_bytes(anchor):
    assert anchor["updates"]["signds"] <= 120


def test_comm_cost_selection_list_grows_the_broadcast():
    base = run(comm_cost, ["--dim", "650", "--samples", "2", "--seed", "1", "--json"])
    listed = run(
        comm_cost, ["--dim", "650", "--samples", "2", "--seed", "1", "--selected", "20", "--json"]
    )
    # 20 ids of 6 characters (1 + 6 bytes each), an array16 header (3) and the key "sel" (4)
    assert listed["global_model"]["f4"] - base["global_model"]["f4"] == 20 * 7 + 3 + 4


@pytest.mark.parametrize(
    ("args", "flag", "text"),
    [
        (["--dim", "0"], "--dim", "dim = 0 is out of domain integer [1, 50000000]"),
        (["--dim", "100", "--k", "0.5"], "--k", "signds.sign_k = 0.5 is out of domain (0, 0.25]"),
        (["--dim", "100", "--samples", "0"], "--samples", "samples = 0 is out of domain"),
    ],
)
def test_comm_cost_errors(args, flag, text):
    out = run(comm_cost, args, ok=False)
    assert f"'{flag}'" in out and text in " ".join(out.split())
