"""Study (docs/hallucination.md, "Where the map contradicts the word"): for each object word of the bundled model's
graded captions (docs/data/*_judged.csv) that has a class activation map (the encoder sees its category,
P >= MIN_PROB), how well the overlap of the word's attention with that map tells a word the person marked absent
from one that is there, against the classifier's own probability. Run from the repository root:
.venv/bin/python docs/studies/map_flags.py (a few minutes, 1 thread)."""
import csv
from pathlib import Path

import numpy as np
import torch

import captioner
from captioner.ui.visualize import half_mass_cells

torch.set_num_threads(1)
DATA = Path("../shared/data")
SETS = {"coco-paired val": (DATA / "coco-paired/images", "docs/data/coco_paired_val_judged.csv"),
        "Flickr8k val": (DATA / "flickr8k/Images", "docs/data/flickr8k_val_judged.csv")}
MEASURES = {"attention inside the map's half-mass region": "share",
            "map inside the attention's half-mass region": "reverse",
            "Bhattacharyya overlap of the two": "overlap",
            "the classifier's P(category) (what the objects check reads)": "p"}


def measures(alpha: np.ndarray, cmap: np.ndarray, p: float) -> dict[str, float]:
    a = np.asarray(alpha, np.float64) / float(np.sum(alpha))
    c = np.asarray(cmap, np.float64) / float(np.sum(cmap))
    return {"share": float(a[half_mass_cells(c)].sum()), "reverse": float(c[half_mass_cells(a)].sum()),
            "overlap": float(np.sqrt(a * c).sum()), "p": p}


def auc(rows: list[dict], key: str) -> float:
    """P(an absent word scores below a present one), ties half: .5 is no signal."""
    pos = np.array([r[key] for r in rows if r["absent"]])[:, None]
    neg = np.array([r[key] for r in rows if not r["absent"]])[None, :]
    return float(((pos < neg) + 0.5 * (pos == neg)).mean())


def main() -> None:
    m = captioner.load(dtype="float32")
    rows = []
    for folder, path in SETS.values():
        for r in csv.DictReader(open(path)):
            cap = m.read(folder / r["image"]).caption()
            if cap.text != r["caption"]:
                continue  # graded on another caption
            absent = {a.rstrip("s") for a in r["absent_objects"].split(";") if a}
            for i, (_, p, cmap) in cap.concept_maps.items():
                rows.append({**measures(cap.alphas[i], cmap, p), "absent": cap.words[i].rstrip("s") in absent})
    print(f"{len(rows)} object words with a map; {sum(r['absent'] for r in rows)} absent by the person's grade")
    for label, key in MEASURES.items():
        print(f"{label}: AUC {auc(rows, key):.2f}")
    for t in (0.1, 0.2, 0.3, 0.4):
        flagged = [r["absent"] for r in rows if r["share"] < t]
        kept = [r["absent"] for r in rows if r["share"] >= t]
        print(f"flag at share < {t:.1f}: {len(flagged)} words flagged, {sum(flagged)} of them absent; "
              f"{len(kept)} not flagged, {sum(kept)} absent")


if __name__ == "__main__":
    main()
