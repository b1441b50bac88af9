"""Secure aggregation wired end to end (issue 21): config and refusals, the ``sa`` map, and
SecAgg+ sync rounds over a real Mosquitto, with a SecureSum implemented here (a plain clipped,
stochastically rounded mean) so the wiring is tested apart from any shipped mechanism."""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

import numpy as np
import pytest
from helpers import mechanisms_registered

from edge_fl.config import load_config
from edge_fl.mechanisms.base import Guarantee, local_update
from edge_fl.mechanisms.none import NoPrivacy
from edge_fl.mechanisms.secure import SecureJob, SecureLayout, secure_sum
from edge_fl.privacy.events import pure_privacy_event

STEP = 2.0**-8
CLIP = 4.0  # L2 bound of a delta
EPS = 0.5  # what one secure contribution costs a device (basic composition: adds up)


class SecureMean(NoPrivacy):
    """A test-local SecureSum: clip the delta to L2 norm CLIP, quantise with step STEP by
    stochastic rounding, and decode the sum to the mean. ``submitted`` records each device's
    integers (what the test compares the secure sum with)."""

    name = "test-secure-mean"
    guarantee = Guarantee("device", "replace_one", "pure")  # charged EPS per secure round
    submitted: dict[tuple[str, int], np.ndarray] = {}  # noqa: RUF012 - a test's record

    def secure_layout(self, job: SecureJob) -> SecureLayout:
        step = job.step or STEP
        q = math.ceil(CLIP / step)
        return SecureLayout(job.n_params, q, (job.selected * q).bit_length() + 1)

    def secure_encode(self, device: Any, msg: Any, layout: SecureLayout, round_seed: bytes):
        delta = local_update(device, msg)
        norm = float(np.linalg.norm(delta))
        if norm > CLIP:
            delta = delta * (CLIP / norm)
        step = CLIP / layout.max_int
        x = delta / step
        low = np.floor(x)
        values = low + (device.rng.random(x.shape) < (x - low))
        values = np.clip(values, -layout.max_int, layout.max_int).astype(np.int64)
        SecureMean.submitted[(device.device_id, msg.round)] = values.copy()
        return values

    def secure_decode(self, total, contributors: int, layout: SecureLayout, round_seed: bytes):
        step = CLIP / layout.max_int
        return (np.asarray(total, np.float64) * step / contributors).astype(np.float32)

    def secure_events(self, job: SecureJob) -> list:
        return [pure_privacy_event(EPS, self.name)]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with mechanisms_registered(SecureMean):
        yield


def config(mosquitto: Any = None, **overrides: Any):
    values: dict[str, Any] = {
        "job": f"sa-{uuid.uuid4().hex[:8]}",
        "data.devices": 10,
        "rounds.rounds": 3,
        "rounds.clients_per_round": 10,
        "rounds.deadline_s": 30,
        "privacy.mechanism": SecureMean.name,
        "secure_aggregation.enabled": True,
        "secure_aggregation.phase_timeout_s": 5.0,
        "reproducible": True,
    }
    if mosquitto is not None:
        values["broker.url"] = mosquitto.url
    values.update(overrides)
    return load_config(None, values)


def test_the_test_mechanism_is_a_secure_sum():
    assert secure_sum(SecureMean(None, None)) is not None


# ------------------------------------------------------------------ over a real Mosquitto


class Crash(Exception):
    """Raised inside the aggregator's ingest: the process dies at that point."""


async def run_secure(job, out, *, vanish=None, observer=None, resume=False, fleet=None,
                     timeout=120.0):  # fmt: skip
    """One aggregator (with its output directory) and a fleet on this loop; returns
    (run, service, fleet, error): ``error`` is what ended the aggregator, if it failed."""
    from edge_fl.protocol.signing import Signer
    from edge_fl.simulation import open_run

    spec = job.cfg.broker
    from edge_fl.transport.url import parse_broker_url

    broker = parse_broker_url(spec.url)
    signer = SIGNER.setdefault("key", Signer.generate())
    run = open_run(job, out, resume=resume)
    service = run.make_service(broker, signer=signer)
    service.secure_observer = observer
    own_fleet = fleet is None
    if own_fleet:
        fleet = job.fleet_runtime(broker, trust=job.trust(signer.verifier))
        fleet.secure_vanish = dict(vanish or {})
    aggregator = asyncio.create_task(service.run())
    await service.connected.wait()
    entry = FLEETS.get(id(fleet))
    if entry is None or entry[0] is not fleet:  # (an id is reused once its object is gone)
        entry = FLEETS[id(fleet)] = (fleet, asyncio.create_task(fleet.run()))
    fleet_task = entry[1]
    error = None
    try:
        await asyncio.wait_for(aggregator, timeout)
    except Crash as exc:
        error = exc
    finally:
        run.close()
    if error is None:
        with __import__("contextlib").suppress(TimeoutError):
            await asyncio.wait_for(fleet_task, 10)
    return run, service, fleet, error


