"""The dashboard page in a real headless Chromium (Debian's chromium + chromium-driver, through
selenium) against a live job on a real Mosquitto, then against the run directory it wrote: the
numbers the page shows are metrics.jsonl's, and its device counts are the retained statuses'."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest

from edge_fl.protocol.codec import decode_status, encode_status
from edge_fl.protocol.messages import Status
from edge_fl.protocol.topics import Topics

EDGE_FL = str(Path(sys.executable).with_name("edge-fl"))
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.broker,
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium "
        "chromium-driver; tools/test.sh installs them)",
    ),
]

ROUNDS = 4
DEVICES = 20
TIMEOUT = 120


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER or ""), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def start_dashboard(args: list[str], token_file: Path) -> tuple[subprocess.Popen, str]:
    """`edge-fl dashboard ARGS` on a free port; its process and base URL (from what it prints)."""
    proc = subprocess.Popen(
        [EDGE_FL, "dashboard", *args, "--port", "0", "--token-file", str(token_file)],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    if "dashboard at " not in line:
        proc.kill()
        raise AssertionError(f"the dashboard did not start: {line}{proc.stderr.read()}")
    url = line.split("dashboard at ", 1)[1].strip()
    return proc, url.split("/?token=")[0]


def wait(driver: Any, condition: Callable[[Any], Any], timeout: float = TIMEOUT) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(condition)


def page_round(driver: Any, rnd: int) -> dict[str, Any]:
    """The page's rounds-table row of round ``rnd``: field -> (exact value, text shown)."""
    cells = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])]"
        ".map(td => [td.dataset.field, td.dataset.value, td.textContent])",
        f'#rounds tr[data-round="{rnd}"] td',
    )  # one script: the table is redrawn between two WebDriver calls
    return {field: (json.loads(value), text) for field, value, text in cells}


def page_counts(driver: Any) -> dict[str, Any]:
    cells = driver.execute_script(
        "return [...document.querySelectorAll('#devices td[data-count]')]"
        ".map(td => [td.dataset.count, td.dataset.value])"
    )
    return {name: json.loads(value) for name, value in cells if value is not None}


def epsilon_legend(driver: Any) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#chart-eps .u-legend .u-label')]"
        ".map(e => e.textContent)"
    )


def rejection_row(driver: Any, reason: str) -> dict[str, Any] | None:
    return driver.execute_script(
        "const tr = document.querySelector(`#rejections tr[data-reason='${arguments[0]}']`);"
        "return tr && {count: JSON.parse(tr.querySelector('td[data-field=count]').dataset.value),"
        " detail: tr.lastElementChild.textContent}",
        reason,
    )


def publish(url: str, topic: str, payload: bytes, retain: bool = False) -> None:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    client = paho.Client(paho.CallbackAPIVersion.VERSION2)
    client.connect(host, int(port))
    client.loop_start()
    try:
        client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(30)
    finally:
        client.loop_stop()
        client.disconnect()


