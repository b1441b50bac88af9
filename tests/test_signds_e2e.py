"""SignDS end to end over a real Mosquitto: what the devices publish, what the ledger charges, and
how MagRR's state moves from round to round."""

from __future__ import annotations

import threading
import uuid

import pytest
from mqtt_tap import UpdateTap

from edge_fl.config import load_config
from edge_fl.privacy.magrr import MagRRConfig
from edge_fl.privacy.signds import SignDSParams, plan
from edge_fl.protocol import DenseUpdate, SignDSUpdate, Topics, UpdateLimits, decode_update
from edge_fl.simulation import simulate

pytestmark = pytest.mark.broker

DEVICES = 10
ROUNDS = 4
SIGN_K, SIGN_EPS = 0.05, 100.0
MLP_DIGITS_PARAMS = 64 * 64 + 64 + 64 * 10 + 10  # 4810


@pytest.fixture(scope="module")
def run(mosquitto, tmp_path_factory):
    """One short SignDS job (every device in every round), recorded by an independent tap."""
    cfg = load_config(
        None,
        {
            "job": f"sd-{uuid.uuid4().hex[:8]}",
            "broker.url": mosquitto.url,
            "reproducible": True,
            "seed": 5,
            "data.dataset": "digits",
            "data.devices": DEVICES,
            "model.name": "mlp",
            "rounds.rounds": ROUNDS,
            "rounds.clients_per_round": DEVICES,
            "rounds.deadline_s": 60.0,
            "training.epochs": 1,
            "training.lr": 0.05,
            "privacy.mechanism": "signds",
            "privacy.signds.sign_k": SIGN_K,
            "privacy.signds.sign_eps": SIGN_EPS,
        },
    )
    records: list[dict] = []
    with UpdateTap(mosquitto.url, Topics(cfg.job, cfg.broker.prefix)) as tap:
        summary = simulate(
            cfg, tmp_path_factory.mktemp("signds"), fleet_hook=lambda r, _f: records.append(r)
        )
        threading.Event().wait(0.5)  # let the tap drain what the broker already forwarded
    return summary, records, tap.payloads


def test_the_wire_carries_signds_votes_only(run):
    summary, records, payloads = run
    assert summary["n_params"] == MLP_DIGITS_PARAMS
    assert summary["rounds_closed"] == ROUNDS
    assert all(r["received"] == DEVICES and r["rejected"] == 0 for r in records)
    h = plan(SignDSParams(k=SIGN_K, eps=SIGN_EPS), MLP_DIGITS_PARAMS).h
    limits = UpdateLimits(MLP_DIGITS_PARAMS, 100, frozenset({"u", "s"}))  # accept either kind
    assert len(payloads) == summary["total_received"] == DEVICES * ROUNDS
    for topic, payload in payloads:
        update = decode_update(payload, limits, topic_device=topic.rsplit("/", 1)[-1])
        assert isinstance(update, SignDSUpdate) and not isinstance(update, DenseUpdate)
        assert len(update.indices) == h and update.sign in (1, -1)
    assert summary["total_bytes_up"] == sum(len(p) for _, p in payloads)
    per_update = summary["total_bytes_up"] / summary["total_received"]
    # h = 76 indices of 13 bits: at most 124 bytes bit-packed, plus the msgpack header
    assert per_update < 124 + 60
    assert per_update < 4 * MLP_DIGITS_PARAMS / 100  # a dense float32 delta is > 19 kB


def test_ledger_charges_sign_eps_plus_rr_eps_per_round(run):
    summary, records, _ = run
    per_round = SIGN_EPS + MagRRConfig().rr_eps
    for r in records:
        # every device took part in every round so far: basic composition is the tight bound
        assert r["accountant"] == "basic"
        assert r["epsilon"] == pytest.approx(r["round"] * per_round, rel=1e-9)
    privacy = summary["privacy"]
    # the summary reports the smallest valid bound: basic composition, or PLD when it shaves off
    # a hair (PLD at delta = 1e-5 is a fraction of a millionth below basic for eps = 105 a round)
    assert privacy["accountant"] in ("basic", "pld")
    assert privacy["epsilon"] <= ROUNDS * per_round
    assert privacy["epsilon"] == pytest.approx(ROUNDS * per_round, rel=1e-6)
    assert privacy["mechanisms"] == ["signds"]  # the registered name, as everywhere else
    assert set(privacy["release_kinds"]) == {"signds", "magrr-bit"}
    assert privacy["events"] == 2 * ROUNDS


def test_magrr_state_advances_and_is_carried(run):
    _, records, _ = run
    cfg = MagRRConfig()
    r_est = cfg.r_est0
    factor = {
        "grow": cfg.growth,
        "count": 1.0,
        "switch": 1.0,
        "hold": 1.0,
        "shrink": 1 / cfg.shrink,
    }
    # the first votes of a fresh model are far above 2 * 1e-5: the fast phase grows
    assert records[0]["magrr_action"] == "grow"
    for r in records:
        # the step applied this round came from the state the previous round left behind
        assert r["signds_step"] == pytest.approx(cfg.step_ratio * DEVICES * r_est)
        r_est *= factor[r["magrr_action"]]
        assert r["magrr_r_est"] == pytest.approx(r_est)
    assert records[-1]["magrr_r_est"] > cfg.r_est0
