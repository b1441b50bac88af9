"""The device's reaction to a dispatch message (docs/protocol.md, "Dispatch message"), without a
broker: the policy's rules (edge_fl/device/policy.py), the connection's checks
(edge_fl/device/dispatch.py), a real agent, and the fleet runtime carrying the same events out."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import real_agent

from edge_fl.device.dispatch import receive_dispatch
from edge_fl.device.policy import (
    DevicePolicy,
    DispatchArrived,
    ModelArrived,
    Resend,
    Train,
    Trained,
    Upload,
    Uploaded,
)
from edge_fl.device.trust import Trust
from edge_fl.protocol import GlobalModel, Topics, encode_global
from edge_fl.protocol.dispatch import encode_dispatch
from edge_fl.protocol.messages import Dispatch
from edge_fl.protocol.signing import Signer

D = 15
TOPICS = Topics("job")
NONCES = {v: bytes([v]) * 16 for v in range(1, 80)}


def gm(version: int, selected: tuple[str, ...] | None = (), **kw: Any) -> GlobalModel:
    """Version ``version``'s model as FedBuff with a concurrency limit publishes it."""
    kw.setdefault("nonce", NONCES[version])
    return GlobalModel(
        "job", version, version, np.zeros(D, np.float32), mode="fedbuff", selected=selected, **kw
    )


def dispatch(version: int, *devices: str, nonce: bytes | None = None) -> DispatchArrived:
    return DispatchArrived(Dispatch("job", version, nonce or NONCES[version], devices))


def trained(policy: DevicePolicy, msg: GlobalModel) -> bytes:
    """Run the Train effect as the agent would (a release kept under its round) and upload."""
    policy.state.answered_round = msg.round
    payload = b"u" + str(msg.round).encode()
    policy.state.last_release = (msg.round, payload)
    assert policy.handle(Trained(msg, payload)) == [Upload(msg.round, payload)]
    assert policy.handle(Uploaded(msg.round)) == []
    return payload


# ---------------------------------------------------------------------------------------------
# The policy


def test_a_dispatch_naming_the_device_trains_it_on_the_model_it_holds():
    p = DevicePolicy("d5")
    model = gm(7, selected=("d0", "d1"))
    assert p.handle(ModelArrived(model)) == []  # not selected when the model went out
    assert p.handle(dispatch(7, "d5", "d6")) == [Train(model)]
    trained(p, model)
    assert p.handle(dispatch(7, "d5")) == []  # the same dispatch again: never a re-send


def test_a_dispatch_naming_others_asks_nothing_and_makes_no_answered_device_resend():
    """The README's fedbuff duplicates, now on their own topic: devices that answered version 7
    send nothing when others are dispatched on it."""
    answered = [DevicePolicy(f"d{i}") for i in range(3)]
    model = gm(7, selected=("d0", "d1", "d2"))
    for p in answered:
        assert p.handle(ModelArrived(model)) == [Train(model)]
        trained(p, model)
    assert [p.handle(dispatch(7, "d5", "d6")) for p in answered] == [[], [], []]


def test_a_dispatch_before_its_model_waits_for_it():
    """Two topics are not ordered with respect to each other: the dispatch for version 8 may
    come first; the model of version 8 then asks the device."""
    p = DevicePolicy("d5")
    p.handle(ModelArrived(gm(7)))
    assert p.handle(dispatch(8, "d5")) == []
    model = gm(8)
    assert p.handle(ModelArrived(model)) == [Train(model)]


def test_a_stale_dispatch_is_ignored_and_a_foreign_nonce_binds_nothing():
    p = DevicePolicy("d5")
    p.handle(ModelArrived(gm(9)))
    assert p.handle(dispatch(8, "d5")) == []  # its model was replaced by version 9
    assert p.state.assigned is None
    # a dispatch for version 9 left on the broker by an earlier run: another nonce
    assert p.handle(dispatch(9, "d5", nonce=b"\xee" * 16)) == []
    assert p.handle(ModelArrived(gm(9))) == []  # this run's model of 9 does not ask d5