SIGNER: dict[str, Any] = {}
#: a fleet run across calls (the crash test's): its task, by the fleet (held, so its id stays
#: its own)
FLEETS: dict[int, tuple[Any, asyncio.Task]] = {}


def contributions(rnd: int, devices) -> np.ndarray:
    return sum(SecureMean.submitted[(d, rnd)] for d in devices)


def test_devices_vanishing_at_each_phase_leave_exactly_the_contributors_sum(mosquitto, tmp_path):
    """12 devices, one round: two vanish before advertising, one before sharing, two before
    masking, two before unmasking (7 of 12 gone, more than calibrated for, at every phase):
    the sum is exactly the sum of the integers of the devices that delivered a masked input,
    and no vector the aggregator holds is any device's input."""
    from edge_fl.job import build_job

    vanish = {
        "d00000": "advertise", "d00001": "advertise", "d00002": "share",
        "d00003": "mask", "d00004": "mask", "d00005": "unmask", "d00006": "unmask",
    }  # fmt: skip
    job = build_job(config(
        mosquitto, **{"data.devices": 12, "rounds.clients_per_round": 12, "rounds.rounds": 1,
                      "secure_aggregation.min_survivors": 4,
                      "secure_aggregation.neighbours": 11, "secure_aggregation.threshold": 3,
                      # the masked phase waits for the deadline (two never send): 20 s is the
                      # two 5 s phase timeouts before it and 10 s for the 7 masked inputs
                      "rounds.deadline_s": 20}
    ))  # fmt: skip
    seen: list[tuple[str, np.ndarray]] = []
    before = job.aggregator_core().params.copy()
    run, _, fleet, error = asyncio.run(
        run_secure(
            job, tmp_path / "run", vanish=vanish, observer=lambda label, v: seen.append((label, v))
        )
    )
    assert error is None
    record = run.recorder.records[-1]
    assert record["status"] == "closed", record
    sa = record["secure"]
    assert sa["outcome"] == "summed"
    assert sa["phases"] == {"keys": 10, "shares": 9, "masked": 7, "unmask": 5}
    assert fleet.published == 7  # its devices' updates are their masked inputs ("0" before)
    contributors = sorted([d for d in
                          (f"d{i:05d}" for i in range(12)) if vanish.get(d) not in
                          ("advertise", "share", "mask")])  # fmt: skip
    assert record["received"] == len(contributors) == 7
    expected = contributions(1, contributors)
    totals = [v for label, v in seen if label == "sum"]
    assert len(totals) == 1 and np.array_equal(totals[0], expected)
    # the model moved by exactly the decoded mean of those integers
    layout = job.secure_plan.layout
    mean = SecureMean(None, None).secure_decode(expected, 7, layout, b"")
    assert np.array_equal(run.core.params, (before + np.float32(1.0) * mean).astype(np.float32))
    # no vector the session held is one device's input (mod 2^b), masked or not
    bits = layout.bits
    inputs = [SecureMean.submitted[(d, 1)] for d in contributors]
    for label, v in seen:
        if label == "sum":
            continue
        ring = np.asarray(v).astype(np.int64) & ((1 << bits) - 1)
        for x in inputs:
            assert not np.array_equal(ring, x & ((1 << bits) - 1)), label
    # every device whose masked input arrived was charged, and only those
    charged = sorted(d for d, r, n in run.core.releases if r == 1)
    assert charged == contributors


def ring_values(y: bytes, bits: int) -> np.ndarray:
    """A masked vector off the wire (docs/specs/secagg.md section 6: ceil(b/8) bytes a value,
    little-endian), lifted to signed: what a recorder of the broker would compute."""
    width = (bits + 7) // 8
    raw = np.frombuffer(y, np.uint8).reshape(-1, width)
    padded = np.zeros((raw.shape[0], 8), np.uint8)
    padded[:, :width] = raw
    v = padded.view("<u8").ravel().astype(np.int64)
    return np.where(v >= 1 << (bits - 1), v - (1 << bits), v)


