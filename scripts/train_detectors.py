#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/train_detectors.py (also installed as `captioner-train-detectors`)."""
import sys

from captioner.cli.train_detectors import main

if __name__ == "__main__":
    sys.exit(main())
