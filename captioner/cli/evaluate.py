"""Evaluate a captioner with the standard COCO caption metrics (pycocoevalcap, PTB tokenizer).

    python scripts/evaluate.py --dataset flickr8k --data-root ../shared/data/flickr8k --split test --beam-size 3
    python scripts/evaluate.py --dataset coco --images DIR --annotations captions_val2017.json --json
    python scripts/evaluate.py --dataset coco --images DIR --annotations captions_val2017.json --grounding

--grounding (COCO only) also measures where the model looks when it names an object: the attention
mass inside the object's instance boxes, for the generated and the teacher-forced reference
captions (captioner/grounding.py). The boxes come from instances_X.json beside captions_X.json, or
--instances PATH.
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
    from captioner.data.features import build_cache, cache_name
    from captioner.engine import caption_features, encode_records, evaluate
    from captioner.metrics import METRIC_KEYS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="model file (default: the bundled model)")
    p.add_argument("--dataset", choices=["flickr8k", "coco", "karpathy"], default="flickr8k")
    p.add_argument("--data-root", default="../shared/data/flickr8k", help="flickr8k: folder with Images/ + captions")
    p.add_argument("--split", choices=["train", "val", "test"], default="test")
    p.add_argument("--images", help="coco/karpathy: image folder")
    p.add_argument("--annotations", help="coco: captions_*.json (all its images); karpathy: dataset_*.json")
    p.add_argument("--beam-size", type=int, default=3)
    p.add_argument("--max-len", type=int, default=50)
    p.add_argument("--length-penalty", type=float, default=None, help="default: the checkpoint's decode setting")
    p.add_argument("--limit", type=int, default=0, help="first N images only")
    p.add_argument("--batch-size", type=int, default=100, help="images decoded together")
    p.add_argument("--cache-dir", default=None, help="reuse/build a feature cache here (frozen encoder)")
    p.add_argument("--output", default="captions.json", help="where the generated captions are written")
    p.add_argument("--spice", action="store_true", help="also SPICE, when its Java models are installed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute type of the whole model (bfloat16: faster on CPUs with AVX512-BF16/AMX and on GPUs)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the scores")
    p.add_argument("--grounding", action="store_true",
                   help="coco: also the attention mass inside the boxes of the objects each word names")
    p.add_argument("--instances", default=None,
                   help="coco: instances_*.json for --grounding (default: beside the --annotations file)")
    args = p.parse_args(argv)
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print

    try:
        model = captioner.load(args.checkpoint, device=args.device, dtype=args.dtype)
        if args.dataset == "flickr8k":
            data = DataConfig(dataset="flickr8k", root=args.data_root)
            split = args.split
        elif args.dataset == "coco":
            if not args.images or not args.annotations:
                p.error("--dataset coco needs --images and --annotations")
            data = DataConfig(dataset="coco", images=args.images, annotations=args.annotations)
            split = "train"  # build_records' 'train' = all images of the given annotation file
        else:
            data = DataConfig(dataset="karpathy", images=args.images or "", annotations=args.annotations or "")
            split = args.split
        data.limit = args.limit
        records = build_records(data, split)
        instances = None
        if args.grounding:
            instances = load_grounding_instances(args)
    except (ValueError, FileNotFoundError, captioner.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    t0 = time.time()
    mc = model.config.model
    if args.cache_dir:
        name = cache_name(args.dataset, f"{split}{args.limit or ''}", mc.encoder, mc.image_size, mc.grid_size)
        name += "" if args.dtype == "float32" else f"-{args.dtype}"  # bf16 features are a different cache
        cache = build_cache(args.cache_dir, name, model.model.encoder, mc.image_size, records, args.device,
                            log=say, progress=not args.json)
        keep = [i for i, r in enumerate(records) if r.image_id not in set(cache.missing)]
        feats = cache.features[keep] if len(keep) < len(records) else cache.features
    else:
        feats, keep = encode_records(model.model, records, mc.image_size, args.device, num_workers=2)
    if len(keep) < len(records):
        bad = [records[i].image_id for i in sorted(set(range(len(records))) - set(keep))]
        say(f"WARNING: {len(bad)} image(s) could not be read and are not scored: {', '.join(bad[:10])}")
    t1 = time.time()
    lp = model.config.decode.length_penalty if args.length_penalty is None else args.length_penalty
    caps = caption_features(model.model, feats, model.vocab, args.beam_size, args.max_len, lp,
                            torch.device(args.device), args.batch_size, progress=not args.json,
                            forbid_unk=model.config.decode.forbid_unk)
    t2 = time.time()
    preds = {records[i].image_id: c for i, c in zip(keep, caps)}
    scores = evaluate(preds, [records[i] for i in keep], METRIC_KEYS, log=say)
    if args.spice:
        from captioner.metrics import score_captions

        scores.update({k: v for k, v in score_captions(preds, {r.image_id: r.captions for r in records},
                                                       metrics=(), spice=True, log=say).items()})
    grounding = {}
    if instances is not None:
        from captioner.grounding import ground_generated, ground_references

        scored = [records[i] for i in keep]
        grounding = {"grounding_generated": ground_generated(model, feats, scored, instances, args.beam_size,
                                                             args.max_len, lp, args.batch_size),
                     "grounding_teacher_forced": ground_references(model, feats, scored, instances)}
    Path(args.output).write_text(json.dumps(
        {"checkpoint": str(args.checkpoint or captioner.DEFAULT_CHECKPOINT), "dataset": args.dataset, "split": split,
         "beam_size": args.beam_size, "length_penalty": lp, "scores": scores,
         **{k: g.to_dict() for k, g in grounding.items()},
         "captions": [{"image_id": k, "caption": v} for k, v in preds.items()]}, indent=1))
    say(f"encoded {len(keep)} images in {t1 - t0:.1f}s, decoded (beam {args.beam_size}) in {t2 - t1:.1f}s "
        f"({len(keep) / max(t2 - t1, 1e-9):.1f} images/s); captions -> {args.output}")
    if args.json:
        print(json.dumps({**{k: scores[k] for k in (*METRIC_KEYS, "n_images")},  # exactly these keys
                          **{k: g.to_dict() for k, g in grounding.items()}}))  # + grounding_* with --grounding
    else:
        for k in (*METRIC_KEYS, "SPICE"):
            if k in scores:
                print(f"{k:8s} {scores[k]:.4f}")
        print(f"images   {scores['n_images']}")
        for k, g in grounding.items():
            print(f"{k.replace('grounding_', 'grounding (') + ')':28s} {g}")
    return 0


def load_grounding_instances(args: argparse.Namespace):
    """The COCO instance boxes for --grounding: --instances, else instances_X.json beside captions_X.json."""
    from captioner.grounding import instances_path_for, load_instances

    if args.dataset != "coco":
        raise ValueError("--grounding needs COCO instance boxes: use it with --dataset coco")
    path = Path(args.instances) if args.instances else instances_path_for(args.annotations)
    if not path.is_file():
        how = "the --instances file" if args.instances else f"no {path.name} beside {args.annotations}"
        raise FileNotFoundError(f"--grounding: {how} ({path}) does not exist. Put COCO's instances_*.json of the "
                                "same split there (annotations_trainval2017.zip) or pass --instances PATH.")
    return load_instances(path)


if __name__ == "__main__":
    sys.exit(main())