def test_a_subscriber_to_every_topic_learns_nothing_of_one_update(mosquitto, tmp_path):
    """A recorder with read access to every topic of the job (the broker's operator) records
    three secure rounds of 10 devices: the only device messages are SecAgg+ kinds and statuses,
    and each recorded masked vector's correlation with that device's true integers is what
    independent vectors give (|r| < 6 / sqrt(d): 6 standard deviations), while the integers
    themselves correlate with the device's next round's (the check can see a relation)."""
    import msgpack

    from edge_fl.job import build_job
    from edge_fl.protocol.secure import up_kind
    from edge_fl.transport.url import parse_broker_url

    job = build_job(config(mosquitto))
    recorded: list[tuple[str, bytes]] = []

    async def main():
        import aiomqtt

        spec = parse_broker_url(mosquitto.url)
        async with aiomqtt.Client(**spec.aiomqtt_kwargs(), identifier="recorder") as sniffer:
            await sniffer.subscribe(f"edgefl/{job.cfg.job}/#", qos=1)

            async def record():
                async for message in sniffer.messages:
                    recorded.append((str(message.topic), bytes(message.payload)))

            task = asyncio.create_task(record())
            run, *_ = await run_secure(job, tmp_path / "run")

            def masked_seen() -> int:
                return sum(up_kind(p) == "mx" for t, p in recorded if "/up/" in t)

            # the broker delivers to the recorder independently of the aggregator: wait until
            # it holds every masked input the aggregator summed (3 rounds x 10), not a tick
            t_end = asyncio.get_running_loop().time() + 30
            while masked_seen() < 30 and asyncio.get_running_loop().time() < t_end:
                await asyncio.sleep(0.02)
            task.cancel()
            return run

    run = asyncio.run(main())
    assert [r["secure"]["outcome"] for r in run.recorder.records] == ["summed"] * 3
    up = [(t.rsplit("/", 1)[1], p) for t, p in recorded if "/up/" in t]
    kinds = {up_kind(p) for _, p in up}
    assert kinds <= {"ak", "sh", "mx", "ua"}, kinds  # no plain update travels
    bits = job.secure_plan.layout.bits
    d = job.model.n_params
    masked = {}
    for device, payload in up:
        msg = msgpack.unpackb(payload, raw=False)
        if msg["k"] == "mx":
            masked[(device, msg["r"])] = ring_values(msg["y"], bits)
    assert len(masked) == 30
    for (device, rnd), y in masked.items():
        x = SecureMean.submitted[(device, rnd)].astype(np.float64)
        r = np.corrcoef(y.astype(np.float64), x)[0, 1]
        assert abs(r) < 6 / math.sqrt(d), (device, rnd, r)
    # the same statistic sees a device's own rounds as related: the check is not blind
    x1, x2 = (SecureMean.submitted[("d00000", r)].astype(np.float64) for r in (1, 2))
    assert np.corrcoef(x1, x2)[0, 1] > 6 / math.sqrt(d)


def test_too_many_vanishing_fails_the_round_cleanly(mosquitto, tmp_path):
    """Fewer masked inputs than min_survivors: the round fails with its reason, the model is
    unchanged, and the devices whose masked input arrived are charged all the same."""
    from edge_fl.job import build_job

    vanish = {f"d{i:05d}": "mask" for i in range(5)}
    # the masked phase waits for the round's deadline (five never send): 10 s, not 30, is ample
    # for 8 devices' keys, shares and 3 masked inputs
    job = build_job(config(
        mosquitto, **{"data.devices": 8, "rounds.clients_per_round": 8, "rounds.rounds": 1,
                      "secure_aggregation.min_survivors": 4, "rounds.deadline_s": 10}
    ))  # fmt: skip
    before = job.aggregator_core().params.copy()
    run, *_ = asyncio.run(run_secure(job, tmp_path / "run", vanish=vanish))
    record = run.recorder.records[-1]
    assert record["status"] == "skipped"
    assert record["secure"]["failed"]["phase"] == "masked"
    assert "3 masked inputs arrived; 4 needed" in record["secure"]["failed"]["reason"]
    assert np.array_equal(run.core.params, before)
    assert sorted(d for d, r, _ in run.core.releases) == ["d00005", "d00006", "d00007"]
    assert run.core.privacy.ledger is not None


