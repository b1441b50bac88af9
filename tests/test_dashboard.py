"""The dashboard without a browser: what the relay makes of the job's messages, who sees what
(the operator token; with Poisson selection nothing that counts participation for anyone else),
and the HTTP side (static files from the package, the token cookie, the SSE stream)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_fl.dashboard import Dashboard
from edge_fl.dashboard.sources import BrokerSource, wall_clock
from edge_fl.dashboard.state import DashboardState
from edge_fl.protocol.codec import encode_ack, encode_global, encode_status
from edge_fl.protocol.messages import Ack, GlobalModel, Status
from edge_fl.server.aggregator import PARTICIPATION_FIELDS
from edge_fl.server.checkpoint import read_checkpoint

JOB = "dash-unit"
TOKEN = "a-test-operator-token-0123456789"

RECORD = {
    "round": 3,
    "version": 3,
    "status": "closed",
    "accuracy": 0.81,
    "loss": 0.62,
    "selected": 12,
    "received": 10,
    "rejected": 2,
    "rejected_by_reason": {"wrong_nonce": 1, "stale": 1},
    "rejection_samples": {"wrong_nonce": "d007: field 'nc' is not the round's nonce"},
    "bytes_up": 192000,
    "bytes_down": 250000,
    "online": 40,
    "wire_up_p50": 19300,
    "wire_up_p95": 19400,
    "wire_up_max": 19500,
    "epsilon": 2.5,
    "delta": 1e-5,
    "epsilon_device_p50": 0.0,
    "epsilon_device_p95": 1.9,
    "epsilon_device_max": 2.5,
}
DEVICE_EPSILON = ("epsilon_device_p50", "epsilon_device_p95", "epsilon_device_max")


def relay(poisson: bool = False) -> BrokerSource:
    state = DashboardState()
    source = BrokerSource(state, "mqtt://127.0.0.1:1", JOB)  # never connected here
    config = {"job": JOB, "privacy": {"poisson_selection": poisson, "budget_epsilon": 4.0}}
    state.set_config(config)
    return source


def status(source: BrokerSource, device: str, online: bool, stopped: str | None = None) -> None:
    info = {"stopped": stopped} if stopped else {}
    payload = encode_status(Status(device, online, 30, info))
    source.handle(source.topics.status(device), payload)


def global_message(source: BrokerSource, rnd: int, issued_at: float = 0.0, **kw: Any) -> None:
    msg = GlobalModel(
        JOB, rnd - 1, rnd, np.zeros(4, np.float32), deadline_s=20.0, issued_at=issued_at, **kw
    )
    source.handle(source.topics.global_model, encode_global(msg))


def test_device_counts_follow_the_retained_statuses() -> None:
    source = relay()
    for i in range(6):
        status(source, f"d{i}", online=True)
    status(source, "d4", online=False)  # its last will
    status(source, "d5", online=True, stopped="budget_exhausted")
    status(source, "d6", online=True, stopped="unsupported_mechanism")
    issued = time.time() - 5
    global_message(source, 2, issued, selected=("d0", "d1", "d4"))
    counts = source.state.device_counts()
    assert counts["known"] == 7
    assert (counts["online"], counts["offline"], counts["stopped"]) == (4, 1, 2)
    assert counts["out_of_budget"] == 1
    assert counts["training"] == 2  # d4 is selected but offline
    source.handle(source.topics.status("d0"), b"")  # cleared: the broker holds nothing now
    assert source.state.device_counts()["known"] == 6
    assert source.state.current["ends_at"] == issued + 20


def test_a_ts_that_is_no_unix_time_counts_from_arrival() -> None:
    """``ts`` is the aggregator's Unix time, taken as is, however long the round has been open
    (a page opened mid-round counts down what is left); another clock's value (older
    aggregators wrote their event loop's) or one from the future counts from arrival."""
    assert wall_clock(12345.6, now=1.7e9) == 1.7e9
    assert wall_clock(1.7e9 - 3, now=1.7e9) == 1.7e9 - 3
    assert wall_clock(1.7e9 - 7200, now=1.7e9) == 1.7e9 - 7200
    assert wall_clock(1.7e9 + 3600, now=1.7e9) == 1.7e9
    source = relay()
    before = time.time()
    global_message(source, 1, issued_at=812.25)
    assert before <= source.state.current["issued_at"] <= time.time()


def test_poisson_selection_keeps_training_secret() -> None:
    source = relay(poisson=True)
    status(source, "d0", online=True)
    global_message(source, 1, sample_rate=0.1)
    assert source.state.device_counts()["training"] is None


