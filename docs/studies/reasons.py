"""Study (docs/confidence.md, "Reasons a person can act on"): the reason each graded caption the bundled model
leaves unsure gives (docs/data/*_judged.csv: the model's own captions), by kind, and how often it is true: the
caption not right (partly or wrong, the person's grade), and for a named object or word, whether the person marked
it absent. Run from the repository root: .venv/bin/python docs/studies/reasons.py (a few minutes, 1 thread)."""
import collections
import csv
import re
from pathlib import Path

import torch

import captioner

torch.set_num_threads(1)
DATA = Path("../shared/data")
SETS = {"coco-paired val": (DATA / "coco-paired/images", "docs/data/coco_paired_val_judged.csv"),
        "Flickr8k val": (DATA / "flickr8k/Images", "docs/data/flickr8k_val_judged.csv"),
        "coco-mini": (DATA / "coco-mini/train2017", "docs/data/coco_mini_judged.csv")}


def kind_of(doubt: str) -> str:
    if doubt.startswith("it is not sure there"):
        return "named object"
    if doubt.startswith("the encoder barely sees"):
        return "barely seen object"
    if doubt.startswith("the model found “"):
        return "unlikely words"
    if "described as" in doubt or "(the nearest: “" in doubt:
        return "quoted description"
    return "hesitated" if doubt.startswith("it hesitated") else "other: " + doubt


def main() -> None:
    m = captioner.load(dtype="float32")
    tally: dict = collections.defaultdict(collections.Counter)
    for name, (folder, path) in SETS.items():
        for r in csv.DictReader(open(path)):
            cap = m.read(folder / r["image"]).caption()
            if cap.sure is not False or cap.text != r["caption"]:
                continue
            kind = kind_of(cap.doubt)
            t = tally[(name, kind)]
            t["n"] += 1
            t["not right"] += r["judged"] != "right"
            absent = {a.rstrip("s") for a in r.get("absent_objects", "").split(";") if a}
            named = (set(re.findall(r"“([^”]+)”", cap.doubt)) if kind == "unlikely words"
                     else set(cap.doubt.split()[-1:]) if kind == "named object"
                     else set(cap.doubt.split()[-4:-3]) if kind == "barely seen object" else set())
            t["named absent"] += bool({w.rstrip("s") for w in named} & absent)
    for (name, kind), t in sorted(tally.items()):
        said = f"{name}: {kind}: {t['n']} unsure captions, not right {t['not right'] / t['n']:.2f}"
        if kind in ("named object", "barely seen object", "unlikely words") and name != "coco-mini":
            said += f", the named word absent {t['named absent'] / t['n']:.2f}"
        print(said)


if __name__ == "__main__":
    main()