def test_a_crash_between_masked_inputs_and_unmasking_skips_the_round(mosquitto, tmp_path):
    """The aggregator dies once every masked input of round 1 is in, before any unmask request
    (kill at the last ``masked_sum``). ``--resume``: round 1 is recorded skipped (never summed
    from what survived), its charges stay, the next rounds use new nonces and sum exactly."""
    from edge_fl.job import build_job

    cfg = config(mosquitto, **{"data.devices": 6, "rounds.clients_per_round": 6,
                               "rounds.rounds": 3})  # fmt: skip
    job = build_job(cfg)
    before = job.aggregator_core().params.copy()
    count = {"masked": 0}

    def crash(label: str, _v: np.ndarray) -> None:
        if label == "masked_sum":
            count["masked"] += 1
            if count["masked"] == 6:
                raise Crash("killed between the masked inputs and the unmasking")

    async def both():
        run, _, fleet, error = await run_secure(job, tmp_path / "run", observer=crash)
        assert isinstance(error, Crash)
        assert run.core.current is not None and run.core.current.number == 1
        nonce1 = run.core.current.nonce
        job2 = build_job(cfg)
        sums: list[np.ndarray] = []
        run2, *_ = await run_secure(
            job2, tmp_path / "run", resume=True, fleet=fleet,
            observer=lambda label, v: sums.append(v) if label == "sum" else None,
        )  # fmt: skip
        return run2, nonce1, sums

    run2, nonce1, sums = asyncio.run(both())
    records = run2.recorder.records
    assert [r["round"] for r in records] == [1, 2, 3]
    first = records[0]
    assert first["status"] == "skipped" and first["version"] == 0
    assert first["secure"]["failed"]["reason"] == "the aggregator restarted mid-round"
    assert [r["status"] for r in records[1:]] == ["closed", "closed"]
    # every device delivered round 1's masked input: charged once, kept across the restart
    devices = [f"d{i:05d}" for i in range(6)]
    for rnd in (1, 2, 3):
        assert sorted(d for d, r, _ in run2.core.releases if r == rnd) == devices
    eps = run2.core.privacy.report()["epsilon"]
    assert eps == pytest.approx(3 * EPS, rel=1e-3)  # the tightest accountant rounds a little
    # rounds 2 and 3: exact sums of what was submitted then, under new nonces
    assert len(sums) == 2
    for rnd, total in zip((2, 3), sums, strict=True):
        assert np.array_equal(total, contributions(rnd, devices))
    assert run2.core.history[2][0] != nonce1
    assert not np.array_equal(run2.core.params, before)  # rounds 2 and 3 applied


def test_a_secure_simulation_learns_like_the_plain_one(mosquitto, tmp_path):
    """``simulate`` with secure aggregation: every round sums (10 of 10 devices), and the
    accuracy is that of the same job without it (the plain job's FedAvg weighs by sample count,
    the secure mean does not; quantisation at 2^-8 costs nothing visible)."""
    from edge_fl.simulation import simulate

    rounds = 5
    secure = simulate(config(mosquitto, **{"rounds.rounds": rounds}), tmp_path / "secure")
    plain = simulate(
        config(mosquitto, **{"rounds.rounds": rounds, "secure_aggregation.enabled": False}),
        tmp_path / "plain",
    )
    assert secure["rounds_closed"] == rounds and secure["total_received"] == 10 * rounds
    print(f"accuracy: secure {secure['final_accuracy']:.4f}, plain {plain['final_accuracy']:.4f}")
    assert secure["final_accuracy"] > 0.85
    assert abs(secure["final_accuracy"] - plain["final_accuracy"]) < 0.03
    # each device was charged once per secure round: EPS x rounds
    assert secure["privacy"]["epsilon"] == pytest.approx(EPS * rounds, rel=1e-3)


