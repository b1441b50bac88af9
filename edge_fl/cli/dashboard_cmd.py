"""``edge-fl dashboard``: serve the operator's page for a live job or a run directory."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
from pathlib import Path
from typing import Any

import click

from edge_fl.cli import fail

__all__ = ["dashboard"]


def _token(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        fail(f"--token-file {path}: {exc.strerror or exc}")
    if len(token) < 16 or any(c in token for c in " ;,\"'\\"):
        fail(f"--token-file {path}: the token must be 16+ characters without spaces or ;,\"'\\")
    return token


@click.command("dashboard")
@click.argument("run_dir", required=False, type=click.Path(path_type=Path, file_okay=False))
@click.option("--broker", "broker_url", help="mqtt[s]://user:pass@host:port (operator, read-only)")
@click.option("--job", help="job id (with --broker)")
@click.option("--prefix", default="edgefl", show_default=True, help="topic prefix (broker.prefix)")
@click.option("--port", type=int, default=8080, show_default=True, help="HTTP port (0: a free one)")
@click.option("--bind", default="127.0.0.1", show_default=True, help="listen address")
@click.option(
    "--token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="the operator token (default: a random one, printed in the URL)",
)
@click.option(
    "--public",
    is_flag=True,
    help="also serve viewers without the token: only what the metrics topic tells every device",
)
@click.option(
    "--max-rate", type=float, default=4.0, show_default=True, help="page updates per second"
)
def dashboard(
    run_dir: Path | None,
    broker_url: str | None,
    job: str | None,
    prefix: str,
    port: int,
    bind: str,
    token_file: Path | None,
    public: bool,
    max_rate: float,
) -> None:
    """Serve a live page of a job (--broker, --job) or of a run directory (RUN_DIR)."""
    from edge_fl.dashboard import Dashboard

    if (run_dir is None) == (broker_url is None):
        fail("give either RUN_DIR or --broker URL --job ID")
    if not 0 < max_rate <= 60:
        fail(f"--max-rate {max_rate:g}: must be in (0, 60]")
    options: dict[str, Any] = {"public": public, "max_rate": max_rate}
    token = _token(token_file)
    if token is not None:
        options["token"] = token
    if broker_url is not None:
        from edge_fl.transport.url import BrokerUrlError, parse_broker_url

        if not job:
            fail("--broker needs --job ID")
        try:
            parse_broker_url(broker_url).tls_context()
            board = Dashboard.live(broker_url, job, prefix, **options)
        except (BrokerUrlError, ValueError) as exc:
            fail(str(exc))
    else:
        assert run_dir is not None
        try:
            board = Dashboard.run_dir(run_dir, **options)
        except OSError as exc:
            fail(str(exc))

    async def main() -> None:
        started = asyncio.Event()
        serving = asyncio.create_task(board.serve(bind, port, started))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, serving.cancel)
        waiting = asyncio.create_task(started.wait())
        await asyncio.wait({serving, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            waiting.cancel()
            serving.result()  # the reason it could not start
            return
        host = f"[{bind}]" if ":" in bind else bind
        click.echo(f"dashboard at http://{host}:{board.port}/?token={board.token}", err=True)
        if public:
            click.echo(f"public view (no token) at http://{host}:{board.port}/", err=True)
        with contextlib.suppress(asyncio.CancelledError):
            await serving

    try:
        asyncio.run(main())
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            fail(f"port {port} on {bind} is already in use (--port 0 picks a free one)")
        fail(str(exc))
