#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/export.py (also installed as `captioner-export`)."""
import sys

from captioner.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