@pytest.mark.slow  # 85 s of CI on a 2-core machine; tests/test_secagg_virtual.py runs the same
# dropout model (devices vanishing at a phase drawn per round) in every CI run
def test_the_fleets_dropout_model_vanishes_devices_mid_protocol(mosquitto, tmp_path):
    """``fleet.dropout`` 0.35: a dropping device vanishes before a phase drawn uniformly. Each
    round sums exactly the integers of the devices whose masked input was charged, or fails
    with its reason and leaves the model as it was."""
    from edge_fl.job import build_job

    job = build_job(config(mosquitto, **{"data.devices": 10, "rounds.rounds": 4,
                                         "fleet.dropout": 0.35}))  # fmt: skip
    sums: dict[int, np.ndarray] = {}
    run_ref: dict[str, Any] = {}

    def observe_round(label: str, v: np.ndarray) -> None:
        if label == "sum":  # inside the open round: its number is the core's
            sums[run_ref["run"].core.current.number] = v

    from edge_fl.protocol.signing import Signer
    from edge_fl.simulation import open_run

    async def main():
        from edge_fl.transport.url import parse_broker_url

        broker = parse_broker_url(job.cfg.broker.url)
        signer = Signer.generate()
        run = run_ref["run"] = open_run(job, tmp_path / "run")
        service = run.make_service(broker, signer=signer)
        service.secure_observer = observe_round
        fleet = job.fleet_runtime(broker, trust=job.trust(signer.verifier))
        aggregator = asyncio.create_task(service.run())
        await service.connected.wait()
        fleet_task = asyncio.create_task(fleet.run())
        try:
            await asyncio.wait_for(aggregator, 180)
        finally:
            run.close()
        await asyncio.wait_for(fleet_task, 10)
        return run, fleet

    run, fleet = asyncio.run(main())
    records = run.recorder.records
    assert len(records) == 4 and fleet.dropouts > 0
    print("dropouts", fleet.dropouts, [(r["status"], r["secure"]["phases"]) for r in records])
    for r in records:
        charged = sorted(d for d, rnd, _ in run.core.releases if rnd == r["round"])
        if r["status"] == "closed":
            assert r["received"] == len(charged)
            assert np.array_equal(sums[r["round"]], contributions(r["round"], charged))
        else:
            assert r["secure"]["outcome"] == "failed" and r["secure"]["failed"]["reason"]
            assert r["round"] not in sums


def run_single_devices(job, out, agents) -> tuple[Any, list[int], list[np.ndarray]]:
    """The aggregator and ``edge-fl device``'s runtime for each agent (one MQTT session each)
    on this loop: (run, updates each device sent, the sums the aggregator's sessions made)."""
    from edge_fl.device.runtime import run_device
    from edge_fl.protocol.signing import Signer
    from edge_fl.simulation import open_run
    from edge_fl.transport.url import parse_broker_url

    sums: list[np.ndarray] = []

    async def main():
        broker = parse_broker_url(job.cfg.broker.url)
        signer = Signer.generate()
        run = open_run(job, out)
        service = run.make_service(broker, signer=signer)
        service.secure_observer = lambda label, v: sums.append(v) if label == "sum" else None
        aggregator = asyncio.create_task(service.run())
        await service.connected.wait()
        devices = [
            asyncio.create_task(
                run_device(agent, broker, job.topics, trust=job.trust(signer.verifier))
            )
            for agent in agents
        ]
        try:
            await asyncio.wait_for(aggregator, 120)
        finally:
            run.close()
        return run, await asyncio.wait_for(asyncio.gather(*devices), 30)

    run, sent = asyncio.run(main())
    return run, sent, sums


def test_the_single_device_runtime_runs_secure_rounds(mosquitto, tmp_path):
    """``edge-fl device``'s runtime (one MQTT session per device, its own inbox subscription)
    against the real aggregator: every round sums all four devices exactly."""
    from edge_fl.job import build_job

    job = build_job(config(mosquitto, **{"data.devices": 4, "rounds.clients_per_round": 4,
                                         "rounds.rounds": 2}))  # fmt: skip
    run, sent, sums = run_single_devices(job, tmp_path / "run", job.agents())
    assert [r["status"] for r in run.recorder.records] == ["closed", "closed"]
    assert sent == [2, 2, 2, 2]
    devices = [f"d{i:05d}" for i in range(4)]
    for rnd, total in zip((1, 2), sums, strict=True):
        assert np.array_equal(total, contributions(rnd, devices))


# ------------------------------------------------------------------ wire, config, refusals


