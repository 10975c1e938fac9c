"""Grounding: does a word's attention fall on the object it names? In the style of Liu et al. 2017,
"Attention correctness in neural image captioning", with COCO instance boxes as the ground truth.

Legend: L words, P = gh * gw attention cells, N boxes.

For every caption word that names a COCO category present in the photo (see `match_words`):

    coverage_ij = area of cell (i, j) inside the UNION of that category's boxes / area of the cell
    mass        = sum_ij alpha_ij * coverage_ij       (alpha: the word's map, sums to 1)
    baseline    = mean_ij coverage_ij                 (the mass of a uniform map = the boxes' area share)

A summary reports the mean mass, the mean baseline, lift = mean mass / mean baseline (1 = no better
than looking everywhere) and the number of words, overall and per category. Two modes:
`ground_generated` / `ground_captions` score the model's own captions (decoded with the model file's
settings; a wrong word is not scored, a missed object is not penalised) and `ground_references` scores
the reference captions under teacher forcing (Decoder.teacher_force), i.e. grounding without caption errors.

Geometry. The model sees the whole photo resized without cropping, so the gh x gw grid covers the
whole image: a box's x scales by gw / width and its y by gh / height. Coverage is exact: the union
of boxes is cut along every box edge and every cell edge into rectangles that are each either inside
or outside the union and inside one cell, and their areas are summed per cell. Crowd annotations
(iscrowd=1, e.g. "a crowd of people") count: their box is where the category is. Boxes are in the
photo's stored pixel frame; photos with an EXIF rotation (which load_image applies) are skipped.

Word rule. Captions are split with the project's tokenizer (captioner.vocab.tokenize). Each
category has a list of names (singular and plural, synonyms, e.g. men/women/children/skier ->
person, puppy -> dog, bike -> bicycle, jet -> airplane, sofa -> couch, table -> dining table,
phone -> cell phone). Names are one or two words. Scanning left to right, a two-word name is tried
before a one-word name at the same position, so "hot dog" is a hot dog, not a dog, and "teddy
bear" is a teddy bear. A two-word name is scored with the attention of its LAST word, the head
noun ("light" of "traffic light"), the step at which the model commits to the object. Words are
scored only when their category has at least one box of non-zero area in the photo.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from ..vocab import tokenize
from .boxes import Instances, box_coverage, instances_path_for, load_instances
from .hallucination import (CaptionHallucination, HallucinationSummary, boxed_categories, caption_hallucination,
                            categories_in, json_number, measure_hallucination, measure_references)
from ..concepts.words import CATEGORY_WORDS, Phrase, match_words, word_table

if TYPE_CHECKING:
    from ..api import Captioner
    from ..decoding.captions import Caption
    from ..config import DecodeConfig
    from ..data.records import ImageRecord

__all__ = ["CATEGORY_WORDS", "GroundingSummary", "Instances", "WordGrounding", "box_coverage", "ground_captions",
           "ground_concept_maps",
           "ground_generated",
           "ground_references", "ground_words", "instances_path_for", "load_instances", "match_words",
           "reference_alphas", "word_table"]
__all__ += ["CaptionHallucination", "HallucinationSummary", "boxed_categories", "caption_hallucination",  # CHAIR
            "categories_in", "measure_hallucination", "measure_references"]


@dataclass
class WordGrounding:
    image_id: str
    word: str  # the scored token (a two-word name's head noun)
    category: str
    mass: float  # attention inside the category's boxes
    baseline: float  # the uniform map's mass (area share of the boxes)


def ground_words(words: Sequence[str], alphas: np.ndarray, coverage: dict[str, np.ndarray],
                 table: dict[Phrase, str], image_id: str = "") -> list[WordGrounding]:
    """One caption: words (L,), alphas (L, gh, gw) each summing to 1, coverage {category: (gh, gw)}
    for the categories in the photo -> one record per word that names one of them."""
    alphas = np.asarray(alphas, dtype=np.float64)
    if len(alphas) != len(words):
        raise ValueError(f"{len(words)} words but {len(alphas)} attention maps")
    out = []
    for i, cat in match_words(words, table):
        cov = coverage.get(cat)
        if cov is None:
            continue
        if alphas[i].shape != cov.shape:
            raise ValueError(f"attention map {alphas[i].shape} and box coverage {cov.shape} differ in shape")
        out.append(WordGrounding(image_id, words[i], cat, float((alphas[i] * cov).sum()), float(cov.mean())))
    return out


@dataclass
class GroundingSummary:
    mass: float  # mean over words of the attention inside the boxes
    baseline: float  # mean over words of the boxes' area share
    lift: float  # mass / baseline (1: no better than a uniform map); NaN without words
    n_words: int
    n_images: int  # images with instance annotations that were scored
    per_category: dict[str, dict[str, float]] = field(default_factory=dict)  # same keys per category

    @classmethod
    def of(cls, words: Sequence[WordGrounding], n_images: int) -> "GroundingSummary":
        by_cat: dict[str, list[WordGrounding]] = defaultdict(list)
        for w in words:
            by_cat[w.category].append(w)
        return cls(*_means(words), len(words), n_images,
                   {c: dict(zip(("mass", "baseline", "lift"), _means(ws)), n_words=len(ws))
                    for c, ws in sorted(by_cat.items(), key=lambda kv: -len(kv[1]))})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; NaN (no words) becomes null."""
        clean = json_number
        return {"mass": clean(self.mass), "baseline": clean(self.baseline), "lift": clean(self.lift),
                "n_words": self.n_words, "n_images": self.n_images,
                "per_category": {c: {k: clean(v) for k, v in d.items()} for c, d in self.per_category.items()}}

    def __str__(self) -> str:
        return (f"mass {self.mass:.4f}  baseline {self.baseline:.4f}  lift {self.lift:.2f}  "
                f"words {self.n_words} in {self.n_images} images")


