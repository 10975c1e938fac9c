#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/benchmark.py (also installed as `captioner-benchmark`)."""
import sys

from captioner.cli.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
