"""Caption images with a trained model (default: the bundled one).

    captioner-caption photo.jpg other.png [--beam-size 3] [--json] [--attention-dir out/] [--animate anim/]
    captioner-caption photos/ [--recursive] [--batch-size 16] [--json [--maps]]
    captioner-caption photo.jpg --explain "a dog runs on the grass" [--json]
    captioner-caption photo.jpg --sample 5 [--temperature 0.6] [--top-k 0] [--top-p 0.9] [--seed 0] [--json]

A FOLDER argument stands for its images (every format the parser reads: images.FORMATS, sorted by path;
--recursive includes subfolders). Images are loaded by a small thread pool, one batch ahead, while the model
captions the previous batch (caption_batch, --batch-size images at a time).

Decode settings left out are the model file's own (its config.decode); --decode KEY=VALUE sets any of
them. Every setting in use is printed on stderr (with --json: recorded in every line). A --json line
carries image, caption, words, word_log_probs and word_probs (each word's probability under the
model), betas (each word's gate), log_prob and every decode setting; --maps adds the attention maps.

Unreadable images get a message on stderr and a non-zero exit code; the others are still captioned.
--attention-dir writes one figure per image and --animate one animation (a frame per word), never two to
one file (see their help), and marks the folder so that a later --recursive search does not read them as photos.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from captioner.cli.inputs import (FIGURE_MARK, figure_paths, find_images, image_extensions, loaded_batches,
                                  unsearched_subfolders)
from captioner.cli.sample_options import add_sample_options, numbered, request_samples, sample_request, sampling_line


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
    p.add_argument("--explain", default=None, metavar="SENTENCE",
                   help="instead of captioning, explain this sentence on each image (Captioner.explain): each word's "
                   "probability and attention; a sentence with no words is an error")
    add_sample_options(p)
    p.add_argument("--attention-dir", default=None, help="write an attention overlay figure (PNG) per image here: "
                   "NAME_attention.png, a FOLDER's subfolders mirrored (x.jpg and x.png: x.jpg_attention.png, "
                   "x.png_attention.png); later folder searches skip this folder")
    p.add_argument("--animate", default=None, metavar="DIR", help="write the caption as it is written per image "
                   "here: NAME_caption.gif, a frame per word with its attention (folders mirrored as --attention-dir)")
    p.add_argument("--device", default=captioner.default_device(), help="cpu, cuda, cuda:1 ... "
                   "(default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32",
                   help="compute type (auto: bfloat16 where the CPU/GPU computes it natively, 2-3x faster)")
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[Any, dict[str, Any]] | None:
    """The model and the decode settings in use, or None after printing why not (exit code 2)."""
    import captioner
    from captioner.cli.decode_options import decode_settings, describe, has_memory

    if args.batch_size < 1:  # --beam-size and --max-len: checked with every decode setting (DecodeConfig.checked)
        print("error: --batch-size must be at least 1", file=sys.stderr)
        return None
    try:
        request = sample_request(args)
        dtype = captioner.preferred_dtype(args.device) if args.dtype == "auto" else args.dtype
        loaded = captioner.load(args.checkpoint, device=args.device, dtype=dtype)
        used = decode_settings(loaded, args)
    except (captioner.CheckpointError, OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    if request is not None:
        print(sampling_line(request, describe(used, sampling=True)), file=sys.stderr)
    elif args.explain is None:
        print(f"decoding with {describe(used, consensus=has_memory(loaded))}", file=sys.stderr)
        if not used.confidence_fitted:
            print("note: this model file has no fitted confidence map: captions carry no confidence "
                  "(captioner-fit-selector --confidence fits one)", file=sys.stderr)
    else:  # nothing is decoded: the sentence is scored word by word (teacher forcing)
        print(f"explaining the sentence (teacher forcing, hard_context {used.hard_context}); nothing is decoded",
              file=sys.stderr)
    return loaded, dataclasses.asdict(used)


def sure_column(cap: Any) -> str:
    """The text line's last column: "sure 0.87", or "unsure 0.31 (why)"; nothing without a confidence."""
    if cap.confidence is None:
        return ""
    return f"\tsure {cap.confidence:.2f}" if cap.sure else f"\tunsure {cap.confidence:.2f} ({cap.doubt})"