def test_acks_and_workers_feed_rejections_and_ingest() -> None:
    source = relay()
    ack = Ack("d3", 2, False, "wrong_nonce", "field 'nc' is absent")
    source.handle(source.topics.ack("d3"), encode_ack(ack))
    source.handle(source.topics.ack("d4"), encode_ack(Ack("d4", 2, True)))  # accepted: no detail
    source.handle(f"edgefl/{JOB}/ingest/worker/w1", b"online")
    source.handle(f"edgefl/{JOB}/ingest/worker/w2", b"offline")
    source.handle(source.topics.metrics, json.dumps({**RECORD, "workers_missing": ["w2"]}).encode())
    view = source.state.view(operator=True)
    assert view["rejections"]["samples"]["wrong_nonce"][0] == ("round 2: d3: field 'nc' is absent")
    assert view["rejections"]["by_reason"] == {"wrong_nonce": 1, "stale": 1}
    assert view["ingest"] == {
        "workers": {"w1": "online", "w2": "offline"},
        "missing": ["w2"],
        "missing_rounds": 1,
    }
    source.handle(source.topics.status("d9"), b"\xc1 not msgpack")
    assert source.bad_messages == 1  # counted, not fatal


@pytest.mark.parametrize("poisson", [False, True])
def test_without_the_token_only_the_public_record(poisson: bool) -> None:
    source = relay(poisson=poisson)
    status(source, "d0", online=True)
    source.state.add_record(RECORD)
    public = source.state.view(operator=False)
    assert set(public) >= {"records", "job", "current"}
    assert not {"devices", "rejections", "ingest"} & set(public)
    row = public["records"][0]
    assert "rejection_samples" not in row
    counting = {*PARTICIPATION_FIELDS, "wire_up_p50", "wire_up_p95", "wire_up_max", *DEVICE_EPSILON}
    shown = set(row) & counting
    if poisson:
        assert not shown, f"participation shown to a viewer without operator rights: {shown}"
        assert row["accuracy"] == RECORD["accuracy"] and row["epsilon"] == RECORD["epsilon"]
    else:
        assert {"received", "bytes_up", "wire_up_max", *DEVICE_EPSILON} <= shown
    operator = source.state.view(operator=True)
    assert operator["records"][0]["received"] == 10 and operator["devices"]["known"] == 1


def test_the_live_page_draws_the_records_epsilon_per_device() -> None:
    """A record from the metrics topic carries the aggregator's epsilon per device: the page
    gets it as is; a run directory's replay never overwrites a record's own."""
    source = relay()
    source.handle(source.topics.metrics, json.dumps(RECORD).encode())
    row = source.state.view(operator=True)["records"][0]
    assert {k: row[k] for k in DEVICE_EPSILON} == {k: RECORD[k] for k in DEVICE_EPSILON}
    source.state.set_device_epsilon({3: dict.fromkeys(DEVICE_EPSILON, 9.0)})
    assert source.state.records[0]["epsilon_device_p95"] == 1.9


def test_a_non_finite_value_becomes_null() -> None:
    state = DashboardState()
    state.add_record({"round": 1, "loss": float("nan"), "accuracy": float("inf")})
    json.dumps(state.view(operator=True), allow_nan=False)  # what the server sends


def fetch(url: str, cookie: str | None = None) -> tuple[int, dict[str, str], bytes]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any) -> None:
            return None

    request = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def first_event(url: str, cookie: str) -> dict[str, Any]:
    request = urllib.request.Request(url, headers={"Cookie": cookie})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        for raw in response:
            line = raw.decode()
            if line.startswith("data: "):
                return json.loads(line[6:])
    raise AssertionError("the stream ended without an event")


def write_run(directory: Path, poisson: bool) -> None:
    directory.mkdir()
    config = {"job": "finished", "privacy": {"poisson_selection": poisson}, "rounds": {"rounds": 3}}
    (directory / "run.json").write_text(json.dumps({"config": config}))
    lines = [json.dumps({**RECORD, "round": r, "version": r}) for r in (1, 2, 3)]
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"round": 4, "acc')


@pytest.mark.parametrize("public", [False, True])
def test_http_token_cookie_static_files_and_stream(tmp_path: Path, public: bool) -> None:
    write_run(tmp_path / "run", poisson=True)

    async def scenario() -> None:
        board = Dashboard.run_dir(tmp_path / "run", token=TOKEN, public=public)
        started = asyncio.Event()
        serving = asyncio.create_task(board.serve("127.0.0.1", 0, started))
        await started.wait()
        base = f"http://127.0.0.1:{board.port}"
        try:
            await asyncio.to_thread(check, base)
        finally:
            serving.cancel()

    def check(base: str) -> None:
        code, _, body = fetch(base + "/api/view")
        if public:
            assert code == 200
            view = json.loads(body)
            assert view["redacted"] and "devices" not in view
            assert "received" not in view["records"][0]  # Poisson: participation hidden
        else:
            assert code == 401 and b"operator token required" in body
        assert fetch(base + "/?token=wrong")[0] == 401
        code, headers, _ = fetch(f"{base}/?token={TOKEN}")
        assert code == 303 and headers["Location"] == "/"
        cookie = headers["Set-Cookie"].split(";")[0]
        assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
        code, _, body = fetch(base + "/api/view", cookie)
        view = json.loads(body)
        assert code == 200 and not view["redacted"] and view["records"][2]["received"] == 10
        assert len(view["records"]) == 3  # the torn last line is not a record (yet)
        code, _, page = fetch(base + "/", cookie)
        assert code == 200 and b"/static/vendor/uplot/uPlot.iife.min.js" in page
        # the chart library and its licence come from the package: nothing from a CDN
        code, _, licence = fetch(base + "/static/vendor/uplot/LICENSE")
        assert code == 200 and b"MIT" in licence
        assert b"http" not in page.replace(b"http-equiv", b"")
        assert fetch(base + "/static/../state.py")[0] == 404
        event = first_event(base + "/events", cookie)
        assert event["records_from"] == 0 and [r["round"] for r in event["records"]] == [1, 2, 3]

    asyncio.run(scenario())