def retained_statuses(url: str, job: str, expected: int) -> dict[str, tuple[bool, str | None]]:
    """Every device's retained status as the broker holds it now (a fresh subscription)."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    topics = Topics(job)
    seen: dict[str, tuple[bool, str | None]] = {}
    got = threading.Event()

    def on_message(_c: Any, _u: Any, msg: paho.MQTTMessage) -> None:
        device = topics.device_of(msg.topic, "status")
        if device and msg.payload:
            status = decode_status(msg.payload, device)
            seen[device] = (status.online, status.info.get("stopped"))
        if len(seen) >= expected:
            got.set()

    client = paho.Client(paho.CallbackAPIVersion.VERSION2)
    client.on_message = on_message
    client.on_connect = lambda c, *_: c.subscribe(topics.all_status, qos=1)
    client.connect(host, int(port))
    client.loop_start()
    try:
        assert got.wait(30), f"only {len(seen)} of {expected} retained statuses"
    finally:
        client.loop_stop()
        client.disconnect()
    return seen


def expected_counts(statuses: dict[str, tuple[bool, str | None]]) -> dict[str, int]:
    stopped = [why for _, why in statuses.values() if why]
    online = sum(1 for on, why in statuses.values() if on and not why)
    return {
        "known": len(statuses),
        "online": online,
        "stopped": len(stopped),
        "out_of_budget": stopped.count("budget_exhausted"),
        "offline": len(statuses) - online - len(stopped),
    }


def check_round(driver: Any, record: dict[str, Any]) -> None:
    """The page's row of ``record``'s round holds exactly its numbers, shown as the page says."""
    row = wait(driver, lambda d: page_round(d, record["round"]) or False)
    for key in ("version", "accuracy", "loss", "epsilon", "bytes_up", "bytes_down", "received"):
        assert row[key][0] == record.get(key), (key, row[key], record.get(key))
    for key in ("wire_up_p50", "wire_up_p95", "wire_up_max", "wire_down_p95"):
        assert row[key][0] == record[key], (key, row[key], record[key])
    assert row["accuracy"][1] == f"{record['accuracy']:.4f}"
    assert row["bytes_up"][1] == f"{record['bytes_up']:,}"
    assert row["wire_up_max"][1] == f"{record['wire_up_max']:,}"


def test_live_job_then_run_dir(make_broker, browser, tmp_path: Path) -> None:
    broker = make_broker()
    job = "dash-live"
    token = tmp_path / "token"
    token.write_text("operator-token-for-the-test-0123456789")
    out = tmp_path / "run"
    dash, base = start_dashboard(["--broker", broker.url, "--job", job], token)
    job_proc = None
    try:
        # without the token: nothing (and no participation) for anyone
        browser.get(base + "/")
        assert "operator token required" in browser.find_element("tag name", "body").text
        browser.get(f"{base}/?token={token.read_text()}")
        wait(browser, lambda d: d.find_element("tag name", "body").get_attribute("data-connected")
             == "true")  # fmt: skip
        job_proc = subprocess.Popen(
            [EDGE_FL, "simulate", "--broker", broker.url, "--job", job, "--devices", str(DEVICES),
             "--rounds", str(ROUNDS), "--clients-per-round", "10", "--mechanism", "gaussian",
             "--epsilon", "16", "--budget", "9", "--out", str(out), "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        # an update the aggregator must refuse (not msgpack): counted in its round's record,
        # its detail on the intruder's negative ack
        # (the aggregator answers only devices that announced themselves: this one says it has
        # stopped, so it is never selected)
        wait(browser, lambda d: page_round(d, 1) or False)
        intruder = Status("intruder", True, 10, {"stopped": "unsupported_mechanism"})
        publish(broker.url, Topics(job).status("intruder"), encode_status(intruder), retain=True)
        publish(broker.url, Topics(job).update("intruder"), b"\xc1 not msgpack")
        # after round N, the page's row N is metrics.jsonl's line N
        wait(browser, lambda d: page_round(d, 2) or False)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        check_round(browser, records[1])
        _, stderr = job_proc.communicate(timeout=TIMEOUT)
        assert job_proc.returncode == 0, stderr
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        for record in records:
            check_round(browser, record)
        assert browser.find_element("id", "accuracy").text == f"{records[-1]['accuracy']:.4f}"
        errors = [
            e
            for e in browser.get_log("browser")
            if e["level"] == "SEVERE" and "401 (Unauthorized)" not in e["message"]  # ours, above
        ]
        assert not errors, errors  # no script error, no file that failed to load
        refused: Counter[str] = Counter()
        for record in records:
            refused.update(record["rejected_by_reason"])
        assert sum(refused.values()) == 1, refused  # the intruder's (not selected, or malformed)
        ((reason, count),) = refused.items()
        row = wait(browser, lambda d: rejection_row(d, reason))
        assert row["count"] == count and "intruder" in row["detail"], row
        # the device table counts are the retained statuses' (once the last ones have arrived)
        want = expected_counts(retained_statuses(broker.url, job, DEVICES + 1))
        assert want["known"] == DEVICES + 1
        wait(browser, lambda d: {k: page_counts(d).get(k) for k in want} == want, 30)
    finally:
        for proc in (job_proc, dash):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    # the finished run, from its directory
    dash, base = start_dashboard([str(out)], token)
    try:
        browser.get(f"{base}/?token={token.read_text()}")
        wait(browser, lambda d: d.find_element("tag name", "body").get_attribute("data-records")
             == str(len(records)))  # fmt: skip
        for record in records:
            check_round(browser, record)

        # epsilon per device, replayed from the checkpoint: its max is the job's, round by round
        # (on the page: every row, the older ones included, once the replay is done)
        def device_max(d: Any) -> list[Any]:
            return [page_round(d, r["round"])["epsilon_device_max"][0] for r in records]

        wait(browser, lambda d: None not in device_max(d))
        for shown, record in zip(device_max(browser), records, strict=True):
            assert shown == pytest.approx(record["epsilon"], rel=1e-9)
        assert "device max" in epsilon_legend(browser)
        checkpoint = json.loads((out / "checkpoint.json").read_text())
        fleet = {dev: (bool(on), why) for dev, (on, _n, why) in checkpoint["devices"].items()}
        want = expected_counts(fleet)
        wait(browser, lambda d: {k: page_counts(d).get(k) for k in want} == want, 30)
    finally:
        dash.kill()
        dash.wait()


@pytest.mark.parametrize(("top", "log"), [(8.0, False), (1300.0, True)])
def test_epsilon_axis_goes_log_over_two_orders_of_magnitude(
    browser, tmp_path: Path, top: float, log: bool
) -> None:
    """SignDS's ~1,300 next to a budget of 4 flattens a linear axis: over 100x, the axis is log."""
    out = tmp_path / "run"
    out.mkdir()
    config = {"job": "eps", "privacy": {"mechanism": "signds", "budget_epsilon": 4.0}}
    (out / "run.json").write_text(json.dumps({"config": config}))
    eps = [top * (r / 5) for r in range(1, 6)]
    lines = [
        json.dumps({"round": r + 1, "version": r + 1, "epsilon": e}) for r, e in enumerate(eps)
    ]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    token = tmp_path / "token"
    token.write_text("operator-token-for-the-test-0123456789")
    dash, base = start_dashboard([str(out)], token)
    try:
        browser.get(f"{base}/?token={token.read_text()}")
        wait(browser, lambda d: d.find_element("tag name", "body").get_attribute("data-records")
             == "5")  # fmt: skip
        note = browser.find_element("id", "eps-scale").text
        assert ("log scale" in note) is log, note
        assert epsilon_legend(browser) == ["job (worst device)", "budget"]  # every series named
    finally:
        dash.kill()
        dash.wait()


