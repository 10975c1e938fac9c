"""Evidence-aware decoding: the encoder's own ImageNet head vetoes object words it rules out.

A decoder learns its words from its captions (Flickr8k is people and dogs; the bundled model adds
coco-paired's COCO photos), so on everyday photos it can name a dog or a person that is not there; yet the encoder's ImageNet classifier, computed from the same annotation vectors (see
concepts/imagenet.py: no second forward pass), often knows better. Before decoding, each photo's concept
probabilities p (B, C) over the COCO categories ImageNet can see become a veto and a bonus per vocabulary
word (B, V), applied to the next-word log-probabilities at every step (rules.Rules):

    the veto, a ban (-inf, like every rule's): w is never written
                                                    if w names category k and p[b, k] < evidence_floor
                                                    (dog: max(evidence_floor, dog_floor))
                                                    or w is a person word and the model file's person
                                                    detector (concepts/detectors.py) gives P(person) <
                                                    person_floor (ImageNet has no person class: without
                                                    a detector, person words get no evidence either way)
    the bonus, a bias: bias[b, w] = +evidence_bonus * p[b, k]   if w names category k, not vetoed, until the
                                                    caption has named k once (then 0: say it, do not repeat it)
                                  = 0                           for every other word
    (with decode.evidence_detectors, the veto's p[b, k] is the larger of the head's and the model file's word
    detector named k, where it has one: detected_probs; the bonus reads the head's. Files written before the
    setting existed, the bundled one among them, decode without it: DecodeConfig.UNSTORED. Without it, the
    category of a word taught on your photos still asks its detector: the head misses many a horse, so the
    taught model would say "stallion" only where its starting model happened to say "horse")

The veto has no size: a word the heads rule out is not one a strong language context may still win (a file
written when it was a penalty, decode.evidence_penalty of 10 nats, decodes it as the ban: config.REMOVED drops the
old setting). Words are the one-word names of the grounding table (concepts/words.py: "dog", "dogs", "puppy" ->
dog); two-word names are left alone ("hot dog" keeps its "dog"). A word taught on your photos (Vocab.aliases,
training/new_words.py: "zoober" started as "train") inherits its source word's evidence entirely: the same
category (bonus, veto, having named it) and, for a person word, the person floor. Settings: config.DecodeConfig.evidence*.

`photo_evidence(reading, model, vocab, settings)` is the one place a photo's evidence is computed, once per
decode from its reading (reading.py): the ruled-out mask (B, V), the person words and the bonus table.
Decoding bans the ruled-out words and adds the bonus (search.decode, which takes the bonus off the reported
log-probabilities again), and reading.annotated marks a caption's contradicted words from the same mask.

Legend: B images, C seen categories, V vocabulary.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..concepts.detectors import PERSON, WordDetectors, detectors_of
from ..concepts.imagenet import CATEGORIES
from ..concepts.words import word_categories
from ..config import DecodeConfig
from ..vocab import Vocab
from .reading import HeadReading


def ruled_out_words(probs: torch.Tensor, words: torch.Tensor, floor: float | torch.Tensor,
                    person: tuple[torch.Tensor, torch.Tensor] | None = None, person_floor: float = 0.0) -> torch.Tensor:
    """probs (B, C), words (V, C), floor (one, or (C,) per category) -> (B, V) 1 where the word names a category
    with P < its floor; with person (P(person) (B,), person words (V,) 0/1) and person_floor > 0, also 1 where the
    word is a person word and P(person) < person_floor. The one place a photo's ruled-out words are computed."""
    out = (probs < floor).float() @ words.t().to(probs)  # (B, V)
    if person is None or person_floor <= 0:
        return out
    below = (person[0].to(probs) < person_floor).float()[:, None] * person[1].to(probs)[None, :]  # (B, V)
    return (out + below).clamp(max=1)


def category_floors(settings: DecodeConfig, n_categories: int) -> torch.Tensor:
    """(C,) the P below which each category's words are ruled out: decode.evidence_floor, dog's raised to
    decode.dog_floor (Flickr8k's dog prior: the wrong dogs of everyday photos have P(dog) .05-.5)."""
    floors = torch.full((n_categories,), float(settings.evidence_floor))  # (C,)
    if n_categories == len(CATEGORIES):  # a table over CATEGORIES (a hand-made one of another width: one floor)
        floors[CATEGORIES.index("dog")] = max(settings.evidence_floor, settings.dog_floor)
    return floors


def checked_detectors(model: torch.nn.Module, settings: DecodeConfig) -> WordDetectors | None:
    """The model's word detectors; a ValueError when decode.person_floor asks for a person detector it lacks."""
    det = detectors_of(model)
    if settings.person_floor > 0 and (det is None or PERSON not in det.groups):
        raise ValueError(f"decode.person_floor={settings.person_floor} needs a model file with a person detector "
                         "(captioner-train-detectors writes one); set decode.person_floor=0 for this model")
    return det


def person_word_mask(vocab: Vocab, det: WordDetectors) -> torch.Tensor:
    """(V,) 0/1: the vocabulary's person words (the person detector's group), a word taught from one included.
    Built once per vocabulary and person group (a loop over the vocabulary); each call gets its own copy."""
    taught = tuple((w, vocab.source(w)) for w in sorted(vocab.aliases))
    return _person_words(tuple(vocab.itos), frozenset(det.members.get(PERSON, ())), taught).clone()


@lru_cache(maxsize=8)
def _person_words(itos: tuple[str, ...], names: frozenset[str], taught: tuple[tuple[str, str], ...]) -> torch.Tensor:
    source = dict(taught)
    return torch.tensor([float(w in names or source.get(w, w) in names) for w in itos])  # (V,)


