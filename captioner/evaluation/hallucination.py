"""Object hallucination: does a caption name objects that are not in the photo? CHAIR, after Rohrbach
et al. 2018, "Object Hallucination in Image Captioning", with the category table and word rule of
concepts/words.py (plurals, synonyms, two-word names: "hot dog" is a hot dog, not a dog).

Per caption, with truth = the categories TRUE for its photo:

    mentioned    = the categories its words name (a set: naming "dog" twice is one mention)
    hallucinated = mentioned - truth
    truth        = categories boxed in the photo (COCO instances, any box, crowd included)
                   UNION categories named by any of the photo's reference captions

    CHAIR-i = sum |hallucinated| / sum |mentioned|          (per mention)
    CHAIR-s = share of captions with hallucinated != {}    (per caption; empty captions count)
    recall  = sum |mentioned & boxed| / sum |boxed|         (per boxed category)

Why recall: CHAIR alone rewards saying less ("a picture" never hallucinates), so it is reported
beside the share of the photo's boxed categories that the caption names.

Why the references join the truth: humans name things the boxes miss (80 categories, unboxed
background objects), and a caption that agrees with a human is not hallucinating, as in the paper.
Scoring a reference caption against a truth that includes itself is therefore 0 by construction;
`measure_references` scores each reference against the boxes and the OTHER references instead
(the human baseline a model can be compared with).

References-only variant (Flickr8k, no boxes, `boxed=None`): truth = what the references name, and
recall is over those categories.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ..vocab import tokenize
from .boxes import Instances
from ..concepts.words import CATEGORY_WORDS, Phrase, match_words, word_table


def categories_in(words_or_text: str | Sequence[str], table: dict[Phrase, str]) -> set[str]:
    """A caption (text, or its tokens) -> the categories it names, by grounding's word rule."""
    words = tokenize(words_or_text) if isinstance(words_or_text, str) else list(words_or_text)
    return {cat for _, cat in match_words(words, table)}


@dataclass(frozen=True)
class CaptionHallucination:
    image_id: str
    caption: str
    mentioned: frozenset[str]  # categories the caption names
    hallucinated: frozenset[str]  # mentioned but not in truth
    truth: frozenset[str]  # boxed | named by the references
    boxed: frozenset[str] | None  # categories with a box in the photo; None: references-only variant

    @property
    def recall_pool(self) -> frozenset[str]:
        """The categories recall counts: the boxed ones, or what the references name without boxes."""
        return self.truth if self.boxed is None else self.boxed


def caption_hallucination(image_id: str, caption: str, references: Sequence[str], boxed: Iterable[str] | None,
                          table: dict[Phrase, str]) -> CaptionHallucination:
    """One caption against its photo's references and boxed categories (None: references only).
    Boxed categories the table cannot name are dropped: no caption could name them."""
    known = set(table.values())
    box = None if boxed is None else frozenset(boxed) & known
    truth = frozenset(box or ()).union(*(categories_in(r, table) for r in references))
    mentioned = frozenset(categories_in(caption, table))
    return CaptionHallucination(image_id, caption, mentioned, mentioned - truth, truth, box)


