#!/usr/bin/env python
"""Thin wrapper: see captioner/cli/download_coco.py (also installed as `captioner-download-coco`)."""
import sys

from captioner.cli.download_coco import main

if __name__ == "__main__":
    sys.exit(main())
