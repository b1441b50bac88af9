"""Run the pure-Python amqtt broker as its own process: `python -m edge_fl.transport.amqtt_server`.

Only the fallback for machines without a Mosquitto binary. It runs in a separate process so its
CPU cost (20-40x Mosquitto per message) does not steal the GIL from the simulation that uses it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys


def broker_config(host: str, port: int) -> dict[str, object]:
    """A minimal amqtt config: one TCP listener, anonymous access, no $SYS and packet logging."""
    return {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}", "max_connections": 0}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }


async def serve(host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT, then shut down so connected clients see a clean close."""
    from amqtt.broker import Broker  # imported late: it is slow to import and optional

    broker = Broker(broker_config(host, port))
    await broker.start()
    print(f"amqtt listening on {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await broker.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(serve(args.host, args.port))
    except Exception as exc:  # BrokerError wrapping EADDRINUSE; the launcher reads the log
        print(f"amqtt failed to listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
