"""Caption images with a trained model (default: the bundled one).

    captioner-caption photo.jpg other.png [--beam-size 3] [--json] [--attention-dir out/] [--animate anim/]
    captioner-caption photos/ [--recursive] [--batch-size 16] [--json [--maps]]
    captioner-caption photos/ --output captions.jsonl     # appended as it goes; a rerun captions only new photos
    torchrun --nproc-per-node 2 -m captioner.cli.caption photos/ --output captions.jsonl   # a share per process
    captioner-caption photo.jpg --explain "a dog runs on the grass" [--json]
    captioner-caption photo.jpg --sample 5 [--temperature 0.6] [--top-k 0] [--top-p 0.9] [--seed 0] [--json]

A FOLDER argument stands for its images (every format the parser reads: images.FORMATS, sorted by path;
--recursive includes subfolders). Photos are read ahead by a thread pool (decoded, resized and preprocessed in
parallel: Captioner.prepare; inputs.read_ahead keeps two batches reading) while the model captions the previous
batch (caption_batch, --batch-size images at a time: by default 16 on a CPU, 64 on a GPU).

Decode settings left out are the model file's own (its config.decode); --decode KEY=VALUE sets any of
them. One short line on stderr names the beam and the settings changed from the file's; --verbose prints every
setting in use (with --json: recorded in every line). A --json line
carries image, caption, words, word_log_probs and word_probs (each word's probability under the
model), betas (each word's gate), log_prob and every decode setting; --maps adds the attention maps.

Unreadable images get a message on stderr and a non-zero exit code; the others are still captioned.
--attention-dir writes one figure per image and --animate one animation (a frame per word), never two to
one file (see their help), and marks the folder so that a later --recursive search does not read them as photos.

--output FILE.jsonl appends each photo's --json line(s) to FILE as the photo is done and skips the photos FILE
already names, so a rerun resumes; under torchrun each process captions its own share into the same file
(jsonl_output.py). A progress bar with its ETA shows on stderr when stderr is a terminal; its photos/s are the
photos finished over the wall time since the start (no smoothing).

Everything that needs no model (the options, the sentence, the input files and folders, the output paths) is
checked before the model loads: a mistake is answered at once, in one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from captioner.cli.inputs import (FIGURE_MARK, figure_paths, find_images, image_extensions, read_ahead,
                                  unsearched_subfolders)
from captioner.cli.jsonl_output import append_lines, share, torchrun_place, written_images
from captioner.cli.sample_options import add_sample_options, numbered, request_samples, sample_request, sampling_line

CPU_BATCH, GPU_BATCH = 16, 64  # --batch-size's default


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from captioner.cli.decode_options import add_decode_options

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("images", nargs="+", metavar="IMAGE_OR_FOLDER")
    p.add_argument("--recursive", action="store_true", help="include images in subfolders of a FOLDER")
    p.add_argument("--batch-size", type=int, default=None, help=f"images captioned together (default {CPU_BATCH} on "
                   f"a CPU, {GPU_BATCH} on a GPU)")
    p.add_argument("--checkpoint", default=None, help="model file (default: the bundled model)")
    add_decode_options(p)
    p.add_argument("--json", action="store_true", help="one JSON object per image: image, caption, words, "
                   "word_log_probs, word_probs, betas, log_prob, confidence, sure, level and doubt (why unsure), "
                   "alternatives, concepts, notes and every decode setting used")
    p.add_argument("--maps", action="store_true", help="with --json or --output: add each word's attention map "
                   "(alphas)")
    p.add_argument("--output", default=None, metavar="FILE.jsonl", help="append each photo's JSON line(s) to this "
                   "file as it goes (nothing on stdout); photos the file already names are skipped, so a rerun "
                   "resumes and a grown folder captions only its new photos; under torchrun every process "
                   "captions its own share into this one file")
    p.add_argument("--explain", default=None, metavar="SENTENCE",
                   help="instead of captioning, explain this sentence on each image (Captioner.explain): each word's "
                   "probability and attention; a sentence with no words is an error")
    add_sample_options(p)
    p.add_argument("--attention-dir", default=None, help="write an attention overlay figure (PNG) per image here: "
                   "NAME_attention.png, a FOLDER's subfolders mirrored (x.jpg and x.png: x.jpg_attention.png, "
                   "x.png_attention.png); later folder searches skip this folder")
    p.add_argument("--animate", default=None, metavar="DIR", help="write the caption as it is written per image "
                   "here: NAME_caption.gif, a frame per word with its attention (folders mirrored as --attention-dir)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available, else "
                   "cpu; under torchrun with GPUs, each process its own: cuda:LOCAL_RANK)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "int8", "auto"], default="float32",
                   help="precision (auto: bfloat16 where the CPU/GPU computes it natively; int8: the decoder step's "
                   "large products in int8 on a CPU, float32 elsewhere; named in each --json line's settings)")
    p.add_argument("--eager", action="store_true", help="on a GPU, run the encoder and the beam search op by op "
                   "instead of replaying them as CUDA graphs recorded once per batch size (recording costs the "
                   "first batch of each size about three searches and two encoder passes)")
    p.add_argument("--verbose", action="store_true", help="print every decode setting in use on stderr (by "
                   "default one short line: the beam and the settings changed from the model file's)")
    return p.parse_args(argv)


def check_options(args: argparse.Namespace) -> bool:
    """False after printing (one line) why the options cannot work; needs no model, so runs before it loads."""
    from captioner.cli.decode_options import check_decode_options

    problem = None
    if args.batch_size is not None and args.batch_size < 1:
        problem = "--batch-size must be at least 1"
    elif args.maps and not (args.json or args.output):
        problem = "--maps adds the attention maps to JSON lines: add --json (or --output FILE.jsonl)"
    for flag, folder in (("--attention-dir", args.attention_dir), ("--animate", args.animate)):
        if problem is None and folder and Path(folder).exists() and not Path(folder).is_dir():
            problem = f"{flag} {folder} is a file; name a folder (it is made when missing) for the figures"
    if problem is None and args.output and Path(args.output).is_dir():
        problem = f"--output {args.output} is a folder; name a file, e.g. {Path(args.output) / 'captions.jsonl'}"
    try:
        if problem is None:
            sample_request(args)
            check_decode_options(args)
    except (ValueError, TypeError) as e:
        problem = str(e)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
    return problem is None and check_sentence(args.explain)


def setup(args: argparse.Namespace, quiet: bool = False) -> tuple[Any, dict[str, Any]] | None:
    """The model and the decode settings in use, or None after printing why not (exit code 2). quiet: say nothing
    of the settings (every torchrun process but the first: they are the same)."""
    import captioner
    from captioner.cli.decode_options import decode_settings, describe, describe_briefly, has_memory
    from captioner.model.vision import TorchvisionMismatch, torchvision_note

    try:
        request = sample_request(args)
        args.device = args.device or captioner.default_device()
        dtype = captioner.preferred_dtype(args.device) if args.dtype == "auto" else args.dtype
        loaded = captioner.load(args.checkpoint, device=args.device, dtype=dtype, capture=not args.eager)
        used = decode_settings(loaded, args)
    except (captioner.CheckpointError, OSError, ValueError, TypeError, TorchvisionMismatch) as e:
        print(f"error: {e}", file=sys.stderr)  # a mismatched torchvision only where the file's encoder needs it
        return None
    brief = describe_briefly(used, loaded.decode_settings(), sampling=request is not None)
    note = None if quiet else torchvision_note()  # a mismatched pair this model does not need: said once, work goes on
    if note:
        print(f"note: {note}", file=sys.stderr)
    if quiet:
        pass
    elif request is not None:
        print(sampling_line(request, describe(used, sampling=True) if args.verbose else brief), file=sys.stderr)
    elif args.explain is None:
        fitted = loaded.resources.fitted
        print(f"decoding with {describe(used, consensus=has_memory(loaded), fitted=fitted) if args.verbose else brief}",
              file=sys.stderr)
        if used.fitted_confidence and fitted.confidence is None:
            print("note: this model file has no fitted confidence map: captions carry no confidence "
                  "(captioner-fit-selector --confidence fits one)", file=sys.stderr)
    else:  # nothing is decoded: the sentence is scored word by word (teacher forcing)
        how = f", hard_context {used.hard_context}" if getattr(loaded.model.decoder, "hard", False) else ""
        print(f"explaining the sentence (teacher forcing{how}); nothing is decoded", file=sys.stderr)
    return loaded, dataclasses.asdict(used)


def sure_column(cap: Any) -> str:
    """The text line's last column: "sure 0.87", or the level, the confidence and why ("may be wrong 0.41 (it
    hesitated between ...)"); nothing without a confidence."""
    if cap.confidence is None:
        return ""
    from captioner.decoding.confidence import shown

    c = shown(cap.confidence)  # the number the level reads
    return f"\tsure {c:.2f}" if cap.sure else f"\t{cap.level} {c:.2f} ({cap.doubt})"


