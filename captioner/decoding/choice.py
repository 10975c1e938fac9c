"""Choosing the caption (the decide stage): which of the beam's finished candidates a person reads.

The beam's first is a weak pick (coco-paired val: CIDEr .68, the best of its five .89; docs/results.md). The choice
is the candidate of highest sum_s weight_s * s, weights fitted in the model file (evaluation/choice_fit.py): score
(the beam's minus the photo's best), consensus and wide (CIDEr-D with the captions of the consensus_k and WIDE x
consensus_k nearest training photos), agreement (with the photo's other candidates: minimum Bayes risk), log_prob
(per token), length (words), objects (sum of P(category) - OBJECT_P over the categories named; a person word: the
person detector's P) and top_object (it names the head's most probable category, P >= OBJECT_P). Legend: B photos,
N the batch's candidates (Pool), B' the photos with two or more, S signals, C COCO categories, V vocabulary, L words.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import torch

from ..concepts.imagenet import THRESHOLD
from .consensus import ConsensusMemory
from .device_beam import Hypothesis

# every signal, in the order the fitter and the app list them
SIGNALS = ("score", "consensus", "wide", "agreement", "log_prob", "length", "objects", "top_object")
CIDER_SIGNALS = ("consensus", "wide", "agreement")  # computed only where weighed
REFERENCES_PER_PASS = 50_000  # the most reference captions one CIDEr-D pass reads (~150 MB of temporaries)
WIDE = 4  # the wide neighbourhood: WIDE x consensus_k nearest training photos
OBJECT_P = THRESHOLD  # the P from which a named category counts for objects and top_object


@dataclass(frozen=True)
class Pool:
    """Every candidate of the photos with at least `least`, flat: a photo's rows consecutive in the beam's order,
    words padded with V (a row past the vocabulary: padded)."""
    photo: torch.Tensor  # (N,) int64: the photo (its index in the batch) of each candidate
    tokens: torch.Tensor  # (N, L) int64: its words, V after the end
    lengths: torch.Tensor  # (N,) int64: words
    log_prob: torch.Tensor  # (N,) float64: the model's log-probability (with <end>'s)
    score: torch.Tensor  # (N,) float64: the beam's score
    min_word: torch.Tensor  # (N,) float64: the least word log-probability, 0 without word log-probs
    words: list[list[int]]  # the tokens on the host
    photos: list[int]  # the photos in the pool, in batch order
    sizes: list[int]  # how many candidates each of them has
    starts: list[int]  # where each of them begins

    @classmethod
    def of(cls, hyps: Sequence[Sequence[Hypothesis]], vocab_size: int, device: torch.device | str = "cpu",
           least: int = 2) -> "Pool":
        photos = [b for b, h in enumerate(hyps) if len(h) >= least]
        cands = [(b, h) for b in photos for h in hyps[b]]
        words = [list(h.tokens) for _, h in cands]
        width = max((len(w) for w in words), default=1) or 1  # one padding column at least
        has = [r for r, (_, h) in enumerate(cands) if h.word_logps is not None and len(h.word_logps)]
        min_word = torch.zeros(len(cands), dtype=torch.float64)  # (N,)
        if has:  # on the side the beam left them (the host, after its one read)
            values = torch.cat([cands[r][1].word_logps for r in has]).double()  # (W,)
            owner = torch.tensor([r for r in has for _ in range(len(cands[r][1].word_logps))], dtype=torch.int64,
                                 device=values.device)  # (W,)
            min_word = min_word.to(values.device).scatter_reduce(0, owner, values, "amin", include_self=False)
        n, dev = len(cands), torch.device(device)
        host = torch.tensor([[b, len(w)] for (b, _), w in zip(cands, words)], dtype=torch.int64).view(n, 2)
        floats = torch.tensor([[float(h.log_prob), float(h.score)] for _, h in cands], dtype=torch.float64).view(n, 2)
        tokens = torch.tensor([w + [vocab_size] * (width - len(w)) for w in words], dtype=torch.int64).view(n, width)
        sizes = [len(hyps[b]) for b in photos]
        return cls(host[:, 0].to(dev), tokens.to(dev), host[:, 1].to(dev), floats[:, 0].to(dev), floats[:, 1].to(dev),
                   min_word.to(dev), words, photos, sizes, list(itertools.accumulate(sizes, initial=0))[:-1])

    def __len__(self) -> int:
        return len(self.words)

    def padded(self, table: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """A word table (V, ...) -> (V + 1, ...) with a row of `fill` for the padding, on the pool's device."""
        table = table.to(self.tokens.device)
        return torch.cat([table, table.new_full((1, *table.shape[1:]), fill)])

    def named(self, table: torch.Tensor) -> torch.Tensor:
        """(V, M) which columns each word names -> (N, M) bool: which each candidate names."""
        return self.padded(table.bool(), False)[self.tokens].any(1)

    def order(self, total: torch.Tensor) -> torch.Tensor:
        """(N,) choice -> (N,) rows grouped by photo, highest first within one, equals in the beam's order."""
        by_total = torch.sort(-total, stable=True).indices  # (N,)
        return by_total[torch.sort(self.photo[by_total], stable=True).indices]  # (N,)


