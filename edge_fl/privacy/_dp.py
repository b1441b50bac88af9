"""dp-accounting, imported on first use.

The device half of every mechanism (clip, noise, sign, vote) needs only numpy; dp-accounting, and
the scipy it pulls in (~100 MB), is needed only to account. Importing it here, lazily, keeps the
base install (``pip install edge-fl``, the device agent) light; the ``server`` and
``accounting`` extras bring it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

HINT = (
    "pip install 'edge-fl[accounting]' (or 'edge-fl[server]'; from a checkout: pip install -e "
    "'.[server]')"
)


class AccountingUnavailable(ImportError):
    """dp-accounting is not installed, and something asked for privacy accounting."""


def available() -> bool:
    """Whether dp-accounting can be imported here (looked up, not imported)."""
    from importlib.util import find_spec

    try:
        return find_spec("dp_accounting") is not None
    except ImportError:  # a finder that refuses it outright
        return False


def events() -> ModuleType:
    """``dp_accounting.dp_event``."""
    try:
        from dp_accounting import dp_event
    except ImportError as exc:
        raise AccountingUnavailable(f"privacy accounting needs dp-accounting: {HINT}") from exc
    return dp_event


def relation(name: str) -> Any:
    """``dp_accounting.NeighboringRelation[name]``."""
    events()
    from dp_accounting.privacy_accountant import NeighboringRelation

    return NeighboringRelation[name]
