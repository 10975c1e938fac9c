"""Study (docs/confidence.md, "Gating on the model's own word probability"): each of the 600 graded captions
(docs/data/*_judged.csv) teacher-forced on its photo for every object word's probability, with its support from
the objects check; then, per support floor and word-probability tau, the sure captions (their out-of-fold
confidence on the shown number at the bundled sure_at) and what a person judged of them; and the pair chosen out
of fold. Run from the repository root: .venv/bin/python docs/studies/objects_gates.py (a few minutes, 1 thread)."""
import csv
import math
from pathlib import Path

import torch

import captioner
from captioner.decoding.confidence import objects_check, shown
from captioner.decoding.rules import checked_detectors, photo_evidence

torch.set_num_threads(1)
DATA = Path("../shared/data")
SETS = {"coco-paired val": (DATA / "coco-paired/images", "docs/data/coco_paired_val_judged.csv"),
        "Flickr8k val": (DATA / "flickr8k/Images", "docs/data/flickr8k_val_judged.csv"),
        "coco-mini": (DATA / "coco-mini/train2017", "docs/data/coco_mini_judged.csv")}


def graded_rows(m: captioner.Captioner) -> dict[str, list[dict]]:
    settings, out = m.decode_settings(), {}
    for name, (folder, path) in SETS.items():
        out[name] = []
        for r in csv.DictReader(open(path)):
            photo = m.read(folder / r["image"])
            cap = photo.explain(r["caption"])
            ev = photo_evidence(photo.reading, m.model, m.vocab, settings)
            check = objects_check(photo.reading, checked_detectors(m.model, settings), m.vocab, ev.words)
            toks = [m.vocab.stoi.get(w, m.vocab.unk) for w in cap.words]
            support = check.support[0, toks].tolist()
            named = [i for i, t in enumerate(toks) if bool(check.columns[t].any())]
            out[name].append({"judged": r["judged"], "absent": r.get("absent_objects", ""),
                              "confidence": float(r.get("confidence") or r["confidence_out_of_fold"]),
                              "objects": [(support[i], math.exp(float(cap.word_log_probs[i]))) for i in named]})
    return out


def sure(r: dict, sure_at: float, floor: float, tau: float) -> bool:
    return shown(r["confidence"]) >= sure_at and all(s >= floor and p >= tau for s, p in r["objects"])


def line(rows: list[dict], sure_at: float, floor: float, tau: float) -> str:
    kept = [r for r in rows if sure(r, sure_at, floor, tau)]
    wrong, absent = sum(r["judged"] == "wrong" for r in kept), sum(bool(r["absent"]) for r in kept)
    right = [r for r in rows if r["judged"] == "right"]
    lost = sum(not sure(r, sure_at, floor, tau) for r in right)
    return (f"{len(kept)} ({len(kept) / len(rows):.0%}), {1 - wrong / max(1, len(kept)):.3f}, {wrong}, {absent}, "
            f"{lost} of {len(right)}")


def main() -> None:
    m = captioner.load(dtype="float32")
    sure_at = m.resources.fitted.confidence.sure_at
    rows = graded_rows(m)
    print("floor, tau | per set: sure (coverage), P(not wrong | sure), wrong and sure, sure naming an absent object, "
          "right and not sure")
    grid = [(f, t) for f in (0.2, 0.25, 0.3, 0.4) for t in (0.0, 0.05, 0.1)]
    for f, t in grid:
        print(f"{f}, {t} | " + " | ".join(f"{n}: {line(rs, sure_at, f, t)}" for n, rs in rows.items()))
    def chosen(fit: list[dict]) -> tuple[float, float]:
        def gain(g):  # the bad sure captions it removes (wrong, or naming an absent object), minus the right ones
            return sum((1 if (r["judged"] == "wrong" or r["absent"]) else -(r["judged"] == "right"))
                       for r in fit if sure(r, sure_at, 0.2, 0.0) and not sure(r, sure_at, *g))
        return max(grid, key=lambda g: (gain(g), -g[0], -g[1]))
    for held in rows:  # out of fold: chosen on the other two sets
        best = chosen([r for n, rs in rows.items() if n != held for r in rs])
        print(f"{held}: chosen on the others {best}: before {line(rows[held], sure_at, 0.2, 0.0)}; "
              f"after {line(rows[held], sure_at, *best)}")
    print("chosen on all three sets:", chosen([r for rs in rows.values() for r in rs]))


if __name__ == "__main__":
    main()
