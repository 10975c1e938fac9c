#!/usr/bin/env python
"""Download COCO 2014 (train2014, val2014, the caption annotations) and Karpathy's split file into the layout
configs/coco_resnet101.yaml reads (captioner/data/download.py):

    python scripts/download_coco.py --dest data/coco --dry-run     # print what it would fetch, and from where
    python scripts/download_coco.py --dest data/coco               # about 19 GB; rerun after a break to resume

Each file resumes where it stopped, is checked against its published MD5 (the split file has none) and is
unpacked; the zips are deleted after unpacking unless --keep-zips.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from captioner.data.download import fetch_all, plan

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", default="data/coco", help="where train2014/, val2014/, annotations/ and "
                   "dataset_coco.json go (default: data/coco, the recipe's data.images)")
    p.add_argument("--dry-run", action="store_true", help="only print the URLs, checksums and what is already there")
    p.add_argument("--keep-zips", action="store_true", help="keep the downloaded zips after unpacking them")
    args = p.parse_args(argv)
    dest = Path(args.dest)
    for line in plan(dest):
        print(line, flush=True)
    if args.dry_run:
        return 0
    try:
        fetch_all(dest, lambda m: print(m, flush=True), keep_zips=args.keep_zips)
    except KeyboardInterrupt:
        print("\nSIGINT: stopped; rerun the same command to resume the download.", file=sys.stderr)
        return 130
    except ValueError as e:  # a checksum that does not match
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # no network, a server error, a full disk
        print(f"error: {e}; rerun the same command to resume.", file=sys.stderr)
        return 1
    print(f"done: {dest}. Next: captioner-prepare --config configs/coco_resnet101.yaml --set data.images={dest} "
          f"data.annotations={dest / 'dataset_coco.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