def test_poisson_job_shows_no_participation_without_the_token(
    make_broker, browser, tmp_path: Path
) -> None:
    """A live Poisson-selection job, the page opened without the operator token (``--public``):
    accuracy and epsilon, but no count, byte or device that tells who took part; with the token
    the device table is there and "training" stays secret."""
    from edge_fl.server.aggregator import PARTICIPATION_FIELDS

    broker = make_broker()
    job = "dash-poisson"
    token = tmp_path / "token"
    token.write_text("operator-token-for-the-test-0123456789")
    out = tmp_path / "run"
    dash, base = start_dashboard(["--broker", broker.url, "--job", job, "--public"], token)
    job_proc = None
    try:
        browser.get(base + "/")
        wait(browser, lambda d: d.find_element("tag name", "body").get_attribute("data-connected")
             == "true")  # fmt: skip
        job_proc = subprocess.Popen(
            [EDGE_FL, "simulate", "--broker", broker.url, "--job", job, "--devices", str(DEVICES),
             "--rounds", "2", "--deadline", "3", "--mechanism", "gaussian-central",
             "--epsilon", "8", "--poisson-selection", "--out", str(out), "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        _, stderr = job_proc.communicate(timeout=TIMEOUT)
        assert job_proc.returncode == 0, stderr
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["received"] >= 0  # the aggregator's own file has them
        wait(browser, lambda d: d.find_element("tag name", "body").get_attribute("data-records")
             == str(len(records)))  # fmt: skip
        view = browser.execute_script(
            "return fetch('/api/view', {credentials: 'omit'}).then(r => r.json())"
        )
        assert view["redacted"] and not {"devices", "rejections", "ingest"} & set(view)
        for row, record in zip(view["records"], records, strict=True):
            leaked = {k for k in row if k in PARTICIPATION_FIELDS or k.startswith("wire_")}
            assert not leaked, leaked
            assert (row["accuracy"], row["epsilon"]) == (record["accuracy"], record["epsilon"])
        for record in records:
            row = page_round(browser, record["round"])
            assert row["accuracy"][0] == record["accuracy"]
            assert row["received"][0] is None and row["bytes_up"][0] is None
            assert row["wire_up_max"][0] is None
        hidden = browser.execute_script(
            "return [...document.querySelectorAll('.operator')].every(s => s.hidden)"
        )
        assert hidden
        # the operator: the device table, with the selection secret
        browser.get(f"{base}/?token={token.read_text()}")
        wait(browser, lambda d: page_counts(d).get("known") == DEVICES)
        cell = browser.find_element("css selector", '#devices td[data-count="training"]')
        assert cell.text == "secret"
    finally:
        for proc in (job_proc, dash):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    # the aggregator's own metrics.jsonl holds the counts: the dashboard's filter keeps them
    # from a viewer without the token
    dash, base = start_dashboard([str(out), "--public"], token)
    try:
        browser.delete_all_cookies()
        browser.get(base + "/")
        wait(browser, lambda d: d.find_element("tag name", "body").get_attribute("data-records")
             == str(len(records)))  # fmt: skip
        for record in records:
            row = page_round(browser, record["round"])
            assert row["accuracy"][0] == record["accuracy"]
            assert row["received"][0] is None and row["bytes_up"][0] is None
        view = browser.execute_script(
            "return fetch('/api/view', {credentials: 'omit'}).then(r => r.json())"
        )
        assert view["redacted"] and "devices" not in view
        shown = {k for row in view["records"] for k in row}
        assert not shown & set(PARTICIPATION_FIELDS)
        assert not {k for k in shown if k.startswith(("wire_", "epsilon_device_"))}
    finally:
        dash.kill()
        dash.wait()
