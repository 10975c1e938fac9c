"""Measure how clearly the default attention overlay lights where each word looked (captioner/bench/overlay_contrast.py):
the mean luminance of the half-attention region over the rest, median and 10th percentile over the content words.

    .venv/bin/python -m captioner.cli.overlay_contrast                       # the first 8 coco-paired val photos
    .venv/bin/python -m captioner.cli.overlay_contrast photos/*.jpg --json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PAIRED = Path("../shared/data/coco-paired")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("photos", nargs="*", help="photos to measure (default: the first --count of coco-paired's val "
                                             "split, photos the bundled model did not train on)")
    p.add_argument("--paired", default=str(PAIRED), help="the coco-paired folder (images/, split_val.txt)")
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--checkpoint", default=None, help="model file (default: the bundled model)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return p


def _photos(args: argparse.Namespace) -> list[Path]:
    if args.photos:
        return [Path(p) for p in args.photos]
    root = Path(args.paired)
    names = sorted((root / "split_val.txt").read_text().split())[: args.count]
    return [root / "images" / n for n in names]


def main(argv: list[str] | None = None) -> int:
    import captioner
    from captioner.bench.overlay_contrast import measure
    from captioner.images import load_image

    args = _parser().parse_args(argv)
    try:
        paths = _photos(args)
        images = [load_image(p) for p in paths]
        loaded = captioner.load(args.checkpoint)
    except (OSError, captioner.ImageError, captioner.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary, per_photo = measure(loaded, images)
    if args.json:
        print(json.dumps({**summary.__dict__, "photos": {p.name: words for p, words in zip(paths, per_photo)}}))
        return 0
    for path, words in zip(paths, per_photo):
        print(f"{path.name}: " + "  ".join(f"{w} {c:.2f}" for w, c in words))
    print(f"contrast of the half-attention region over the rest, {summary.words} content words of {len(paths)} "
          f"photos: median {summary.median:.2f}, 10th percentile {summary.p10:.2f} (the region: median "
          f"{summary.median_region:.0%} of the photo)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
