#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/evaluate.py (also installed as `captioner-evaluate`)."""
import sys

from captioner.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
