"""Objects checked: whether the encoder sees each object a caption names, before the caption is called sure.

A word names an object when it is a one-word name of a COCO category (concepts/words.py: "cake", "dog") or a word
of one of the model file's word detectors (concepts/detectors.py: "man" -> person, "shirt", "grass"). Its support
on a photo is the strongest evidence the encoder's heads hold for it:

    support[b, w] = max( max_c  P_head(c | b)      over the categories c that w names,
                         max_k  P_detector(k | b)  over the detector groups k that w belongs to )

(a person word: the person detector's P, which already reads the head's clothes classes). `word_support` builds the
(B, V) table once per decode from the photos' reading (objects_check); what the judge reads of each chosen
caption (confidence.SIGNAL_OF), for the whole batch at once:

    support       the least support among the objects the caption names (1 when it names none)
    unsupported   how many objects it names with support below SUPPORT_FLOOR
    disagreement  the share of the beam's other candidates that name another set of objects
    head_entropy  the entropy of the head's P over the COCO categories and "none of them" (nats)

and `template` flags Flickr8k's habit, "a <person> in a <colour> <garment>", which the COCO photos rarely earn.
An object below SUPPORT_FLOOR keeps a caption from being sure whatever its confidence (confidence.level), and it
is what the reason of an unsure caption names first ("it is not sure there is a cake": `doubt_of_objects`).

Legend: B photos, B' those with a chosen caption, N the batch's candidates, C COCO categories, K detector groups,
V vocabulary, M = C + K object columns, L words.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from ..concepts.detectors import WordDetectors
from ..vocab import Vocab
from .pool import Pool
from .reading import HeadReading, words_of

# an object whose support is below this is "unsupported": the heads barely see it, and a caption naming one is
# never sure (docs/confidence.md: at .2 the val sets' sure captions name fewer absent objects, P(good) kept)
SUPPORT_FLOOR = 0.2
TEMPLATE = re.compile(r"\bin (a|an) (\w+ )?(red|blue|green|yellow|pink|black|white|orange|purple|brown|gray|grey"
                      r"|striped|dark|light) (\w+ )?(shirt|t-shirt|jacket|dress|hat|helmet|coat|sweater|top|shorts"
                      r"|uniform|outfit|jersey|suit|swimsuit|cap|costume|bathing)\b")
MASS = frozenset("water grass snow sand food bread meat broccoli".split())  # "there is water"


@dataclass(frozen=True)
class ObjectCheck:
    """The photos' object evidence: support (B, V) per word (0 where the word names no object) and columns
    (V, M) bool: which categories and detector groups each word names (no column: not an object word)."""

    support: torch.Tensor  # (B, V)
    columns: torch.Tensor  # (V, M) bool

    def named(self, tokens: Sequence[Sequence[int]]) -> list[list[int]]:
        """Each photo's caption words (photo n: tokens[n]) -> the positions of its words that name an object."""
        names = self.columns.any(1).tolist()  # (V,) read once
        return [[i for i, t in enumerate(toks) if names[t]] for toks in tokens]

    def unsupported(self, tokens: Sequence[Sequence[int]], floor: float = SUPPORT_FLOOR) -> list[list[int]]:
        """Each photo's caption words (photo n: tokens[n]) -> the positions of its object words whose support is
        below floor, least supported first: one gather and one read for the batch."""
        weak = torch.where(self.columns.any(1).to(self.support.device), self.support.float(), float("inf"))  # (B, V)
        support = words_of(weak, tokens)  # (n, L) on the host: inf where the word names no object
        return [sorted((i for i, p in enumerate(row) if p < floor), key=row.__getitem__) for row in support]


def membership(vocab: Vocab, categories: torch.Tensor, det: WordDetectors | None) -> torch.Tensor:
    """(V, M) bool: the categories each word names (categories (V, C), concepts/words.word_categories) and, with
    detectors, the groups it belongs to (a taught word: its source word's). On the categories' device."""
    cols = [categories.bool()]
    if det is not None:
        taught = tuple((w, vocab.source(w)) for w in sorted(vocab.aliases))
        members = tuple(frozenset(det.members.get(g, ())) for g in det.groups)
        cols.append(_groups(tuple(vocab.itos), members, taught).to(categories.device))
    return torch.cat(cols, 1)  # (V, M)


@lru_cache(maxsize=8)
def _groups(itos: tuple[str, ...], members: tuple[frozenset[str], ...], taught: tuple[tuple[str, str], ...]
            ) -> torch.Tensor:
    source = dict(taught)
    return torch.tensor([[source.get(w, w) in names for names in members] for w in itos], dtype=torch.bool)  # (V, K)


