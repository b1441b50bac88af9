"""Dashboard screenshots and responsiveness (docs/dashboard.md), never run in CI.

One private Mosquitto, ``edge-fl aggregator`` and ``edge-fl fleet`` shards as separate processes,
``edge-fl dashboard`` live on the job and a headless Chromium on its page. Measures, from the
moment every device is online until the job ends: the page's rendered updates per second and
its time per render, the relay's MQTT messages per second, and the CPU of the dashboard process,
of Chromium (all its processes) and of the aggregator, from /proc.

    EDGE_FL_DASH_DEVICES=1000 pytest -m bench -s tests/test_dashboard_bench.py -k screenshot
    EDGE_FL_DASH_DEVICES=10000 pytest -m bench -s tests/test_dashboard_bench.py -k responsive
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_dashboard_browser import EDGE_FL, browser, start_dashboard, wait  # noqa: F401

from edge_fl.transport.broker import EmbeddedBroker

pytestmark = [pytest.mark.bench, pytest.mark.broker, pytest.mark.timeout(1800)]

DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def tree(pid: int) -> list[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.Error:
        return []


def page(driver: Any) -> dict[str, Any]:
    return driver.execute_script(
        "const s = window.__dashboard; const b = document.body.dataset;"
        "const c = {}; document.querySelectorAll('#devices td[data-count]')"
        ".forEach(td => c[td.dataset.count] = JSON.parse(td.dataset.value || 'null'));"
        "return {rendered: s.rendered, renderMs: s.renderMs, records: +(b.records || 0), counts: c}"
    )


#: the screenshot's job: digits (MLP) learns within a few rounds; devices run out of budget
DIGITS = ["--dataset", "digits", "--model", "mlp", "--epsilon", "200", "--budget", "100"]
#: the load job: small logreg updates (10,000 devices' data drawn lazily)
SYNTHETIC = ["--dataset", "synthetic", "--model", "logreg", "--epsilon", "40", "--budget", "20"]


def job_commands(
    url: str, job: str, devices: int, out: Path, data: list[str]
) -> tuple[list[str], list[str]]:
    per_round = max(10, devices // (5 if data is DIGITS else 10))
    common = ["--broker", url, "--job", job, "--devices", str(devices), *data,
              "--rounds", os.environ.get("EDGE_FL_DASH_ROUNDS", "12"),
              "--clients-per-round", str(per_round), "--deadline", "60",
              "--mechanism", "gaussian"]  # fmt: skip
    aggregator = [EDGE_FL, "aggregator", *common, "--out", str(out)]
    return aggregator, common


def run(
    driver: Any, tmp_path: Path, devices: int, shot: Path | None, simulate: bool = False
) -> dict[str, Any]:
    """``simulate``: the job as one ``edge-fl simulate`` process (whose records carry every
    device's wire bytes), else ``edge-fl aggregator`` and ``edge-fl fleet`` shards (the
    aggregator's CPU apart)."""
    shards = max(1, devices // 5000)
    broker = EmbeddedBroker(kind="mosquitto").start()
    token = tmp_path / "token"
    token.write_text("operator-token-for-the-bench-0123456789")
    job = "dash-bench"
    out = tmp_path / "run"
    dash, base = start_dashboard(["--broker", broker.url, "--job", job], token)
    procs: list[subprocess.Popen] = []
    try:
        driver.get(f"{base}/?token={token.read_text()}")
        wait(driver, lambda d: d.execute_script("return document.body.dataset.connected")
             == "true")  # fmt: skip
        relay0 = relay(base, token)
        data = DIGITS if simulate else SYNTHETIC
        aggregator, common = job_commands(broker.url, job, devices, out, data)
        if simulate:
            aggregator = [EDGE_FL, "simulate", *common, "--out", str(out), "--no-progress"]
        agg = subprocess.Popen(aggregator, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        procs.append(agg)
        for i in range(0 if simulate else shards):
            fleet = [EDGE_FL, "fleet", *common, "--shard", f"{i}/{shards}"]
            procs.append(subprocess.Popen(fleet, stderr=subprocess.DEVNULL))
        t_connect = time.monotonic()
        wait(driver, lambda d: (page(d)["counts"].get("online") or 0) >= devices, 900)
        online_s = time.monotonic() - t_connect
        connect_rate = (relay(base, token) - relay0) / online_s
        chrome = driver.service.process.pid
        start = {"t": time.monotonic(), "page": page(driver), "relay": relay(base, token)}
        cpu0 = {"dashboard": cpu_s(dash.pid), "aggregator": cpu_s(agg.pid),
                "chromium": sum(cpu_s(p) for p in tree(chrome))}  # fmt: skip
        shot_taken = False
        agg_cpu = cpu0["aggregator"]
        while agg.poll() is None:
            agg_cpu = max(agg_cpu, cpu_s(agg.pid))  # /proc forgets it once it has exited
            now = page(driver)
            if shot is not None and not shot_taken and now["records"] >= 6:
                driver.save_screenshot(str(shot))
                shot_taken = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                agg.wait(timeout=1.0)
        end = {"t": time.monotonic(), "page": page(driver), "relay": relay(base, token)}
        cpu1 = {"dashboard": cpu_s(dash.pid), "aggregator": agg_cpu,
                "chromium": sum(cpu_s(p) for p in tree(chrome))}  # fmt: skip
        # the aggregator's CPU is read at exit: the last reading before it ended
        span = end["t"] - start["t"]
        rendered = end["page"]["rendered"] - start["page"]["rendered"]
        result = {
            "devices": devices,
            "online_after_s": round(online_s, 1),
            "window_s": round(span, 1),
            "rounds": end["page"]["records"],
            "page_updates_per_s": round(rendered / span, 2),
            "page_ms_per_update": round(
                (end["page"]["renderMs"] - start["page"]["renderMs"]) / max(rendered, 1), 2
            ),
            "relay_messages_per_s": round((end["relay"] - start["relay"]) / span, 1),
            "relay_messages_per_s_while_connecting": round(connect_rate, 1),
            "cpu_percent": {k: round(100 * (cpu1[k] - cpu0[k]) / span, 1) for k in cpu0},
            "load_average": os.getloadavg()[0],
        }
        print(json.dumps(result))
        return result
    finally:
        for proc in (*procs, dash):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        broker.stop()


def relay(base: str, token: Path) -> int:
    import urllib.request

    request = urllib.request.Request(
        base + "/api/view", headers={"Cookie": f"edgefl_dashboard={token.read_text()}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(json.loads(response.read())["relay"]["messages"])


def test_screenshot_live_fleet(browser, tmp_path: Path) -> None:  # noqa: F811
    devices = int(os.environ.get("EDGE_FL_DASH_DEVICES", "1000"))
    DOCS_IMG.mkdir(parents=True, exist_ok=True)
    run(browser, tmp_path, devices, DOCS_IMG / "dashboard-live.png", simulate=True)
    # and the finished run, from its directory
    token = tmp_path / "token"
    dash, base = start_dashboard([str(tmp_path / "run")], token)
    try:
        browser.get(f"{base}/?token={token.read_text()}")
        wait(browser, lambda d: page(d)["records"] > 0)
        wait(browser, lambda d: d.execute_script(  # per-device epsilon, replayed from the run
            "return [...document.querySelectorAll('#chart-eps .u-legend .u-label')]"
            ".some(e => e.textContent === 'device max')"))  # fmt: skip
        browser.save_screenshot(str(DOCS_IMG / "dashboard-run.png"))
    finally:
        dash.kill()
        dash.wait()


def test_responsive_with_many_devices(browser, tmp_path: Path) -> None:  # noqa: F811
    devices = int(os.environ.get("EDGE_FL_DASH_DEVICES", "10000"))
    result = run(browser, tmp_path, devices, None)
    assert result["page_updates_per_s"] > 0


def test_status_storm(browser, tmp_path: Path) -> None:  # noqa: F811
    """Every one of N devices comes online, then goes offline (last wills), as fast as one
    publisher can send: how fast the relay folds statuses, what the page renders meanwhile, and
    how long after the last status the page shows the final counts."""
    import paho.mqtt.client as paho

    from edge_fl.protocol.codec import encode_status
    from edge_fl.protocol.messages import Status
    from edge_fl.protocol.topics import Topics

    devices = int(os.environ.get("EDGE_FL_DASH_DEVICES", "10000"))
    broker = EmbeddedBroker(kind="mosquitto").start()
    token = tmp_path / "token"
    token.write_text("operator-token-for-the-bench-0123456789")
    topics = Topics("dash-storm")
    dash, base = start_dashboard(["--broker", broker.url, "--job", topics.job], token)
    host, port = broker.url.split("://", 1)[1].rsplit(":", 1)
    client = paho.Client(paho.CallbackAPIVersion.VERSION2)
    client.connect(host, int(port))
    client.loop_start()
    try:
        browser.get(f"{base}/?token={token.read_text()}")
        wait(browser, lambda d: d.execute_script("return document.body.dataset.connected")
             == "true")  # fmt: skip
        chrome = browser.service.process.pid
        results = []
        for online in (True, False):
            payloads = [
                (topics.status(f"d{i:05d}"), encode_status(Status(f"d{i:05d}", online, 30)))
                for i in range(devices)
            ]
            want = "online" if online else "offline"
            before = page(browser)
            relay0 = relay(base, token)
            cpu0 = (cpu_s(dash.pid), sum(cpu_s(p) for p in tree(chrome)))
            t0 = time.monotonic()
            infos = [client.publish(t, p, qos=1, retain=True) for t, p in payloads]
            for info in infos:
                info.wait_for_publish(60)
            sent = time.monotonic()
            wait(browser, lambda d: page(d)["counts"].get(want) == devices, 600)  # noqa: B023
            shown = time.monotonic()
            after = page(browser)
            cpu1 = (cpu_s(dash.pid), sum(cpu_s(p) for p in tree(chrome)))
            span = shown - t0
            results.append({
                "devices": devices,
                "storm": want,
                "publish_s": round(sent - t0, 2),
                "page_final_after_last_publish_s": round(shown - sent, 2),
                "relay_statuses_per_s": round((relay(base, token) - relay0) / span, 0),
                "page_updates_per_s": round((after["rendered"] - before["rendered"]) / span, 2),
                "page_ms_per_update": round(
                    (after["renderMs"] - before["renderMs"])
                    / max(after["rendered"] - before["rendered"], 1),
                    2,
                ),
                "cpu_percent": {
                    "dashboard": round(100 * (cpu1[0] - cpu0[0]) / span, 1),
                    "chromium": round(100 * (cpu1[1] - cpu0[1]) / span, 1),
                },
                "load_average": os.getloadavg()[0],
            })  # fmt: skip
            print(json.dumps(results[-1]))
        assert all(r["page_updates_per_s"] <= 5 for r in results)  # coalesced, not per message
    finally:
        client.loop_stop()
        client.disconnect()
        dash.kill()
        dash.wait()
        broker.stop()
