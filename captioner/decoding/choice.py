"""Choosing the caption: which of the beam's finished captions a person reads.

Beam search ends with several finished captions per photo, and its own order (the length-normalised
log-probability) is a weak judge of them: on coco-paired val the beam's first caption scores CIDEr .68, a random
one of its five .66 and the best of the five .89 (docs/results.md, "Choosing the caption"). Each candidate c of a
photo is described by cheap signals, and the caption is the candidate of highest

    choice(c) = sum_s weight_s * s(c)

with the weights the model file fitted (fitted.py; a weight of 0: the signal is not computed). The signals:

    score       the beam's score minus the photo's best: log_prob / (words + 1) ** length_penalty, with the
                evidence's bias (search.py)
    consensus   CIDEr-D with the captions of the decode.consensus_k training photos nearest in pooled features
                (consensus.py: Devlin et al. 2015)
    wide        the same over the WIDE x consensus_k nearest: what people say of a larger neighbourhood
    agreement   CIDEr-D with the photo's other candidates: minimum-Bayes-risk selection (Kumar and Byrne 2004),
                the caption the beam's alternatives agree with
    log_prob    the model's own log-probability per word (no bias, no length penalty)
    length      words
    objects     sum over the COCO categories the caption names (concepts/words.py) of P(category) - OBJECT_P,
                the encoder's head's probability less the concepts' threshold: naming what the head sees adds,
                naming what it barely sees (the wrong dog, the couch that is a bed) subtracts; a person word
                counts the same with the file's person detector's P(person), where it has one
    top_object  1 when the caption names the category the head finds most probable (P >= OBJECT_P), else 0

The weights are fitted by `captioner-fit-selector` on the val sets (never test): least squares predicting each
candidate's CIDEr relative to its photo's other candidates, judged out of fold (k-fold over photos), and stored as
the model file's fitted data (fitted.py: captioner-export --fitted). Weights on score and consensus alone are the
consensus rerank; a file without a fitted choice (or decode.fitted_choice false) keeps the beam's order, and so
does one without a consensus memory beside it (the CIDEr-D tables and the nearest photos come from it).

Legend: B photos, P regions, D feature dim, n a photo's candidates, C COCO categories, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..concepts.imagenet import THRESHOLD
from ..concepts.words import word_categories
from ..config import DecodeConfig
from ..vocab import Vocab
from .confidence import ConfidenceMap, finite
from .confidence import signals as sure_signals
from .consensus import ConsensusMemory
from .hypotheses import Hypothesis
from .support import ObjectCheck

# every signal, in the order the fitter and the app list them
SIGNALS = ("score", "consensus", "wide", "agreement", "log_prob", "length", "objects", "top_object")
WIDE = 4  # the wide neighbourhood: WIDE x consensus_k nearest training photos
OBJECT_P = THRESHOLD  # the P from which a named category counts for objects and the top category for top_object


@dataclass(frozen=True)
class Weights:
    """The weight of each signal (SIGNALS order) and what it needs computed."""

    values: tuple[float, ...]

    @classmethod
    def from_json(cls, data: Any) -> "Weights":
        """The weights as the model file stores them ({signal: weight}; a signal left out weighs 0); a ValueError
        names an unknown signal or a weight that is not a finite number."""
        if not isinstance(data, dict) or set(data) - set(SIGNALS):
            raise ValueError(f"the choice weighs unknown signals {sorted(set(data) - set(SIGNALS))} (known: "
                             f"{', '.join(SIGNALS)})" if isinstance(data, dict) else
                             f"the choice's weights must be a mapping, got {data!r}")
        return cls(tuple(finite(data.get(s, 0.0), s) for s in SIGNALS))

    def to_json(self) -> dict[str, float]:
        """The weights as the model file stores them (from_json reads them back)."""
        return dict(zip(SIGNALS, self.values))

    def __getitem__(self, signal: str) -> float:
        return self.values[SIGNALS.index(signal)]

    @property
    def beam_order(self) -> bool:
        """Whether only the beam's own score counts (nothing to compute: today's order)."""
        return not any(self.values[1:])

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.values, dtype=torch.float64)  # (S,)


BEAM_ORDER = Weights((1.0,) + (0.0,) * (len(SIGNALS) - 1))  # the beam's own score alone: its order kept


def signals(cands: Sequence[Hypothesis], near: Sequence[int], wide: Sequence[int], probs: torch.Tensor | None,
            categories: torch.Tensor, memory: ConsensusMemory, weights: Weights,
            person: tuple[float, torch.Tensor] | None = None) -> torch.Tensor:
    """One photo's candidates -> their signals (n, S) in SIGNALS order; a signal of weight 0 is left 0 (not
    computed). near / wide: the memory photos nearest this one (consensus_k, WIDE x consensus_k); probs (C,): the
    head's P(category) or None without a head; categories (V, C): which words name which category; person:
    (P(person), the person words (V,) 0/1) from the file's person detector, or None."""
    out = torch.zeros(len(cands), len(SIGNALS), dtype=torch.float64)  # (n, S)
    best = max(h.score for h in cands)
    cider = memory.cider
    near_refs = [memory.captions_of(j) for j in near] if weights["consensus"] else []
    wide_refs = [memory.captions_of(j) for j in wide] if weights["wide"] else []
    tokens = [h.tokens for h in cands]
    if near_refs:  # every candidate in one call (CiderD.agreements)
        out[:, 1] = cider.agreements(tokens, [near_refs] * len(cands))
    if wide_refs:
        out[:, 2] = cider.agreements(tokens, [wide_refs] * len(cands))
    if weights["agreement"] and len(cands) > 1:
        out[:, 3] = cider.agreements(tokens, [[[c for j, c in enumerate(tokens) if j != i]] for i in range(len(cands))])
    for i, h in enumerate(cands):
        words = len(h.tokens)
        out[i, 0] = h.score - best
        out[i, 4] = h.log_prob / (words + 1)  # <end> included: a per-token mean
        out[i, 5] = words
        if probs is not None and words:
            ids = torch.tensor(h.tokens)  # (L,)
            named = categories[ids].amax(0) > 0  # (C,) the categories the caption names
            out[i, 6] = float((probs[named] - OBJECT_P).sum())
            if person is not None and bool(person[1][ids].any()):
                out[i, 6] += person[0] - OBJECT_P
            top = int(probs.argmax())
            out[i, 7] = float(named[top] and probs[top] >= OBJECT_P)
    return out