def test_round_seed_matches_the_documented_example_and_hkdf():
    from edge_fl.protocol.secure import round_seed
    from edge_fl.secagg.primitives import context, hkdf

    nc = bytes.fromhex("00112233445566778899aabbccddeeff")
    seed = round_seed("demo", 4, nc)
    text = (__import__("pathlib").Path(__file__).parents[1] / "docs" / "protocol.md").read_text()
    assert seed.hex() in text
    assert seed == hkdf(nc, b"", context("round-seed", "demo", 4))
    assert round_seed("demo", 5, nc) != seed


def sa_map(**changes):
    return {"b": 16, "k": 4, "md": False, "ms": 3, "n": 8, "q": 256, "t": 2, **changes}


def global_with(sa, selected=("d00000", "d00001", "d00002", "d00003", "d00004"), **fields):
    from edge_fl.protocol import GlobalModel

    return GlobalModel(
        job="demo", version=0, round=1, params=np.zeros(8, np.float32), selected=selected,
        nonce=bytes(16), secure=sa, **fields,
    )  # fmt: skip


def test_the_sa_map_round_trips_signed_and_is_checked_on_both_sides():
    from edge_fl.protocol import decode_global, encode_global
    from edge_fl.protocol.signing import Signer

    signer = Signer.generate()
    payload = encode_global(global_with(sa_map()), signer=signer)
    msg = decode_global(payload, verifier=signer.verifier)
    assert msg.secure == sa_map()
    assert list(msg.secure) == ["b", "k", "md", "ms", "n", "q", "t"]
    # what devices would refuse, the aggregator refuses to send
    for bad in (sa_map(k=5), sa_map(k=3, t=2), sa_map(t=5), sa_map(ms=6), sa_map(q=1 << 20)):
        with pytest.raises(ValueError, match="sa"):
            encode_global(global_with(bad))
    for bad in (sa_map(extra=1), sa_map(k=3, t=2)):  # k = 3 < n - 1: no Harary graph has it
        with pytest.raises(ValueError, match="sa"):
            encode_global(global_with(bad))
    with pytest.raises(ValueError, match="sa"):
        encode_global(global_with(sa_map(), selected=None))


def test_a_global_message_without_sa_is_byte_for_byte_what_it_was():
    from edge_fl.protocol import encode_global

    plain = global_with(None)
    assert b"\xa2sa" not in encode_global(plain)


def test_up_kind_tells_secagg_messages_from_updates():
    import edge_fl.secagg.messages as M
    from edge_fl.protocol import DenseUpdate, encode_update
    from edge_fl.protocol.secure import masked_head, up_kind

    nc = bytes(range(16))
    ak = M.encode("ak", 3, nc, ck=bytes(32), sk=bytes(32), bh=bytes(32))
    mx = M.encode("mx", 3, nc, b=12, m=b"\x01", y=bytes(6))
    assert up_kind(ak) == "ak" and up_kind(mx) == "mx"
    assert masked_head(mx) == (3, nc) and masked_head(ak) is None
    update = encode_update(DenseUpdate("d00001", 3, 0, 5, np.zeros(4, np.float32), nonce=nc))
    assert up_kind(update) is None and up_kind(b"") is None and up_kind(b"\x85garbage") is None


def test_a_disabled_section_changes_neither_digest_nor_job_document():
    base = load_config(None, {"job": "same"})
    off = load_config(None, {"job": "same", "secure_aggregation.enabled": False,
                             "secure_aggregation.dropout": 0.2})  # fmt: skip
    on = load_config(None, {"job": "same", "secure_aggregation.enabled": True})
    assert base.digest() == off.digest() != on.digest()
    from edge_fl.job import build_job

    assert "secure_aggregation" not in build_job(base).job_document().config
    doc = build_job(config(**{"job": "same"})).job_document().config
    assert doc["secure_aggregation"]["enabled"] is True


