"""Prepare a dataset for training: check it, build and report the vocabulary, and encode every image
once into the frozen-encoder feature cache (reused by every later run with the same encoder/grid), or
with model.tune_stages into the frozen lower stages' activation cache (+ mirror images with data.flip).
A mix (data.sources) gets each caption set's caches, named after the set.

    .venv/bin/captioner-prepare --config configs/flickr8k_cpu.yaml
"""
from __future__ import annotations

from captioner.cli import device_refused

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    from captioner.training.stopping import Interrupted, StopSignal

    try:
        with StopSignal().catch():  # Ctrl-C / SIGTERM: the cache being written is removed, finished ones stay
            return _main(argv)
    except Interrupted as e:
        print(f"\n{e.name}: stopped; the cache being built was removed (the finished ones are kept). Rerun the same "
              "command to go on.", file=sys.stderr, flush=True)
        return e.code


def _main(argv: list[str] | None) -> int:
    from captioner.cli import numpy_before_torch

    numpy_before_torch()
    from captioner.api import default_device
    from captioner.config import load_config
    from captioner.data import build_mix
    from captioner.data.features import build_cache
    from captioner.training.sources import cache_encoder
    from captioner.model.encoder import build_preprocess

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML/JSON recipe in configs/")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    p.add_argument("--splits", nargs="+", action="extend", default=None, help="splits to encode (default: train val)")
    p.add_argument("--no-features", action="store_true", help="only check the data and report the vocabulary")
    p.add_argument("--vocab-out", default=None, help="also save the vocabulary JSON here")
    p.add_argument("--device", default=default_device(), help="default: cuda when available, else cpu")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--skip-missing", action="store_true",
                   help="prepare without the photos the captions list but the folder lacks (default: an error)")
    args = p.parse_args(argv)
    args.splits = list(dict.fromkeys(args.splits or ["train", "val"]))  # every --splits counts, each split once
    if device_refused(args.device):
        return 2
    try:
        cfg = load_config(args.config, args.set)
        mix = {s: build_mix(cfg.data, s) for s in args.splits}
        encoder = cache_encoder(cfg)  # the frozen encoder training will cache features with
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    records = {(src.name, split): recs for split, sets in mix.items() for src, recs in sets}
    for (name, split), recs in records.items():
        missing = [r.image_id for r in recs if not r.path.is_file()]
        print(f"{name} {split}: {len(recs)} images, {sum(len(r.captions) for r in recs)} captions"
              + (f"; {len(missing)} image files missing, e.g. {', '.join(missing[:5])}" if missing else ""))
    if _missing_refused(records, args.skip_missing) or _emptied(records):
        return 2
    if "train" in mix:
        _report_vocabulary(cfg, [c for _, recs in mix["train"] for r in recs for c in r.captions], args.vocab_out)
    if args.no_features:
        return 0
    if cfg.from_activations:  # model.tune_stages: the frozen lower stages' activations instead of features
        return _activations(cfg, records, args.device, not args.no_progress)
    if cfg.encoder_in_loop:
        print("note: this recipe fine-tunes the encoder or augments images, so training does not use the feature cache")
    prep = build_preprocess(cfg.model)
    if not _plan(cfg, records, encoder, prep):
        return 1
    for (source, split), recs in records.items():
        t = time.time()
        name = prep.cache_name(source, cfg.data.cache_split(split))
        cache = build_cache(cfg.data.cache_dir, name, encoder, prep, recs, args.device,
                            num_workers=cfg.data.num_workers, progress=not args.no_progress)
        print(f"{source} {split}: features {tuple(cache.features.shape)} float16 at {cache.path} "
              f"({time.time() - t:.0f}s)")
    return 0


def _plan(cfg, records, encoder, prep) -> bool:
    """Print the disk the caches still to build need (float16 (P, D) per photo) against the free space, and
    refuse (False) when it is short, before anything is encoded."""
    from captioner.data.features import open_cache
    from captioner.diskspace import free_bytes, mib

    per_photo = encoder.grid_size ** 2 * encoder.out_dim * 2
    todo = {name: len(recs) for (source, split), recs in records.items()
            if open_cache(cfg.data.cache_dir, name := prep.cache_name(source, cfg.data.cache_split(split)), encoder,
                          prep, recs) is None}
    if not todo:
        return True
    need, free = per_photo * sum(todo.values()), free_bytes(cfg.data.cache_dir)
    print(f"to encode: {sum(todo.values()):,} photos into {len(todo)} cache(s) in {cfg.data.cache_dir}: "
          f"{per_photo / 1024:.0f} KiB each ({encoder.grid_size}x{encoder.grid_size}x{encoder.out_dim} float16), "
          f"{need / 2**30:.2f} GiB in all; {mib(free)} free there. The time per photo is printed after the first batches.")
    if free is not None and free < need + (1 << 26):
        print(f"error: not enough disk space for the caches: {need / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB "
              "free. Free some space or set data.cache_dir to a larger disk, then rerun.", file=sys.stderr)
        return False
    return True


