"""Wire bytes of a real job against the broker's $SYS counters and a loopback packet capture.

    .venv/bin/python tools/bench_wire.py                     # plain and TLS, 5 devices, 3 rounds
    .venv/bin/python tools/bench_wire.py --devices 20 --rounds 5 --tls only
    .venv/bin/python tools/bench_wire.py --codecs             # wire bytes per round per codec

One process runs a private Mosquitto (``sys_interval 1``), the aggregator, the fleet (every device
receiving the model on its own session, so everything is measured) and an observer subscribed to
``$SYS/broker/bytes/+``. ``tcpdump`` (root) captures the broker port on ``lo``. Compared:

* MQTT layer: every paho client of the process (``edge_fl.transport.wire.PROCESS``) against the
  broker's ``$SYS/broker/bytes/received`` / ``sent`` (the observer's own traffic is in both).
* TCP payload and IP bytes: the link model (loopback MSS 65,483) against the capture.

The helpers (``Capture``, ``read_pcap``, ``measure``) are used by ``tests/test_wire_bytes.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
LOOPBACK_MSS = 65_483  # lo MTU 65,536 - 20 IPv4 - 20 TCP - 12 timestamps (Linux advmss)


# ---------------------------------------------------------------------------------- capture


def capture_unavailable() -> str | None:
    """Why a loopback capture cannot run here, or None."""
    if shutil.which("tcpdump") is None:
        return "tcpdump not installed (apt-get install tcpdump)"
    if os.geteuid() != 0:
        return "capturing on lo needs root"
    return None


def read_pcap(path: Path, port: int) -> dict[str, int]:
    """TCP payload and whole-IP bytes per direction of a classic pcap (Linux ``lo``: Ethernet
    link type) for the broker ``port``: up = to the broker, down = from it."""
    data = path.read_bytes()
    if len(data) < 24:
        return dict.fromkeys(("up_tcp", "down_tcp", "up_ip", "down_ip", "up_n", "down_n"), 0)
    magic = struct.unpack("<I", data[:4])[0]
    endian = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
    linktype = struct.unpack(endian + "I", data[20:24])[0]
    link_header = {1: 14, 113: 16, 276: 20, 0: 4}[linktype]
    out = dict.fromkeys(("up_tcp", "down_tcp", "up_ip", "down_ip", "up_n", "down_n"), 0)
    pos = 24
    while pos + 16 <= len(data):
        _, _, incl, _ = struct.unpack(endian + "IIII", data[pos : pos + 16])
        frame = data[pos + 16 : pos + 16 + incl]
        pos += 16 + incl
        ip = frame[link_header:]
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
            continue
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[ihl:]
        sport, dport = struct.unpack("!HH", tcp[:4])
        payload = total - ihl - (tcp[12] >> 4) * 4
        side = "up" if dport == port else "down" if sport == port else None
        if side is None:
            continue
        out[f"{side}_tcp"] += payload
        out[f"{side}_ip"] += total
        out[f"{side}_n"] += 1
    return out


class Capture:
    """``tcpdump -i lo`` of one TCP port into a temp pcap (headers only: -s 128)."""

    def __init__(self, port: int, directory: Path) -> None:
        self.port = port
        self.path = directory / f"wire-{port}.pcap"
        self.proc: subprocess.Popen[bytes] | None = None
        self.result: dict[str, int] = {}

    def __enter__(self) -> Capture:
        err = self.path.with_suffix(".err")
        self._err = err.open("wb")
        self.proc = subprocess.Popen(
            [
                *("tcpdump", "-i", "lo", "-s", "128", "-U", "--immediate-mode", "-n"),
                *("-w", str(self.path), "tcp", "port", str(self.port)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._err,
        )
        deadline = time.monotonic() + 10
        while b"listening on" not in err.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tcpdump did not start: {err.read_text()}")
            time.sleep(0.02)
        time.sleep(0.5)  # "listening on" can precede the filter's attachment by a moment
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        time.sleep(0.3)  # the last FIN/ACKs
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()
        self.result = read_pcap(self.path, self.port)


# ---------------------------------------------------------------------------------- a job


def make_tls_files(directory: Path) -> Any:
    """CA and server certificate for 127.0.0.1 by the shipped make-certs.sh."""
    from edge_fl.transport.broker import ListenerTLS

    subprocess.run(
        [
            *("bash", str(REPO / "broker" / "make-certs.sh")),
            *("-o", str(directory), "localhost", "127.0.0.1"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return ListenerTLS(
        str(directory / "ca.crt"), str(directory / "server.crt"), str(directory / "server.key")
    )


class SysObserver:
    """Latest ``$SYS/broker/bytes/received`` and ``sent`` (its own packets are counted too)."""

    def __init__(self) -> None:
        from edge_fl.transport.wire import WireCounter

        self.values: dict[str, int] = {}
        self.updates = 0
        self.counter = WireCounter()
        self.task: asyncio.Task | None = None

    async def run(self, spec: Any) -> None:
        import aiomqtt

        from edge_fl.transport.wire import attach

        client = aiomqtt.Client(**spec.aiomqtt_kwargs(), identifier=f"sys-{uuid.uuid4().hex[:6]}")
        attach(client, self.counter)
        async with client:
            await client.subscribe("$SYS/broker/bytes/+", qos=0)
            async for message in client.messages:
                name = str(message.topic).rsplit("/", 1)[-1]
                self.values[name] = int(bytes(message.payload).decode())
                self.updates += 1

    async def next_update(self, timeout: float = 5.0) -> dict[str, int]:
        """Wait until the broker published both counters again (a fresh snapshot)."""
        start = self.updates
        deadline = time.monotonic() + timeout
        while self.updates < start + 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return dict(self.values)


def job_config(devices: int, rounds: int, **overrides: Any) -> Any:
    from edge_fl.config import load_config

    values = {
        "job": f"wire-{uuid.uuid4().hex[:8]}",
        "data.devices": devices,
        "data.dataset": "digits",
        "model.name": "mlp",
        "rounds.rounds": rounds,
        "rounds.clients_per_round": devices,
        **overrides,
    }
    return load_config(None, values)


@contextlib.contextmanager
def count_ingest_tap(tls: bool) -> Any:
    """The aggregator reads PUBLISH packets past paho (``service.IngestTap``): count what it
    diverts into ``wire.PROCESS`` too, so the process total is every byte the broker sent it."""
    from edge_fl.server import service
    from edge_fl.transport import wire

    tap = getattr(service, "IngestTap", None)
    if tap is None:
        yield
        return
    divert = tap._divert

    def counted(self: Any, start: int, end: int) -> bool:
        taken = divert(self, start, end)
        if taken:
            wire.PROCESS.received(end, tls)  # the buffer starts at the packet's first byte
        return taken

    tap._divert = counted
    try:
        yield
    finally:
        tap._divert = divert


async def _measure(cfg: Any, spec: Any, capture_dir: Path | None, device_downlink: bool) -> dict:
    from edge_fl.job import build_job
    from edge_fl.metrics import RunRecorder
    from edge_fl.simulation import run_job
    from edge_fl.transport import wire

    wire.install()
    link = wire.LinkModel(mss=LOOPBACK_MSS)
    wire.PROCESS.link = link  # segments are counted per write with the captured link's MSS
    observer = SysObserver()
    before = wire.PROCESS.totals()
    obs_task = asyncio.create_task(observer.run(spec))
    while not observer.values:  # the first $SYS snapshot: the observer is connected
        await asyncio.sleep(0.05)
        if obs_task.done():
            obs_task.result()
    job = build_job(cfg)
    recorder = RunRecorder(None)
    summary = await run_job(job, spec, recorder, link=link, device_downlink=device_downlink)
    await asyncio.sleep(0.3)  # the last DISCONNECTs reach the broker
    sys_values = await observer.next_update()
    process = {k: v - before[k] for k, v in wire.PROCESS.totals().items()}
    obs_task.cancel()
    with contextlib.suppress(BaseException):
        await obs_task
    return {
        "summary": summary,
        "records": recorder.records,
        "sys": sys_values,
        "process": process,
        "observer": observer.counter.totals(),
        "link": link,
    }


def measure(
    devices: int = 5,
    rounds: int = 3,
    *,
    tls: bool = False,
    capture: bool = True,
    device_downlink: bool = True,
    **overrides: Any,
) -> dict[str, Any]:
    """One job on a fresh broker with ``sys_interval 1`` (and a capture of its port): the
    process's MQTT counts, the broker's $SYS counters, the capture, the model's estimates."""
    from edge_fl.transport import wire
    from edge_fl.transport.broker import EmbeddedBroker
    from edge_fl.transport.url import parse_broker_url

    with tempfile.TemporaryDirectory(prefix="bench-wire-") as tmp:
        directory = Path(tmp)
        listener = make_tls_files(directory) if tls else None
        cfg = job_config(devices, rounds, **overrides)
        with EmbeddedBroker("mosquitto", tls=listener, extra_config=["sys_interval 1"]) as broker:
            spec = parse_broker_url(broker.url)
            cap = Capture(broker.port, directory) if capture else None
            with cap if cap is not None else contextlib.nullcontext(), count_ingest_tap(tls):
                out = asyncio.run(_measure(cfg, spec, directory, device_downlink))
            # the broker closes its sockets when it stops: not part of the compared traffic
        out["capture"] = cap.result if cap is not None else None
    process = out["process"]
    up_ip, down_ip = wire.ip_bytes(process, out["link"])
    out["estimate"] = {
        "up_tcp": process["up_tcp"],
        "down_tcp": process["down_tcp"],
        "up_ip": up_ip,
        "down_ip": down_ip,
    }
    out["tls"] = tls
    out["job"] = cfg.job
    return out


