"""The checkpoint's ledger file (edge_fl/server/ledger_file.py): a round's commit appends that
round's releases and selections instead of rewriting the job's, the checkpoint stays the commit
point (a crash between the append and the rename, or a torn last line, loses nothing committed
and charges nothing twice), and a checkpoint of the older format still loads."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import DenseUpdate, Status, UpdateLimits, encode_status, encode_update
from edge_fl.server import checkpoint
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings
from edge_fl.server.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from edge_fl.server.ledger_file import ChangeTracked, LedgerReader, is_ledger_file, with_ledger
from edge_fl.storage import OutputError

D = 5
DEVICES = [f"d{i}" for i in range(6)]
MODES = [("sync", None), ("fedbuff", None), ("fedasync", 3)]
#: the asynchronous policy's own checkpoint fields: updates held for the next window and those
#: applied within the staleness bound (both bounded; every version's nonce is in the history)
ASYNC_OWN = ("held", "applied")


def engine(mode: str = "sync", concurrency: int | None = None, seed: int = 3) -> AggregatorCore:
    settings = AggregatorSettings(
        job="j", rounds=500, target=3, min_updates=2, deadline_s=10.0, mode=mode, buffer_size=2
    )
    core = AggregatorCore(
        settings, np.zeros(D, np.float32), UpdateLimits(D), seeded_generator(seed),
        concurrency=concurrency,
    )  # fmt: skip
    for d in DEVICES:
        core.on_status(d, encode_status(Status(d, True, 100)))
    return core


def run_rounds(core: AggregatorCore, n: int, out: Path | None = None) -> None:
    """``n`` rounds in which the first three devices asked answer; a checkpoint after each."""
    for _ in range(n):
        msg = core.open_round(0.0)
        assert msg is not None
        asked = msg.selected if msg.selected is not None else tuple(DEVICES)
        for device in asked[:3]:
            delta = np.full(D, 0.01, np.float32)
            update = DenseUpdate(device, msg.round, msg.version, 40, delta,
                                 nonce=core.nonce_of(msg.round))  # fmt: skip
            core.on_update(device, encode_update(update))
        core.close_round(1.0, 0.1)
        if out is not None:
            save_checkpoint(core, out)


def ledger_of(core: AggregatorCore, nonces: bool = True) -> dict:
    """``nonces=False``: to compare two runs (nonces are fresh random bytes in each)."""
    return {
        "releases": [tuple(r) for r in core.releases],
        "noised": list(core.noised_rounds),
        "history": {r: (n if nonces else None, sel) for r, (n, sel) in core.history.items()},
    }


def resumed(out: Path, mode: str = "sync", concurrency: int | None = None) -> AggregatorCore:
    core = engine(mode, concurrency, seed=99)  # the checkpoint carries the generator's state
    load_checkpoint(core, out)
    return core


def ledger_files(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if is_ledger_file(p.name))


@pytest.mark.parametrize(("mode", "concurrency"), MODES)
def test_the_commit_writes_the_same_bytes_at_round_40_as_at_round_4(tmp_path, mode, concurrency):
    """checkpoint.json no longer grows with the job; the ledger file grows by the round's lines."""
    core = engine(mode, concurrency)
    sizes, grown = [], []
    for _ in range(40):
        before = sum(p.stat().st_size for p in ledger_files(tmp_path))
        run_rounds(core, 1, tmp_path)
        state = json.loads((tmp_path / "checkpoint.json").read_text())
        for key in ASYNC_OWN:
            state.pop(key, None)
        sizes.append(len(json.dumps(state)))
        grown.append(sum(p.stat().st_size for p in ledger_files(tmp_path)) - before)
    assert len(ledger_files(tmp_path)) == 1
    # the same fields every round (a few digits more in the counters and the ledger's coverage)
    assert sizes[-1] - sizes[3] < 40, sizes
    assert max(grown[4:]) < 400  # one round's releases and selection
    state = json.loads((tmp_path / "checkpoint.json").read_text())
    assert state["format"] == 3 and not {"releases", "history", "noised_rounds"} & set(state)
    assert state["ledger"]["releases"] == len(core.releases) >= 40