def _missing_refused(records: dict, skip: bool) -> bool:
    """Photos the captions list that are not on disk: named, and (without --skip-missing) an error, as a
    half-copied folder is a mistake far more often than a choice -> whether prepare stops."""
    gone = sorted({str(r.path) for recs in records.values() for r in recs if not r.path.is_file()})
    if not gone:
        return False
    names = ", ".join(gone[:20]) + (f" and {len(gone) - 20} more" if len(gone) > 20 else "")
    if skip:
        print(f"--skip-missing: preparing without {len(gone)} photo(s) the captions list: {names}")
        return False
    print(f"error: {len(gone)} photo(s) listed in the captions are not on disk: {names}. Copy them into the "
          "folder, remove their lines from the captions file, or pass --skip-missing to prepare without them",
          file=sys.stderr)
    return True


def _emptied(records: dict) -> bool:
    """Whether leaving out the photos missing on disk (--skip-missing) empties a split: said in one line (the
    run would fail later, at its first validation, with "no predictions to score") -> whether prepare stops."""
    for (name, split), recs in records.items():
        if recs and not any(r.path.is_file() for r in recs):
            gone = ", ".join(r.image_id for r in recs[:5]) + (" ..." if len(recs) > 5 else "")
            print(f"error: {name} {split}: every photo of the split is missing on disk ({gone}), so --skip-missing "
                  f"leaves it empty; put them back, or add captioned photos (without split files every 10th photo "
                  "by name goes to val and to test)", file=sys.stderr)
            return True
    return False


def _report_vocabulary(cfg, caps: list[str], vocab_out: str | None) -> None:
    """Print the vocabulary captioner-train will use (with train.init_from: the start file's, extended by the
    captions' new words) and its statistics on the training captions; save it to `vocab_out` when given."""
    from captioner.checkpoint import load_checkpoint
    from captioner.training.run import run_vocabulary

    init_vocab = load_checkpoint(cfg.train.init_from).vocab if cfg.train.init_from else None
    vocab = run_vocabulary(cfg, caps, init_vocab)
    if init_vocab is not None:
        new = vocab.itos[len(init_vocab):]
        print(f"vocabulary of {cfg.train.init_from} ({len(init_vocab)} words)"
              + (f" + {len(new)} new from your captions: {', '.join(new[:12])}{' ...' if len(new) > 12 else ''}"
                 if new else (" + no new words (a word needs data.min_word_count="
                              f"{cfg.data.min_word_count} captions)" if cfg.train.extend_vocab else "")))
    print(vocab.stats(caps, cfg.data.max_caption_len))
    if vocab_out:
        vocab.save(vocab_out)


def _activations(cfg, records, device: str, progress: bool) -> int:
    from captioner.data.activations import build_activations, cache_name
    from captioner.model.encoder import Encoder, build_preprocess

    encoder = Encoder(cfg.model.encoder, cfg.model.pretrained, cfg.model.grid_size, cfg.model.output_stride)
    prep = build_preprocess(cfg.model)
    if not _plan(cfg, records, encoder, prep):
        return 1
    for (source, split), recs in records.items():
        t = time.time()
        name = cache_name(prep, source, cfg.data.cache_split(split), encoder.split_block)
        flip = cfg.data.flip and split == "train"
        cache = build_activations(cfg.data.cache_dir, name, encoder, prep, recs, flip, device,
                                  num_workers=cfg.data.num_workers, progress=progress)
        size = cache.acts.nbytes * (2 if flip else 1) + cache.logits.nbytes
        print(f"{source} {split}: activations {tuple(cache.acts.shape)} float16{' + flipped' if flip else ''} at {cache.path} "
              f"({size / 2**20:.0f} MiB, {cache.bytes_per_photo / 1024:.0f} KiB per view; {time.time() - t:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