class Evidence:
    """Per-image word scores for decoding: probs (B, C) concept probabilities, words (V, C) from
    word_categories, settings.evidence_* -> `ruled_out` (B, V) (what the veto bans) and the bonus
    `bias_after(images, named)` for the live rows.
    `person`: (P(person) (B,), person words (V,)) from the word detectors, or None when the model has none.
    Built by photo_evidence (one per decode); tests build it from hand-made probabilities."""

    def __init__(self, probs: torch.Tensor, words: torch.Tensor, settings: DecodeConfig,
                 person: tuple[torch.Tensor, torch.Tensor] | None = None, seen: torch.Tensor | None = None):
        """`seen` (B, C): what rules a category out, when not `probs` (detected_probs: the head or the word
        detector of the same name, whichever sees it more)."""
        self.words = words.to(probs)  # (V, C)
        self.person = person  # (P(person) (B,), person words (V,)) or None: what else reads it (the choice)
        floors = category_floors(settings, probs.shape[1]).to(probs)  # (C,)
        out = ruled_out_words(probs if seen is None else seen.to(probs), self.words, floors, person,
                              settings.person_floor)  # (B, V)
        # (B, V) True: the word names an object the heads rule out. The veto bans it (rules.Rules: -inf, never
        # written; no bias of a size), and a Caption marks it contradicted
        self.ruled_out = out > 0
        self.bonus = settings.evidence_bonus * probs * (probs >= floors).float()  # (B, C)
        self.has_bonus = bool(settings.evidence_bonus) and bool((self.bonus > 0).any())  # else no bias at all

    def bias_after(self, images: torch.Tensor, named: torch.Tensor | None) -> torch.Tensor:
        """images (N,), the categories each row has named so far (N, C) 0/1 or None (none yet) -> the bias (N, V)
        each next word gets: each category's bonus until the row has named it (rules.Rules keeps `named` step by
        step instead of reading every word, and asks only where there is a bonus). The veto is no bias: Rules bans
        `ruled_out`."""
        bonus = self.bonus[images]  # (N, C)
        if named is not None:
            bonus = bonus * (1 - named)
        return bonus @ self.words.t()  # (N, V)

    def word_bias(self, image: int, tokens: list[int]) -> torch.Tensor:
        """(L,) the bias each of an image's caption words got when decoding chose it (after the words
        before it): what separates the decoding score from the model's own log-probability."""
        return self.word_biases([image], [tokens])[0, :len(tokens)]

    def word_biases(self, images: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """Many captions at once: caption i of image images[i] -> (N, L) the bias each of its words got (0 after its
        end; L the longest's words), on the evidence's device: its bonus (a banned word is never written, and
        carries no bias where a caption holds one anyway)."""
        (V, C), L = self.words.shape, max(map(len, tokens), default=0)
        out = self.bonus.new_zeros(len(tokens), L)  # (N, L)
        if not self.has_bonus or not L:
            return out
        t = torch.tensor([w + [V] * (L - len(w)) for w in tokens], dtype=torch.long).view(len(tokens), L)
        t, image = t.to(self.words.device), torch.tensor(images, dtype=torch.long).to(self.words.device)  # (N,)
        named = torch.cat([self.words, self.words.new_zeros(1, C)])[t]  # (N, L, C) each word's; padding's none
        before = torch.cat([torch.zeros_like(named[:, :1]), named.cummax(1).values[:, :-1]], 1)  # (N, L, C) before it
        return ((self.bonus[image][:, None, :] * (1 - before)) * named).sum(-1)  # (N, L): bias_after at each step


def detected_probs(probs: torch.Tensor, det: WordDetectors | None, detections: torch.Tensor | None
                   ) -> torch.Tensor:
    """probs (B, C) -> (B, C) where a word detector has a group named after category k ("horse"), the larger
    of the head's P(k) and the detector's: the veto's probability. The ImageNet head is a weak horse detector
    (one horse class); the caption-trained detector sees most horses, and neither sees one that is not there."""
    if det is None or detections is None:
        return probs
    out = probs.clone()
    for k, cat in enumerate(CATEGORIES):
        if cat in det.groups:
            out[:, k] = torch.maximum(probs[:, k], det.prob_of(detections, cat).to(probs))
    return out


def photo_evidence(reading: HeadReading, model: torch.nn.Module, vocab: Vocab, settings: DecodeConfig
                   ) -> Evidence | None:
    """The photos' evidence from their reading, computed once per decode: the ruled-out words (category
    words below decode.evidence_floor; person words below decode.person_floor with a person detector), the
    bonus table. None without the ImageNet head. Decoding uses it only with decode.evidence; the contradicted
    words of every Caption come from its `ruled_out` either way. A ValueError when decode.person_floor asks
    for a person detector the model lacks."""
    det = checked_detectors(model, settings)
    if reading.probs is None:
        return None
    words = word_categories(vocab).to(reading.probs.device)  # (V, C)
    person = None
    if det is not None and reading.seen is not None:
        person = (det.prob_of(reading.seen, PERSON), person_word_mask(vocab, det).to(reading.probs.device))
    seen = None
    if settings.evidence_detectors:
        seen = detected_probs(reading.probs, det, reading.seen)
    elif vocab.aliases and det is not None and reading.seen is not None:  # a taught word's category: its detector
        taught = words[[vocab.stoi[w] for w in vocab.aliases]].amax(0) > 0  # (C,) categories a taught word names
        seen = torch.where(taught, detected_probs(reading.probs, det, reading.seen), reading.probs)  # (B, C)
    return Evidence(reading.probs, words, settings, person, seen)


__all__ = ["Evidence", "photo_evidence", "word_categories", "checked_detectors", "person_word_mask"]
