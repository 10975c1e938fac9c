"""Train the visual word detectors (concepts/detectors.py: noisy-OR MIL over the annotation grid, Fang
et al. 2015) on a model file's OWN encoder, calibrate them, choose decode.person_floor, and write a copy
of the model file that carries them:

    .venv/bin/captioner-train-detectors --data-root ../shared/data/flickr8k \\
        --coco-images ../shared/data/coco-mini/train2017 \\
        --coco-annotations ../shared/data/coco-mini/annotations/captions_train2017.json \\
        --cache-dir cache --out runs/detectors/model.safetensors

Trains on Flickr8k train (labels: does a reference caption use a word of the group), calibrates (Platt)
on Flickr8k val, reports average precision per word on val and on coco-mini (person: COCO's person boxes;
other words: its captions), and picks the person floor on val AND coco-mini (never test): the largest at
which at most --max-miss of the photos with a person would have their person words vetoed.
"""
from __future__ import annotations

from captioner.cli import device_refused

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np


def _parser() -> argparse.ArgumentParser:
    from captioner.concepts.detectors import GROUP_WORDS
    from captioner.training.detectors import FitSettings

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="model file whose encoder to use (default: the bundled one)")
    p.add_argument("--data-root", default=None, help="Flickr8k folder (captions.txt + official split files)")
    p.add_argument("--config", default=None,
                   help="instead of --data-root: train on the train sets of this recipe's data (data.sources: e.g. "
                        "configs/mix_cpu.yaml, Flickr8k + coco-paired), calibrate on its val sets")
    p.add_argument("--coco-images", default=None, help="coco-mini photos (held-out choice of the floor)")
    p.add_argument("--coco-annotations", default=None, help="captions_X.json (instances_X.json beside it)")
    p.add_argument("--cache-dir", required=True, help="feature caches (shared with evaluate.py --cache-dir)")
    p.add_argument("--out", required=True, help="where to write the model file with detectors")
    p.add_argument("--groups", default=",".join(GROUP_WORDS), help="comma-separated word groups (GROUP_WORDS)")
    p.add_argument("--person-floor", type=float, default=None, help="store this floor (default: choose it)")
    p.add_argument("--max-miss", type=float, default=0.06,
                   help="the chosen floor vetoes person words on at most this share of photos WITH a person")
    p.add_argument("--noise", type=int, default=64,
                   help="also train on this many random-noise photos as negatives of every word (a detector must not "
                        "see a person in noise)")
    p.add_argument("--report", default=None, help="also write the measurements as JSON here")
    p.add_argument("--limit", type=int, default=0, help="first N photos of train and of val only (a quick try)")
    p.add_argument("--device", default="cpu")
    for f in fields(FitSettings):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(flag, type=_strict_bool, default=f.default, metavar="BOOL")
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    return p


