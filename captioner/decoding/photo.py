"""A Photo: one photo read once, and everything about it asked there.

`Captioner.read(image)` opens the image once (its size noted), preprocesses and encodes it once and applies
the encoder's heads once (reading.read_heads). The Photo keeps the annotation vectors (1, P, D) and that
reading, so asking it for a caption at other settings, for beam alternatives, for the explanation of any
typed sentence or for its concepts never runs the encoder or the ImageNet head again; a generated caption
and an explained sentence are dressed by the same builder (reading.annotated) and list the same concepts.

    photo = model.read("photo.jpg")
    photo.caption(), photo.caption(beam_size=1), photo.explain("a dog on the grass"), photo.concepts.top
    photo.sample(n=5, seed=0)   # 5 drawn captions (temperature 0.6, top_p 0.9), the same ones for the same seed
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import torch

from ..concepts.imagenet import Concepts
from ..config import SAMPLE_TEMPERATURE, SAMPLE_TOP_P, DecodeConfig  # the sampling defaults: read there
from ..vocab import Vocab
from .captions import Caption, captions_from_features, photo_notes, sampled_captions
from .rules import photo_evidence
from .explain import explain_features, sentence_words
from .reading import HeadReading, annotated, photo_concepts
from .resources import Resources
from .sampling import Draw, SampleSettings



class Loaded(Protocol):
    """What a Photo needs from the Captioner that read it (api.Captioner; `loaded` wherever the code holds one)."""

    model: torch.nn.Module
    vocab: Vocab
    source: str | None
    resources: Resources  # what its decodes read besides the model (resources.py)

    def decode_settings(self, **overrides: Any) -> DecodeConfig: ...


class Photo:
    """One photo as a Captioner read it: `size` (width, height) as the model received it, `file_size` as the file
    had it (larger when it was shrunk on reading: images.WORKING_SIDE), `transparent` (the file was fully
    transparent), `flat` (one flat colour), `notes` (e.g. far smaller than the model's input), `features` (1, P, D), `reading` (the heads'
    outputs), `concepts`; `caption(**settings)` and `explain(text)` decode from these, never from the image again."""

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
        """Remarks on the photo itself: a fully transparent file holds no picture; a photo of one flat colour has
        nothing to caption; a photo far smaller than the model's input is enlarged a lot."""
        return photo_notes(self.size, self.input_side, self.file_size, self.transparent, self.flat)

    @property
    def concepts(self) -> Concepts:
        """What the encoder's heads see (Concepts: categories at P >= THRESHOLD with person and detected
        words, top ImageNet classes, every P); Concepts.unseen() (nothing) for an encoder without the ImageNet
        head. Every Caption of this photo carries `Concepts.top`."""
        if self._concepts is None:
            self._concepts = photo_concepts(self.reading, self.loaded.model)[0]
        return self._concepts

    def caption(self, **overrides: Any) -> Caption:
        """The caption at the model file's decode settings, or with `overrides` (any DecodeConfig field)."""
        return caption_photos(self.loaded, [self], **overrides)[0]

    def sample(self, n: int = 5, temperature: float = SAMPLE_TEMPERATURE, top_k: int = 0, top_p: float = SAMPLE_TOP_P,
               seed: int | None = None, **overrides: Any) -> list[Caption]:
        """n captions drawn from the model (decoding/sampling.py), in the order drawn: each word from the next-word
        distribution under the caption's rules (decode settings: the model file's, or `overrides`), divided by
        `temperature` (> 0; small approaches greedy decoding; default 0.6), cut to the `top_k` best words (0: no cut;
        1: greedy) and to the nucleus holding `top_p` of the probability ((0, 1]; 1: no cut; default 0.9). `seed` (>= 0) makes the draws
        reproducible (the same seed, settings and device: the same captions) with a generator of its own, never
        torch's global random state; None draws a fresh seed, recorded in each Caption's settings["sample"].
        Each Caption has its words' attention maps, gates and log-probs like a caption (score None); a ValueError
        names an argument out of range."""
        request = SampleSettings(n, Draw(temperature, top_k, top_p), seed).checked()
        settings = self.loaded.decode_settings(**overrides)
        caps = sampled_captions(self.loaded.model, self.features, self.reading, self.loaded.vocab, settings, request)[0]
        return [self._own(cap, settings) for cap in caps]

    @torch.no_grad()
    def explain(self, text: str, **overrides: Any) -> Caption:
        """Any sentence about the photo -> a Caption of exactly its words, teacher-forced (decoding/explain.py):
        where the model looks for each word and how likely it finds each, with the photo's concepts, the
        words its heads contradict and concept maps, like a generated caption. NoWordsError without words."""
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
        """The caption with what this photo says of it: its size, the model's input side, the file it came from."""
        return dataclasses.replace(cap, photo_size=self.size, input_side=self.input_side, file_size=self.file_size,
                                   transparent=self.transparent, flat=self.flat,
                                   settings={**cap.settings, **dataclasses.asdict(settings)},  # a sample's kept
                                   model_file=self.loaded.source)


@torch.no_grad()
def caption_photos(loaded: Loaded, photos: Sequence[Photo], **overrides: Any) -> list[Caption]:
    """Photos read by `loaded` (a Captioner) -> their captions, decoded together (batched over photos and beams)."""
    if not photos:
        return []
    settings = loaded.decode_settings(**overrides)
    feats = torch.cat([p.features for p in photos])  # (B, P, D)
    reading = HeadReading.cat([p.reading for p in photos])
    caps = captions_from_features(loaded.model, feats, loaded.vocab, settings, loaded.resources,
                                  batch_size=len(photos), reading=reading)
    return [p._own(c, settings) for p, c in zip(photos, caps)]
