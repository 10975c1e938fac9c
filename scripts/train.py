#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/train.py (also installed as `captioner-train`)."""
import sys

from captioner.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