def test_auto_clock_is_virtual_time_under_secure_aggregation_too():
    """Secure rounds' phase deadlines are simulated seconds (tests/test_secagg_virtual.py)."""
    assert config(**{"fleet.profile": "phone-fleet"}).fleet.virtual
    assert load_config(None, {"fleet.profile": "phone-fleet"}).fleet.virtual


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"privacy.mechanism": "laplace", "privacy.epsilon": 8.0},
            "privacy.mechanism = 'laplace' cannot run under secure aggregation",
        ),
        ({"rounds.mode": "fedasync"}, "rounds.mode = 'fedasync': a buffer of one update is a"),
        (
            {"rounds.mode": "fedbuff", "rounds.buffer_size": 9},
            "a cohort of K' = ceil(buffer_size 9 / (1 - dropout 0.3)) = 13 devices exceeds",
        ),
        (
            {"ingest.workers": 2, "ingest.partition": "site", "ingest.spawn": False},
            "ingest.partition = 'site': secure rounds are sharded over one broker",
        ),
        ({"compression.uplink": "q8"}, "compression.uplink = 'q8': a masked input"),
        (
            {"secure_aggregation.neighbours": 2, "secure_aggregation.threshold": 2},
            "neighbours 2: with 30% dropouts",
        ),
        ({"secure_aggregation.min_survivors": 11}, "min_survivors = 11 must be in [2, 10]"),
    ],
)
def test_unsupported_combinations_are_refused_in_one_line(overrides, message):
    from edge_fl.config import ConfigError
    from edge_fl.job import build_job

    with pytest.raises(ConfigError) as caught:
        build_job(config(**overrides))
    text = str(caught.value)
    assert message in text and "\n" not in text, text


def test_the_cli_refuses_in_one_line(tmp_path):
    from click.testing import CliRunner

    from edge_fl.cli import main

    result = CliRunner().invoke(
        main,
        [
            "simulate",
            "--secure-aggregation",
            "--mode",
            "fedasync",
            "--rounds",
            "1",
            "--mechanism",
            SecureMean.name,
            "--out",
            str(tmp_path / "x"),
        ],
    )
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "a cohort of one, whose sum is" in lines[0], result.output


# ------------------------------------------------------------------ the device side


def test_a_republished_round_neither_restarts_the_session_nor_resends():
    """Same nonce again (a re-broadcast): no new session, nothing published; the same inbox
    bytes again: the same answer again."""
    from edge_fl.device.policy import InboxArrived, ModelArrived, Publish, Train, Trained
    from edge_fl.job import build_job
    from edge_fl.secagg import AggregatorSession, Deliver

    job = build_job(config(**{"data.devices": 4, "rounds.clients_per_round": 4,
                              "secure_aggregation.min_survivors": 2}))  # fmt: skip
    core = job.aggregator_core()
    agents = {a.device_id: a for a in job.agents()}
    roster = tuple(sorted(agents))
    plan = job.secure_plan
    msg = global_with(plan.wire(4), selected=roster)
    msg = type(msg)(**{**msg.__dict__, "params": core.params, "job": job.cfg.job,
                       "config_digest": ""})  # fmt: skip
    agg = AggregatorSession(plan.params(job.cfg.job, 1, msg.nonce, roster))
    inbox: dict[str, list[bytes]] = {d: [] for d in roster}

    def run(device: str, effects: list) -> list:
        out = []
        for e in effects:
            if isinstance(e, Publish):
                out.append(e.kind)
                for eff in agg.receive(device, e.payload):
                    if isinstance(eff, Deliver):
                        inbox[eff.device].append(eff.payload)
            elif isinstance(e, Train):
                agents[device].on_global(e.msg)
                out += run(device, agents[device].handle(Trained(e.msg, None)))
        return out

    kinds = {d: run(d, agents[d].handle(ModelArrived(msg))) for d in roster}
    assert all(k == ["ak"] for k in kinds.values())  # mx waits for the forwarded shares
    # the same model again: nothing, no second session
    session = agents["d00000"].session
    assert run("d00000", agents["d00000"].handle(ModelArrived(msg))) == []
    assert agents["d00000"].session is session
    for d in roster:  # nk
        assert run(d, agents[d].handle(InboxArrived(inbox[d][0]))) == ["sh"]
    again = agents["d00000"].handle(InboxArrived(inbox["d00000"][0]))
    assert [e.kind for e in again] == ["sh"]  # same bytes, same answer (the aggregator: duplicate)
    for d in roster:  # sf
        assert run(d, agents[d].handle(InboxArrived(inbox[d][1]))) == ["mx"]
    for d in roster:  # uq
        assert run(d, agents[d].handle(InboxArrived(inbox[d][2]))) == ["ua"]
    assert agg.outcome is not None and agg.outcome.contributors == roster
    total = sum(SecureMean.submitted[(d, 1)] for d in roster)
    assert np.array_equal(agg.outcome.total, total)


