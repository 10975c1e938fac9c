"""Caption images with a trained model (default: the bundled one).

    python scripts/caption.py photo.jpg other.png [--beam-size 3] [--json] [--attention-dir out/]
    python scripts/caption.py photos/ [--recursive] [--batch-size 16] [--json [--maps]]

A FOLDER argument stands for its images (.jpg .jpeg .png .webp .gif .bmp, sorted by path; --recursive
includes subfolders). Images are loaded by a small thread pool, one batch ahead, while the model
captions the previous batch (caption_batch, --batch-size images at a time).

Decode settings left out are the model file's own (its config.decode); --decode KEY=VALUE sets any of
them. Every setting in use is printed on stderr (with --json: recorded in every line). A --json line
carries image, caption, words, word_log_probs and word_probs (each word's probability under the
model), betas (each word's gate), log_prob and every decode setting; --maps adds the attention maps.

Unreadable images get a message on stderr and a non-zero exit code; the others are still captioned.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp")
LOAD_THREADS = 2


def expand_inputs(inputs: list[str], recursive: bool = False) -> list[str]:
    """Files as given; each folder -> its images sorted by path (subfolders too when recursive)."""
    out: list[str] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = p.rglob("*") if recursive else p.iterdir()
            out += sorted(str(f) for f in found if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
        else:
            out.append(item)
    return out


def _load(path: str) -> tuple[str, Any]:
    """(path, PIL image) or (path, ImageError): a bad file is reported, never raised, from a worker."""
    from captioner.images import ImageError, load_image

    try:
        return path, load_image(path)
    except ImageError as e:
        return path, e


def loaded_batches(paths: list[str], batch_size: int, threads: int = LOAD_THREADS) -> Iterator[list[tuple[str, Any]]]:
    """Batches of (path, image or ImageError), in order; the next batch loads while the caller
    works on this one, and at most two batches of images are held at a time."""
    with ThreadPoolExecutor(threads) as pool:
        pending = [pool.submit(_load, p) for p in paths[:batch_size]]
        for k in range(0, len(paths), batch_size):
            following = [pool.submit(_load, p) for p in paths[k + batch_size:k + 2 * batch_size]]
            yield [f.result() for f in pending]
            pending = following


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    import captioner
    from captioner.cli.decode_options import add_decode_options

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("images", nargs="+", metavar="IMAGE_OR_FOLDER")
    p.add_argument("--recursive", action="store_true", help="include images in subfolders of a FOLDER")
    p.add_argument("--batch-size", type=int, default=16, help="images captioned together (default 16)")
    p.add_argument("--checkpoint", default=None, help="model file (default: the bundled model)")
    add_decode_options(p)
    p.add_argument("--json", action="store_true", help="one JSON object per image: image, caption, words, "
                   "word_log_probs, word_probs, betas, log_prob and every decode setting used")
    p.add_argument("--maps", action="store_true", help="with --json: add each word's attention map (alphas)")
    p.add_argument("--attention-dir", default=None, help="write an attention overlay figure (PNG) per image here")
    p.add_argument("--device", default=captioner.default_device(), help="cpu, cuda, cuda:1 ... "
                   "(default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32",
                   help="compute type (auto: bfloat16 where the CPU/GPU computes it natively, 2-3x faster)")
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[Any, dict[str, Any]] | None:
    """The model and the decode settings in use, or None after printing why not (exit code 2)."""
    import captioner
    from captioner.cli.decode_options import decode_settings, describe

    if (args.beam_size is not None and args.beam_size < 1) or (args.max_len is not None and args.max_len < 1) \
            or args.batch_size < 1:
        print("error: --beam-size, --max-len and --batch-size must be at least 1", file=sys.stderr)
        return None
    try:
        dtype = captioner.preferred_dtype(args.device) if args.dtype == "auto" else args.dtype
        model = captioner.load(args.checkpoint, device=args.device, dtype=dtype)
        used = decode_settings(model, args)
    except (captioner.CheckpointError, OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    print(f"decoding with {describe(used)}", file=sys.stderr)
    return model, dataclasses.asdict(used)


def emit(args: argparse.Namespace, path: str, img: Any, cap: Any, settings: dict[str, Any]) -> None:
    """Print one image's line (text or JSON) and write its figure when asked."""
    if args.json:
        print(json.dumps(cap.to_dict(path, settings, maps=args.maps)), flush=True)
    else:
        print(f"{path}\t{cap.text}", flush=True)
    if args.attention_dir:
        from captioner.ui.visualize import attention_figure, figure_png

        out_dir = Path(args.attention_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / (Path(path).stem + "_attention.png")).write_bytes(figure_png(attention_figure(img, cap)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ready = setup(args)
    if ready is None:
        return 2
    model, settings = ready
    paths = expand_inputs(args.images, args.recursive)
    failed = 0
    for batch in loaded_batches(paths, args.batch_size):
        good = [(path, img) for path, img in batch if not isinstance(img, Exception)]
        for path, err in batch:
            if isinstance(err, Exception):
                print(f"error: {err}", file=sys.stderr)
                failed += 1
        caps = model.caption_batch([img for _, img in good], **settings) if good else []
        for (path, img), cap in zip(good, caps):
            emit(args, path, img, cap, settings)
    if not paths:
        print("error: no images found (folders are searched for "
              f"{' '.join(IMAGE_EXTENSIONS)}; --recursive for subfolders)", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
