#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/train_lm.py (also installed as `captioner-train-lm`)."""
import sys

from captioner.cli.train_lm import main

if __name__ == "__main__":
    sys.exit(main())
