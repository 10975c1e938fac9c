"""A Photo: one photo read once (`Captioner.read`: encoded and its heads read once), asked for captions at any
settings, samples, its concepts, and the explanation of any typed sentence, never running the encoder again.

Explaining teacher-forces the sentence (model/forced.py) into a Caption with the fields decoding fills, so a caption
and its explained text have the same maps, gates and probabilities; words the vocabulary lacks are fed as <unk>
(Caption.unknown); a sentence without words is a NoWordsError. Legend: P = G*G cells, D feature dim, L words.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..concepts.imagenet import Concepts
from ..config import SAMPLE_TEMPERATURE, SAMPLE_TOP_P, DecodeConfig  # the sampling defaults: read there
from ..images import photo_notes
from ..model.decoder import Decoder
from ..model.forced import force_sentences
from ..vocab import Vocab, tokenize_typed
from .captions import Caption, caption_features, sampled_captions
from .reading import HeadReading, annotated, grid_side, photo_concepts
from .resources import Resources
from .rules import photo_evidence
from .sampling import Draw, SampleSettings


class NoWordsError(ValueError):
    """The sentence to explain has no words (empty or only punctuation); the message says so."""


def sentence_words(text: str) -> list[str]:
    """A typed sentence -> its words (tokenize_typed); NoWordsError when it has none."""
    words = tokenize_typed(text)
    if not words:
        shown = text.strip()[:40]
        raise NoWordsError(f"the sentence {shown!r} has no words to explain: type at least one word"
                           if shown else "the sentence is empty: type at least one word to explain")
    return words


def explain_features(decoder: Decoder, feats: torch.Tensor, vocab: Vocab, words: Sequence[str],
                     context: str = "expected") -> Caption:
    """feats (1, P, D) of one photo, words (L,) -> the Caption of exactly those words: alphas (L, G, G), betas
    (L,), word_log_probs (L,), log_prob = their sum + log p(<end>)."""
    words = list(words)
    if not words:
        raise NoWordsError("no words to explain: a sentence needs at least one word")
    (forced,) = force_sentences(decoder, feats, vocab, [words], context)
    L, g = len(words), grid_side(feats.shape[1])
    unknown = [i for i, w in enumerate(words) if w not in vocab.stoi]
    lp = forced.step_log_probs  # (L+1,)
    return Caption(" ".join(words), words, forced.alphas.reshape(L, g, g), float(lp.sum(dtype=np.float64)), [],
                   forced.betas, lp[:L].astype(np.float32), unknown)


class Loaded(Protocol):
    """What a Photo needs from the Captioner that read it (api.Captioner; `loaded` wherever the code holds one)."""

    model: torch.nn.Module
    vocab: Vocab
    source: str | None
    precision: str  # "float32", "bfloat16" or "int8" (api.usable_precision): named in each caption's settings
    resources: Resources  # what its decodes read besides the model (resources.py)

    def decode_settings(self, **overrides: Any) -> DecodeConfig: ...


class Photo:
    """One photo as a Captioner read it: `size` (width, height) as the model received it, `file_size` as the file
    had it (larger when shrunk on reading), `transparent`, `flat` (one colour), `features` (1, P, D), `reading`."""

    def __init__(self, loaded: Loaded, features: torch.Tensor, reading: HeadReading, size: tuple[int, int],
                 input_side: int, name: str | None = None, file_size: tuple[int, int] | None = None,
                 transparent: bool = False, flat: bool = False):
        self.loaded, self.features, self.reading = loaded, features, reading  # (1, P, D)
        self.size, self.input_side, self.name = (int(size[0]), int(size[1])), int(input_side), name
        self.file_size = self.size if file_size is None else (int(file_size[0]), int(file_size[1]))
        self.transparent, self.flat = bool(transparent), bool(flat)
        self._concepts: Concepts | None = None

    @property
    def notes(self) -> list[str]:
        """Remarks on the photo itself (images.photo_notes)."""
        return photo_notes(self.size, self.input_side, self.file_size, self.transparent, self.flat)

    @property
    def concepts(self) -> Concepts:
        """What the encoder's heads see (Concepts; unseen() without the ImageNet head): each Caption carries .top."""
        if self._concepts is None:
            self._concepts = photo_concepts(self.reading, self.loaded.model)[0]
        return self._concepts

    def caption(self, **overrides: Any) -> Caption:
        """The caption at the model file's decode settings, or with `overrides` (any DecodeConfig field)."""
        return caption_photos(self.loaded, [self], **overrides)[0]

    def sample(self, n: int = 5, temperature: float = SAMPLE_TEMPERATURE, top_k: int = 0, top_p: float = SAMPLE_TOP_P,
               seed: int | None = None, **overrides: Any) -> list[Caption]:
        """n captions drawn from the model, in order, under the caption's rules (the file's decode settings or
        `overrides`): logits divided by `temperature` (> 0), cut to the `top_k` best words (0: no cut; 1: greedy)
        and the nucleus holding `top_p` ((0, 1]). `seed` (>= 0) makes the draws reproducible with a generator of
        their own; None draws a fresh seed, recorded in settings["sample"]. A ValueError names a bad argument."""
        request = SampleSettings(n, Draw(temperature, top_k, top_p), seed).checked()
        settings = self.loaded.decode_settings(**overrides)
        caps = sampled_captions(self.loaded.model, self.features, self.reading, self.loaded.vocab, settings, request)[0]
        return [self._own(cap, settings) for cap in caps]

    @torch.no_grad()
    def explain(self, text: str, **overrides: Any) -> Caption:
        """Any sentence about the photo -> the Caption of exactly its words (explain_features), dressed like a
        generated caption. NoWordsError without words."""
        words = sentence_words(text)
        loaded = self.loaded
        settings = loaded.decode_settings(**overrides)
        cap = explain_features(loaded.model.decoder, self.features, loaded.vocab, words, settings.hard_context)
        ids = [loaded.vocab.stoi.get(w, loaded.vocab.unk) for w in cap.words]
        evidence = photo_evidence(self.reading, loaded.model, loaded.vocab, settings)  # its ruled-out words
        (cap,) = annotated([cap], [ids], self.reading, self.features, loaded.model, loaded.vocab,
                           None if evidence is None else evidence.ruled_out)
        return self._own(cap, settings)

    def _own(self, cap: Caption, settings: DecodeConfig) -> Caption:
        """The caption with what this photo says of it: its sizes, the settings and precision, the model file."""
        return dataclasses.replace(cap, photo_size=self.size, input_side=self.input_side, file_size=self.file_size,
                                   transparent=self.transparent, flat=self.flat,  # a sample's settings kept:
                                   settings={**cap.settings, **dataclasses.asdict(settings),
                                             "precision": self.loaded.precision},
                                   model_file=self.loaded.source)


@torch.no_grad()
def caption_photos(loaded: Loaded, photos: Sequence[Photo], **overrides: Any) -> list[Caption]:
    """Photos read by `loaded` (a Captioner) -> their captions, decoded together (batched over photos and beams)."""
    if not photos:
        return []
    settings = loaded.decode_settings(**overrides)
    feats = torch.cat([p.features for p in photos])  # (B, P, D)
    reading = HeadReading.together([p.reading for p in photos])
    caps = caption_features(loaded.model, feats, reading, loaded.vocab, settings, loaded.resources)
    return [p._own(c, settings) for p, c in zip(photos, caps)]