def _strict_bool(text: str) -> bool:
    """argparse type for boolean flags: the config system's reading ("ture" is an error naming the value)."""
    from captioner.config import parse_bool

    try:
        return parse_bool(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects true/false (or yes/no, on/off, 1/0), got '{text}'") from None


def _features(loaded, cache_dir: str, dataset: str, label: str, records: list, device: str):
    """Cached annotation vectors (N, P, D) of records (evaluate.py's cache names) and the kept records."""
    from captioner.data.features import build_cache

    cache = build_cache(cache_dir, loaded.preprocess.cache_name(dataset, label), loaded.model.encoder,
                        loaded.preprocess, records, device, num_workers=1)
    keep = [i for i, r in enumerate(records) if r.image_id not in set(cache.missing)]
    return np.asarray(cache.features[keep]) if len(keep) < len(records) else cache.features, [records[i] for i in keep]


def _split_features(args, loaded, split: str) -> tuple[np.ndarray, list]:
    """Features and records of `split` over the caption sets: Flickr8k at --data-root, or every set of
    --config's data (the training run's caches are reused: same names, same encoder)."""
    from captioner.config import DataConfig, load_config
    from captioner.data import build_mix

    if args.config:
        data = load_config(args.config).data
    elif args.data_root:
        data = DataConfig(dataset="flickr8k", root=args.data_root)
    else:
        raise ValueError("name the training photos: --data-root FLICKR8K or --config RECIPE (its data.sources)")
    data.limit = args.limit
    part = f"-first{args.limit}" if args.limit else ""  # the cache of a few photos is not the whole split's
    got = [_features(loaded, args.cache_dir, src.name, split + part, recs, args.device)
           for src, recs in build_mix(data, split)]
    feats = got[0][0] if len(got) == 1 else np.concatenate([np.asarray(x) for x, _ in got])  # (N, P, D)
    return feats, [r for _, recs in got for r in recs]


def _with_noise(loaded, feats: np.ndarray, records: list, n: int) -> tuple[np.ndarray, list]:
    """The training features plus those of n seeded uniform-noise photos, each with no captions (a negative
    of every word group)."""
    import torch
    from PIL import Image

    from captioner.data import ImageRecord

    rng = np.random.default_rng(0)
    photos = [Image.fromarray(rng.integers(0, 256, (64 * (1 + i % 4), 64 * (1 + i % 4), 3), dtype=np.uint8))
              for i in range(n)]
    with torch.no_grad():
        noise = loaded.encode(torch.stack([loaded.preprocess(p) for p in photos])).float().numpy()  # (n, P, D)
    feats = np.asarray(feats)  # kept in the cache's dtype (float16): no float32 copy of every photo's features
    return (np.concatenate([feats, noise.astype(feats.dtype)]),
            records + [ImageRecord(f"noise{i}", Path(f"noise{i}.png"), []) for i in range(n)])


def _coco(args, loaded) -> tuple[np.ndarray, list, np.ndarray] | None:
    """coco-mini features, records and person presence from its instance boxes (None without --coco-*)."""
    from captioner.cli.evaluate import coco_split_label
    from captioner.config import DataConfig
    from captioner.data import build_records
    from captioner.evaluation.boxes import instances_path_for, load_instances

    if not args.coco_images or not args.coco_annotations:
        return None
    records = build_records(DataConfig(dataset="coco", images=args.coco_images, annotations=args.coco_annotations),
                            "train")
    feats, records = _features(loaded, args.cache_dir, "coco", coco_split_label(args.coco_annotations), records,
                               args.device)
    inst = load_instances(instances_path_for(args.coco_annotations))
    person = np.array([len(inst.boxes.get(r.image_id, {}).get("person", [])) > 0 for r in records])
    return feats, records, person


def _ap_table(det, probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    from captioner.training.detectors import average_precision

    return {g: round(average_precision(probs[:, k], labels[:, k]), 4) for k, g in enumerate(det.groups)}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if device_refused(args.device):
        return 2
    try:
        report, loaded = _train(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loaded.save(args.out)
    print(f"wrote {args.out} (decode.person_floor {loaded.config.decode.person_floor})")
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=2))
    return 0


def _train(args: argparse.Namespace):
    import captioner
    from captioner.concepts.detectors import PERSON, WordDetectors, attach, caption_labels, group_members
    from captioner.concepts.imagenet import imagenet_head_or_none
    from captioner.training import detectors as T

    loaded = captioner.load(args.checkpoint, device=args.device)
    members = group_members([g.strip() for g in args.groups.split(",") if g.strip()])
    train_x, train_r = _split_features(args, loaded, "train")
    if args.noise:
        train_x, train_r = _with_noise(loaded, train_x, train_r, args.noise)
    val_x, val_r = _split_features(args, loaded, "val")
    train_y, val_y = (caption_labels([r.captions for r in rs], members) for rs in (train_r, val_r))
    settings = T.FitSettings(**{f.name: getattr(args, f.name) for f in fields(T.FitSettings)})
    det = T.fit(WordDetectors(list(members), train_x.shape[-1], members), train_x, train_y, settings)
    head = imagenet_head_or_none(loaded.model)
    sets = {"val": (val_x, val_y[:, det.groups.index(PERSON)].numpy() if PERSON in det.groups else None)}
    coco = _coco(args, loaded)
    if coco is not None:
        sets["coco"] = (coco[0], coco[2])
    priors = {name: None if head is None else T.clothes_priors(head, x) for name, (x, _) in sets.items()}
    report = {"settings": vars(settings), "positives_train": {g: int(v) for g, v in zip(members, train_y.sum(0))}}
    if PERSON in det.groups and head is not None:  # how much of the ImageNet head's clothes evidence to add
        k = det.groups.index(PERSON)
        raw = {name: T.raw_logits(det, x)[:, k] for name, (x, _) in sets.items()}
        a, aps = T.choose_prior_weight(list(raw.values()), list(priors.values()), [y for _, y in sets.values()])
        det.prior_weight[k] = a
        report["person_prior_weight"], report["person_ap_by_prior_weight"] = a, {str(w): v for w, v in aps.items()}
    T.calibrate(det, T.raw_logits(det, val_x, priors["val"]), val_y)
    _measure(det, sets, priors, val_y, coco, report)
    held = [(report.pop(f"_{name}_person"), y) for name, (_, y) in sets.items() if f"_{name}_person" in report]
    floor = args.person_floor if args.person_floor is not None else T.choose_floor(held, args.max_miss)
    report["person_floor"] = floor
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("floors") and k != "settings"}, indent=1))
    loaded.config.decode.person_floor = floor if PERSON in det.groups else 0.0
    attach(loaded.model, det)
    return report, loaded


def _measure(det, sets: dict, priors: dict, val_y, coco, report: dict) -> None:
    """Per-word AP on val (caption labels) and coco-mini (captions; person: its boxes), the floor tables."""
    from captioner.concepts.detectors import PERSON, caption_labels
    from captioner.training import detectors as T

    probs = {name: T.probabilities(det, x, priors[name]).numpy() for name, (x, _) in sets.items()}
    report["ap_val"] = _ap_table(det, probs["val"], val_y.numpy())
    if coco is not None:
        labels = caption_labels([r.captions for r in coco[1]], det.members).numpy()
        report["ap_coco_captions"] = _ap_table(det, probs["coco"], labels)
    if PERSON in det.groups:
        k = det.groups.index(PERSON)
        for name, (_, y) in sets.items():
            report[f"ap_{name}_person"] = round(T.average_precision(probs[name][:, k], y), 4)
            report[f"{name}_person_floors"] = T.floor_report(probs[name][:, k], y, T.FLOORS)
            report[f"_{name}_person"] = probs[name][:, k]


if __name__ == "__main__":
    sys.exit(main())