@pytest.mark.parametrize(("mode", "concurrency"), MODES)
def test_a_resumed_core_has_exactly_the_ledger_and_goes_on_as_the_uninterrupted_one(
    tmp_path, mode, concurrency
):
    live = engine(mode, concurrency)
    run_rounds(live, 4, tmp_path / "a")
    again = resumed(tmp_path / "a", mode, concurrency)
    assert ledger_of(again) == ledger_of(live)
    # both go on; the resumed one appends to the same file (no second generation)
    run_rounds(live, 3, tmp_path / "b")
    run_rounds(again, 3, tmp_path / "a")
    assert [tuple(r) for r in live.releases] == [tuple(r) for r in again.releases]
    assert len(ledger_files(tmp_path / "a")) == 1
    on_disk = read_checkpoint(tmp_path / "a")
    assert [tuple(r) for r in on_disk["releases"]] == [tuple(r) for r in again.releases]
    assert on_disk["noised_rounds"] == again.noised_rounds
    assert set(map(int, on_disk["history"])) == set(again.history)


def test_a_selection_that_grows_after_it_was_written_is_restored_as_it_grew(tmp_path):
    """An asynchronous version's selection grows (dispatch messages): the later line wins."""
    core = engine("fedasync", 3)
    run_rounds(core, 2, tmp_path)
    version = max(core.history)
    nonce, selected = core.history[version]
    core.history[version] = (nonce, selected | {"d5", "d4"})
    save_checkpoint(core, tmp_path)
    assert resumed(tmp_path, "fedasync", 3).history == core.history


def crash_at_state(monkeypatch):
    """The process dies after the ledger append and the parameters file, before the rename of
    checkpoint.json (the commit point)."""
    real = checkpoint.atomic_write

    def crash(path, data):
        if path.name == "checkpoint.json":
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(checkpoint, "atomic_write", crash)