def test_a_device_slower_than_the_phase_timeout_contributes_within_the_round_deadline(
    mosquitto, tmp_path
):
    """``edge-fl device``'s runtime answers its inbox while it trains, and the masked phase
    waits for the round's deadline: a device whose local training takes longer than
    ``phase_timeout_s`` (but less than ``deadline_s``) still shares its keys in time and has its
    masked input summed."""
    import time as _time

    from edge_fl.job import build_job

    timeout_s, slow_s = 3.0, 8.0
    job = build_job(config(mosquitto, **{
        "data.devices": 4, "rounds.clients_per_round": 4, "rounds.rounds": 1,
        "rounds.deadline_s": 60, "secure_aggregation.phase_timeout_s": timeout_s,
    }))  # fmt: skip
    agents = job.agents()
    slow = agents[0]
    train = slow.on_global

    def slow_train(msg):
        _time.sleep(slow_s)  # a Pi: local training longer than a phase's timeout
        return train(msg)

    slow.on_global = slow_train
    run, sent, sums = run_single_devices(job, tmp_path / "run", agents)
    [record] = run.recorder.records
    assert record["status"] == "closed" and sent == [1, 1, 1, 1]
    assert np.array_equal(sums[0], contributions(1, [f"d{i:05d}" for i in range(4)]))


def test_device_signing_keys_sign_every_advert_and_an_unsigned_device_is_left_out(
    mosquitto, tmp_path
):
    """``security.device_keys`` (minted by ``edge-fl keygen DIR --devices N``): every device
    signs its keys and masked input and checks its neighbours'; the aggregator refuses the keys
    of a device that does not sign (an impostor's, to an honest party) and sums the others
    exactly, round after round."""
    import dataclasses

    from edge_fl.job import build_job
    from edge_fl.protocol.device_keys import mint_device_keys
    from edge_fl.protocol.signing import Signer
    from edge_fl.transport.url import parse_broker_url

    directory = mint_device_keys(tmp_path / "keys", [f"d{i:05d}" for i in range(6)])
    job = build_job(config(mosquitto, **{
        "data.devices": 6, "rounds.clients_per_round": 6, "rounds.rounds": 2,
        "secure_aggregation.min_survivors": 3, "security.device_keys": str(directory),
        "secure_aggregation.neighbours": 4, "secure_aggregation.threshold": 3,
    }))  # fmt: skip
    signer = SIGNER.setdefault("key", Signer.generate())
    fleet = job.fleet_runtime(parse_broker_url(mosquitto.url), trust=job.trust(signer.verifier))
    assert all(a.secure.signer is not None for a in fleet.agents.values())
    impostor = fleet.agents["d00003"]
    impostor.secure = dataclasses.replace(impostor.secure, signer=None)
    run, _, _, error = asyncio.run(run_secure(job, tmp_path / "run", fleet=fleet))
    assert error is None
    records = run.recorder.records
    assert [r["status"] for r in records] == ["closed", "closed"]
    honest = [f"d{i:05d}" for i in range(6) if i != 3]
    for rnd, record in enumerate(records, start=1):
        sa = record["secure"]
        assert sa["outcome"] == "summed" and sa["phases"]["keys"] == 5
        assert sa["rejected_by_reason"].get("bad_keys") == 1
        assert record["received"] == 5
        assert SecureMean.submitted[("d00003", rnd)] is not None  # it trained, was left out
    assert sorted({d for d, r, n in run.core.releases}) == honest


def test_a_device_key_that_is_not_the_directorys_is_refused_in_one_line(tmp_path):
    from edge_fl.config import ConfigError
    from edge_fl.job import build_job
    from edge_fl.protocol.device_keys import mint_device_keys

    directory = mint_device_keys(tmp_path / "a", [f"d{i:05d}" for i in range(3)])
    other = mint_device_keys(tmp_path / "b", ["d00001"])
    (tmp_path / "a" / "devices" / "d00001.key").write_bytes(
        (other.parent / "devices" / "d00001.key").read_bytes()
    )
    job = build_job(config(**{"data.devices": 3, "rounds.clients_per_round": 3,
                              "security.device_keys": str(directory)}))  # fmt: skip
    with pytest.raises(ValueError, match=r"device d00001's signing key is not the one"):
        job.agents()
    (tmp_path / "a" / "device-keys.json").write_text("{")
    with pytest.raises(ConfigError, match=r"security.device_keys: device key directory .* JSON"):
        build_job(config(**{"data.devices": 3, "rounds.clients_per_round": 3,
                            "security.device_keys": str(directory)}))  # fmt: skip