def finite(value: Any, name: str) -> float:
    """A fitted number as a float, or a ValueError naming it (a bool, text, NaN or infinity is no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def by_signal(data: Any, known: Sequence[str], what: str, name: str = "{}") -> tuple[float, ...]:
    """{signal: number} as a model file stores it (one left out: 0) -> the numbers in `known` order, or a ValueError
    (`name`: how it calls signal s's number)."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a mapping, got {data!r}")
    if set(data) - set(known):
        raise ValueError(f"{what} name unknown signals {sorted(set(data) - set(known))} (known: {', '.join(known)})")
    return tuple(finite(data.get(s, 0.0), name.format(s)) for s in known)


@dataclass(frozen=True)
class Weights:
    """The weight of each signal, SIGNALS order."""
    values: tuple[float, ...]

    @classmethod
    def from_json(cls, data: Any) -> "Weights":
        return cls(by_signal(data, SIGNALS, "the choice's weights"))

    def to_json(self) -> dict[str, float]:
        return dict(zip(SIGNALS, self.values))

    def __getitem__(self, signal: str) -> float:
        return self.values[SIGNALS.index(signal)]

    @property
    def beam_order(self) -> bool:
        """Whether only the beam's own score counts (its order kept, nothing to compute)."""
        return not any(self.values[1:])


BEAM_ORDER = Weights((1.0,) + (0.0,) * (len(SIGNALS) - 1))


def signals(pool: Pool, photos: int, cider: torch.Tensor, probs: torch.Tensor | None,
            categories: torch.Tensor | None, person: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(N, S) float64. cider (N, 3): agreements; probs (B, C): the head's P; categories (V, C): the words naming
    each (either None: objects, top_object 0); person: (P(person) (B,), person words (V,)) or None."""
    out = torch.zeros(len(pool), len(SIGNALS), dtype=torch.float64, device=pool.tokens.device)  # (N, S)
    best = pool.score.new_full((photos,), float("-inf")).scatter_reduce(0, pool.photo, pool.score, "amax")  # (B,)
    out[:, 0] = pool.score - best[pool.photo]
    out[:, 1:4] = cider.to(out)
    out[:, 4] = pool.log_prob / (pool.lengths + 1)  # <end> included: a per-token mean
    out[:, 5] = pool.lengths
    if probs is not None and categories is not None:
        p = probs.to(out)[pool.photo]  # (N, C)
        named = pool.named(categories)  # (N, C)
        out[:, 6] = ((p - OBJECT_P) * named).sum(1)
        if person is not None:
            says_person = pool.named(person[1].reshape(-1, 1))[:, 0]  # (N,)
            out[:, 6] += torch.where(says_person, person[0].to(out)[pool.photo] - OBJECT_P, 0.0)
        top_p, top = p.max(1)  # (N,) each
        out[:, 7] = (named.gather(1, top[:, None])[:, 0] & (top_p >= OBJECT_P)).to(out)
    return out


def agreements(pool: Pool, nearest: Sequence[Sequence[int]], k: int, memory: ConsensusMemory,
               wanted: Collection[str]) -> torch.Tensor:
    """(N, 3): each candidate's CIDER_SIGNALS, those `wanted` computed (the others 0), in as few CIDEr-D passes
    as REFERENCES_PER_PASS allows; a candidate's value does not depend on what else a pass holds."""
    cands, sets, rows = [], [], []  # words, their references, (row, column)
    for column, signal in ((c, s) for c, s in enumerate(CIDER_SIGNALS) if s in wanted):
        for b, at, size in zip(pool.photos, pool.starts, pool.sizes):  # a photo's rows are at, at + 1, ...
            near = nearest[b][:k] if signal == "consensus" else nearest[b]
            for r in range(at, at + size):
                refs = ([[pool.words[s] for s in range(at, at + size) if s != r]] if signal == "agreement"
                        else [memory.captions_of(j) for j in near])  # the others in the beam's order, or the memory's
                if refs[0]:  # a photo's only candidate agrees with nobody: 0
                    cands.append(pool.words[r])
                    sets.append(refs)
                    rows.append((r, column))
    device = pool.tokens.device
    out = torch.zeros(len(pool), 3, dtype=torch.float64, device=device)  # (N, 3)
    at = torch.tensor(rows, dtype=torch.int64).view(-1, 2).to(device)  # (X, 2) candidate, column
    values, size, first = [], 0, 0
    for i, refs in enumerate(sets):
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
    """Each photo's nearest training photos (B lists of k') and cosines (B, k'): the first k consensus's, all wide's."""
    nearest: list[list[int]]
    cosines: torch.Tensor
    k: int

    @classmethod
    def of(cls, memory: ConsensusMemory, feats: torch.Tensor, k: int, wide: bool) -> "Neighbours":
        cosines, nearest = memory.nearest(feats, WIDE * k if wide else k)  # (B, k')
        return cls(nearest.tolist(), cosines, k)


@dataclass(frozen=True)
class Decision:
    """The choice on the device: signals (N, S), choice (N,), chosen order (N,), chosen row and runner-up (B',)."""
    pool: Pool
    signals: torch.Tensor
    total: torch.Tensor
    order: torch.Tensor
    best: torch.Tensor
    runner: torch.Tensor
    weights: Weights

    def host(self) -> tuple[torch.Tensor, ...]:
        """What the hypotheses carry, flat for one read: signals (N * S,), totals (N,), order (N,)."""
        return self.signals.flatten(), self.total, self.order.to(self.total)


def choose(pool: Pool, photos: int, cider: torch.Tensor, probs: torch.Tensor | None, weights: Weights,
           person: tuple[torch.Tensor, torch.Tensor] | None = None, categories: torch.Tensor | None = None
           ) -> Decision:
    """The pool (of `photos` photos) -> the Decision by `weights`: one product, one sort, nothing read."""
    device = pool.tokens.device
    seen = torch.tensor([float(bool(weights[s])) for s in CIDER_SIGNALS], dtype=torch.float64, device=device)  # (3,)
    x = signals(pool, photos, cider.to(device) * seen, probs, categories, person)  # (N, S)
    total = x @ torch.tensor(weights.values, dtype=torch.float64, device=device)  # (N,)
    order = pool.order(total) if not weights.beam_order else torch.arange(len(pool), device=device)  # (N,)
    first = torch.tensor(pool.starts, dtype=torch.int64, device=device)  # (B',)
    return Decision(pool, x, total, order, order[first], order[first + 1], weights)