def test_a_crash_between_the_append_and_the_rename_loses_and_doubles_nothing(tmp_path, monkeypatch):
    reference = engine()
    run_rounds(reference, 6, tmp_path / "ref")

    core = engine()
    out = tmp_path / "run"
    run_rounds(core, 3, out)
    committed = ledger_of(core)
    covered = json.loads((out / "checkpoint.json").read_text())["ledger"]["bytes"]
    run_rounds(core, 1)
    crash_at_state(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(core, out)
    monkeypatch.undo()
    (ledger,) = ledger_files(out)
    assert ledger.stat().st_size > covered  # round 4's lines: appended, covered by nothing

    # readers take the covered prefix only: round 4 is not in the ledger ...
    assert len(read_checkpoint(out)["releases"]) == len(committed["releases"])
    again = resumed(out)
    assert ledger_of(again) == committed and again.round_number == 3
    # ... and a resumed run (whose journal would replay round 4) writes each release once
    run_rounds(again, 3, out)
    assert ledger_of(again, nonces=False) == ledger_of(reference, nonces=False)
    on_disk = read_checkpoint(out)["releases"]
    assert [tuple(r) for r in on_disk] == [tuple(r) for r in reference.releases]
    assert len(on_disk) == len({(d, r) for d, r, _ in on_disk})
    assert ledger_files(out) == [ledger]  # the same file, its uncovered tail cut before appending


def test_a_torn_last_line_is_ignored_and_cut(tmp_path, monkeypatch):
    """An append cut short (power loss mid-write): half a line past what the checkpoint covers."""
    core = engine()
    run_rounds(core, 2, tmp_path)
    committed = ledger_of(core)
    run_rounds(core, 1)
    real = os.pwrite

    def half_then_die(fd, data, offset):
        real(fd, bytes(data[: len(data) // 2 + 3]), offset)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "pwrite", half_then_die)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(core, tmp_path)
    monkeypatch.undo()
    (ledger,) = ledger_files(tmp_path)
    assert not ledger.read_bytes().endswith(b"\n")  # torn
    again = resumed(tmp_path)
    assert ledger_of(again) == committed
    run_rounds(again, 1, tmp_path)
    lines = ledger.read_bytes().decode().splitlines()
    assert all(json.loads(line) for line in lines)  # the torn tail was cut before the append
    assert ledger_of(resumed(tmp_path)) == ledger_of(again)


def test_a_failed_commit_starts_a_new_ledger_file_and_the_old_one_goes_after_the_next(
    tmp_path, monkeypatch
):
    """The process goes on after a full disk: what the writer appended may be uncovered, so the
    next commit writes a new file with everything; the previous pair stays until it is in place."""
    core = engine()
    run_rounds(core, 2, tmp_path)
    (first,) = ledger_files(tmp_path)
    run_rounds(core, 1)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OutputError, match="No space left on device"):
        save_checkpoint(core, tmp_path)
    monkeypatch.undo()
    assert resumed(tmp_path).round_number == 2  # the previous checkpoint, its ledger intact
    save_checkpoint(core, tmp_path)
    (second,) = ledger_files(tmp_path)
    assert second != first
    assert ledger_of(resumed(tmp_path)) == ledger_of(core)


def test_a_ledger_file_that_lost_committed_lines_is_refused(tmp_path):
    """Never resume with fewer releases than were committed: a short or altered file is an
    error in one line, not a smaller ledger."""
    core = engine()
    run_rounds(core, 3, tmp_path)
    (ledger,) = ledger_files(tmp_path)
    data = ledger.read_bytes()
    ledger.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1])  # the last line gone
    with pytest.raises(ValueError, match="committed releases are missing") as short:
        load_checkpoint(engine(), tmp_path)
    assert len(str(short.value).splitlines()) == 1
    ledger.write_bytes(data.replace(b'"d0"', b'"d9"', 1))  # same length, other content
    with pytest.raises(ValueError, match="do not match the checkpoint's digest"):
        load_checkpoint(engine(), tmp_path)
    ledger.unlink()
    with pytest.raises(ValueError, match="cannot read the checkpoint"):
        read_checkpoint(tmp_path)


def test_a_checkpoint_of_the_older_format_still_loads_and_moves_to_a_ledger_file(tmp_path):
    """Format 2 listed releases, noised rounds and history inline in checkpoint.json."""
    core = engine()
    run_rounds(core, 3, tmp_path)
    state = read_checkpoint(tmp_path)
    for p in ledger_files(tmp_path):
        p.unlink()
    del state["ledger"]
    state["format"] = 2
    (tmp_path / "checkpoint.json").write_text(json.dumps(state))
    assert read_checkpoint(tmp_path)["releases"] == state["releases"]
    again = resumed(tmp_path)
    assert ledger_of(again) == ledger_of(core)
    run_rounds(again, 1, tmp_path)
    assert json.loads((tmp_path / "checkpoint.json").read_text())["format"] == 3
    assert len(ledger_files(tmp_path)) == 1
    run_rounds(core, 1)
    assert ledger_of(resumed(tmp_path), nonces=False) == ledger_of(core, nonces=False)


def test_a_cleared_history_starts_a_new_ledger_file(tmp_path):
    """A core that forgot its run (a sharded worker's new run) is no continuation of the file."""
    core = engine()
    run_rounds(core, 2, tmp_path)
    (first,) = ledger_files(tmp_path)
    core.forget()
    run_rounds(core, 3, tmp_path)
    (second,) = ledger_files(tmp_path)
    assert second != first
    assert ledger_of(resumed(tmp_path)) == ledger_of(core)


def test_the_reader_follows_a_running_job_reading_only_what_was_appended(tmp_path):
    """The dashboard's way: one reader across checkpoints; a commit under way (lines past the
    covered prefix) changes nothing of what it reads."""
    core = engine()
    reader = LedgerReader()
    for _ in range(5):
        run_rounds(core, 1, tmp_path)
        state = with_ledger(
            tmp_path, json.loads((tmp_path / "checkpoint.json").read_text()), reader
        )
        assert [tuple(r) for r in state["releases"]] == [tuple(r) for r in core.releases]
        covered = state["ledger"]["bytes"]
        assert reader.offset == covered
    (ledger,) = ledger_files(tmp_path)
    with ledger.open("ab") as f:  # the next commit's append, its rename not done yet
        f.write(b'["r","d1",6,40]\n["h",6')
    state = with_ledger(tmp_path, json.loads((tmp_path / "checkpoint.json").read_text()), reader)
    assert len(state["releases"]) == len(core.releases)


def test_the_change_tracked_dict_logs_sets_and_counts_losses():
    d: ChangeTracked[int, str] = ChangeTracked()
    d[1] = "a"
    d.setdefault(2, "b")
    d.update({3: "c"})
    d |= {1: "z"}
    assert d.changes == [1, 2, 3, 1] and d.epoch == 0 and d == {1: "z", 2: "b", 3: "c"}
    d.pop(7, None)
    assert d.epoch == 0
    del d[2]
    assert d.epoch == 1 and d.changes == []
    d.clear()
    assert d.epoch == 2 and not d


def test_the_dashboard_follows_the_ledger_of_a_run_directory(tmp_path):
    """``edge-fl dashboard RUN_DIR``'s source: the checkpoint it replays epsilon from carries the
    releases of the ledger file, read as the job appends them."""
    from edge_fl.dashboard.sources import RunDirSource
    from edge_fl.dashboard.state import DashboardState

    core = engine()
    source = RunDirSource(DashboardState(), tmp_path)
    for _ in range(3):
        run_rounds(core, 2, tmp_path)
        assert source.poll()
        assert source._checkpoint is not None
        assert [tuple(r) for r in source._checkpoint["releases"]] == core.releases
    assert (
        source._ledger.offset
        == json.loads((tmp_path / "checkpoint.json").read_text())["ledger"]["bytes"]
    )
