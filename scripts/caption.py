#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/caption.py (also installed as `captioner-caption`)."""
import sys

from captioner.cli.caption import main

if __name__ == "__main__":
    sys.exit(main())
