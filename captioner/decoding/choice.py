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

Legend: B photos, P regions, D feature dim, N the batch's candidates (pool.Pool), B' the photos with two or more,
S signals, C COCO categories, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..concepts.imagenet import THRESHOLD
from ..concepts.words import word_categories
from ..config import DecodeConfig
from ..vocab import Vocab
from .confidence import SIGNALS as SURE_SIGNALS
from .confidence import ConfidenceMap, finite, sure_signals
from .consensus import ConsensusMemory
from .hypotheses import Hypothesis
from .pool import Pool
from .support import ObjectCheck

# every signal, in the order the fitter and the app list them
SIGNALS = ("score", "consensus", "wide", "agreement", "log_prob", "length", "objects", "top_object")
CIDER_SIGNALS = ("consensus", "wide", "agreement")  # the CIDEr-D signals: computed only where weighed
# the reference captions one CIDEr-D pass compares with at most (a wide neighbourhood holds ~400 per candidate):
# ~1.7M n-gram entries, ~150 MB of temporaries
REFERENCES_PER_PASS = 50_000
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


def signals(pool: Pool, nearest: Sequence[Sequence[int]], k: int, probs: torch.Tensor | None,
            categories: torch.Tensor | None, memory: ConsensusMemory, weights: Weights,
            person: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Every candidate of the batch's pool -> its signals (N, S) float64 in SIGNALS order, on the pool's device; a
    CIDEr-D signal (consensus, wide, agreement) of weight 0 is left 0 (not computed). nearest: each photo's memory
    photos, nearest first (the first k: consensus; all of them, WIDE x k: wide); probs (B, C): the head's
    P(category), or None without a head; categories (V, C): which words name which category (None: objects and
    top_object left 0); person: (P(person) (B,), the person words (V,) 0/1) from the file's person detector, or None."""
    out = torch.zeros(len(pool), len(SIGNALS), dtype=torch.float64, device=pool.tokens.device)  # (N, S)
    out[:, 0] = pool.score - pool.group_max(pool.score, len(nearest))[pool.photo]
    out[:, 1:4] = _agreements(pool, nearest, k, memory, weights).to(out)
    out[:, 4] = pool.log_prob / (pool.lengths + 1)  # <end> included: a per-token mean
    out[:, 5] = pool.lengths
    if probs is not None and categories is not None:
        p = probs.to(out)[pool.photo]  # (N, C)
        named = pool.named(categories)  # (N, C) the categories each candidate names
        out[:, 6] = ((p - OBJECT_P) * named).sum(1)
        if person is not None:
            says_person = pool.named(person[1].reshape(-1, 1))[:, 0]  # (N,)
            out[:, 6] += torch.where(says_person, person[0].to(out)[pool.photo] - OBJECT_P, 0.0)
        top_p, top = p.max(1)  # (N,) each
        out[:, 7] = (named.gather(1, top[:, None])[:, 0] & (top_p >= OBJECT_P)).to(out)
    return out


def _agreements(pool: Pool, nearest: Sequence[Sequence[int]], k: int, memory: ConsensusMemory,
                weights: Weights) -> torch.Tensor:
    """(N, 3): consensus, wide and agreement of every candidate (0 where not weighed), in as few CIDEr-D passes
    as bounded memory allows (one for a batch of 16 photos)."""
    cands: list[list[int]] = []
    sets: list[list] = []
    rows: list[tuple[int, int]] = []
    for column, signal in enumerate(CIDER_SIGNALS):
        if not weights[signal]:
            continue
        for r, (b, words) in enumerate(zip(pool.owners, pool.words)):
            near = nearest[b][:k] if signal == "consensus" else nearest[b]
            refs = [pool.others(r)] if signal == "agreement" else [memory.captions_of(j) for j in near]
            if refs[0]:  # a photo's only candidate agrees with nobody: 0
                cands.append(words)
                sets.append(refs)
                rows.append((r, column))
    device = pool.tokens.device
    out = torch.zeros(len(pool), 3, dtype=torch.float64, device=device)  # (N, 3)
    at = torch.tensor(rows, dtype=torch.int64).view(-1, 2).to(device)  # (X, 2) the candidate and the column of each agreement
    values, size, first = [], 0, 0
    for i, refs in enumerate(sets):  # passes of at most REFERENCES_PER_PASS references (memory stays bounded)
        if size and size + sum(map(len, refs)) > REFERENCES_PER_PASS:
            values.append(memory.cider.agreements(cands[first:i], sets[first:i]).to(device))  # (i - first,)
            first, size = i, 0
        size += sum(map(len, refs))
    if cands:
        values.append(memory.cider.agreements(cands[first:], sets[first:]).to(device))
        out[at[:, 0], at[:, 1]] = torch.cat(values)  # (X,)
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
    (confidence.sure_signals; every signal they need computed) and, with a map, its `confidence`; check: the photos'
    objects check (support.py: Evidence.check), or None. settings: consensus_k.

    The whole batch is decided at once (pool.Pool): every candidate's signals as one (N, S) tensor, the choice one
    product with the weights, the order one sort, the chosen captions' confidence signals and their confidence one
    sigmoid; what the hypotheses carry is read to the host once, at the end."""
    how_sure = fitted is not None if how_sure is None else how_sure
    if memory is None or (weights.beam_order and not how_sure) or all(len(h) < 2 for h in hyps):
        return [list(h) for h in hyps]
    # what the confidence reads beyond the choice's own signals (a fitted map: the signals it weighs; none: every one,
    # as the fit needs); the agreement always (the sure caption's, and "it hesitated")
    sure_extra = Weights(tuple(float(how_sure and not v and (s == "agreement" or fitted is None or fitted.weighs(s)))
                               for s, v in zip(SIGNALS, weights.values)))
    k = int(settings.consensus_k)
    wide = weights["wide"] or sure_extra["wide"]
    cosines, nearest = memory.nearest_with_cosines(feats, WIDE * k if wide else k)  # (B, k') nearest first
    if weights["objects"] or weights["top_object"] or how_sure:
        categories = (word_categories(vocab) if categories is None else categories).to(torch.bool)  # (V, C)
    else:
        categories = None
    device = feats.device
    pool = Pool.of(hyps, memory.vocab_size, device)  # the memory speaks the model's vocabulary
    need = Weights(tuple(float(bool(a or b)) for a, b in zip(weights.values, sure_extra.values)))  # 1: computed
    x = signals(pool, nearest.tolist(), k, None if categories is None else probs, categories, memory, need,
                person)  # (N, S): every signal the choice or the confidence reads
    seen = torch.tensor([bool(weights[s]) or s not in CIDER_SIGNALS for s in SIGNALS], device=device)  # (S,)
    x_choice = x * seen  # (N, S): as the choice sees them (a CIDEr-D signal it does not weigh: 0)
    total = x_choice @ weights.tensor().to(device)  # (N,)
    order = pool.order(total) if not weights.beam_order else torch.arange(len(pool), device=device)  # (N,)
    first = torch.tensor(pool.starts, dtype=torch.int64, device=device)  # (B',) each photo's first row
    best, runner = order[first], order[first + 1]  # (B',) each photo's chosen row and its runner-up
    parts = [x_choice.flatten(), total, order.to(total)]
    if how_sure:
        margin = (total[best] - total[runner]) if not weights.beam_order else torch.zeros_like(total[best])  # (B',)
        texts = [" ".join(vocab.itos[t] for t in pool.words[r]) for r in range(len(pool))]
        photos = torch.tensor(pool.photos, dtype=torch.int64, device=device)  # (B',)
        chosen = {name: x[best, SIGNALS.index(name)] for name in ("wide", "consensus", "agreement", "log_prob",
                                                                   "objects")}  # (B',) each
        sure = sure_signals(pool, best, photos, chosen, margin, cosines[:, 0].to(x)[photos],
                            None if probs is None or categories is None else probs.to(x)[photos], categories,
                            person, check, texts)  # (B', S')
        confidence = fitted.confidences(sure) if fitted is not None else torch.zeros(len(first)).to(x)  # (B',)
        parts += [sure.flatten(), confidence]
    return _dressed(hyps, pool, torch.cat(parts).tolist(), not weights.beam_order, how_sure, fitted is not None)


def _dressed(hyps: Sequence[Sequence[Hypothesis]], pool: Pool, host: list[float], chose: bool, how_sure: bool,
             confident: bool) -> list[list[Hypothesis]]:
    """The decision read to the host (choose's one read, flat: the choice's signals (N, S), totals (N,), order (N,),
    then with how_sure the chosen captions' signals (B', S') and confidences (B',)) -> each photo's hypotheses in
    the chosen order, each carrying its choice (where chose) and the first its sure_signals and confidence."""
    n, s, width = len(pool), len(SIGNALS), len(SURE_SIGNALS)
    rows, totals = [host[i * s:(i + 1) * s] for i in range(n)], host[n * s:n * s + n]
    ranked, sure = [int(r) for r in host[n * s + n:n * s + 2 * n]], host[n * s + 2 * n:]
    out = [list(h) for h in hyps]
    for g, (b, at) in enumerate(zip(pool.photos, pool.starts)):  # a photo's candidates are rows at, at + 1, ...
        cands = out[b]
        if chose:
            for i, h in enumerate(cands):
                h.choice, h.signals = totals[at + i], dict(zip(SIGNALS, rows[at + i]))
        out[b] = ordered = [cands[r - at] for r in ranked[at:at + len(cands)]]
        if how_sure:
            ordered[0].sure_signals = dict(zip(SURE_SIGNALS, sure[g * width:(g + 1) * width]))
            ordered[0].confidence = sure[len(pool.photos) * width + g] if confident else None
    return out
