#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/build_consensus.py (also installed as `captioner-build-consensus`)."""
import sys

from captioner.cli.build_consensus import main

if __name__ == "__main__":
    sys.exit(main())
