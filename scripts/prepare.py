#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/prepare.py (also installed as `captioner-prepare`)."""
import sys

from captioner.cli.prepare import main

if __name__ == "__main__":
    sys.exit(main())
