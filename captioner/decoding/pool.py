"""A batch's finished captions as one flat pool of tensors: what the decision after the beam reads (choice.py,
confidence.py, support.py) without a loop over photos or candidates.

The beam leaves each photo a list of Hypotheses (best first by its score). The choice, the confidence and the objects
check compute their signals for every candidate of every photo at once, so the candidates are laid out flat: row r
is candidate rank[r] of photo photo[r], its words padded to the longest with V (one row past the
vocabulary, which every word table here gets as a row of zeros: `padded`).

Legend: N candidates of the batch, L the longest's words, V vocabulary.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from .device_beam import Hypothesis


@dataclass(frozen=True)
class Pool:
    """Every candidate of the photos that have at least two, flat (see the module's doc)."""

    photo: torch.Tensor  # (N,) int64: the photo (its index in the batch) of each candidate
    rank: torch.Tensor  # (N,) int64: its place in the beam's order, 0 = the beam's first
    tokens: torch.Tensor  # (N, L) int64: its words, V after the end
    lengths: torch.Tensor  # (N,) int64: words
    log_prob: torch.Tensor  # (N,) float64: the model's log-probability (with <end>'s)
    score: torch.Tensor  # (N,) float64: the beam's score (length-normalised, with the evidence's bonus)
    min_word: torch.Tensor  # (N,) float64: the least probable word's log-probability, 0 without word log-probs
    words: list[list[int]]  # the same tokens on the host (CIDEr-D's n-grams, the template's text)
    owners: list[int]  # the same photo of each candidate on the host
    photos: list[int]  # the photos in the pool, in batch order
    sizes: list[int]  # how many candidates each of them has (its rows are consecutive)

    @classmethod
    def of(cls, hyps: Sequence[Sequence[Hypothesis]], vocab_size: int, device: torch.device | str = "cpu",
           least: int = 2) -> "Pool":
        """Each photo's hypotheses -> the pool of the photos with at least `least` (a photo with one caption has
        nothing to choose among; the fitter's pools take every photo)."""
        photos = [b for b, h in enumerate(hyps) if len(h) >= least]
        cands = [(b, i, h) for b in photos for i, h in enumerate(hyps[b])]
        words = [list(h.tokens) for _, _, h in cands]
        width = max((len(w) for w in words), default=1) or 1  # one padding column at least: every min has a column
        # the least word log-prob of each: one flat min over every candidate's words (0 without them)
        has = [r for r, (_, _, h) in enumerate(cands) if h.word_logps is not None and len(h.word_logps)]
        min_word = torch.zeros(len(cands), dtype=torch.float64)  # (N,)
        if has:  # on the side the beam left them (the host, after its one read)
            values = torch.cat([cands[r][2].word_logps for r in has]).double()  # (W,)
            owner = torch.tensor([r for r in has for _ in range(len(cands[r][2].word_logps))], dtype=torch.int64,
                                 device=values.device)  # (W,)
            min_word = min_word.to(values.device).scatter_reduce(0, owner, values, "amin", include_self=False)
        n = len(cands)
        host = torch.tensor([[b, i, len(w)] for (b, i, _), w in zip(cands, words)], dtype=torch.int64).view(n, 3)
        floats = torch.tensor([[float(h.log_prob), float(h.score)] for _, _, h in cands],
                              dtype=torch.float64).view(n, 2)
        tokens = torch.tensor([w + [vocab_size] * (width - len(w)) for w in words], dtype=torch.int64).view(n, width)
        dev = torch.device(device)
        return cls(host[:, 0].to(dev), host[:, 1].to(dev), tokens.to(dev), host[:, 2].to(dev), floats[:, 0].to(dev),
                   floats[:, 1].to(dev), min_word.to(dev), words, [b for b, _, _ in cands], photos, [len(hyps[b]) for b in photos])

    def __len__(self) -> int:
        return len(self.words)

    @cached_property
    def starts(self) -> list[int]:
        """Each photo's first row (computed once: others asks it for every row)."""
        return list(itertools.accumulate(self.sizes[:-1], initial=0)) if self.sizes else []

    def group_sizes(self) -> torch.Tensor:
        """(B',) how many candidates each photo of the pool has."""
        return torch.tensor(self.sizes, device=self.photo.device)

    def others(self, row: int) -> list[list[int]]:
        """The words of the other candidates of the same photo, in the beam's order."""
        starts = self.starts
        g = bisect.bisect_right(starts, row) - 1  # the row's photo, its rows from starts[g]
        return [self.words[s] for s in range(starts[g], starts[g] + self.sizes[g]) if s != row]

    def padded(self, table: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
        """A word table (V, ...) -> (V + 1, ...) with a row of `fill` for the padding, on the pool's device."""
        table = table.to(self.tokens.device)
        return torch.cat([table, table.new_full((1, *table.shape[1:]), fill)])

    def named(self, table: torch.Tensor) -> torch.Tensor:
        """(V, M) bool: which columns each word names -> (N, M) bool: which each candidate names."""
        return self.padded(table.bool(), False)[self.tokens].any(1)

    def group_max(self, values: torch.Tensor, photos: int) -> torch.Tensor:
        """(N,) -> (photos,) each photo's largest (-inf for a photo not in the pool)."""
        out = values.new_full((photos,), float("-inf"))
        return out.scatter_reduce(0, self.photo, values, "amax")

    def group_sum(self, values: torch.Tensor, photos: int) -> torch.Tensor:
        """(N,) -> (photos,) each photo's sum."""
        return values.new_zeros(photos).index_add(0, self.photo, values)

    def order(self, total: torch.Tensor) -> torch.Tensor:
        """(N,) each candidate's choice -> (N,) the pool's rows grouped by photo (in pool order), highest choice
        first within a photo, equals in the beam's order."""
        by_total = torch.sort(-total, stable=True).indices  # (N,)
        return by_total[torch.sort(self.photo[by_total], stable=True).indices]  # (N,)


__all__ = ["Pool"]