def emit(args: argparse.Namespace, path: str, cap: Any) -> str | None:
    """Print one image's line (text or JSON). An explained
    sentence's text line adds its log-probability and each word's probability (unknown words marked). With
    --output nothing is printed: the JSON line is returned, for the file."""
    import numpy as np

    if args.output:
        return json.dumps(cap.to_dict(path, maps=args.maps))  # notes included, as in a --json line
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
    return None


def draw(img: Any, cap: Any, figure: Path | None = None, animation: Path | None = None,
         sentence: str | None = None) -> None:
    """Write one caption's attention figure and animation, where asked; an explained `sentence`'s figure is
    titled as one (visualize.explained_title), never as a caption the model wrote."""
    if figure is not None:
        from captioner.ui.visualize import attention_figure, explained_title, figure_png

        figure.parent.mkdir(parents=True, exist_ok=True)
        title = None if sentence is None else explained_title(cap.text)
        figure.write_bytes(figure_png(attention_figure(img, cap, title=title)))
    if animation is not None:
        from captioner.ui.animate import caption_animation

        animation.parent.mkdir(parents=True, exist_ok=True)
        animation.write_bytes(caption_animation(img, cap))


@dataclasses.dataclass
class Plan:
    paths: list[str]  # this process's photos still to caption, in order
    figures: dict[str, Path]  # image -> its figure (--attention-dir)
    animations: dict[str, Path]  # image -> its animation (--animate)
    missing: int = 0  # input files that are not there (each named on stderr)
    written: int = 0  # this process's photos the --output file already holds (skipped)


