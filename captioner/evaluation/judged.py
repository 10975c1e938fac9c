"""A person's judgment of captions (docs/data/*_judged.csv: right / partly / wrong) set against a confidence.

Each judged row (image file, caption, judged) is matched to a scored caption of the same photo and the same text
(a photo is named by its file or by its COCO id, 74: the number in a COCO file's name), so
a confidence from another decode or another map is never set against a grade of another caption. What is said of
the matched rows: how many, the AUROC of the confidence for not wrong against wrong and for right against the
rest, and at a threshold the crosstab a person deciding what to publish wants: how many wrong captions are still
sure, how many right ones are not.
"""
from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Iterable, Sequence

from .confidence_fit import auroc

GRADES = ("right", "partly", "wrong")


def photo_key(name: str) -> str:
    """A photo's name as both sides spell it: a COCO file name or id -> its number without leading zeros, any other
    name (a Flickr8k file's) as it is."""
    m = re.fullmatch(r"(?:COCO_\w+?_)?0*(\d+)(?:\.jpg)?", name)
    return m.group(1) if m else name


def read_judged(path: str | Path) -> list[dict[str, str]]:
    """The judged rows of one CSV (image, caption, judged, ...); a ValueError names a grade it does not know."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    bad = sorted({r["judged"] for r in rows} - set(GRADES))
    if bad:
        raise ValueError(f"{path}: grades {bad} are not {', '.join(GRADES)}; fix the CSV's judged column")
    return rows


def matched(judged: Iterable[dict[str, str]], scored: Iterable[tuple[str, str, float, bool]]
            ) -> list[tuple[str, float, bool]]:
    """(grade, confidence, seen) of every judged row whose photo and caption text a scored (image, caption,
    confidence, seen: every object the caption names seen by the heads) has; the others are left out."""
    conf = {(photo_key(i), c.strip()): (v, s) for i, c, v, s in scored}
    return [(r["judged"], *conf[k]) for r in judged if (k := (photo_key(r["image"]), r["caption"].strip())) in conf]


def crosstab(pairs: Sequence[tuple[str, float, bool]], sure_at: float) -> dict:
    """The matched rows' counts, AUROCs (not wrong vs wrong, right vs the rest) and at sure_at: sure (confidence
    at or above it and every object seen, as a Caption's), wrong and sure, right and not sure, P(right or partly |
    sure)."""
    grades, conf = [g for g, _, _ in pairs], [c for _, c, _ in pairs]
    sure = [g for g, c, seen in pairs if c >= sure_at and seen]
    return {"rows": len(pairs), **{g: grades.count(g) for g in GRADES},
            "AUROC not wrong": auroc(conf, [g != "wrong" for g in grades]),
            "AUROC right": auroc(conf, [g == "right" for g in grades]),
            "sure": len(sure), "wrong and sure": sure.count("wrong"),
            "right and not sure": grades.count("right") - sure.count("right"),
            "P(not wrong | sure)": (len(sure) - sure.count("wrong")) / max(len(sure), 1)}


__all__ = ["GRADES", "photo_key", "read_judged", "matched", "crosstab"]
