"""edge-fl's default job as a Flower app (tools/bench_flower.py)."""