def folder_notes(args: argparse.Namespace, skipped: list[Path]) -> None:
    """Say which folders were not searched: figure folders, and subfolders without --recursive."""
    for folder in skipped:
        print(f"note: skipping {folder}: a figure folder (--attention-dir), not input", file=sys.stderr)
    if not args.recursive:
        for item in args.images:
            subs = unsearched_subfolders(Path(item))
            if subs:
                print(f"note: {item} has {len(subs)} subfolder(s) that were not searched ({', '.join(subs[:3])}"
                      f"{' ...' if len(subs) > 3 else ''}): add --recursive to caption their images too",
                      file=sys.stderr)


def plan(args: argparse.Namespace, rank: int = 0, world: int = 1) -> Plan | int:
    """This process's photos still to caption and where their figures go, or the exit code after printing why
    there is nothing to do; needs no model. Missing input files are named here; a folder with no photos is an
    error; photos the --output file already names are skipped; under torchrun this rank takes its share
    (jsonl_output.share). The figure folders are marked (FIGURE_MARK) so that a later folder search skips them."""
    try:
        found, skipped = find_images(args.images, args.recursive, args.attention_dir)
        figures = figure_paths(found, args.attention_dir) if args.attention_dir else {}
        animations = figure_paths(found, args.animate, "_caption.gif") if args.animate else {}
        done = written_images(args.output) if args.output else set()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rank == 0:  # every torchrun process finds the same folders and files: the first one says so
        folder_notes(args, skipped)
    if not found:
        print("error: no images found (folders are searched for "
              f"{' '.join(image_extensions())}; --recursive for subfolders)", file=sys.stderr)
        return 1
    missing = {path for path, _ in found if not os.path.exists(path)}
    for path in sorted(missing) if rank == 0 else ():
        print(f"error: {path}: no such file", file=sys.stderr)
    mine = share([path for path, _ in found if path not in missing], rank, world)
    todo = [path for path in mine if path not in done]
    if args.output and len(todo) < len(mine):
        print(f"note: {len(mine) - len(todo)} of {len(mine)} photo(s) are already in {args.output}: skipped",
              file=sys.stderr)
    return Plan(todo, figures, animations, len(missing), len(mine) - len(todo))


def captions_for(loaded: Any, images: list[Any], settings: dict[str, Any], sentence: str | None,
             request: Any = None) -> list[list[Any]]:
    """Each image's captions: one decoded, --sample's drawn ones, or (--explain) the sentence explained on it."""
    if request is not None:
        return [request_samples(p, request, settings) for p in loaded.read_batch(images)]
    if sentence is None:
        return [[c] for c in loaded.caption_batch(images, **settings)] if images else []
    return [[loaded.explain(img, sentence, hard_context=settings["hard_context"])] for img in images]


