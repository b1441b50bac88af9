"""``edge-fl device``: one device agent (e.g. on a Raspberry Pi) that joins a job from the broker.

The whole command on a device is ``edge-fl device --broker URL --id ID [--data-dir DIR]``: the
job's settings come from the aggregator's signed job document (``edge_fl.device.join``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import click

from edge_fl.cli import configure_logging, fail

log = logging.getLogger("edge_fl.device")


def _local_settings(config: str | None, **flags: Any) -> dict[str, Any]:
    """This device's own settings: the flags over the optional device config file."""
    out: dict[str, Any] = {"url": None, "prefix": "edgefl", "id": None, "index": None}
    out |= {"data_dir": None, "public_key": None, "job": None}
    out |= {"device_keys": None, "signing_key": None}
    if config:
        from edge_fl.config import ConfigError, read_config_file

        try:
            raw = read_config_file(config)
        except ConfigError as exc:
            fail(str(exc))
        allowed = {"broker", "device", "security", "data", "job"}
        unknown = sorted(set(raw) - allowed)
        if unknown:
            fail(
                f"{config}: {', '.join(unknown)}: not a device setting (a device takes only "
                "broker, device, security.public_key, security.device_keys, data.data_dir and "
                "job; everything else "
                "comes from the aggregator's job document)"
            )
        broker, device = raw.get("broker") or {}, raw.get("device") or {}
        out |= {
            "url": broker.get("url"),
            "prefix": broker.get("prefix", "edgefl"),
            "id": device.get("id"),
            "index": device.get("index"),
            "data_dir": (raw.get("data") or {}).get("data_dir"),
            "public_key": (raw.get("security") or {}).get("public_key"),
            "device_keys": (raw.get("security") or {}).get("device_keys"),
            "signing_key": device.get("signing_key"),
            "job": raw.get("job"),
        }
    out |= {k: v for k, v in flags.items() if v is not None}
    return out


@click.command()
@click.option("--broker", "url", help="mqtt[s]://ID:PASSWORD@host:port[?ca=FILE]")
@click.option("--id", "device_id", help="this device's id = its MQTT username (e.g. d00007)")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    help="where this device's data files are (femnist/mnist; the bundled digits need none)",
)
@click.option(
    "--public-key", help="the aggregator's public key (hex, PEM or a file): verify what it sends"
)
@click.option(
    "--device-keys",
    help="secure aggregation: the devices' public signing keys (device-keys.json); sign this "
    "device's SecAgg+ messages and check its neighbours'",
)
@click.option(
    "--signing-key",
    type=click.Path(dir_okay=False),
    help="this device's private signing key (default: devices/<id>.key beside --device-keys)",
)
@click.option("--job", help="which job to join when the broker announces several")
@click.option("--prefix", help="topic prefix (default edgefl)")
@click.option("--index", type=int, help="this device's share of the dataset (default: from --id)")
@click.option("--config", type=click.Path(dir_okay=False), help="the same settings as a file")
@click.option("--wait", type=float, help="give up after this many seconds without a job")
@click.option(
    "--reproducible",
    is_flag=True,
    help="accept a job that asks for seeded, predictable noise (tests only; refused otherwise)",
)
@click.option(
    "--retry-forever",
    is_flag=True,
    help="retry also after an authentication or certificate refusal (for a system service)",
)
@click.option(
    "--secure-aggregation",
    "secure_aggregation",
    is_flag=True,
    help="join only a job that runs secure aggregation (the aggregator never sees this "
    "device's update alone)",
)
@click.option("-v", "--verbose", count=True)
def device(url, device_id, data_dir, public_key, job, prefix, index, config, wait, **kw) -> None:
    """Join the job announced on the broker and serve its rounds until it ends.

    Everything about the job (model, data, training, privacy) comes from the aggregator's job
    document, signed when it has a key: give --public-key to accept only that."""
    configure_logging(kw["verbose"] or 1)
    s = _local_settings(
        config,
        url=url,
        id=device_id,
        data_dir=data_dir,
        public_key=public_key,
        job=job,
        prefix=prefix,
        index=index,
        device_keys=kw["device_keys"],
        signing_key=kw["signing_key"],
    )
    if not s["url"]:
        fail("a device needs --broker URL (or broker.url in --config)")
    if not s["id"]:
        fail("which device is this? give --id (its MQTT username, e.g. d00007)")
    if s["signing_key"] and not s["device_keys"]:
        fail("--signing-key signs secure-aggregation messages only with --device-keys FILE")
    if s["device_keys"] and not s["public_key"]:
        fail(
            "--device-keys needs --public-key: an unsigned round could drop its secure "
            "parameters (this device's update in the clear) or lower its threshold"
        )
    from edge_fl.identity import device_index

    index = s["index"] if s["index"] is not None else device_index(s["id"])
    if index is None:
        fail(f"device id {s['id']!r} does not end in its index: give --index")
    s["reproducible"] = kw["reproducible"]
    s["secure_aggregation"] = kw["secure_aggregation"]
    try:
        sent = asyncio.run(_serve(s, index, kw["retry_forever"], wait))
    except RuntimeError as exc:
        fail(str(exc))
    click.echo(f"device {s['id']}: {sent} updates sent", err=True)
    sys.exit(0)


