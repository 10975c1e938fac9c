"""Speed measurements behind scripts/benchmark.py (see captioner/cli/benchmark.py)."""
