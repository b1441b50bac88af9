"""Privacy mechanisms, SignDS/MagRR, accounting and audits (pure, numpy + dp-accounting)."""

from edge_fl.privacy._dp import HINT as ACCOUNTING_INSTALL_HINT
from edge_fl.privacy._dp import AccountingUnavailable
from edge_fl.privacy._dp import available as accounting_available

__all__ = ["ACCOUNTING_INSTALL_HINT", "AccountingUnavailable", "accounting_available"]