def test_a_dispatch_while_busy_queues_the_version_it_asks_for():
    p = DevicePolicy("d5")
    old = gm(3, selected=("d5",))
    assert p.handle(ModelArrived(old)) == [Train(old)]
    p.state.answered_round = 3  # training on version 3 (slower than the aggregator waited)
    newer = gm(4)
    assert p.handle(ModelArrived(newer)) == []
    assert p.handle(dispatch(4, "d5")) == []  # busy: version 4 waits
    assert p.state.queued is newer
    assert p.handle(Trained(old, None)) == [Train(newer)]


def test_a_rebroadcast_resends_to_a_device_a_dispatch_asked():
    """After the aggregator (or the device) lost the broker the retained model comes again: a
    device a dispatch asked counts as asked by it and re-sends the same bytes (a PUBACK from a
    broker that died proves nothing)."""
    p = DevicePolicy("d5")
    model = gm(7, selected=("d0",))
    p.handle(ModelArrived(model))
    assert p.handle(dispatch(7, "d5")) == [Train(model)]
    sent = trained(p, model)
    assert p.handle(ModelArrived(gm(7, selected=("d0",)))) == [Resend(7, sent)]
    assert p.state.answered_round == 7


def test_a_stopped_device_is_not_asked():
    p = DevicePolicy("d5")
    p.state.stopped_reason = "budget_exhausted"
    p.handle(ModelArrived(gm(2)))
    assert p.handle(dispatch(2, "d5")) == []


def test_a_device_subscribes_to_dispatch_once_its_job_is_asynchronous():
    p = DevicePolicy("d0")
    assert not p.uses_dispatch
    p.handle(ModelArrived(GlobalModel("job", 0, 1, np.zeros(D, np.float32), selected=("d1",))))
    assert not p.uses_dispatch  # sync: nothing is ever dispatched, the traffic is unchanged
    p.handle(ModelArrived(gm(1)))
    assert p.uses_dispatch


# ---------------------------------------------------------------------------------------------
# The connection's checks


def test_the_connection_checks_signature_job_and_window_and_never_moves_the_window():
    key = Signer.generate()
    trust = Trust(verifier=key.verifier)
    assert trust.receive(encode_global(gm(5), signer=key), TOPICS, D) is not None
    good = Dispatch("job", 5, NONCES[5], ("d1",))
    event = receive_dispatch(trust, encode_dispatch(good, key), TOPICS)
    assert event is not None and event.dispatch == good
    assert receive_dispatch(trust, encode_dispatch(good), TOPICS) is None  # unsigned
    assert receive_dispatch(trust, encode_dispatch(good, Signer.generate()), TOPICS) is None
    other = Dispatch("other", 5, NONCES[5], ("d1",))
    assert receive_dispatch(trust, encode_dispatch(other, key), TOPICS) is None
    stale = Dispatch("job", 4, NONCES[4], ("d1",))
    assert receive_dispatch(trust, encode_dispatch(stale, key), TOPICS) is None
    ahead = Dispatch("job", 70, NONCES[70], ("d1",))
    assert receive_dispatch(trust, encode_dispatch(ahead, key), TOPICS) is None
    # a dispatch ahead of its model is taken (within the window) and moves nothing
    next_one = Dispatch("job", 6, NONCES[6], ("d1",))
    assert receive_dispatch(trust, encode_dispatch(next_one, key), TOPICS) is not None
    assert (trust.window.last_round, trust.window.last_version) == (5, 5)
    assert trust.rejected["dispatch_unsigned"] == 1
    assert trust.rejected["dispatch_bad_signature"] == 1
    assert trust.rejected["dispatch_stale"] == 1 and trust.rejected["dispatch_future"] == 1
    # after a reconnection the dispatch may come before the model, any number of versions on
    trust.window.rejoin()
    assert receive_dispatch(trust, encode_dispatch(ahead, key), TOPICS) is not None


# ---------------------------------------------------------------------------------------------
# A real agent through the same events


def model(version: int, selected: tuple[str, ...]) -> GlobalModel:
    return GlobalModel(
        "job", version, version, np.zeros(15, np.float32), mode="fedbuff",
        selected=selected, nonce=NONCES[version],
    )  # fmt: skip


