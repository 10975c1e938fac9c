"""Evaluate a captioner with the standard COCO caption metrics (pycocoevalcap, PTB tokenizer).

    python scripts/evaluate.py --dataset flickr8k --data-root ../shared/data/flickr8k --split test --beam-size 3
    python scripts/evaluate.py --dataset coco --images DIR --annotations captions_val2017.json --json

Decode settings left out are the model file's own (its config.decode); the output JSON records the
settings used. COCO results are labelled with the annotation file's split (captions_val2017.json -> val2017).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    import captioner
    from captioner.config import DataConfig
    from captioner.data import build_records
    from captioner.data.features import build_cache
    from captioner.evaluation import encode_records, evaluate_model
    from captioner.metrics import METRIC_KEYS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="model file (default: the bundled model)")
    p.add_argument("--dataset", choices=["flickr8k", "coco", "karpathy"], default="flickr8k")
    p.add_argument("--data-root", default="../shared/data/flickr8k", help="flickr8k: folder with Images/ + captions")
    p.add_argument("--split", choices=["train", "val", "test"], default="test")
    p.add_argument("--images", help="coco/karpathy: image folder")
    p.add_argument("--annotations", help="coco: captions_*.json (all its images); karpathy: dataset_*.json")
    p.add_argument("--beam-size", type=int, default=None, help="default: the checkpoint's decode setting")
    p.add_argument("--max-len", type=int, default=None, help="default: the checkpoint's decode setting")
    p.add_argument("--length-penalty", type=float, default=None, help="default: the checkpoint's decode setting")
    p.add_argument("--limit", type=int, default=0, help="first N images only")
    p.add_argument("--batch-size", type=int, default=100, help="images decoded together")
    p.add_argument("--cache-dir", default=None, help="reuse/build a feature cache here (frozen encoder)")
    p.add_argument("--output", default="captions.json", help="where the generated captions are written")
    p.add_argument("--spice", action="store_true", help="also SPICE, when its Java models are installed")
    p.add_argument("--device", default=captioner.default_device(), help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute type of the whole model (bfloat16: faster on CPUs with AVX512-BF16/AMX and on GPUs)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the scores")
    args = p.parse_args(argv)
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print

    try:
        model = captioner.load(args.checkpoint, device=args.device, dtype=args.dtype)
        used = model.decode_settings(args.beam_size, args.max_len, args.length_penalty)
        if args.dataset == "flickr8k":
            data = DataConfig(dataset="flickr8k", root=args.data_root)
            split = label = args.split
        elif args.dataset == "coco":
            if not args.images or not args.annotations:
                p.error("--dataset coco needs --images and --annotations")
            data = DataConfig(dataset="coco", images=args.images, annotations=args.annotations)
            split = "train"  # build_records' 'train' = all images of the given annotation file
            label = coco_split_label(args.annotations)
        else:
            data = DataConfig(dataset="karpathy", images=args.images or "", annotations=args.annotations or "")
            split = label = args.split
        data.limit = args.limit
        records = build_records(data, split)
    except (ValueError, FileNotFoundError, captioner.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    t0 = time.time()
    if args.cache_dir:
        part = f"{label}-first{args.limit}" if args.limit else label  # "val2017-first2", not "val20172"
        name = model.preprocess.cache_name(args.dataset, part, args.dtype)
        cache = build_cache(args.cache_dir, name, model.model.encoder, model.preprocess, records, args.device,
                            log=say, progress=not args.json)
        keep = [i for i, r in enumerate(records) if r.image_id not in set(cache.missing)]
        feats = cache.features[keep] if len(keep) < len(records) else cache.features
    else:
        feats, keep = encode_records(model.model, records, model.preprocess, args.device, num_workers=2)
    if len(keep) < len(records):
        bad = [records[i].image_id for i in sorted(set(range(len(records))) - set(keep))]
        say(f"WARNING: {len(bad)} image(s) could not be read and are not scored: {', '.join(bad[:10])}")
    t1 = time.time()
    scores, preds = evaluate_model(model.model, model.vocab, feats, [records[i] for i in keep], used.beam_size,
                                   used.max_len, used.length_penalty, torch.device(args.device), used.forbid_unk,
                                   METRIC_KEYS, args.batch_size, progress=not args.json, log=say,
                                   block_trigrams=used.block_trigrams)
    t2 = time.time()  # decoding and scoring
    if args.spice:
        from captioner.metrics import score_captions

        scores.update({k: v for k, v in score_captions(preds, {r.image_id: r.captions for r in records},
                                                       metrics=(), spice=True, log=say).items()})
    Path(args.output).write_text(json.dumps(
        {"checkpoint": str(args.checkpoint or captioner.DEFAULT_CHECKPOINT), "dataset": args.dataset, "split": label,
         "beam_size": used.beam_size, "max_len": used.max_len, "length_penalty": used.length_penalty, "scores": scores,
         "captions": [{"image_id": k, "caption": v} for k, v in preds.items()]}, indent=1))
    say(f"encoded {len(keep)} images in {t1 - t0:.1f}s, decoded (beam {used.beam_size}) and scored in {t2 - t1:.1f}s; "
        f"captions -> {args.output}")
    if args.json:
        print(json.dumps({k: scores[k] for k in (*METRIC_KEYS, "n_images")}))  # exactly these keys
    else:
        for k in (*METRIC_KEYS, "SPICE"):
            if k in scores:
                print(f"{k:8s} {scores[k]:.4f}")
        print(f"images   {scores['n_images']}")
    return 0


def coco_split_label(annotations: str | Path) -> str:
    """The split a COCO caption file holds, from its name: captions_val2017.json -> val2017."""
    return Path(annotations).stem.removeprefix("captions_")


if __name__ == "__main__":
    sys.exit(main())