@pytest.mark.broker
@pytest.mark.parametrize("mechanism", ["gaussian", pytest.param("dpsgd", marks=pytest.mark.slow)])
def test_device_epsilon_replays_the_ledger(tmp_path: Path, mechanism: str) -> None:
    """Per-device epsilon from a run's checkpoint: its maximum is, round by round, the job's
    epsilon the aggregator recorded (the worst device's), and the quantiles are ordered."""
    import subprocess
    import sys

    from edge_fl.dashboard.epsilon import DeviceEpsilon

    out = tmp_path / "run"
    edge_fl = str(Path(sys.executable).with_name("edge-fl"))
    model = ["--model", "logreg"] if mechanism == "dpsgd" else []
    made = subprocess.run(
        [edge_fl, "simulate", "--devices", "20", "--rounds", "4", "--clients-per-round", "8",
         "--mechanism", mechanism, "--epsilon", "8", *model, "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((out / "run.json").read_text())["config"]
    checkpoint = read_checkpoint(out)  # with the releases of its ledger file
    by_round = DeviceEpsilon(config).per_round(records, checkpoint)
    assert sorted(by_round) == [r["round"] for r in records]
    for record in records:
        q = by_round[record["round"]]
        assert q["epsilon_device_max"] == pytest.approx(record["epsilon"], rel=1e-9)
        assert q["epsilon_device_p50"] <= q["epsilon_device_p95"] <= q["epsilon_device_max"]
        for key in DEVICE_EPSILON:  # the aggregator's own, composed through its ledger
            assert record[key] == pytest.approx(q[key], rel=1e-9), (record["round"], key)
    assert by_round[records[0]["round"]]["epsilon_device_p50"] == 0.0  # 8 of 20 uploaded


def test_a_rewritten_metrics_file_is_read_again(tmp_path: Path) -> None:
    """A resumed run reconciles metrics.jsonl by replacing it (a new file, maybe as long): the
    dashboard reads the new one from its start, not from where it stopped in the old one."""
    write_run(tmp_path / "run", poisson=False)
    board = Dashboard.run_dir(tmp_path / "run", token=TOKEN)
    source = board.source
    assert [r["round"] for r in board.state.records] == [1, 2, 3]
    path = tmp_path / "run" / "metrics.jsonl"
    kept = [json.dumps({**RECORD, "round": r, "version": r, "accuracy": 0.5}) for r in (1, 2)]
    replacement = tmp_path / "run" / "metrics.jsonl.tmp"
    replacement.write_text("\n".join(kept) + "\n" + " " * 4000 + "\n")  # longer than before
    assert replacement.stat().st_size > path.stat().st_size
    replacement.replace(path)
    assert source.poll()
    assert [(r["round"], r["accuracy"]) for r in board.state.records] == [(1, 0.5), (2, 0.5)]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "give either RUN_DIR or --broker URL --job ID"),
        (["--broker", "mqtt://127.0.0.1:1"], "--broker needs --job ID"),
        (["--broker", "ftp://h:1", "--job", "j"], "scheme 'ftp' is not supported"),
        (["--broker", "mqtt://h:1", "--job", "a/b"], "is not a valid topic segment"),
        (["NO_SUCH_DIR"], "no metrics.jsonl here"),
        (["RUN", "--max-rate", "0"], "--max-rate 0: must be in (0, 60]"),
        (["RUN", "--token-file", "SHORT"], "the token must be 16+ characters"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    from click.testing import CliRunner

    from edge_fl.cli.dashboard_cmd import dashboard

    write_run(tmp_path / "RUN", poisson=False)
    (tmp_path / "SHORT").write_text("short")
    args = [str(tmp_path / a) if a in ("RUN", "SHORT", "NO_SUCH_DIR") else a for a in args]
    result = CliRunner().invoke(dashboard, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edge-fl: error: ") and says in lines[0], lines


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    import socket

    from click.testing import CliRunner

    from edge_fl.cli.dashboard_cmd import dashboard

    write_run(tmp_path / "run", poisson=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(dashboard, [str(tmp_path / "run"), "--port", str(port)])
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"edge-fl: error: port {port} on 127.0.0.1 is already in use (--port 0 picks a free one)"
    )