@dataclass
class HallucinationSummary:
    chair_s: float  # share of captions with a hallucinated category; NaN without captions
    chair_i: float  # hallucinated / mentioned categories; NaN without mentions
    recall: float  # boxed categories named / boxed; NaN when nothing is boxed
    n_captions: int
    n_mentions: int  # unique categories per caption, summed
    n_hallucinated: int  # of those, not in truth
    n_captions_hallucinating: int
    n_boxed: int  # recall's denominator (per caption: boxed, or reference-named without boxes)
    n_named_boxed: int  # recall's numerator
    references_only: bool  # True: no boxes, truth = what the references name
    per_category: dict[str, dict[str, float | int | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, records: Sequence[CaptionHallucination]) -> "HallucinationSummary":
        n_ment = sum(len(r.mentioned) for r in records)
        n_hall = sum(len(r.hallucinated) for r in records)
        n_bad = sum(bool(r.hallucinated) for r in records)
        n_box = sum(len(r.recall_pool) for r in records)
        n_named = sum(len(r.mentioned & r.recall_pool) for r in records)
        return cls(_share(n_bad, len(records)), _share(n_hall, n_ment), _share(n_named, n_box), len(records),
                   n_ment, n_hall, n_bad, n_box, n_named, bool(records) and all(r.boxed is None for r in records),
                   _per_category(records))

    def worst(self, n: int = 10) -> list[tuple[str, int, int]]:
        """The most hallucinated categories: [(category, hallucinated, mentions)], most first."""
        rows = [(c, int(d["hallucinated"] or 0), int(d["mentions"] or 0)) for c, d in self.per_category.items()]
        return sorted((r for r in rows if r[1] > 0), key=lambda r: (-r[1], -r[1] / r[2], r[0]))[:n]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; NaN (nothing to divide by) becomes null."""
        keys = ("chair_s", "chair_i", "recall", "n_captions", "n_mentions", "n_hallucinated",
                "n_captions_hallucinating", "n_boxed", "n_named_boxed", "references_only")
        return {**{k: json_number(getattr(self, k)) for k in keys},
                "per_category": {c: {k: json_number(v) for k, v in d.items()} for c, d in self.per_category.items()},
                "worst": [{"category": c, "hallucinated": h, "mentions": m} for c, h, m in self.worst()]}

    def __str__(self) -> str:
        truth = "references" if self.references_only else "boxes + references"
        return (f"CHAIR-s {self.chair_s:.4f}  CHAIR-i {self.chair_i:.4f}  recall {self.recall:.4f}  "
                f"({self.n_captions_hallucinating}/{self.n_captions} captions, {self.n_hallucinated}/"
                f"{self.n_mentions} mentions hallucinated; truth: {truth})")


def _share(num: int, den: int) -> float:
    return num / den if den else math.nan


def json_number(v: Any) -> Any:
    """NaN (a share of nothing) -> None, so JSON files say null; anything else unchanged."""
    return None if isinstance(v, float) and math.isnan(v) else v


def _per_category(records: Sequence[CaptionHallucination]) -> dict[str, dict[str, float | int | None]]:
    """category -> mentions, hallucinated, chair_i, boxed (captions whose photo has it in the recall
    pool), named_when_boxed, recall; most mentioned first."""
    count: dict[str, Counter] = {k: Counter() for k in ("mentions", "hallucinated", "boxed", "named_when_boxed")}
    for r in records:
        count["mentions"].update(r.mentioned)
        count["hallucinated"].update(r.hallucinated)
        count["boxed"].update(r.recall_pool)
        count["named_when_boxed"].update(r.mentioned & r.recall_pool)
    cats = set(count["mentions"]) | set(count["boxed"])
    out = {}
    for c in sorted(cats, key=lambda c: (-count["mentions"][c], -count["boxed"][c], c)):
        m, h, b, nb = (count[k][c] for k in ("mentions", "hallucinated", "boxed", "named_when_boxed"))
        out[c] = {"mentions": m, "hallucinated": h, "chair_i": _share(h, m), "boxed": b,
                  "named_when_boxed": nb, "recall": _share(nb, b)}
    return out


# ---------------------------------------------------------------- whole sets

def measure_hallucination(captions: Mapping[str, str], references: Mapping[str, Sequence[str]],
                          boxed: Mapping[str, Iterable[str]] | None,
                          categories: Sequence[str] | None = None) -> HallucinationSummary:
    """CHAIR of captions {image id: caption} against references {image id: [caption]} and boxed
    {image id: categories with a box} (see boxed_categories); boxed=None is the references-only
    variant. categories: the names to look for (default: the 80 COCO categories of CATEGORY_WORDS)."""
    table = word_table(CATEGORY_WORDS if categories is None else categories)
    _check_ids(captions, references, boxed)
    return HallucinationSummary.of([
        caption_hallucination(i, c, references[i], None if boxed is None else boxed[i], table)
        for i, c in captions.items()])


def measure_references(references: Mapping[str, Sequence[str]], boxed: Mapping[str, Iterable[str]] | None,
                       categories: Sequence[str] | None = None) -> HallucinationSummary:
    """The human baseline: every reference caption against its photo's boxes and the photo's OTHER
    references (leave one out; with itself in the truth it could never hallucinate)."""
    table = word_table(CATEGORY_WORDS if categories is None else categories)
    _check_ids(references, references, boxed)
    records = []
    for i, refs in references.items():
        box = None if boxed is None else boxed[i]
        for k, ref in enumerate(refs):
            records.append(caption_hallucination(i, ref, [*refs[:k], *refs[k + 1:]], box, table))
    return HallucinationSummary.of(records)


def _check_ids(ids: Iterable[str], references: Mapping[str, Any], boxed: Mapping[str, Any] | None) -> None:
    """Every scored image has references (and boxes): a missing one is a mismatched split, not a
    photo with nothing in it, and would silently turn every mention into a hallucination."""
    for what, have in (("references", references), ("boxed categories", boxed)):
        missing = [] if have is None else [i for i in ids if i not in have]
        if missing:
            raise ValueError(f"{len(missing)} captioned image(s) have no {what}, e.g. {missing[:5]}: pass them for "
                             "every captioned image (boxes: boxed_categories of the same split's instances file)")


def boxed_categories(instances: Instances, image_ids: Iterable[str] | None = None) -> dict[str, set[str]]:
    """{image id: categories with at least one box (any size, crowd included)} for the given ids
    (default: every image of the instance file; an image without boxes maps to the empty set)."""
    ids = list(instances.sizes) if image_ids is None else [str(i) for i in image_ids]
    unknown = [i for i in ids if i not in instances.sizes]
    if unknown:
        raise ValueError(f"{len(unknown)} image(s) are not in {instances.path}, e.g. {unknown[:5]}: pass the "
                         "instances file of the same split as the captions (--instances PATH)")
    return {i: {c for c, b in instances.boxes.get(i, {}).items() if len(b)} for i in ids}