def choose(hyps: Sequence[Sequence[Hypothesis]], feats: torch.Tensor, probs: torch.Tensor | None,
           memory: ConsensusMemory | None, vocab: Vocab, settings: DecodeConfig,
           person: tuple[torch.Tensor, torch.Tensor] | None = None,
           categories: torch.Tensor | None = None, how_sure: bool | None = None, weights: Weights = BEAM_ORDER,
           fitted: ConfidenceMap | None = None, check: ObjectCheck | None = None) -> list[list[Hypothesis]]:
    """Each photo's finished hypotheses (best first by beam score) -> reordered by `choice`, highest first, each
    hypothesis's `choice` set (None when the beam's order is kept: no memory, all weights on the score, or one
    hypothesis). feats (B, P, D); probs (B, C): the head's P(category), or None; person: (P(person) (B,), person
    words (V,)) from the file's person detector (Evidence.person), or None; categories (V, C): which words name
    which category, where the caller holds the table already (Evidence.words: built once per decode), else built.
    weights: the choice's (the model file's fitted ones: fitted.Fitted.choice_in_use); fitted: the confidence map
    (Fitted.map_in_use) or None. how_sure (default: where there is a map): each chosen caption's `sure_signals` set
    (confidence.signals; every signal they need computed) and, with a map, its `confidence`; check: the photos'
    objects check (support.py: Evidence.check), or None. settings: consensus_k."""
    how_sure = fitted is not None if how_sure is None else how_sure
    if memory is None or (weights.beam_order and not how_sure) or all(len(h) < 2 for h in hyps):
        return [list(h) for h in hyps]
    # what the confidence reads beyond the choice's own signals, computed for the chosen caption alone (a fitted map:
    # the signals it weighs; none: every one, as the fit needs); the agreement for "it hesitated" separately
    sure_extra = Weights(tuple(float(how_sure and not v and s != "agreement" and (fitted is None or fitted.weighs(s)))
                               for s, v in zip(SIGNALS, weights.values)))
    k = int(settings.consensus_k)
    wide = weights["wide"] or sure_extra["wide"]
    cosines, nearest = memory.nearest_with_cosines(feats, WIDE * k if wide else k)  # (B, k') nearest first
    nearest = nearest.tolist()
    if not (weights["objects"] or weights["top_object"] or how_sure):
        categories = None
    else:
        categories = (word_categories(vocab) if categories is None else categories).cpu().to(torch.bool)  # (V, C)
    w = weights.tensor()  # (S,)
    out = []
    for image, cands in enumerate(hyps):
        if len(cands) < 2:
            out.append(list(cands))
            continue
        p = None if probs is None or categories is None else probs[image].float().cpu()  # (C,)
        who = None if person is None or p is None else (float(person[0][image]), person[1].cpu().bool())
        near = nearest[image]
        if weights.beam_order:  # how_sure alone: the beam's order, no choice score
            order, total = list(range(len(cands))), None
        else:
            x = signals(cands, near[:k], near, p, categories, memory, weights, who)  # (n, S)
            total = (x @ w).tolist()  # (n,)
            order = sorted(range(len(cands)), key=lambda i: -total[i])  # stable on ties
            for h, t, row in zip(cands, total, x.tolist()):
                h.choice, h.signals = t, dict(zip(SIGNALS, row))
        ordered = [cands[i] for i in order]
        if how_sure:
            best = ordered[0]
            extra = dict(zip(SIGNALS, signals([best], near[:k], near, p, categories, memory, sure_extra, who)[0].tolist()))
            row = {s: extra[s] if sure_extra[s] or best.signals is None else best.signals[s] for s in SIGNALS}
            row["agreement"] = memory.cider.agreement(best.tokens, [[c.tokens for c in ordered[1:]]])
            margin = 0.0 if total is None else total[order[0]] - total[order[1]]
            best.sure_signals = sure_signals(best, row, margin, float(cosines[image, 0]), p, categories, who,
                                             None if check is None else check.row(image),
                                             [c.tokens for c in ordered[1:]], " ".join(vocab.itos[t] for t in best.tokens))
            best.confidence = None if fitted is None else fitted(best.sure_signals)
        out.append(ordered)
    return out
