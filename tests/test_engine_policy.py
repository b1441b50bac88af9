"""The engine as composition: one AggregatorCore whose round policy (sync rounds, FedBuff,
FedAsync) owns its state and saves it with snapshot()/restore(); checkpoints, journals and
sharding use only public API (issue 19, item 1)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import DenseUpdate, Status, UpdateLimits, encode_status, encode_update
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings
from edge_fl.server.asynchronous import AsyncPolicy
from edge_fl.server.policy import SyncPolicy

D = 5
DEVICES = [f"d{i}" for i in range(6)]
SERVER = Path(__file__).resolve().parent.parent / "edge_fl" / "server"


def engine(mode: str, concurrency: int | None = None, seed: int = 3) -> AggregatorCore:
    settings = AggregatorSettings(
        job="j", rounds=50, target=3, min_updates=2, deadline_s=10.0, mode=mode, buffer_size=2
    )
    core = AggregatorCore(
        settings,
        np.zeros(D, np.float32),
        UpdateLimits(D),
        seeded_generator(seed),
        concurrency=concurrency,
    )
    for d in DEVICES:
        core.on_status(d, encode_status(Status(d, True, 100)))
    return core


def answer(core: AggregatorCore, device: str, rnd: int, base: int) -> None:
    delta = np.full(D, 0.01, np.float32)
    core.on_update(device, encode_update(DenseUpdate(device, rnd, base, 40, delta,
                                                     nonce=core.nonce_of(rnd))))  # fmt: skip


def run_rounds(core: AggregatorCore, n: int) -> None:
    """``n`` rounds in which every device answers what it was asked (async: the window fills
    and one more is held for the next)."""
    for _ in range(n):
        msg = core.open_round(0.0)
        assert msg is not None
        asked = msg.selected if msg.selected is not None else tuple(DEVICES)
        for device in asked[:3]:
            answer(core, device, msg.round, msg.version)
        core.close_round(1.0, 0.1)


def test_the_mode_picks_the_policy_of_the_one_engine():
    assert isinstance(engine("sync").policy, SyncPolicy)
    assert isinstance(engine("fedbuff").policy, AsyncPolicy)
    assert type(engine("fedasync", concurrency=3)) is AggregatorCore
    with pytest.raises(ValueError, match="concurrency limit"):
        engine("sync", concurrency=2)


def selections(core: AggregatorCore) -> dict[int, frozenset[str]]:
    return {r: sel for r, (_, sel) in core.history.items()}


@pytest.mark.parametrize(
    ("mode", "concurrency"), [("sync", None), ("fedbuff", None), ("fedbuff", 4), ("fedasync", 3)]
)
def test_a_snapshot_restores_the_engine_and_its_policy(mode, concurrency):
    live = engine(mode, concurrency)
    run_rounds(live, 3)
    state = json.loads(json.dumps(live.snapshot()))  # plain data, as a checkpoint stores it
    assert state["releases"] and (mode == "sync" or state["held"])
    fresh = engine(mode, concurrency, seed=99)  # another seed: the snapshot carries the state
    fresh.restore(state, live.params)
    assert json.loads(json.dumps(fresh.snapshot())) == state


@pytest.mark.parametrize("mode", ["sync", "fedbuff", "fedasync"])
def test_a_restored_engine_continues_as_the_original(mode):
    """Same selections, releases and model after two more rounds (nonces are fresh random
    bytes in both). With a concurrency limit a resumed core rebuilds its in-flight set and may
    select other replacements (test_async_core covers what it must keep)."""
    live = engine(mode)
    run_rounds(live, 3)
    fresh = engine(mode, seed=99)
    fresh.restore(json.loads(json.dumps(live.snapshot())), live.params)
    run_rounds(live, 2)
    run_rounds(fresh, 2)
    np.testing.assert_array_equal(fresh.params, live.params)
    assert fresh.releases == live.releases and fresh.version == live.version == 5
    assert selections(fresh) == selections(live)
    assert [d for d, _ in fresh.policy.snapshot().get("held", [])] == [
        d for d, _ in live.policy.snapshot().get("held", [])
    ]


def test_held_updates_are_the_async_policys_state():
    core = engine("fedbuff")
    msg = core.open_round(0.0)
    for device in DEVICES[:4]:  # K = 2: two are applied, two wait for the next window
        answer(core, device, msg.round, msg.version)
    held = core.policy.snapshot()["held"]
    assert [d for d, _ in held] == DEVICES[2:4]
    assert "held" not in engine("sync").snapshot()


def test_no_server_module_reads_another_objects_private_state():
    """Checkpoint, journal, sharding and the service use the engine's public API: no
    ``obj._name`` on anything but ``self`` (the paho adapter's socket and acks apart: the
    transport adapter's, tested below), no hasattr, no isinstance on the engine's types."""
    allowed = {"fresh._fd", "fresh._size"}  # a Journal reading a Journal's
    found = []
    for path in sorted(SERVER.glob("*.py")):
        text = path.read_text()
        for m in re.finditer(r"\b(?!self\b|cls\b)([a-z_][a-z0-9_]*)\.(_[a-z][a-z0-9_]*)\b", text):
            if f"{m.group(1)}.{m.group(2)}" not in allowed:
                found.append(f"{path.name}: {m.group(0)}")
        found += [f"{path.name}: hasattr" for _ in re.finditer(r"\bhasattr\(", text)]
        types = r"isinstance\([^)]*\b(SyncRound|AsyncWindow|AggregatorCore|\w*Policy)\b"
        found += [f"{path.name}: {m.group(0)}" for m in re.finditer(types, text)]
    assert found == []


def test_only_the_transport_adapter_touches_another_objects_private_names():
    """Anywhere in the package, ``obj._name`` on something other than ``self`` is either the
    transport adapter's (paho/aiomqtt internals, each behaviour tested in
    tests/test_transport_adapter.py) or a class reading another instance of itself."""
    same_class = {
        "exact_sum.py": {"other._carry", "other._top", "other._lo", "out._top", "out._lo"},
        "journal.py": {"fresh._fd", "fresh._size"},
    }
    public = {"os._exit", "privacy._dp"}  # the standard library's; a package's own private module
    found = []
    for path in sorted((SERVER.parent).rglob("*.py")):
        if path.name == "client_adapter.py":
            continue
        allowed = public | same_class.get(path.name, set())
        text = path.read_text()
        for m in re.finditer(r"\b(?!self\b|cls\b)([a-z_][a-z0-9_]*)\.(_[a-z][a-z0-9_]*)\b", text):
            if m.group(0) not in allowed:
                found.append(f"{path.relative_to(SERVER.parent)}: {m.group(0)}")
    assert found == []


def test_no_module_imports_another_modules_private_names():
    """``from x import _name`` across modules is the same breach as ``obj._name``: a part's
    private names are its own. Left: the privacy package's private modules, imported by that
    package's own modules."""
    allowed = {("privacy", "_dp"), ("privacy", "_checks")}
    found = []
    pattern = r"from\s+([\w.]+)\s+import\s+\(?([^)\n]*(?:\n[^)\n]*)*?)\)?\s*$"
    for path in sorted(SERVER.parent.rglob("*.py")):
        for m in re.finditer(pattern, path.read_text(), flags=re.M):
            if m.group(1) == "__future__":
                continue
            names = [n.split(" as ")[0].strip() for n in m.group(2).replace("\n", " ").split(",")]
            for name in names:
                dunder = name.startswith("__") and name.endswith("__")  # __version__ is public
                if name.startswith("_") and not dunder and (path.parent.name, name) not in allowed:
                    found.append(f"{path.relative_to(SERVER.parent)}: {m.group(1)}.{name}")
    assert found == []