def ratios(out: dict[str, Any]) -> dict[str, float | None]:
    """Measured / reference ratios for the report and the tests."""
    p, s, c, e = out["process"], out["sys"], out["capture"], out["estimate"]
    r: dict[str, float | None] = {
        "mqtt_up_vs_sys_received": p["up"] / s["received"],
        "mqtt_down_vs_sys_sent": p["down"] / s["sent"],
    }
    if c is not None:
        r.update(
            {
                "tcp_up_vs_capture": e["up_tcp"] / c["up_tcp"],
                "tcp_down_vs_capture": e["down_tcp"] / c["down_tcp"],
                "ip_up_vs_capture": e["up_ip"] / c["up_ip"],
                "ip_down_vs_capture": e["down_ip"] / c["down_ip"],
            }
        )
    return r


def _report(out: dict[str, Any]) -> dict[str, Any]:
    s = out["summary"]
    return {
        "tls": out["tls"],
        "devices_wire": {k: s[k] for k in s if k.startswith("total_wire")},
        "payload": {"bytes_up": s["total_bytes_up"], "bytes_down": s["total_bytes_down"]},
        "process_mqtt": {"up": out["process"]["up"], "down": out["process"]["down"]},
        "sys": out["sys"],
        "capture": out["capture"],
        "estimate": out["estimate"],
        "ratios": {k: None if v is None else round(v, 4) for k, v in ratios(out).items()},
    }


