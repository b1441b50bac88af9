"""Per-device broker credentials: the file `broker/mint-credentials.sh` prints.

One line per MQTT user, ``NAME<TAB>URL`` (``mqtts://NAME:PASSWORD@HOST:PORT?ca=PATH``). A simulated
fleet on a secured broker needs one user per device: the ACL lets a device write only its own
update topic and the broker allows one connection per username, so devices sharing a user would
forge each other's updates or kick each other off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from edge_fl.transport.url import BrokerSpec, parse_broker_url


class CredentialsError(ValueError):
    """A credentials file that cannot serve the devices asked of it (one line, for the CLI)."""


def read_credentials(path: str | Path) -> dict[str, BrokerSpec]:
    """Parse a credentials file into {name: spec}; blank lines and ``#`` comments are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialsError(f"credentials file {path}: {exc.strerror or exc}") from None
    users: dict[str, BrokerSpec] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, url = line.partition("\t")
        if not sep:
            name, _, url = line.partition(" ")
        name, url = name.strip(), url.strip()
        where = f"credentials file {path}, line {number}"
        if not name or not url:
            raise CredentialsError(f"{where}: expected NAME<TAB>URL (mint-credentials.sh output)")
        try:
            spec = parse_broker_url(url)
        except ValueError as exc:
            raise CredentialsError(f"{where}: {exc}") from None
        if spec.username is None or spec.password is None:
            raise CredentialsError(f"{where}: the URL of {name!r} has no username and password")
        if name in users:
            raise CredentialsError(f"{where}: {name!r} appears twice")
        users[name] = spec
    if not users:
        raise CredentialsError(f"credentials file {path}: no NAME<TAB>URL lines")
    return users


def device_specs(
    users: dict[str, BrokerSpec],
    devices: Iterable[str],
    base: BrokerSpec | None = None,
    *,
    source: str = "the credentials file",
) -> dict[str, BrokerSpec]:
    """The spec each device connects with: its own username and password, and the host, port
    and TLS settings of ``base`` (the --broker URL) when given, else those of its line.

    Raises CredentialsError naming the first missing devices."""
    devices = list(devices)
    missing = [d for d in devices if d not in users]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CredentialsError(
            f"{source} has no line for {len(missing)} of {len(devices)} devices: {shown} "
            "(mint them: broker/mint-credentials.sh -n COUNT)"
        )
    if base is None:
        return {d: users[d] for d in devices}
    return {
        d: dataclasses.replace(base, username=users[d].username, password=users[d].password)
        for d in devices
    }


def without_user(spec: BrokerSpec) -> BrokerSpec:
    """The spec's host, port and TLS settings, with no credentials."""
    return dataclasses.replace(spec, username=None, password=None)
