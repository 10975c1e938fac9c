"""Evidence-aware decoding: the encoder's own ImageNet head vetoes object words it rules out.

A decoder learns its words from its captions (Flickr8k is people and dogs; the bundled model adds
coco-paired's COCO photos), so on everyday photos it can name a dog or a person that is not there; yet the encoder's ImageNet classifier, computed from the same annotation vectors (see
concepts/imagenet.py: no second forward pass), often knows better. Before decoding, each photo's concept
probabilities p (B, C) over the COCO categories ImageNet can see become one additive bias per
vocabulary word (B, V), applied to the next-word log-probabilities at every step (search.word_logp):

    bias[b, w] = -evidence_penalty                  if w names category k and p[b, k] < evidence_floor
               = +evidence_bonus * p[b, k]          if w names category k otherwise, until the caption
                                                    has named k once (then 0: say it, do not repeat it)
               = 0                                  for every other word
    bias[b, w] = -evidence_penalty                  if w is a person word and the model file's person
                                                    detector (concepts/detectors.py) gives P(person) <
                                                    person_floor (ImageNet has no person class: without
                                                    a detector, person words get no evidence either way)

A large penalty forbids the word; a moderate one lets a strong language context still win. Words
are the one-word names of the grounding table (concepts/words.py: "dog", "dogs", "puppy" -> dog);
two-word names are left alone ("hot dog" keeps its "dog"). Settings: config.DecodeConfig.evidence*.

Legend: B images, C seen categories, V vocabulary.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..concepts.imagenet import CATEGORIES
from ..config import DecodeConfig
from ..concepts.words import CATEGORY_WORDS
from ..vocab import Vocab


def word_categories(vocab: Vocab, categories: tuple[str, ...] = CATEGORIES) -> torch.Tensor:
    """(V, C) 0/1: vocabulary word w is a one-word name of category k. Built once per vocabulary (a
    Python loop over the table that every caption call needed); each call gets its own copy."""
    return _word_categories(tuple(vocab.itos), tuple(categories)).clone()


@lru_cache(maxsize=8)
def _word_categories(itos: tuple[str, ...], categories: tuple[str, ...]) -> torch.Tensor:
    stoi = {w: i for i, w in enumerate(itos)}
    m = torch.zeros(len(itos), len(categories))
    for k, cat in enumerate(categories):
        for name in CATEGORY_WORDS[cat].split():
            if "_" not in name and name in stoi:
                m[stoi[name], k] = 1.0
    return m


def ruled_out_words(probs: torch.Tensor, words: torch.Tensor, floor: float) -> torch.Tensor:
    """probs (B, C), words (V, C) -> (B, V) 1 where the word names a category with P < floor."""
    return (probs < floor).float() @ words.t().to(probs)


def person_ruled_out(person: torch.Tensor, person_words: torch.Tensor, floor: float) -> torch.Tensor:
    """P(person) (B,), person_words (V,) 0/1 -> (B, V) 1 where the word is a person word and P < floor."""
    return (person < floor).float()[:, None] * person_words.to(person)[None, :]


class Evidence:
    """Per-image word scores for decoding: probs (B, C) concept probabilities, words (V, C) from
    word_categories, settings.evidence_* -> `bias(images, tokens)` for the live rows. `person`:
    (P(person) (B,), person words (V,)) from the word detectors, or None when the model has none."""

    def __init__(self, probs: torch.Tensor, words: torch.Tensor, settings: DecodeConfig,
                 person: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.words = words.to(probs)  # (V, C)
        out = ruled_out_words(probs, self.words, settings.evidence_floor)  # (B, V)
        if person is not None and settings.person_floor > 0:
            out = (out + person_ruled_out(person[0].to(probs), person[1], settings.person_floor)).clamp(max=1)
        self.penalty = -settings.evidence_penalty * out  # (B, V)
        self.bonus = settings.evidence_bonus * probs * (probs >= settings.evidence_floor).float()  # (B, C)
        self.has_bonus = bool(settings.evidence_bonus) and bool((self.bonus > 0).any())  # else bias = penalty

    def bias(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """images (N,) the image of each live row, tokens (N, t) its words so far -> (N, V)."""
        if not self.has_bonus:  # no word earns a bonus (evidence_bonus 0, the stored setting): a lookup per step
            return self.penalty[images]  # (N, V)
        bonus = self.bonus[images]  # (N, C)
        if tokens.shape[1]:
            named = self.words[tokens].amax(1)  # (N, C): categories the row has named already
            bonus = bonus * (1 - named)
        return self.penalty[images] + bonus @ self.words.t()  # (N, V)

    def word_bias(self, image: int, tokens: list[int]) -> torch.Tensor:
        """(L,) the bias each of an image's caption words got when decoding chose it (after the words
        before it): what separates the decoding score from the model's own log-probability."""
        t = torch.tensor(tokens, dtype=torch.long, device=self.penalty.device)  # (L,)
        out = self.penalty[image, t]  # (L,)
        if not self.has_bonus or not tokens:
            return out
        named = self.words[t]  # (L, C): the categories each word names
        before = torch.cat([torch.zeros_like(named[:1]), named.cummax(0).values[:-1]])  # (L, C): named before word k
        return out + ((self.bonus[image] * (1 - before)) * named).sum(-1)  # (L,): bias() at each step, at once
