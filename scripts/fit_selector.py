#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/fit_selector.py (also installed as `captioner-fit-selector`)."""
import sys

from captioner.cli.fit_selector import main

if __name__ == "__main__":
    sys.exit(main())