def objects_check(reading: HeadReading, det: WordDetectors | None, vocab: Vocab, categories: torch.Tensor
                  ) -> ObjectCheck | None:
    """The photos' objects check from their reading (the head's P, the detectors' where the file has them: det)
    and categories (V, C), which words name which category; None without the ImageNet head."""
    if reading.probs is None:
        return None
    return word_support(reading.probs, reading.seen if det is not None else None, membership(vocab, categories, det))


def word_support(probs: torch.Tensor, seen: torch.Tensor | None, columns: torch.Tensor) -> ObjectCheck:
    """probs (B, C) the head's P(category), seen (B, K) the detectors' P(group) or None, columns (V, M) ->
    the ObjectCheck: each word's support, the largest P among its columns."""
    evidence = probs.float() if seen is None else torch.cat([probs.float(), seen.float().to(probs.device)], 1)  # (B, M)
    cols = columns[:, :evidence.shape[1]].to(evidence.device)  # (V, M)
    support = (evidence[:, None, :] * cols[None].float()).amax(-1)  # (B, V)
    return ObjectCheck(support, cols.bool())


def disagreement(pool: Pool, best: torch.Tensor, check: ObjectCheck | None) -> torch.Tensor:
    """(B',) float64: the share of each photo's other candidates that name another set of objects than its chosen
    caption (best (B',): its row of the pool); 0 without a check."""
    out = torch.zeros(len(best), dtype=torch.float64, device=best.device)  # (B',)
    if check is None:
        return out
    objects = pool.named(check.columns)  # (N, M) the object columns each candidate names
    sizes = pool.group_sizes()  # (B',)
    group = torch.repeat_interleave(torch.arange(len(best), device=best.device), sizes)  # (N,)
    differs = (objects != objects[best][group]).any(1)  # (N,) a candidate naming another set of objects than the chosen
    return out.index_add(0, group, differs.double()) / (sizes - 1).clamp_min(1)


def candidate_support(pool: Pool, rows: torch.Tensor, photos: torch.Tensor, check: ObjectCheck
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """support and unsupported (the module's doc) of the pool's rows `rows` (R,), whose photos are `photos` (R,)
    -> (R,) float64 each: the least support among the object words (1 where none) and how many are below
    SUPPORT_FLOOR."""
    tokens = pool.tokens[rows]  # (R, L)
    is_object = pool.padded(check.columns.any(1), False)[tokens]  # (R, L) the words that name an object
    support = torch.cat([check.support.float(), check.support.new_ones(len(check.support), 1)], 1)  # (B, V + 1)
    support = support.to(rows.device)[photos].gather(1, tokens)  # (R, L)
    least = torch.where(is_object, support, float("inf")).amin(1)  # (R,)
    return (torch.where(least.isinf(), 1.0, least.double()),
            (is_object & (support < SUPPORT_FLOOR)).sum(1).double())


def entropy(probs: torch.Tensor | None) -> torch.Tensor | float:
    """The entropy (nats) of the head's P (..., C) over the COCO categories and the rest ("none of them"), (...)
    float64; 0 without a head."""
    if probs is None:
        return 0.0
    p = probs.double().clamp_min(0)  # (..., C)
    p = torch.cat([p, (1 - p.sum(-1, keepdim=True)).clamp_min(0)], -1)  # (..., C + 1)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    return -(p * p.clamp_min(1e-12).log()).sum(-1)


def template(text: str) -> float:
    """1.0 where the caption has Flickr8k's "in a <colour> <garment>", else 0.0."""
    return float(bool(TEMPLATE.search(text)))


def doubt_of_objects(words: Sequence[str]) -> str:
    """The reason an unsure caption gives for the objects the check found unsupported (least supported first):
    "it is not sure there is a cake" (or "... a cake or a table")."""
    return "it is not sure there " + ("are " if _plural(words[0]) else "is ") + " or ".join(_phrase(w) for w in words)


def _plural(word: str) -> bool:
    return word.endswith("s") and not word.endswith("ss") and word not in MASS


def _phrase(word: str) -> str:
    if _plural(word) or word in MASS:
        return word
    return ("an " if word[0] in "aeiou" else "a ") + word


__all__ = ["SUPPORT_FLOOR", "ObjectCheck", "objects_check", "membership", "word_support", "candidate_support",
           "disagreement", "entropy", "template", "doubt_of_objects"]
