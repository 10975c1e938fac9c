"""Choosing the caption: which of the beam's finished captions a person reads.

Beam search ends with several finished captions per photo, and its own order (the length-normalised
log-probability) is a weak judge of them: on coco-paired val the beam's first caption scores CIDEr .68, a random
one of its five .66 and the best of the five .89 (docs/results.md, "Choosing the caption"). Each candidate c of a
photo is described by cheap signals, and the caption is the candidate of highest

    choice(c) = (1 - w) * score(c) + w * consensus(c) + sum_s select_s * s(c)

with w = decode.consensus_weight and select_s = decode.select_<s> (0: the signal is not computed). The signals:

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
candidate's CIDEr relative to its photo's other candidates, judged out of fold (k-fold over photos), and stored in
the model file's decode settings like any other. A file whose select_* are 0 ranks as the consensus rerank did
(and without consensus_weight, as the beam did); without a consensus memory beside the file (the CIDEr-D tables
and the nearest photos come from it) the beam's order is kept.

Legend: B photos, P regions, D feature dim, n a photo's candidates, C COCO categories, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..concepts.imagenet import THRESHOLD
from ..concepts.words import word_categories
from ..config import DecodeConfig
from ..vocab import Vocab
from .confidence import ConfidenceMap
from .confidence import signals as sure_signals
from .consensus import ConsensusMemory
from .hypotheses import Hypothesis

# every signal, in the order the fitter and the app list them; "score" and "consensus" are weighted by
# decode.consensus_weight (w), the others by decode.select_<name>
SIGNALS = ("score", "consensus", "wide", "agreement", "log_prob", "length", "objects", "top_object")
WIDE = 4  # the wide neighbourhood: WIDE x consensus_k nearest training photos
OBJECT_P = THRESHOLD  # the P from which a named category counts for objects and the top category for top_object


@dataclass(frozen=True)
class Weights:
    """The weight of each signal (SIGNALS order) and what it needs computed."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, settings: DecodeConfig) -> "Weights":
        w = float(settings.consensus_weight)
        return cls((1 - w, w) + tuple(float(getattr(settings, f"select_{s}")) for s in SIGNALS[2:]))

    def __getitem__(self, signal: str) -> float:
        return self.values[SIGNALS.index(signal)]

    @property
    def beam_order(self) -> bool:
        """Whether only the beam's own score counts (nothing to compute: today's order)."""
        return not any(self.values[1:])

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.values, dtype=torch.float64)  # (S,)


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
           categories: torch.Tensor | None = None, how_sure: bool | None = None) -> list[list[Hypothesis]]:
    """Each photo's finished hypotheses (best first by beam score) -> reordered by `choice`, highest first, each
    hypothesis's `choice` set (None when the beam's order is kept: no memory, all weights on the score, or one
    hypothesis). feats (B, P, D); probs (B, C): the head's P(category), or None; person: (P(person) (B,), person
    words (V,)) from the file's person detector (Evidence.person), or None; categories (V, C): which words name
    which category, where the caller holds the table already (Evidence.words: built once per decode), else built.
    how_sure (default: where the settings hold a fitted confidence map): each chosen caption's `sure_signals` set
    (confidence.signals; every signal they need computed) and, with a map, its `confidence`."""
    weights, fitted = Weights.of(settings), ConfidenceMap.of(settings)
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
            best.sure_signals = sure_signals(best, row, margin, float(cosines[image, 0]), p, categories, who)
            best.confidence = None if fitted is None else fitted(best.sure_signals)
        out.append(ordered)
    return out
