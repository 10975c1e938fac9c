"""Caption images with a trained model (default: the bundled one).

    python scripts/caption.py photo.jpg other.png [--beam-size 3] [--json] [--attention-dir out/]

Decode settings left out are the model file's own (its config.decode); --decode KEY=VALUE sets any of
them. Every setting in use is printed on stderr (with --json: recorded in every line).

Unreadable images get a message on stderr and a non-zero exit code; the others are still captioned.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import captioner
    from captioner.cli.decode_options import add_decode_options, decode_settings, describe
    from captioner.images import load_image

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("images", nargs="+", metavar="IMAGE")
    p.add_argument("--checkpoint", default=None, help="model file (default: the bundled model)")
    add_decode_options(p)
    p.add_argument("--json", action="store_true", help="one JSON object per image: image, caption, log_prob and "
                   "every decode setting used")
    p.add_argument("--attention-dir", default=None, help="write an attention overlay figure (PNG) per image here")
    p.add_argument("--device", default=captioner.default_device(), help="cpu, cuda, cuda:1 ... "
                   "(default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32",
                   help="compute type (auto: bfloat16 where the CPU/GPU computes it natively, 2-3x faster)")
    args = p.parse_args(argv)
    if (args.beam_size is not None and args.beam_size < 1) or (args.max_len is not None and args.max_len < 1):
        print("error: --beam-size and --max-len must be at least 1", file=sys.stderr)
        return 2
    try:
        dtype = captioner.preferred_dtype(args.device) if args.dtype == "auto" else args.dtype
        model = captioner.load(args.checkpoint, device=args.device, dtype=dtype)
    except (captioner.CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        used = decode_settings(model, args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    settings = dataclasses.asdict(used)
    print(f"decoding with {describe(used)}", file=sys.stderr)

    failed = 0
    good: list[tuple[str, object]] = []
    for path in args.images:
        try:
            good.append((path, load_image(path)))
        except captioner.ImageError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
    caps = model.caption_batch([img for _, img in good], **settings) if good else []
    out_dir = Path(args.attention_dir) if args.attention_dir else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    for (path, img), cap in zip(good, caps):
        if args.json:
            print(json.dumps({"image": path, "caption": cap.text, "log_prob": cap.log_prob, **settings}), flush=True)
        else:
            print(f"{path}\t{cap.text}", flush=True)
        if out_dir:
            from captioner.visualize import attention_figure, figure_png

            target = out_dir / (Path(path).stem + "_attention.png")
            target.write_bytes(figure_png(attention_figure(img, cap)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
