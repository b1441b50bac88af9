"""Privacy mechanisms, SignDS/MagRR, accounting and audits (pure, numpy + dp-accounting)."""
