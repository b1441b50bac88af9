"""Privacy mechanisms, SignDS/MagRR, accounting and audits (pure, numpy + dp-accounting)."""

from edge_fl.privacy._dp import HINT as ACCOUNTING_INSTALL_HINT

__all__ = ["ACCOUNTING_INSTALL_HINT"]