def test_an_agent_asked_by_a_dispatch_trains_once_and_answers_with_the_versions_nonce():
    from edge_fl.protocol import UpdateLimits, decode_update

    a = real_agent("d5")
    msg = model(3, ("d0",))
    assert a.handle(ModelArrived(msg)) == []
    assert a.on_global(msg) is None  # not asked: no training, no release
    [effect] = a.handle(dispatch(3, "d5"))
    assert effect == Train(msg)
    payload = a.on_global(msg)
    assert payload is not None
    update = decode_update(payload, UpdateLimits(n_params=15))
    assert (update.round, update.base_version, update.nonce) == (3, 3, NONCES[3])
    assert a.handle(Trained(msg, payload)) == [Upload(3, payload)]
    assert a.handle(Uploaded(3)) == []
    assert a.handle(dispatch(3, "d5")) == []
    assert (a.state.exposures, a.state.updates_sent) == (1, 1)


# ---------------------------------------------------------------------------------------------
# The fleet runtime carries the same events out


def test_the_fleet_hands_a_dispatch_to_the_devices_it_names_and_nobody_publishes_twice():
    """Version 1 goes out selecting d0 and d1; a dispatch asks d2. Only d2 trains on it (without
    a modelled download: it holds the model), and nobody who answered publishes again."""
    from test_fleet_runtime_policy import fleet, updates

    async def scenario():
        f = fleet(4)
        f.hand_out(model(1, ("d0", "d1")), 100)
        await f.settled()
        f.hand_dispatch(Dispatch("job", 1, NONCES[1], ("d2", "d9")))  # d9: not in this fleet
        await f.settled()
        f.hand_dispatch(Dispatch("job", 1, NONCES[1], ("d2",)))  # delivered again
        await f.settled()
        return f

    f = asyncio.run(scenario())
    assert updates(f) == {"d0": 1, "d1": 1, "d2": 1, "d3": 0}
    assert (f.published, f.resent) == (3, 0)


def test_a_device_back_from_unavailability_holds_the_model_a_dispatch_asks_for():
    """A device outside its availability window keeps its session and receives the model
    (it does not train); once back, a dispatch on that version trains it."""
    from test_fleet_runtime_policy import fleet, updates

    async def scenario():
        f = fleet(3)
        f.unavailable.add("d2")
        f.hand_out(model(1, ("d0", "d2")), 100)  # d2 went away after it was selected
        await f.settled()
        assert updates(f) == {"d0": 1, "d1": 0, "d2": 0}
        f.unavailable.discard("d2")
        f.hand_dispatch(Dispatch("job", 1, NONCES[1], ("d2",)))
        await f.settled()
        return f

    assert updates(asyncio.run(scenario())) == {"d0": 1, "d1": 0, "d2": 1}


# ---------------------------------------------------------------------------------------------
# The minimal device (devices/minimal/device.py) from the document alone


def minimal():
    path = Path(__file__).resolve().parents[1] / "devices" / "minimal" / "device.py"
    spec = importlib.util.spec_from_file_location("minimal_device_dispatch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("signed", [False, True])
def test_the_minimal_device_decodes_the_dispatch_vectors(signed):
    import json

    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    dev = minimal()
    content = json.loads(
        (Path(__file__).resolve().parent / "vectors" / "dispatch.json").read_text()
    )
    key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(content["signing_key"]["public_key"]))
    for v in content["vectors"]:
        if v["signed"] != signed:
            continue
        m = dev.decode_dispatch(bytes.fromhex(v["hex"]), key if signed else None)
        assert (m["job"], m["ver"], m["nc"].hex(), m["sel"]) == (
            v["message"]["job"],
            v["message"]["version"],
            v["message"]["nonce"],
            v["message"]["selected"],
        )
    for r in content["rejections"]:
        with pytest.raises((ValueError, InvalidSignature)):  # the device logs it and goes on
            dev.decode_dispatch(bytes.fromhex(r["hex"]), key if r["public_key"] else None)
