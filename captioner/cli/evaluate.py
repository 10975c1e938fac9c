"""Evaluate a captioner with the standard COCO caption metrics (pycocoevalcap, PTB tokenizer).

    .venv/bin/captioner-evaluate --dataset flickr8k --data-root ../shared/data/flickr8k --split test --beam-size 3
    .venv/bin/captioner-evaluate --dataset coco --images DIR --annotations captions_val2017.json --json
    .venv/bin/captioner-evaluate --dataset coco --images DIR --annotations captions_val2017.json --grounding

--report PAGE.html writes one self-contained page of where the model fails (captioner/ui/report.py): every
photo's caption, references, CIDEr, hallucinated and missed objects and the attention of each object word,
worst first, under the corpus scores; it opens offline (every image embedded).

--grounding (COCO only) also measures where the model looks when it names an object: the attention
mass inside the object's instance boxes, for the generated and the teacher-forced reference
captions (captioner/evaluation/grounding.py). The boxes come from instances_X.json beside captions_X.json, or
--instances PATH.

Decode settings left out are the model file's own (its config.decode); --decode KEY=VALUE sets any of
them (e.g. --decode block_trigrams=false); the output JSON records every setting used. COCO results are labelled with the annotation file's split (captions_val2017.json -> val2017).

Progress goes to stderr: a bar on a terminal, else a line at each tenth of the encoding and of the decoding
(logs.progress), so a log file or a pipe shows how far it is.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path



def _parser() -> argparse.ArgumentParser:
    import captioner
    from captioner.cli.decode_options import add_decode_options

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="model file (default: the bundled model)")
    p.add_argument("--dataset", choices=["flickr8k", "coco", "karpathy"], default="flickr8k")
    p.add_argument("--data-root", default="../shared/data/flickr8k", help="flickr8k: folder with Images/ + captions")
    p.add_argument("--split", choices=["train", "val", "test"], default="test")
    p.add_argument("--images", help="coco/karpathy: image folder")
    p.add_argument("--annotations", help="coco: captions_*.json (all its images); karpathy: dataset_*.json")
    p.add_argument("--split-file", default=None,
                   help="coco: only the photos this file names, one file name per line (e.g. coco-paired's split_val.txt)")
    add_decode_options(p)
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="first N images only (N >= 1; leave it out to evaluate every image of the split)")
    p.add_argument("--batch-size", type=int, default=100, help="images decoded together")
    p.add_argument("--cache-dir", default=None, help="reuse/build a feature cache here (frozen encoder)")
    p.add_argument("--output", default=None,
                   help="where the scores, settings and captions are written (default: evaluations/<run>-<model>_"
                        "<dataset>_<split>.json, e.g. a-best_flickr8k_test.json for runs/a/best.safetensors, "
                        "bundled_flickr8k_test.json for the bundled model; an existing file is replaced and the "
                        "command says so)")
    p.add_argument("--spice", action="store_true", help="also SPICE, when its Java models are installed")
    p.add_argument("--device", default=captioner.default_device(), help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=list(captioner.api.DTYPES), default="float32",
                   help="precision of the model (bfloat16: faster on CPUs with AVX512-BF16/AMX and on GPUs; int8: the "
                        "decoder step's products in int8 on a CPU, model/int8_rows.py)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the scores (the other lines "
                   "and the progress go to stderr)")
    p.add_argument("--grounding", action="store_true",
                   help="coco: also the attention mass inside the boxes of the objects each word names")
    p.add_argument("--hallucination", action="store_true",
                   help="also CHAIR-s, CHAIR-i and object recall (truth: COCO boxes + references; flickr8k: references)")
    p.add_argument("--coverage", action="store_true",
                   help="how far the caption's confidence can be trusted: CIDEr and CHAIR-s of the surest 100/90/80/70/"
                        "60/50%% of photos, AUROC, calibration error, the sure captions' share (needs a model file "
                        "with a fitted confidence map)")
    p.add_argument("--report", default=None, metavar="HTML",
                   help="also write one self-contained page of where the model fails: each photo's caption, "
                        "references, CIDEr, hallucinated and missed objects and object words' attention, worst first")
    p.add_argument("--instances", default=None,
                   help="coco: instances_*.json for --grounding/--hallucination (default: beside --annotations)")
    return p


def _records(args: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[list, str]:
    """The records to evaluate and the split label recorded with the results."""
    from captioner.config import DataConfig
    from captioner.data import build_records

    if args.split_file and args.dataset != "coco":
        p.error("--split-file is for --dataset coco (flickr8k and karpathy have their own splits)")
    if args.dataset == "flickr8k":
        data, split, label = DataConfig(dataset="flickr8k", root=args.data_root), args.split, args.split
    elif args.dataset == "coco":
        if not args.images or not args.annotations:
            p.error("--dataset coco needs --images and --annotations")
        # build_records' 'train' = the whole file, or the photos --split-file names (as a train_split)
        data = DataConfig(dataset="coco", images=args.images, annotations=args.annotations,
                          train_split=args.split_file or "")
        split, label = "train", coco_split_label(args.annotations)
        if args.split_file:  # labelled "<captions file>-<split file>"
            label = f"{label}-{Path(args.split_file).stem}"
    else:
        data = DataConfig(dataset="karpathy", images=args.images or "", annotations=args.annotations or "")
        split = label = args.split
    data.limit = args.limit or 0  # DataConfig: 0 = all
    return build_records(data, split), label


def _features(args: argparse.Namespace, loaded, records: list, label: str, say) -> tuple:
    """(features (N', P, D) of the readable images, their indices in records)."""
    from captioner.data.features import build_cache
    from captioner.evaluation.scoring import encode_records

    if not args.cache_dir:
        return encode_records(loaded.model, records, loaded.preprocess, args.device, num_workers=2,
                              progress=True)
    part = f"{label}-first{args.limit}" if args.limit else label  # "val2017-first2", not "val20172"
    name = loaded.preprocess.cache_name(args.dataset, part, args.dtype)
    cache = build_cache(args.cache_dir, name, loaded.model.encoder, loaded.preprocess, records, args.device,
                        log=say, progress=True)
    keep = [i for i, r in enumerate(records) if r.image_id not in set(cache.missing)]
    return (cache.features[keep] if len(keep) < len(records) else cache.features), keep


def main(argv: list[str] | None = None) -> int:
    import captioner
    from captioner.cli.decode_options import decode_settings
    from captioner.evaluation.scoring import evaluate_model
    from captioner.evaluation.metrics import METRIC_KEYS, java_available, missing_java

    p = _parser()
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:  # 0 used to mean "all", against the help's "first N"
        p.error(f"--limit must be at least 1, got {args.limit} (leave it out to evaluate every image)")
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    from captioner.cli import torchvision_refused

    if torchvision_refused():
        return 2
    if not java_available():  # the reported scores are pycocoevalcap's: refused in one line before any work
        print(f"error: {missing_java()}", file=sys.stderr)
        return 2
    try:
        loaded = captioner.load(args.checkpoint, device=args.device, dtype=args.dtype)
        used = decode_settings(loaded, args)
        records, label = _records(args, p)
        need_boxes = args.grounding or ((args.hallucination or args.report or args.coverage) and args.dataset == "coco"
                                        and _has_boxes(args, say))
        instances = load_grounding_instances(args) if need_boxes else None
    except (ValueError, TypeError, FileNotFoundError, captioner.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.output = args.output or default_output(args, label, {k: v for k, v in dataclasses.asdict(used).items()
                                                              if v != getattr(loaded.config.decode, k)})
    t0 = time.time()
    feats, keep = _features(args, loaded, records, label, say)
    if len(keep) < len(records):
        bad = [records[i].image_id for i in sorted(set(range(len(records))) - set(keep))]
        say(f"WARNING: {len(bad)} image(s) could not be read and are not scored: {', '.join(bad[:10])}")
    scored, t1 = [records[i] for i in keep], time.time()
    scores, preds, caps = evaluate_model(loaded.model, loaded.vocab, feats, scored, used, loaded.resources,
                                         METRIC_KEYS, args.batch_size, progress=True, log=say)
    say(f"encoded {len(keep)} images in {t1 - t0:.1f}s, decoded (beam {used.beam_size}) and scored in "
        f"{time.time() - t1:.1f}s; captions -> {args.output}")
    if args.spice:
        from captioner.evaluation.metrics import score_captions

        scores.update(score_captions(preds, {r.image_id: r.captions for r in scored}, metrics=(), spice=True, log=say))
    grounding = _grounding(args, loaded, feats, scored, caps, preds, instances)
    if args.coverage:
        scores["coverage"] = coverage_report(caps, scored, instances, say)
    _write(args, label, used, scores, grounding, preds)
    if args.report:
        _report(args, label, scored, caps, scores, instances, say)
    return 0


def _report(args: argparse.Namespace, label: str, records: list, caps: list, scores: dict, instances, say) -> None:
    """--report: the failure page (captioner/ui/report.py), with per-photo CIDEr and the boxes when there are any."""
    from captioner.evaluation.grounding import boxed_categories
    from captioner.evaluation.metrics import cider_per_image
    from captioner.ui.report import write_report

    refs = {r.image_id: r.captions for r in records}
    cider = cider_per_image({r.image_id: c.text for r, c in zip(records, caps)}, refs)
    boxed = boxed_categories(instances, refs) if instances is not None else None
    model = Path(args.checkpoint).name if args.checkpoint else "bundled model"
    out = write_report(args.report, records, caps, scores, cider, boxed, f"{model} on {args.dataset} {label}")
    say(f"report of {len(records)} photos, worst first -> {out}")


def _write(args: argparse.Namespace, label: str, used, scores: dict, grounding: dict, preds: dict) -> None:
    """The --output file (settings, scores, grounding, captions) and the printed summary."""
    import captioner
    from captioner.evaluation.metrics import METRIC_KEYS

    out = Path(args.output)
    if out.exists():
        print(f"note: replacing the earlier result at {out}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(
        {"checkpoint": str(args.checkpoint or captioner.DEFAULT_CHECKPOINT), "model_file": _model_path(args.checkpoint),
         "dataset": args.dataset, "split": label,
         **dataclasses.asdict(used), "scores": scores, **{k: g.to_dict() for k, g in grounding.items()},
         "captions": [{"image_id": k, "caption": v} for k, v in preds.items()]}, indent=1))
    if args.json:
        print(json.dumps({**{k: scores[k] for k in (*METRIC_KEYS, "n_images")},  # exactly these keys
                          **{k: g.to_dict() for k, g in grounding.items()}}))  # + grounding_* with --grounding
        return
    for k in (*METRIC_KEYS, "SPICE", "bad_ending", "repeated_bigram", "salad"):
        if k in scores:
            print(f"{k:16s} {scores[k]:.4f}")
    for kind in ("adjacent", "x_and_x", "content"):  # repeated words, the captions' share beside the people's
        if f"repeat_{kind}" in scores:
            print(f"{'repeat ' + kind:16s} {scores[f'repeat_{kind}']:.4f}  (references "
                  f"{scores.get(f'references_repeat_{kind}', float('nan')):.4f})")
    print(f"images           {scores['n_images']}")
    for k, g in grounding.items():
        label = k.replace("grounding_", "grounding (") + ")" if k.startswith("grounding_") else k
        print(f"{label:28s} {g}")


def _grounding(args: argparse.Namespace, loaded, feats, scored: list, caps: list, preds: dict, instances) -> dict:
    """--grounding (attention in the boxes of the words' objects) and --hallucination (CHAIR), each where asked."""
    grounding = {}
    if instances is not None and args.grounding:
        from captioner.concepts.imagenet import imagenet_head_or_none
        from captioner.evaluation.grounding import ground_captions, ground_concept_maps, ground_references

        grounding = {"grounding_generated": ground_captions(caps, scored, instances),
                     "grounding_teacher_forced": ground_references(loaded, feats, scored, instances)}
        if imagenet_head_or_none(loaded.model) is not None:  # the ceiling of train.alpha_cam: the classifier's own maps
            grounding["grounding_concept_maps"] = ground_concept_maps(loaded, feats, scored, instances)
    if args.hallucination:
        grounding.update(hallucination_report(preds, scored, instances))
    return grounding


def hallucination_report(preds: dict, records: list, instances) -> dict:
    """CHAIR of the generated captions and, as a human baseline, of each reference against the others;
    truth = boxed categories (COCO) + what the references name, or the references alone (no boxes)."""
    from captioner.evaluation.grounding import boxed_categories, measure_hallucination, measure_references

    refs = {r.image_id: r.captions for r in records}
    boxed = boxed_categories(instances, refs) if instances is not None else None
    return {"hallucination": measure_hallucination(preds, refs, boxed),
            "hallucination_references": measure_references(refs, boxed)}


def coverage_report(caps: list, records: list, instances, say) -> dict | None:
    """--coverage: each photo's per-photo CIDEr-D (the set's document frequencies) and CHAIR beside its caption's
    confidence -> confidence_fit.summary at the file's fitted sure_at, printed; None (and a line saying why) without
    confidences."""
    from captioner.evaluation.confidence_fit import Row, summary
    from captioner.evaluation.grounding import boxed_categories
    from captioner.evaluation.hallucination import CATEGORY_WORDS, caption_hallucination, word_table
    from captioner.evaluation.metrics import cider_per_image

    if any(c.confidence is None for c in caps):
        say("coverage: not measured: this model file has no fitted confidence map (captioner-fit-selector "
            "--confidence fits one)")
        return None
    sure_at = next((c.sure_at for c in caps), None)  # the model file's (fitted with its map), on every caption
    refs = {r.image_id: r.captions for r in records}
    cider = cider_per_image({r.image_id: c.text for r, c in zip(records, caps)}, refs)
    boxed = boxed_categories(instances, refs) if instances is not None else None
    table = word_table(CATEGORY_WORDS)
    rows = [Row(c.sure_signals, cider[r.image_id], bool(caption_hallucination(
        r.image_id, c.text, r.captions, None if boxed is None else boxed[r.image_id], table).hallucinated), c.text,
        r.image_id) for r, c in zip(records, caps)]
    out = summary([c.confidence for c in caps], rows, sure_at)
    say(f"coverage ({'boxes and references' if boxed else 'references only'} for CHAIR-s): "
        + ", ".join(f"{k} CIDEr {v['CIDEr']:.3f} CHAIR-s {v['CHAIR-s']:.3f}" for k, v in out["coverage"].items()))
    say(f"confidence: AUROC {out['AUROC good']:.3f} (CIDEr >= .5), {out['AUROC bottom third']:.3f} (bottom third), "
        f"calibration error {out['calibration error']:.3f}; sure (>= {sure_at:.2f}) {out['sure']['share']:.0%} of "
        f"photos, CIDEr {out['sure']['CIDEr']:.3f}, CHAIR-s {out['sure']['CHAIR-s']:.3f}")
    return out


def _has_boxes(args: argparse.Namespace, say) -> bool:
    """--hallucination on COCO captions: with instance boxes when there are any (--instances or beside the
    captions file); without them (e.g. coco-paired) the truth is what the references name, as on Flickr8k."""
    from captioner.evaluation.boxes import instances_path_for

    if args.instances or instances_path_for(args.annotations).is_file():
        return True
    say(f"note: no instance boxes for {args.annotations}: CHAIR and recall use what the references name")
    return False


def default_output(args: argparse.Namespace, label: str, changed: dict | None = None) -> str:
    """evaluations/<run>-<model file stem>_<dataset>_<split label>[-firstN][_<setting><value>...].json: one file
    per model, data and decoding, so a COCO result never lands on a Flickr8k one, two runs' best.safetensors
    (runs/a/, runs/b/) never land on each other's (a-best_..., b-best_...), and the same model decoded with other
    settings than its file's (`changed`: setting -> value, e.g. beam_size 3 -> _beam_size3) keeps its own file;
    <run> is the model file's folder, the bundled model is "bundled". Where that name already holds the result of
    another model file (a folder of the same name elsewhere), the name gets a short hash of this file's path."""
    part = f"{label}-first{args.limit}" if args.limit else label
    decode = "".join(f"_{k}{v}" for k, v in sorted((changed or {}).items()))
    name = f"{model_label(args.checkpoint)}_{args.dataset}_{part}{decode}"
    path = Path("evaluations") / f"{name}.json"
    if path.is_file() and _written_for(path) not in (None, _model_path(args.checkpoint)):
        path = path.with_name(f"{name}-{hashlib.sha1(_model_path(args.checkpoint).encode()).hexdigest()[:6]}.json")
    return str(path)


def _model_path(checkpoint: str | None) -> str:
    import captioner

    return str(Path(checkpoint or captioner.DEFAULT_CHECKPOINT).resolve())


def _written_for(result: Path) -> str | None:
    """The model file (resolved) an earlier result was written for; None when it does not say (unreadable)."""
    try:
        data = json.loads(result.read_text())
        return str(data.get("model_file") or Path(data["checkpoint"]).resolve())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def model_label(checkpoint: str | None) -> str:
    """A model file's readable name for its results: "<folder>-<stem>" (runs/a/best.safetensors -> a-best,
    the folder as resolved, so ./best.safetensors inside runs/a is a-best too); "bundled" for None."""
    if not checkpoint:
        return "bundled"
    path = Path(checkpoint).resolve()
    return f"{path.parent.name}-{path.stem}" if path.parent.name else path.stem


def coco_split_label(annotations: str | Path) -> str:
    """The split a COCO caption file holds, from its name: captions_val2017.json -> val2017."""
    return Path(annotations).stem.removeprefix("captions_")


def load_grounding_instances(args: argparse.Namespace):
    """The COCO instance boxes for --grounding: --instances, else instances_X.json beside captions_X.json."""
    from captioner.evaluation.grounding import instances_path_for, load_instances

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
