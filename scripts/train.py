#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/train.py (also installed as `captioner-train`)."""
import sys

try:
    from captioner.cli.train import main
except KeyboardInterrupt:  # a Ctrl-C in the first milliseconds, before the command's own handler is installed
    print("\nSIGINT: stopped while starting, before any training. Rerun the same command to resume.", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())