def emit(args: argparse.Namespace, path: str, img: Any, cap: Any, settings: dict[str, Any],
         figure: Path | None = None, animation: Path | None = None) -> None:
    """Print one image's line (text or JSON) and write its figure (when asked) to `figure`. An explained
    sentence's text line adds its log-probability and each word's probability (unknown words marked)."""
    import numpy as np

    if args.json:
        print(json.dumps(cap.to_dict(path, maps=args.maps)), flush=True)  # its own settings and model file
    elif args.explain is not None:
        words = " ".join(f"{w}{'(unk)' if i in cap.unknown else ''}={np.exp(lp):.3f}"
                         for i, (w, lp) in enumerate(zip(cap.words, cap.word_log_probs)))
        print(f"{path}\t{cap.text}\tlog_prob {cap.log_prob:.2f}\t{words}", flush=True)
    elif "sample" in cap.settings:
        print(f"{path}\tsample {cap.settings['sample']['index'] + 1}\t{cap.text}", flush=True)
    else:
        print(f"{path}\t{cap.text}{sure_column(cap)}", flush=True)
    if not args.json:  # the JSON carries them; beside the text line they go to stderr, as the command's other notes
        for note in cap.notes:  # e.g. a photo far smaller than the model's input, or shrunk on reading
            print(f"note: {path}: {note}", file=sys.stderr, flush=True)
    if figure is not None:
        from captioner.ui.visualize import attention_figure, figure_png

        figure.parent.mkdir(parents=True, exist_ok=True)
        figure.write_bytes(figure_png(attention_figure(img, cap)))
    if animation is not None:
        from captioner.ui.animate import caption_animation

        animation.parent.mkdir(parents=True, exist_ok=True)
        animation.write_bytes(caption_animation(img, cap))


def plan(args: argparse.Namespace) -> tuple[list[str], dict[str, Path], dict[str, Path]] | None:
    """(the images to caption, image -> figure path, image -> animation path), or None after printing why
    not. The figure folders are marked (FIGURE_MARK) so that a later folder search skips them."""
    try:
        found, skipped = find_images(args.images, args.recursive, args.attention_dir)
        figures = figure_paths(found, args.attention_dir) if args.attention_dir else {}
        animations = figure_paths(found, args.animate, "_caption.gif") if args.animate else {}
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    for folder in skipped:
        print(f"note: skipping {folder}: a figure folder (--attention-dir), not input", file=sys.stderr)
    if not args.recursive:
        for item in args.images:
            subs = unsearched_subfolders(Path(item))
            if subs:
                print(f"note: {item} has {len(subs)} subfolder(s) that were not searched ({', '.join(subs[:3])}"
                      f"{' ...' if len(subs) > 3 else ''}): add --recursive to caption their images too",
                      file=sys.stderr)
    for out in (args.attention_dir, args.animate):
        if out and found:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / FIGURE_MARK).write_text("figures written by captioner-caption; folder searches skip this "
                                                 "folder\n")
    return [path for path, _ in found], figures, animations


def describe(loaded: Any, images: list[Any], settings: dict[str, Any], sentence: str | None,
             request: Any = None) -> list[list[Any]]:
    """Each image's captions: one decoded, --sample's drawn ones, or (--explain) the sentence explained on it."""
    if request is not None:
        return [request_samples(p, request, settings) for p in loaded.read_batch(images)]
    if sentence is None:
        return [[c] for c in loaded.caption_batch(images, **settings)] if images else []
    return [[loaded.explain(img, sentence, hard_context=settings["hard_context"])] for img in images]


def check_sentence(loaded: Any, sentence: str | None) -> bool:
    """--explain: False after printing why a sentence cannot be explained. Its unknown words are noted once,
    with each photo's line (the Caption's notes: emit)."""
    if sentence is None:
        return True
    from captioner.decoding.explain import NoWordsError, sentence_words

    try:
        sentence_words(sentence)
    except NoWordsError as e:
        print(f"error: --explain: {e}", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    from captioner.cli import torchvision_refused

    args = parse_args(argv)
    if torchvision_refused():
        return 2
    ready = setup(args)
    planned = plan(args) if ready is not None and check_sentence(ready[0], args.explain) else None
    if planned is None:
        return 2
    loaded, settings = ready
    request = sample_request(args)  # checked by setup
    paths, figures, animations = planned
    failed = 0
    for batch in loaded_batches(paths, args.batch_size):
        good = [(path, img) for path, img in batch if not isinstance(img, Exception)]
        for path, err in batch:
            if isinstance(err, Exception):
                print(f"error: {err}", file=sys.stderr)
                failed += 1
        caps = describe(loaded, [img for _, img in good], settings, args.explain, request)
        for (path, img), image_caps in zip(good, caps):
            for i, cap in enumerate(image_caps, 1):
                emit(args, path, img, cap, settings, *numbered([figures.get(path), animations.get(path)], i, request))
    if not paths:
        print("error: no images found (folders are searched for "
              f"{' '.join(image_extensions())}; --recursive for subfolders)", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
