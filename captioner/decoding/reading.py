"""Read: what the encoder's heads say about photos (read_heads: the ImageNet classifier and the word detectors,
once per photo), and `annotated`, which dresses a Caption (generated or explained) with it: concepts, detections,
contradicted words, concept maps. Legend: B photos, P = G*G cells, D feature dim, K ImageNet classes, C COCO
categories, V vocabulary, L words.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..concepts.detectors import detect_words, detectors_of, with_detections
from ..concepts.imagenet import (MAP_CATEGORIES, THRESHOLD, Concepts, category_probs, concepts_of,
                                 imagenet_head_or_none, imagenet_logits)
from ..concepts.maps import MIN_PROB, category_maps
from ..concepts.words import word_categories
from ..vocab import Vocab


@dataclass
class HeadReading:
    """The heads' outputs for `photos` photos B (None where the model has no such head)."""

    logits: torch.Tensor | None  # (B, K) the ImageNet classifier's logits, float32
    probs: torch.Tensor | None  # (B, C) P(category) over CATEGORIES (imagenet.category_probs)
    seen: torch.Tensor | None  # (B, K') the word detectors' P(word group), float32
    photos: int  # B, known with or without the heads

    @staticmethod
    def together(readings: Sequence["HeadReading"]) -> "HeadReading":
        """The readings of several photos as one (photos in order)."""
        join = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
        return HeadReading(*(join([getattr(r, f) for r in readings]) for f in ("logits", "probs", "seen")),
                           photos=sum(r.photos for r in readings))

    def rows(self, start: int, stop: int) -> "HeadReading":
        """The reading of photos start..stop-1."""
        cut = lambda t: None if t is None else t[start:stop]  # noqa: E731
        return HeadReading(cut(self.logits), cut(self.probs), cut(self.seen), len(range(self.photos)[start:stop]))


@torch.no_grad()
def read_heads(model: torch.nn.Module, feats: torch.Tensor) -> HeadReading:
    """Annotation vectors (B, P, D) -> the heads' reading: the classifier runs once, the detectors once."""
    head = imagenet_head_or_none(model)
    if head is None:
        return HeadReading(None, None, None, len(feats))
    logits = imagenet_logits(head, feats)  # (B, K): the classifier's one run over these photos
    probs = category_probs(logits)  # (B, C)
    seen = detect_words(model, feats, logits)  # (B, K') or None
    return HeadReading(logits, probs, None if seen is None else seen.float(), len(feats))


def photo_concepts(reading: HeadReading, model: torch.nn.Module, threshold: float = THRESHOLD,
                   top_k: int = 5) -> list[Concepts]:
    """One Concepts per photo: COCO categories and detected words at P >= threshold, the top_k ImageNet classes;
    Concepts.unseen() per photo without the ImageNet head."""
    if reading.logits is None:
        return [Concepts.unseen() for _ in range(reading.photos)]
    out = concepts_of(reading.logits, threshold, top_k)
    det = detectors_of(model)
    if det is not None and reading.seen is not None:
        for c, seen in zip(out, reading.seen.tolist()):  # one host read for the batch
            c.top = with_detections(c.top, det, seen, threshold)
            c.probs.update({g: round(seen[k], 4) for k, g in enumerate(det.groups) if g not in c.probs})
    return out


def annotated(caps: Sequence[Any], tokens: Sequence[Sequence[int]], reading: HeadReading,
              feats: torch.Tensor, model: torch.nn.Module, vocab: Vocab, ruled_out: torch.Tensor | None) -> list[Any]:
    """Each Caption (generated or explained) dressed with its photo's reading, as a new value: concepts,
    detections, contradicted words and the concept maps of its words. tokens[n]: the word ids of caps[n]; feats
    (n, P, D) and the reading's rows are their photos; ruled_out (n, V) bool: the evidence's ruled-out words."""
    if reading.logits is None:
        return list(caps)
    concepts = photo_concepts(reading, model)
    ruled = [[False] * len(t) for t in tokens] if ruled_out is None else words_of(ruled_out, tokens)
    det = detectors_of(model)
    seen = reading.seen.tolist() if det is not None and reading.seen is not None else None  # (n, K') read once
    maps = concept_maps(tokens, imagenet_head_or_none(model), feats, vocab, reading.logits)
    return [dataclasses.replace(cap, concepts=list(concepts[n].top),
                                contradicted=[i for i, bad in enumerate(ruled[n]) if bad],
                                detections=cap.detections if seen is None else
                                [(g, round(p, 4)) for g, p in zip(det.groups, seen[n])],
                                concept_maps={**cap.concept_maps, **maps[n]})
            for n, cap in enumerate(caps)]


def concept_maps(tokens: Sequence[Sequence[int]], head: torch.nn.Linear, feats: torch.Tensor, vocab: Vocab,
                 logits: torch.Tensor | None = None) -> list[dict[int, tuple[str, float, np.ndarray]]]:
    """Each caption's concept maps, by word index: for a word naming a MAP_CATEGORIES category, that category's
    map on its photo when P >= MIN_PROB. feats (n, P, D) the captions' photos, logits (n, K) their classifier's."""
    out: list[dict[int, tuple[str, float, np.ndarray]]] = [{} for _ in tokens]
    cats = map_word_categories(vocab).tolist()  # (V,) category index or -1, read once
    where = [(n, i, cats[t]) for n, toks in enumerate(tokens) for i, t in enumerate(toks) if cats[t] >= 0]
    if not where:
        return out
    rows = torch.tensor([n for n, _, _ in where], device=feats.device)
    maps, probs = category_maps(head, feats[rows], torch.tensor([c for _, _, c in where], device=feats.device),
                                None if logits is None else logits[rows.to(logits.device)])
    for (n, i, c), m, p in zip(where, maps.cpu().numpy(), probs.tolist()):
        if p >= MIN_PROB:
            g = grid_side(m.shape[0])
            out[n][i] = (MAP_CATEGORIES[c], round(p, 4), m.reshape(g, g))
    return out


def words_of(table: torch.Tensor, tokens: Sequence[Sequence[int]]) -> list[list]:
    """A per-photo word table (n, V) and each photo's words -> each word's entry, on the host: one gather and one
    read (n x V would be a large read; n x L is not)."""
    width = max(map(len, tokens), default=0)
    at = torch.tensor([list(t) + [0] * (width - len(t)) for t in tokens], dtype=torch.long).view(len(tokens), width)
    got = table.gather(1, at.to(table.device)).tolist()  # (n, L)
    return [row[:len(t)] for row, t in zip(got, tokens)]


def grid_side(regions: int) -> int:
    """P attention cells -> the side G of the square grid (the encoders' grids are square)."""
    g = math.isqrt(regions)
    if g * g != regions:
        raise ValueError(f"{regions} attention cells do not form a square grid")
    return g


def map_word_categories(vocab: Vocab) -> np.ndarray:
    """(V,) the MAP_CATEGORIES index each vocabulary word names (-1: none)."""
    m = word_categories(vocab, MAP_CATEGORIES)  # (V, C+1), at most one 1 per row
    return np.where(m.sum(1).numpy() > 0, m.argmax(1).numpy(), -1)


__all__ = ["HeadReading", "read_heads", "photo_concepts", "annotated"]
