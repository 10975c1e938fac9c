"""Train the concept-conditioned language model (captioner/language_model.py) on text only: Flickr8k
train captions + the COCO caption text, over the captioner's vocabulary extended with the words it lacks.

    python scripts/train_lm.py --flickr8k ../shared/data/flickr8k \\
        --coco-captions ../shared/data/coco-captions/captions_val2017_text.json --out runs/lm/lm.safetensors \\
        --max-minutes 17     # 6 epochs of ~160 s on one CPU thread: val perplexity 17.2

Validation: Flickr8k dev captions + ~5% of the COCO images' captions (perplexity). At the end it
prints sentences for a few concept sets. `--describe FILE` only prints those for a trained model.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

SHOW = [["pizza"], ["giraffe"], ["laptop"], ["dog"], ["cat"], ["zebra"], []]


def _parser() -> argparse.ArgumentParser:
    from captioner.lm.train import LMTrainSettings

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flickr8k", help="Flickr8k folder (captions.txt + split files)")
    p.add_argument("--coco-captions", help="COCO caption JSON (text only is enough)")
    p.add_argument("--captioner", default=None, help="captioner checkpoint whose vocabulary to extend (default: bundled)")
    p.add_argument("--out", default="runs/lm/lm.safetensors", help="where to write the best model")
    p.add_argument("--min-count", type=int, default=5, help="new words need this many training occurrences")
    p.add_argument("--max-len", type=int, default=30, help="drop sentences longer than this many words")
    p.add_argument("--holdout", type=float, default=0.05, help="share of COCO images held out for validation")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--describe", default=None, metavar="FILE", help="only print sentences of this trained LM")
    for f in fields(LMTrainSettings):  # every training setting as --name-with-dashes
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=f.default, metavar="BOOL")
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    return p


def _report(lm, log) -> None:
    from captioner.lm.train import concept_vector, describe, next_word_logprob

    for line in describe(lm, SHOW):
        log(line)
    for word in ("pizza", "giraffe", "laptop"):
        on = next_word_logprob(lm, ["a"], word, concept_vector([word], lm.categories))
        off = next_word_logprob(lm, ["a"], word, concept_vector([], lm.categories))
        log(f"log p({word} | <start> a, {{{word}}}) = {on:.2f}   with {{}}: {off:.2f}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)  # main() may be called in-process (tests)


def _run(args: argparse.Namespace) -> int:
    from captioner.api import DEFAULT_CHECKPOINT
    from captioner.checkpoint import CheckpointError, load_checkpoint
    from captioner.lm.model import load_language_model
    from captioner.lm.data import CATEGORIES, build_corpus
    from captioner.lm.train import LMTrainSettings, build_lm, fit
    from captioner.logs import JsonlLogger

    log = lambda s: print(s, flush=True)  # noqa: E731
    try:
        if args.describe:
            _report(load_language_model(args.describe), log)
            return 0
        if not args.flickr8k or not args.coco_captions:
            print("error: --flickr8k and --coco-captions are required to train", file=sys.stderr)
            return 2
        captioner_vocab = load_checkpoint(args.captioner or DEFAULT_CHECKPOINT).vocab
        corpus = build_corpus(args.flickr8k, args.coco_captions, captioner_vocab, args.min_count, args.max_len,
                              args.holdout)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    settings = LMTrainSettings(**{f.name: getattr(args, f.name) for f in fields(LMTrainSettings)})
    lm = build_lm(corpus, len(captioner_vocab), CATEGORIES, settings)
    log(f"sentences {corpus.counts}; vocabulary {len(captioner_vocab)} captioner words + "
        f"{len(corpus.vocab) - len(captioner_vocab)} new = {len(corpus.vocab)}; "
        f"{sum(p.numel() for p in lm.parameters()):,} parameters; {settings}")
    t = time.perf_counter()
    best = fit(lm, corpus, settings, args.out, log, JsonlLogger(Path(args.out).with_name("metrics.jsonl")))
    log(f"best epoch {best.get('epoch')}: val ppl {best['val_ppl']:.2f}; {time.perf_counter() - t:.0f}s in all; "
        f"{args.out}: {Path(args.out).stat().st_size / 1e6:.1f} MB")
    _report(load_language_model(args.out), log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