def _means(words: Sequence[WordGrounding]) -> tuple[float, float, float]:
    if not words:
        return math.nan, math.nan, math.nan
    mass = float(np.mean([w.mass for w in words]))
    base = float(np.mean([w.baseline for w in words]))
    return mass, base, mass / base if base > 0 else math.nan


def _usable(records: Sequence["ImageRecord"], instances: Instances) -> list[int]:
    """Indices of the records whose photo the instance file describes in the frame the model sees."""
    from PIL import Image

    from ..images import _TRANSPOSE, _orientation

    keep = []
    for i, r in enumerate(records):
        if r.image_id not in instances.sizes:
            continue
        try:
            with Image.open(r.path) as im:
                if _orientation(im) in _TRANSPOSE:  # load_image rotates it: the boxes would not line up
                    continue
        except OSError:
            continue
        keep.append(i)
    if records and not keep:
        raise ValueError(f"none of the {len(records)} images is described by {instances.path}; pass the instances "
                         "file of the same split as the captions (--instances PATH)")
    return keep


# ---------------------------------------------------------------- the two modes

def ground_captions(captions: Sequence["Caption"], records: Sequence["ImageRecord"], instances: Instances
                    ) -> GroundingSummary:
    """Grounding of captions already decoded (one per record, e.g. evaluation's): each word's map
    against its category's boxes."""
    keep = _usable(records, instances)
    table = word_table(instances.categories)
    scored: list[WordGrounding] = []
    for i in keep:
        cap = captions[i]
        gh, gw = cap.alphas.shape[1:]  # (L, gh, gw)
        scored += ground_words(cap.words, cap.alphas, instances.coverage(records[i].image_id, gh, gw), table,
                               records[i].image_id)
    return GroundingSummary.of(scored, len(keep))


def ground_generated(loaded: "Captioner", feats: torch.Tensor | np.ndarray, records: Sequence["ImageRecord"],
                     instances: Instances, settings: "DecodeConfig | None" = None) -> GroundingSummary:
    """Grounding of the model's own captions: feats (N, P, D) of records (N,), decoded exactly as
    evaluation decodes them (captions_from_features) with `settings` (None: the model file's own)."""
    from ..decoding.captions import captions_from_features

    keep = _usable(records, instances)
    caps = captions_from_features(loaded.model, feats[keep], loaded.vocab, settings or loaded.decode_settings(),
                                  loaded.resources)
    return ground_captions(caps, [records[i] for i in keep], instances)


def reference_alphas(loaded: "Captioner", feats: torch.Tensor, captions: Sequence[Sequence[str]],
                     max_len: int = 50) -> list[np.ndarray]:
    """Teacher forcing on tokenised captions of ONE image: feats (1, P, D), captions (C,) of words ->
    for each caption (min(len, max_len), P) attention, row t being the map with which word t is
    predicted (the same step at which decoding would emit it). model.forced.force_sentences does the work."""
    from ..model.forced import force_sentences

    x = torch.as_tensor(feats).to(loaded.device)
    forced = force_sentences(loaded.model.decoder, x, loaded.vocab, [list(c)[:max_len] for c in captions])
    return [f.alphas for f in forced]


@torch.no_grad()
def ground_references(loaded: "Captioner", feats: torch.Tensor | np.ndarray, records: Sequence["ImageRecord"],
                      instances: Instances, max_len: int = 50) -> GroundingSummary:
    """Grounding of the reference captions under teacher forcing (no caption errors): every word of
    every reference that names a category in the photo."""
    keep = _usable(records, instances)
    table, g = word_table(instances.categories), loaded.grid_size
    scored: list[WordGrounding] = []
    for i in keep:
        caps = [tokenize(c) for c in records[i].captions]
        x = torch.as_tensor(np.asarray(feats[i:i + 1], dtype=np.float32))  # (1, P, D)
        cov = instances.coverage(records[i].image_id, g, g)
        for words, a in zip(caps, reference_alphas(loaded, x, caps, max_len)):
            words = words[:len(a)]
            scored += ground_words(words, a.reshape(len(words), g, g), cov, table, records[i].image_id)
    return GroundingSummary.of(scored, len(keep))


@torch.no_grad()
def ground_concept_maps(loaded: "Captioner", feats: torch.Tensor | np.ndarray, records: Sequence["ImageRecord"],
                        instances: Instances, min_prob: float = 0.1) -> GroundingSummary:
    """Grounding of the encoder's own concept maps (concepts/maps.py): for every category with boxes in
    the photo that the ImageNet head sees with P >= min_prob, its class activation map's mass inside
    the boxes. The ceiling of what train.alpha_cam can teach the attention (`word` is the category)."""
    from ..concepts.maps import concept_maps
    from ..concepts.imagenet import MAP_CATEGORIES, encoder_head

    keep = _usable(records, instances)
    head, g = encoder_head(loaded.model), loaded.grid_size
    scored: list[WordGrounding] = []
    for i in keep:
        x = torch.as_tensor(np.asarray(feats[i:i + 1], dtype=np.float32)).to(loaded.device)  # (1, P, D)
        maps, probs = concept_maps(head, x)  # (1, C, P), (1, C)
        for cat, cov in instances.coverage(records[i].image_id, g, g).items():
            if cat in MAP_CATEGORIES and float(probs[0, MAP_CATEGORIES.index(cat)]) >= min_prob:
                m = maps[0, MAP_CATEGORIES.index(cat)].cpu().numpy().reshape(g, g)
                scored.append(WordGrounding(records[i].image_id, cat, cat, float((m * cov).sum()), float(cov.mean())))
    return GroundingSummary.of(scored, len(keep))