def check_sentence(sentence: str | None) -> bool:
    """--explain: False after printing why a sentence cannot be explained (needs no model). Its unknown words
    are noted once, with each photo's line (the Caption's notes: emit)."""
    if sentence is None:
        return True
    from captioner.decoding.photo import NoWordsError, sentence_words

    try:
        sentence_words(sentence)
    except NoWordsError as e:
        print(f"error: --explain: {e}", file=sys.stderr)
        return False
    return True


def default_batch(device: str | None) -> int:
    """Photos captioned together when --batch-size is not given: more on a GPU, where a batch costs little more
    than one photo."""
    return GPU_BATCH if device and str(device).startswith("cuda") else CPU_BATCH


def prepared(loaded: Any, path: str, figures: bool) -> tuple[Any, Any]:
    """(the decoded picture where figures are drawn, else None; the photo prepared for the model): what a reader
    thread does for one photo (ImageError for an unusable file)."""
    from captioner.images import load_image

    if not figures:
        return None, loaded.prepare(path)
    img = load_image(path)
    return img, loaded.prepare(img)


def caption_all(args: argparse.Namespace, loaded: Any, settings: dict[str, Any], planned: Plan,
                progress: bool) -> int:
    """Caption the planned photos a batch at a time (the next batches read ahead meanwhile), each photo's lines
    printed or appended to --output as soon as it is done; a bar with its ETA on stderr when `progress`.
    Returns how many photos could not be read (each named on stderr)."""
    from tqdm import tqdm

    request, failed = sample_request(args), 0  # checked by check_options
    for out in (args.attention_dir, args.animate):
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / FIGURE_MARK).write_text("figures written by captioner-caption; folder searches skip this "
                                                 "folder\n")
    figures = bool(planned.figures or planned.animations)
    bar = tqdm(total=len(planned.paths), desc="captioning", unit="photo", file=sys.stderr, disable=not progress,
               smoothing=0)  # photos/s: the photos finished over the wall time since the start
    batches = read_ahead(planned.paths, args.batch_size or default_batch(args.device),
                         lambda path: prepared(loaded, path, figures))
    for batch in batches:
        good = [(path, item) for path, item in batch if not isinstance(item, Exception)]
        caps = captions_for(loaded, [ready for _, (_, ready) in good], settings, args.explain, request)
        with tqdm.external_write_mode(file=sys.stdout):  # the bar steps aside for the lines
            for path, err in batch:
                if isinstance(err, Exception):
                    print(f"error: {err}", file=sys.stderr)
                    failed += 1
            for (path, (img, _)), image_caps in zip(good, caps):
                lines = []
                for i, cap in enumerate(image_caps, 1):
                    paths = numbered([planned.figures.get(path), planned.animations.get(path)], i, request)
                    lines.append(emit(args, path, cap))
                    draw(img, cap, *paths, sentence=args.explain)
                if args.output:
                    append_lines(args.output, lines)
        bar.update(len(batch))
    bar.close()
    return failed


def torch_gpus() -> bool:
    """Whether torch sees a CUDA GPU here."""
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # then everything that needs no torch, so that a mistake is answered at once
    rank, world = torchrun_place(dict(os.environ))  # (0, 1) outside torchrun
    planned = plan(args, rank, world) if check_options(args) else 2
    if isinstance(planned, int):
        return planned
    if not planned.paths:  # everything already in --output, or this rank's share is empty
        return 1 if planned.missing else 0
    if world > 1 and args.device in (None, "cuda") and torch_gpus():  # one GPU per process, as torchrun numbers them
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    ready = setup(args, quiet=rank > 0)
    if ready is None:
        return 2
    start = time.perf_counter()
    failed = caption_all(args, *ready, planned, progress=rank == 0 and sys.stderr.isatty())
    if args.output:
        who, done, took = f"rank {rank} of {world}: " if world > 1 else "", len(planned.paths) - failed, \
            time.perf_counter() - start
        print(f"{who}{done} photo(s) captioned into {args.output} in {took:.1f} s ({done / took:.2f} photos/s, "
              "the model's loading not counted)", file=sys.stderr)
    return 1 if failed or planned.missing else 0


if __name__ == "__main__":
    sys.exit(main())