async def _serve(s: dict[str, Any], index: int, retry_forever: bool, wait: float | None) -> int:
    from edge_fl.device.runtime import run_device
    from edge_fl.transport.url import parse_broker_url

    try:
        spec = parse_broker_url(s["url"])
        spec.tls_context()  # a missing or unreadable TLS file: said now, not on first connect
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    verifier = None
    if s["public_key"]:
        from edge_fl.protocol.signing import SigningKeyError, load_verifier

        try:
            verifier = load_verifier(s["public_key"])
        except (SigningKeyError, OSError) as exc:
            raise RuntimeError(f"--public-key: {exc}") from None
    else:
        log.warning(
            "no --public-key: this device cannot tell the aggregator's job and models from a "
            "forgery by anyone who may publish on the broker"
        )
    keys = _device_keys(s) if s["device_keys"] else None  # before connecting: said at once
    doc = await _fetch(spec, s, verifier, retry_forever, wait)
    local = {
        "broker": {"url": s["url"], "prefix": s["prefix"]},
        # device keys: the job is calibrated as its aggregator's is (2t > k)
        "security": {"public_key": s["public_key"], "device_keys": s["device_keys"]},
        "device": {"id": s["id"], "index": index},
        "data_dir": s["data_dir"],
    }
    job = join_job(doc, local, index, reproducible=s.get("reproducible", False))
    cfg = job.cfg
    if s.get("secure_aggregation") and not cfg.secure_aggregation.enabled:
        raise RuntimeError(
            f"job {doc.job!r} does not run secure aggregation: refused (--secure-aggregation)"
        )
    _check_budget_support(job)
    agent = job.agent(index)
    agent.device_id = s["id"]
    if keys is not None:
        if agent.secure is None:
            raise RuntimeError("--device-keys: this job does not run secure aggregation")
        try:
            agent.secure = agent.secure.signed(s["id"], *keys)
        except ValueError as exc:
            raise RuntimeError(f"--device-keys: {exc}") from None
    log.info(
        "joined job %s (digest %s, %s, %s mechanism, %d examples)",
        doc.job,
        doc.digest,
        "signed" if doc.signed else "UNSIGNED",
        cfg.privacy.mechanism,
        agent.n_samples,
    )
    trust = job.trust()
    trust.bind_run(doc.run)  # the run it joined: another run's messages are replays
    return await run_device(
        agent, spec, job.topics, doc.digest, trust=trust, retry_forever=retry_forever
    )


def join_job(doc: Any, local: dict[str, Any], index: int, *, reproducible: bool = False) -> Any:
    """The job this device runs from the aggregator's document ``doc`` (an
    ``edge_fl.job.Job``); RuntimeError (one line) if the device cannot take part.

    The same checks the aggregator's own build made (``edge_fl.job.build_job``, on the same
    values), so a device accepts every document its aggregator accepted, except what is the
    device's own to refuse: predictable noise (``reproducible: true``) unless this device was
    started with ``--reproducible``, an index outside the job, and data it does not have."""
    from edge_fl.config import ConfigError
    from edge_fl.device.join import device_config
    from edge_fl.job import build_job

    if doc.config.get("reproducible") is True and not reproducible:
        raise RuntimeError(
            f"job {doc.job!r} asks for reproducible (seeded, predictable) noise, which anyone "
            "who reads its document could recompute: refused (start the device with "
            "--reproducible for a test)"
        )
    try:
        cfg = device_config(doc, local)
        if not 0 <= index < cfg.data.devices:
            raise RuntimeError(
                f"device index {index} is outside the job's [0, data.devices = {cfg.data.devices})"
            )
        return build_job(cfg, evaluates=False)
    except ConfigError as exc:
        raise RuntimeError(str(exc)) from None


async def _fetch(
    spec: Any, s: dict[str, Any], verifier: Any, retry_forever: bool, wait: Any
) -> Any:
    """The job document; broker trouble is retried with backoff like the rounds are."""
    from edge_fl.device.join import NoJob, fetch_job_document
    from edge_fl.device.runtime import retry_broker

    async def once() -> Any:
        return await fetch_job_document(
            spec,
            prefix=s["prefix"],
            job=s["job"],
            verifier=verifier,
            identifier=f"edgefl-join-{s['id']}",
            wait_s=wait,
        )

    try:
        return await retry_broker(spec, once, retry_forever=retry_forever)
    except NoJob as exc:
        raise RuntimeError(str(exc)) from None


def _check_budget_support(job: Any) -> None:
    """A budget is enforced by the device's own ledger, which needs dp-accounting: say so now,
    not at the first release."""
    if job.private and job.cfg.privacy.budget_epsilon is not None:
        try:
            import dp_accounting  # noqa: F401
        except ImportError:
            from edge_fl.privacy import ACCOUNTING_INSTALL_HINT

            raise RuntimeError(
                "this job sets privacy.budget_epsilon: the device's own ledger that enforces it "
                f"needs dp-accounting: {ACCOUNTING_INSTALL_HINT}"
            ) from None


def _device_keys(s: dict[str, Any]) -> tuple[Any, Any]:
    """(this device's signer, the directory) for --device-keys; RuntimeError in one line."""
    from pathlib import Path

    from edge_fl.protocol.device_keys import DeviceKeys, private_key_path
    from edge_fl.protocol.signing import Signer

    key = s["signing_key"] or private_key_path(Path(s["device_keys"]).parent, s["id"])
    try:
        keys = DeviceKeys.load(s["device_keys"])
    except ValueError as exc:  # SigningKeyError included
        raise RuntimeError(f"--device-keys: {exc}") from None
    try:
        signer = Signer.load(key)
    except ValueError as exc:
        raise RuntimeError(f"--signing-key {key}: {exc}") from None
    if s["id"] not in keys:
        raise RuntimeError(f"--device-keys: {s['id']} is not in {s['device_keys']}")
    if keys.key_of(s["id"]).hex() != signer.verifier.hex():
        raise RuntimeError(
            f"--signing-key {key}: not the key {s['device_keys']} lists for {s['id']}"
        )
    return signer, keys
