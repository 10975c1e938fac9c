"""Fit the choice among the beam's captions (captioner/decoding/choice.py) on val photos, and say what it gains.

    .venv/bin/captioner-fit-selector --data ../shared/data --cache-dir cache --output evaluations/selector.json

For each val set found under --data (coco-paired's val split, Flickr8k's val split, coco-mini; never a test split)
the model decodes every photo's candidates (the beam at the file's settings, --beam-size to change it), each
candidate gets its signals and its CIDEr against the photo's references, and the command prints

- the pool's headroom: the best candidate of each photo (the oracle), the beam's first, a random candidate and the
  file's current choice (for --pools beam sizes and nucleus samples too, with each pool's decoding time);
- each signal's out-of-fold gain: the CIDEr of the choices of weights fitted without the photo (5 folds over all
  sets' photos, 3 shuffles), with every signal and with each one left out;
- the weights fitted on every photo of the kept signals, then CIDEr, CHAIR-s, CHAIR-i and object recall of their
  choices with each --objects weight added (the signal that rewards naming what the encoder's head sees and
  penalises naming what it barely sees: CIDEr hardly notices a wrong object, a person reading the caption does);
- the kept weights, under "fitted" in the --output report: `captioner-export MODEL OUT --fitted REPORT` stores
  them as the model file's fitted data (decoding/resources.py; they are not decode settings).

A signal is kept when leaving it out lowers the mean out-of-fold CIDEr over the sets (each set weighed alike) by
more than MIN_GAIN.
The model file must have its consensus memory beside it (captioner-build-consensus). Feature caches go in
--cache-dir (the encoder runs once per set).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

VAL_SETS = ("coco-paired-val", "flickr8k-val", "coco-mini")
# a signal's out-of-fold gain (mean CIDEr over the sets) below this is noise, not kept: on the bundled model two runs'
# gains of length (-.0002, +.0018) and top_object (+.0003, +.0013) moved by more than themselves
MIN_GAIN = 0.003


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="model file (default: the bundled model)")
    p.add_argument("--data", default="../shared/data", help="folder holding coco-paired/, flickr8k/ and coco-mini/")
    p.add_argument("--sets", nargs="+", action="extend", default=[], choices=VAL_SETS,
                   help="val sets to fit on (default: every one)")
    p.add_argument("--cache-dir", default="cache", help="feature caches (reused when they match the encoder)")
    p.add_argument("--beam-size", type=int, default=None, help="the pool to choose from (default: the file's)")
    p.add_argument("--pools", nargs="+", action="extend", default=[], metavar="POOL",
                   help="also measure these pools' headroom: beamK (e.g. beam10) or sampleN (N nucleus samples, "
                        "temperature .6, top-p .9, added to the beam's)")
    p.add_argument("--objects", type=float, nargs="+", action="extend", default=[], metavar="W",
                   help="weights of the objects signal to try beside the fitted weights (default 0 1 2 3; CIDEr "
                        "hardly sees a wrong object, CHAIR does): the one of least CHAIR-s within .005 mean CIDEr of "
                        "the best is kept")
    p.add_argument("--confidence", action="store_true",
                   help="fit how sure a caption is (decoding/confidence.py) instead of the choice: out-of-fold AUROC, "
                        "calibration, coverage per set, and the map with its sure_at under \"fitted\" in --output")
    p.add_argument("--use", nargs="+", action="extend", default=[], metavar="SIGNAL",
                   help="with --confidence: fit the map on these signals (decoding/confidence.py SIGNALS) instead of "
                        "those the leave-one-out rule keeps (its table is printed either way)")
    p.add_argument("--judged", nargs="+", action="extend", default=[], metavar="CSV",
                   help="with --confidence: person-judged captions (docs/data/*_judged.csv) to set the out-of-fold "
                        "confidence against (rows matched by photo and caption text)")
    p.add_argument("--limit", type=int, default=None, help="the first N photos of each set (a quick look)")
    p.add_argument("--output", default=None, help="write the tables and the fitted data (\"fitted\": what "
                   "captioner-export --fitted stores in a model file) as JSON here")
    return p


def _records(data: Path, name: str, limit: int | None) -> list:
    from captioner.config import DataConfig
    from captioner.data import build_records

    if name == "coco-paired-val":
        root = data / "coco-paired"
        cfg, split = DataConfig(dataset="coco", images=str(root / "images"), annotations=str(root / "captions.json"),
                                train_split=str(root / "split_val.txt")), "train"  # 'train' = the split file's photos
    elif name == "flickr8k-val":
        cfg, split = DataConfig(dataset="flickr8k", root=str(data / "flickr8k")), "val"
    else:
        root = data / "coco-mini"
        cfg, split = DataConfig(dataset="coco", images=str(root / "train2017"),
                                annotations=str(root / "annotations" / "captions_train2017.json")), "train"
    return build_records(cfg, split, limit)


def _pools(loaded, feats, settings, extra: list[str]) -> dict[str, tuple[list, float]]:
    """{pool name: (each photo's hypotheses in beam order, seconds per photo)} for the beam and each extra pool."""
    import torch

    from captioner.decoding.captions import decode_photos, sampled_captions
    from captioner.decoding.reading import read_heads
    from captioner.decoding.sampling import Draw, SampleSettings
    from captioner.decoding.search import Hypothesis

    beam = dataclasses.replace(settings, fitted_choice=False)  # the beam's own order: the choice is fitted here
    out = {}
    for name in [f"beam{settings.beam_size}"] + extra:
        t0, hyps = time.perf_counter(), []
        for k in range(0, len(feats), 50):
            x = feats[k:k + 50]
            reading = read_heads(loaded.model, x)
            if name.startswith("beam"):
                hyps += [list(d.hyps) for d in decode_photos(loaded.model, x, reading, loaded.vocab, dataclasses.replace(
                    beam, beam_size=int(name[4:])), loaded.resources).photos]
            else:
                caps = sampled_captions(loaded.model, x, reading, loaded.vocab, beam,
                                        SampleSettings(int(name[6:]), Draw(0.6, 0, 0.9), 0).checked())
                hyps += [[Hypothesis([loaded.vocab.stoi[w] for w in c.words], torch.zeros(0), c.log_prob,
                                     c.log_prob / (len(c.words) + 1)) for c in cs] for cs in caps]
        out[name] = (hyps, (time.perf_counter() - t0) / max(len(feats), 1))
    return out


def main(argv: list[str] | None = None) -> int:
    import captioner

    args = _parser().parse_args(argv)
    args.sets, args.objects = args.sets or list(VAL_SETS), args.objects or [0.0, 1.0, 2.0, 3.0]
    try:
        loaded = captioner.load(args.checkpoint)
        settings = loaded.decode_settings(**({"beam_size": args.beam_size} if args.beam_size else {}))
        if loaded.resources.memory is None:
            raise ValueError("the model file has no consensus memory beside it: build one with captioner-build-consensus")
        for pool in args.pools:
            if not (pool[:4] == "beam" and pool[4:].isdigit() or pool[:6] == "sample" and pool[6:].isdigit()):
                raise ValueError(f"--pools: '{pool}' is neither beamK nor sampleN")
        sets = {n: _records(Path(args.data), n, args.limit) for n in args.sets}
    except (ValueError, FileNotFoundError, captioner.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report: dict = {"checkpoint": str(args.checkpoint or captioner.DEFAULT_CHECKPOINT),
                    "settings": dataclasses.asdict(settings), "headroom": {}}
    fitted, truth, sure = {}, {}, {}
    for name, records in sets.items():
        rows, fitted[name], truth[name], sure[name] = _measure(loaded, name, records, settings, args)
        report["headroom"][name] = rows
        for pool_name, row in rows.items():
            print(f"{name} {pool_name}: " + ", ".join(f"{key} {v:.3f}" if key != "ms per photo" else f"{v:.0f} ms/photo"
                                                      for key, v in row.items()), flush=True)
    if args.confidence:
        report["confidence"] = _confidence(sure, args.use, args.judged)
        report["fitted"] = {"confidence": report["confidence"].pop("fitted")}
        print(_store_line(args))
        _write(args.output, report)
        return 0
    report.update(_signals(fitted))
    report.update(_objects(fitted, truth, report["weights"], args.objects))
    try:
        report["fitted"] = {"choice": _as_fitted(report["weights"])}
    except ValueError as e:
        report["fitted"] = None
        print(f"error: {e}", file=sys.stderr)
    else:
        print(f"the choice: {report['fitted']['choice']}; {_store_line(args)}")
    _write(args.output, report)
    return 0 if report["fitted"] is not None else 1


def _store_line(args: argparse.Namespace) -> str:
    """How to store the report's fitted data in a model file."""
    report = args.output or "REPORT.json (rerun with --output REPORT.json)"
    return f"store it: captioner-export MODEL OUT --half --fitted {report}"


def _write(output: str | None, report: dict) -> None:
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(report, indent=1))


def _confidence(sure: dict, use: list[str], judged: list[str]) -> dict:
    """The confidence map judged out of fold on each set (and against each judged CSV), its threshold, and the map
    fitted on every photo; use: the signals to fit on (none: those kept_signals keeps)."""
    import dataclasses as dc

    from captioner.decoding.confidence import SIGNALS
    from captioner.evaluation.confidence_fit import fit_sets, kept_signals, out_of_fold, summary, threshold

    kept, table = kept_signals(sure)
    print("out-of-fold mean AUROC (bottom third of CIDEr): " + ", ".join(f"{k} {v:.3f}" for k, v in table.items()))
    print(f"kept: {', '.join(kept)}")
    if use:
        unknown = sorted(set(use) - set(SIGNALS))
        if unknown:
            raise SystemExit(f"error: --use: unknown signals {unknown} (known: {', '.join(SIGNALS)})")
        kept = [s for s in SIGNALS if s in use]
        print(f"fitted on (--use): {', '.join(kept)}")
    oof = out_of_fold(sure, use=kept)
    at = threshold(oof, sure)
    report = {"signals": table, "kept": kept, "sure_at": at, "out of fold": {}}
    for name, rows in sure.items():
        s = report["out of fold"][name] = summary(oof[name], rows, at)
        print(f"{name}: {s['photos']} photos, good {s['good']:.2f}, AUROC {s['AUROC good']:.3f} (bottom third "
              f"{s['AUROC bottom third']:.3f}), calibration error {s['calibration error']:.3f}; sure "
              f"{s['sure']['share']:.0%} CIDEr {s['sure']['CIDEr']:.3f} CHAIR-s {s['sure']['CHAIR-s']:.3f} (unsure "
              f"CIDEr {s['sure']['unsure CIDEr']:.3f})")
        print("  coverage " + ", ".join(f"{k} CIDEr {v['CIDEr']:.3f} CHAIR-s {v['CHAIR-s']:.3f}"
                                       for k, v in s["coverage"].items()))
        print("  reliability " + ", ".join(f"{r['bin']}: {r['photos']} at {r['confidence']:.2f} -> {r['good']:.2f}"
                                          for r in s["reliability"]))
    fitted = dc.replace(fit_sets(sure, use=kept), sure_at=at).rounded()
    report["fitted"] = fitted.to_json()
    report["rows"] = {n: [{"image": r.image_id, "caption": r.caption, "cider": r.cider, "confidence": c,
                           "hallucinates": r.hallucinates, "signals": r.signals} for r, c in zip(rows, oof[n])]
                      for n, rows in sure.items()}
    print(f"the map: bias {fitted.bias:g}, " + ", ".join(f"{s} {w:g}" for s, w in fitted.to_json()["weights"].items()
                                                      if w) + f", sure at {fitted.sure_at:g}")
    report["judged"] = _judged(judged, report["rows"], at)
    return report


def _judged(paths: list[str], rows: dict, at: float) -> dict:
    """Each judged CSV's rows matched to the out-of-fold confidences: AUROCs and the crosstab at `at`."""
    from captioner.evaluation.confidence_fit import seen
    from captioner.evaluation.judged import crosstab, matched, read_judged

    scored = [(r["image"], r["caption"], r["confidence"], seen(r["signals"])) for rs in rows.values() for r in rs]
    out = {}
    for path in paths:
        t = out[path] = crosstab(matched(read_judged(path), scored), at)
        print(f"{path}: {t['rows']} judged captions matched, AUROC not wrong {t['AUROC not wrong']:.3f}, right "
              f"{t['AUROC right']:.3f}; sure {t['sure']}, wrong and sure {t['wrong and sure']} of {t['wrong']}, right "
              f"and not sure {t['right and not sure']} of {t['right']}, P(not wrong | sure) "
              f"{t['P(not wrong | sure)']:.2f}")
    return out


def _measure(loaded, name: str, records: list, settings, args: argparse.Namespace) -> tuple[dict, list, tuple]:
    """One val set: its pools' headroom rows, the Pools (signals, CIDEr, texts) of the file's own beam, and what
    CHAIR needs (image ids, references, COCO boxes where the set has them)."""
    import numpy as np
    import torch

    from captioner.concepts.words import word_categories
    from captioner.data.features import build_cache
    from captioner.decoding.confidence import decide
    from captioner.decoding.confidence import SIGNALS as JUDGED
    from captioner.decoding.rules import checked_detectors, photo_evidence
    from captioner.decoding.reading import read_heads
    from captioner.decoding.choice import CIDER_SIGNALS, SIGNALS, WIDE, agreements, signals
    from captioner.decoding.confidence import objects_check
    from captioner.decoding.choice import Pool as Candidates
    from captioner.evaluation.choice_fit import Pool, baselines, candidate_cider

    memory, fitted_now = loaded.resources.memory, loaded.resources.fitted  # the file's current choice and map
    cache = build_cache(args.cache_dir, loaded.preprocess.cache_name(name, "val"), loaded.model.encoder,
                        loaded.preprocess, records, "cpu", num_workers=1, progress=False, log=print)
    keep = [i for i, r in enumerate(records) if r.image_id not in set(cache.missing)]
    feats = torch.from_numpy(np.asarray(cache.features[keep], dtype=np.float32))  # (N, P, D)
    refs = [records[i].captions for i in keep]
    ids = [records[i].image_id for i in keep]
    boxed = _boxes(args, name, dict(zip(ids, refs)))
    reading = read_heads(loaded.model, feats)
    probs, evidence = reading.probs, photo_evidence(reading, loaded.model, loaded.vocab, settings)  # (N, C) or None
    person = None if evidence is None else evidence.person  # (P(person) (N,), person words (V,)) or None
    check = None if evidence is None else objects_check(reading, checked_detectors(loaded.model, settings),
                                                        loaded.vocab, evidence.words)
    pools = _pools(loaded, feats, settings, args.pools)
    k = settings.consensus_k
    nearest, categories = memory.nearest(feats, WIDE * k)[1].tolist(), word_categories(loaded.vocab).to(torch.bool)
    rows, fitted = {}, []
    for pool_name, (hyps, seconds) in pools.items():
        if pool_name.startswith("sample"):  # the beam's candidates and the samples: the pool a choice would see
            beam_hyps = pools[f"beam{settings.beam_size}"][0]
            hyps = [b + [h for h in s if all(h.tokens != c.tokens for c in b)] for b, s in zip(beam_hyps, hyps)]
        texts = [tuple(" ".join(loaded.vocab.itos[t] for t in h.tokens) for h in hs) for hs in hyps]
        cider = candidate_cider(refs, texts)
        current = decide(hyps, feats, probs, memory, loaded.vocab, settings, fitted_now.choice_in_use(settings),
                         fitted_now.map_in_use(settings), judged=JUDGED, person=person,
                         categories=None if evidence is None else evidence.words, check=check)
        every_one = Candidates.of(hyps, len(loaded.vocab), least=1)  # every photo's candidates, flat
        x = signals(every_one, len(hyps), agreements(every_one, nearest, k, memory, CIDER_SIGNALS), probs, categories,
                    person).split(
            [len(hs) for hs in hyps])  # (n, S) per photo
        pool = [Pool(xs, torch.tensor(c, dtype=torch.float64), [id(h) for h in hs].index(id(cur.best)), t)
                for xs, hs, c, cur, t in zip(x, hyps, cider, current, texts)]
        rows[pool_name] = {**baselines(pool), "ms per photo": 1000 * seconds}
        if pool_name == f"beam{settings.beam_size}":
            fitted, sure = pool, _sure_rows(current, pool, ids, refs, boxed)
    return rows, fitted, (ids, refs, boxed), sure


def _sure_rows(current: list, pools: list, ids: list, refs: list, boxed: dict | None) -> list:
    """Each photo's chosen caption as a confidence_fit.Row: its confidence signals, CIDEr-D, CHAIR."""
    from captioner.evaluation.confidence_fit import Row
    from captioner.evaluation.hallucination import CATEGORY_WORDS, caption_hallucination, word_table

    table = word_table(CATEGORY_WORDS)
    out = []
    for cur, pool, i, r in zip(current, pools, ids, refs):
        text = pool.texts[pool.shipped]
        h = caption_hallucination(i, text, r, None if boxed is None else boxed[i], table)
        out.append(Row(cur.sure_signals, float(pool.cider[pool.shipped]), bool(h.hallucinated), text, str(i)))
    return out


def _boxes(args: argparse.Namespace, name: str, refs: dict) -> dict | None:
    """coco-mini's boxed categories per photo (CHAIR against boxes + references); None: references only."""
    if name != "coco-mini":
        return None
    from captioner.evaluation.grounding import boxed_categories, load_instances

    return boxed_categories(load_instances(Path(args.data) / "coco-mini" / "annotations" / "instances_train2017.json"), refs)


def _objects(fitted: dict, truth: dict, weights: dict[str, float], values: list[float]) -> dict:
    """CIDEr and CHAIR of the fitted weights' choices with each objects weight; the kept one (least mean CHAIR-s
    among those within .005 mean CIDEr of the best) replaces the fitted objects weight."""
    import torch

    from captioner.decoding.choice import SIGNALS
    from captioner.evaluation.choice_fit import chosen_cider, chosen_texts
    from captioner.evaluation.hallucination import measure_hallucination

    table = {}
    scale = weights["score"] + weights["consensus"]  # the stored choice's scale: score + consensus = 1
    for v in values:  # v as the stored choice holds it
        w = torch.tensor([v * scale if s == "objects" else weights[s] for s in SIGNALS], dtype=torch.float64)
        row = {}
        for name, pools in fitted.items():
            ids, refs, boxed = truth[name]
            h = measure_hallucination(dict(zip(ids, chosen_texts(pools, w))), dict(zip(ids, refs)), boxed)
            row[name] = {"CIDEr": sum(chosen_cider(p, w) for p in pools) / len(pools),
                         "CHAIR-s": h.chair_s, "CHAIR-i": h.chair_i, "recall": h.recall}
        table[v] = row
        print(f"objects {v:g}: " + " | ".join(f"{n} CIDEr {r['CIDEr']:.3f} CHAIR-s {r['CHAIR-s']:.3f} CHAIR-i "
                                              f"{r['CHAIR-i']:.3f} recall {r['recall']:.3f}" for n, r in row.items()))
    mean = {v: {k: sum(r[k] for r in row.values()) / len(row) for k in ("CIDEr", "CHAIR-s")} for v, row in table.items()}
    best = max(m["CIDEr"] for m in mean.values())
    keep = min((v for v in values if mean[v]["CIDEr"] >= best - 0.005), key=lambda v: (mean[v]["CHAIR-s"], -v))
    print(f"objects weight kept: {keep:g} (in-sample: the fit's other weights are fitted on these photos too)")
    return {"objects": {str(v): row for v, row in table.items()}, "weights": {**weights, "objects": keep * scale}}


def _signals(fitted: dict) -> dict:
    """Out-of-fold CIDEr with the beam's score only, every signal, each signal left out; the signals kept (leaving
    one out lowers the sets' mean) and their weights fitted on every photo."""
    from captioner.decoding.choice import SIGNALS
    from captioner.evaluation.choice_fit import fit, out_of_fold

    table = {"beam score only": out_of_fold(fitted, ["score"]), "every signal": out_of_fold(fitted, list(SIGNALS))}
    print("out of fold: beam score only " + _line(table["beam score only"]) + " | every signal "
          + _line(table["every signal"]), flush=True)
    for s in SIGNALS[1:]:
        table[f"without {s}"] = out_of_fold(fitted, [u for u in SIGNALS if u != s])
        gain = _mean(table["every signal"]) - _mean(table[f"without {s}"])
        print(f"  without {s:11s} {_line(table[f'without {s}'])}  (its gain {gain:+.4f})", flush=True)
    kept = ["score"] + [s for s in SIGNALS[1:] if _mean(table["every signal"]) - _mean(table[f"without {s}"]) > MIN_GAIN]
    kept_oof = out_of_fold(fitted, kept)
    print(f"kept {', '.join(kept)}: out of fold {_line(kept_oof)}")
    weights = fit([p for pools in fitted.values() for p in pools], kept)
    return {"signals": table, "kept": kept, "kept out of fold": kept_oof, "weights": dict(zip(SIGNALS, weights.tolist()))}


def _as_fitted(weights: dict[str, float]) -> dict[str, float]:
    import torch

    from captioner.decoding.choice import SIGNALS
    from captioner.evaluation.choice_fit import as_fitted

    return as_fitted(torch.tensor([weights[s] for s in SIGNALS], dtype=torch.float64))


def _mean(scores: dict[str, float]) -> float:
    return sum(scores.values()) / len(scores)


def _line(scores: dict[str, float]) -> str:
    return ", ".join(f"{n} {v:.3f}" for n, v in scores.items())


if __name__ == "__main__":
    sys.exit(main())