def measure_handshake(repeat: int = 5) -> dict[str, float]:
    """TLS handshake bytes per direction of one client to the embedded broker: captured TCP
    payload of ``repeat`` connect/disconnects minus the MQTT packets' TLS records and the
    close_notify alerts (what ``LinkModel.tls_handshake_up``/``_down`` hold)."""
    import aiomqtt

    from edge_fl.transport import wire
    from edge_fl.transport.broker import EmbeddedBroker
    from edge_fl.transport.url import parse_broker_url

    wire.install()
    counter = wire.WireCounter(
        wire.LinkModel(mss=LOOPBACK_MSS, tls_handshake_up=0, tls_handshake_down=0)
    )

    async def sessions(spec: Any) -> None:
        for i in range(repeat):
            client = aiomqtt.Client(**spec.aiomqtt_kwargs(), identifier=f"hs-{i}")
            wire.attach(client, counter)
            async with client:
                pass

    with tempfile.TemporaryDirectory(prefix="bench-wire-") as tmp:
        listener = make_tls_files(Path(tmp))
        with EmbeddedBroker("mosquitto", tls=listener) as broker:
            spec = parse_broker_url(broker.url)
            with Capture(broker.port, Path(tmp)) as cap:
                asyncio.run(sessions(spec))
    c, n = counter.totals(), repeat
    # the counter's tcp figures hold the MQTT records and close_notify alerts only
    return {
        "tls_handshake_up": (cap.result["up_tcp"] - c["up_tcp"]) / n,
        "tls_handshake_down": (cap.result["down_tcp"] - c["down_tcp"]) / n,
        "mqtt_up_per_session": c["up"] / n,
        "mqtt_down_per_session": c["down"] / n,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tls", choices=("both", "only", "off"), default="both")
    ap.add_argument("--codecs", action="store_true", help="wire bytes per round per codec")
    ap.add_argument("--handshake", action="store_true", help="measure TLS handshake bytes")
    args = ap.parse_args()
    why = capture_unavailable()
    if why:
        print(f"no packet capture: {why}", file=sys.stderr)
    if args.handshake:
        if why:
            return 2
        print(json.dumps(measure_handshake()))
        return 0
    if args.codecs:
        return codecs_table(args.devices, args.rounds)
    modes = {"both": (False, True), "only": (True,), "off": (False,)}[args.tls]
    for tls in modes:
        out = measure(args.devices, args.rounds, tls=tls, capture=why is None)
        print(json.dumps(_report(out), indent=1))
    return 0


def codecs_table(devices: int, rounds: int) -> int:
    """Per device per round wire bytes (measured) beside comm-cost's prediction, per codec."""
    from edge_fl.cli.comm_cmds import wire_round_cost

    print("codec  payload_up  wire_up/dev/round  wire_down/dev/round  predicted up/down  ratio")
    for codec in ("f32", "f16", "q8", "q4", "topk"):
        out = measure(
            devices, rounds, capture=False, device_downlink=True, **{"compression.uplink": codec}
        )
        recs = out["records"][1:]  # round 1 also carries the connects
        up = sum(r["wire_up"] for r in recs) / (len(recs) * devices)
        down = sum(r["wire_down"] for r in recs) / (len(recs) * devices)
        payload = sum(r["bytes_up"] for r in recs) / (len(recs) * devices)
        n_params = out["summary"]["n_params"]
        job = out["summary"].get("job") or out["job"]
        pred = wire_round_cost(n_params, codec=codec, selected=devices, job=job)
        print(
            f"{codec:5s}  {payload:10.0f}  {up:17.0f}  {down:19.0f}  "
            f"{pred['up']:>8}/{pred['down']:<8}  {up / pred['up']:.4f}/{down / pred['down']:.4f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
