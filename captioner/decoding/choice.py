"""Choosing the caption: which of the beam's finished captions a person reads.

Beam search ends with several finished captions per photo, and its own order (the length-normalised
log-probability) is a weak judge of them: on coco-paired val the beam's first caption scores CIDEr .68, a random
one of its five .66 and the best of the five .89 (docs/results.md, "Choosing the caption"). Each candidate c of a
photo is described by cheap signals, and the caption is the candidate of highest

    choice(c) = sum_s weight_s * s(c)

with the weights the model file fitted (fitted.py; a CIDEr-D signal of weight 0 is not computed for it). The choice
only orders; how sure the chosen caption is, is the judge's (confidence.judge). The signals:

    score       the beam's score minus the photo's best: log_prob / (words + 1) ** length_penalty, with the
                evidence's bonus (search.py)
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
import math
from typing import Any, Collection, Sequence

import torch

from ..concepts.imagenet import THRESHOLD
from .consensus import ConsensusMemory
from .device_beam import Hypothesis
from .pool import Pool

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


def finite(value: Any, name: str) -> float:
    """A fitted number as a float, or a ValueError naming it (a bool, text, NaN or infinity is no weight)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


BEAM_ORDER = Weights((1.0,) + (0.0,) * (len(SIGNALS) - 1))  # the beam's own score alone: its order kept


def signals(pool: Pool, photos: int, cider: torch.Tensor, probs: torch.Tensor | None,
            categories: torch.Tensor | None, person: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Every candidate of the batch's pool (of `photos` photos) -> its signals (N, S) float64 in SIGNALS order, on
    the pool's device. cider (N, 3): its CIDEr-D signals (agreements: consensus, wide, agreement; 0 where not
    computed); probs (B, C): the head's P(category), or None without a head; categories (V, C): which words name
    which category (None: objects and top_object left 0); person: (P(person) (B,), the person words (V,) 0/1) from
    the file's person detector, or None."""
    out = torch.zeros(len(pool), len(SIGNALS), dtype=torch.float64, device=pool.tokens.device)  # (N, S)
    out[:, 0] = pool.score - pool.group_max(pool.score, photos)[pool.photo]
    out[:, 1:4] = cider.to(out)
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


def agreements(pool: Pool, nearest: Sequence[Sequence[int]], k: int, memory: ConsensusMemory,
               wanted: Collection[str]) -> torch.Tensor:
    """(N, 3): consensus, wide and agreement (CIDER_SIGNALS) of every candidate, those `wanted` computed (the
    others 0), in as few CIDEr-D passes as bounded memory allows (one for a batch of 16 photos). Each candidate's
    value is its own whatever else a pass holds."""
    cands: list[list[int]] = []
    sets: list[list] = []
    rows: list[tuple[int, int]] = []
    for column, signal in enumerate(CIDER_SIGNALS):
        if signal not in wanted:
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


@dataclass(frozen=True)
class Neighbours:
    """Each photo's nearest training photos in the consensus memory, nearest first (B lists of k'), their cosines
    (B, k') and consensus_k: the first k are the consensus neighbourhood, all k' the wide one (WIDE x k, where the
    choice or the judge reads `wide`). Fetched once per batch for the choice and the judge alike."""
    nearest: list[list[int]]
    cosines: torch.Tensor
    k: int

    @classmethod
    def of(cls, memory: ConsensusMemory, feats: torch.Tensor, k: int, wide: bool) -> "Neighbours":
        cosines, nearest = memory.nearest_with_cosines(feats, WIDE * k if wide else k)  # (B, k') nearest first
        return cls(nearest.tolist(), cosines, k)


@dataclass(frozen=True)
class Decision:
    """The choice over a batch's candidates, on the device: the pool (pool.Pool), every candidate's signals (N, S)
    in SIGNALS order (a CIDEr-D signal the weights leave at 0: not computed, 0), its choice (N,), the rows in the
    chosen order (N,: each photo's rows stay together), each photo's chosen row and runner-up (B',), and the
    weights it chose by (chose: False where they keep the beam's own order)."""
    pool: Pool
    signals: torch.Tensor
    total: torch.Tensor
    order: torch.Tensor
    best: torch.Tensor
    runner: torch.Tensor
    weights: Weights

    @property
    def chose(self) -> bool:
        return not self.weights.beam_order

    def host(self) -> tuple[torch.Tensor, ...]:
        """What the hypotheses carry of the choice, flat for one read: the signals (N, S), totals (N,), order (N,)."""
        return self.signals.flatten(), self.total, self.order.to(self.total)


def choose(pool: Pool, photos: int, cider: torch.Tensor, probs: torch.Tensor | None, weights: Weights,
           person: tuple[torch.Tensor, torch.Tensor] | None = None, categories: torch.Tensor | None = None
           ) -> Decision:
    """A batch's candidates (the pool of `photos` photos, each with two or more) -> the Decision: every
    candidate's signals, its choice with the model file's fitted `weights` (fitted.Fitted.choice_in_use) and the
    order, highest first, the whole batch at once (one product, one sort). cider (N, 3): the candidates' CIDEr-D
    signals (agreements), of which the choice reads those it weighs; probs (B, C): the head's P(category), or
    None; person: (P(person) (B,), person words (V,)) from the file's person detector (Evidence.person), or None;
    categories (V, C) bool: which words name which category, or None (objects and top_object left 0). Nothing is
    read to the host here (Decision.host)."""
    device = pool.tokens.device
    seen = torch.tensor([float(bool(weights[s])) for s in CIDER_SIGNALS], dtype=torch.float64, device=device)  # (3,)
    x = signals(pool, photos, cider.to(device) * seen, None if categories is None else probs, categories,
                person)  # (N, S): a CIDEr-D signal the choice does not weigh is 0 in what it says
    total = x @ weights.tensor().to(device)  # (N,)
    order = pool.order(total) if not weights.beam_order else torch.arange(len(pool), device=device)  # (N,)
    first = torch.tensor(pool.starts, dtype=torch.int64, device=device)  # (B',) each photo's first row
    return Decision(pool, x, total, order, order[first], order[first + 1], weights)


def ordered(hyps: Sequence[Sequence[Hypothesis]], decision: Decision, host: list[float]
            ) -> list[tuple[list[Hypothesis], list[float] | None, list[dict[str, float]] | None]]:
    """Decision.host read to the host (flat, first) -> each photo's hypotheses in the chosen order, with each one's
    choice and signals where the weights chose (None, None: the beam's order kept)."""
    pool, n, s = decision.pool, len(decision.pool), len(SIGNALS)
    rows, totals = [host[i * s:(i + 1) * s] for i in range(n)], host[n * s:n * s + n]
    ranked = [int(r) for r in host[n * s + n:n * s + 2 * n]]
    out: list[tuple[list[Hypothesis], list[float] | None, list[dict[str, float]] | None]] = [
        (list(h), None, None) for h in hyps]
    for b, at in zip(pool.photos, pool.starts):  # a photo's candidates are rows at, at + 1, ...
        rows_of = ranked[at:at + len(hyps[b])]
        picked = [hyps[b][r - at] for r in rows_of]
        out[b] = (picked, [totals[r] for r in rows_of], [dict(zip(SIGNALS, rows[r])) for r in rows_of]) \
            if decision.chose else (picked, None, None)
    return out
