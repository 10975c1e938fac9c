"""CIDEr-D (Vedantam et al. 2015) on token ids, document frequencies from the training references: SCST's reward
and the consensus agreement. For n = 1..4 a caption is a TF-IDF vector over its n-grams, g_n(k) = tf(k) * log(N_images
/ max(1, df(k))). Against each reference r: the cosine with the candidate's weights clipped to the reference's
(min(g_c, g_r) * g_r), times exp(-(len_c - len_r)^2 / (2 sigma^2)), sigma = 6; the score is 10 x the mean over n and
references (pycocoevalcap's, given the same df: tests/test_cider.py's oracle). On tensors: each caption's distinct
n-grams (words as digits of one int64 code) flat (Grams), the training references' built once (the bank), every
(candidate, reference) pair's clipped products summed per pair and n.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch

Caption = Sequence[int]


@dataclass(frozen=True)
class Grams:
    """Captions as TF-IDF n-gram vectors, flat: caption c's entries (by code) are rows starts[c]:starts[c + 1]."""
    row: torch.Tensor  # (E,) int64: the caption of each entry
    ids: torch.Tensor  # (E,) int64: its n-gram, an index into CiderD.codes (>= len(codes): one no reference has)
    order: torch.Tensor  # (E,) int64: n - 1
    weight: torch.Tensor  # (E,) float64: tf * idf
    starts: torch.Tensor  # (C + 1,) int64
    norms: torch.Tensor  # (C, n) float64: each caption's vector length per n
    lengths: torch.Tensor  # (C,) float64: words
    width: int  # the ids are below this

    def to(self, device: torch.device) -> "Grams":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "width"})


def _spans(owner: torch.Tensor, start: torch.Tensor, stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranges start[s]:stop[s] owned by owner[s] -> every (owner, index) of them, flat: two (X,) tensors."""
    count = stop - start  # (S,)
    span = torch.repeat_interleave(torch.arange(len(count), device=count.device), count)  # (X,)
    first = (count.cumsum(0) - count)[span]  # (X,) where each span begins in the flat list
    return owner[span], start[span] + torch.arange(len(span), device=count.device) - first


class CiderD:
    """CIDEr-D with document frequencies fixed at construction (the training references)."""

    def __init__(self, references: Sequence[Sequence[Caption]], n: int = 4, sigma: float = 6.0,
                 device: torch.device | str = "cpu"):
        """references: for each training image, its reference captions (token ids)."""
        if not references:
            raise ValueError("CIDEr-D needs the training references to compute document frequencies")
        self.n, self.sigma, self.device = n, sigma, torch.device(device)
        self.base = 1 << (62 // n)  # an n-gram's code: its words + 1 as digits in this base (below 2^62)
        self.log_n = math.log(float(len(references)))
        self._sets: dict[tuple[tuple[int, ...], ...], tuple[int, int]] = {}  # an image's references -> bank rows
        captions, image = [], []  # every reference caption, its image
        for j, refs in enumerate(references):
            key = tuple(tuple(r) for r in refs)
            self._sets.setdefault(key, (len(captions), len(captions) + len(key)))
            captions += key
            image += [j] * len(key)
        row, code, order, tf, lengths = self._count(captions)
        self.codes, inverse = torch.unique(code, return_inverse=True)  # (G,) every reference n-gram, sorted
        per_image = torch.unique(torch.tensor(image, dtype=torch.int64, device=self.device)[row] * len(self.codes)
                                 + inverse)  # each image's distinct n-grams once
        df = torch.bincount(per_image % len(self.codes), minlength=len(self.codes)).to(torch.float64)  # (G,)
        self.idf = self.log_n - torch.log(df.clamp_min(1.0))  # (G,)
        self._bank = self._grams(row, code, order, tf, lengths)  # (the references' captions)

    def to(self, device: torch.device | str) -> "CiderD":
        """This CIDEr-D with its tables on `device` (itself when they are there already)."""
        device = torch.device(device)
        if device == self.device:
            return self
        out = object.__new__(CiderD)
        out.__dict__.update(self.__dict__, device=device, codes=self.codes.to(device), idf=self.idf.to(device),
                            _bank=self._bank.to(device))
        return out

    def _count(self, captions: Sequence[Caption]) -> tuple[torch.Tensor, ...]:
        """Captions -> their distinct n-grams' caption, code, n - 1 and count (E,) (by caption, then code), and
        each caption's words (C,) float64."""
        lengths = [len(c) for c in captions]
        width = max(lengths, default=0)
        top = max((max(c) for c in captions if len(c)), default=-1)  # checked on the host: no read of the device
        if top >= self.base - 1:
            raise ValueError(f"CIDEr-D reads word ids 0..{self.base - 2}: a caption holds {top}")
        words = torch.tensor([list(c) + [-1] * (width - len(c)) for c in captions], dtype=torch.int64,
                             device=self.device).view(len(captions), width)  # (C, L), -1 after the end
        n = min(self.n, width)
        codes = torch.zeros(len(captions), n, width, dtype=torch.int64, device=self.device)  # (C, n, L)
        valid = torch.zeros(len(captions), n, width, dtype=torch.bool, device=self.device)  # (C, n, L)
        code = torch.zeros_like(words)  # (C, L)
        for k in range(n):  # code of the (k+1)-gram starting at i, from the k-gram's
            code = code[:, :width - k] * self.base + words[:, k:] + 1  # (C, L - k)
            codes[:, k, :width - k] = code
            valid[:, k, :width - k] = words[:, k:] >= 0  # the grams that end before the padding
        row, order, at = valid.nonzero(as_tuple=True)  # (E',) each: one read for every n
        code = codes[row, order, at]
        code, by_code = code.sort(stable=True)  # grouped by caption, by code within it
        row, order = row[by_code], order[by_code]
        row, by_row = row.sort(stable=True)
        code, order = code[by_row], order[by_row]
        new = torch.ones_like(row, dtype=torch.bool)  # (E,) the first of a run of equal (caption, code)
        new[1:] = (row[1:] != row[:-1]) | (code[1:] != code[:-1])
        tf = torch.bincount(new.cumsum(0) - 1).to(torch.float64) if len(row) else code.new_zeros(0, dtype=torch.float64)
        return row[new], code[new], order[new], tf, torch.tensor(lengths, dtype=torch.float64, device=self.device)

    def _grams(self, row: torch.Tensor, code: torch.Tensor, order: torch.Tensor, tf: torch.Tensor,
               lengths: torch.Tensor) -> Grams:
        """Counted n-grams -> their TF-IDF vectors; n-grams no reference has are numbered after the references'."""
        g = len(self.codes)
        at = torch.searchsorted(self.codes, code).clamp_(max=max(g - 1, 0))  # (E,)
        known = self.codes[at] == code if g else torch.zeros_like(code, dtype=torch.bool)
        idf = torch.where(known, self.idf[at], self.log_n) if g else torch.full_like(tf, self.log_n)  # (E,)
        ids = torch.where(known, at, g)  # (E,)
        unknown = torch.unique(code[~known], return_inverse=True)[1]
        ids[~known] = g + unknown
        width = g + int(unknown.max()) + 1 if len(unknown) else g
        weight = tf * idf  # (E,)
        c = len(lengths)
        squares = weight.new_zeros(c * self.n).index_add_(0, row * self.n + order, weight * weight)  # (C * n,)
        starts = torch.cat([row.new_zeros(1), torch.bincount(row, minlength=c).cumsum(0)])  # (C + 1,)
        return Grams(row, ids, order, weight, starts, squares.sqrt().view(c, self.n), lengths, width)

    def _pairs(self, cands: Grams, refs: Grams, pc: torch.Tensor, pr: torch.Tensor) -> torch.Tensor:
        """Pairs (candidate pc, reference pr) (P,) -> (P,): the clipped cosines summed over n, times the penalty."""
        pair, entry = _spans(torch.arange(len(pc), device=pc.device), refs.starts[pr], refs.starts[pr + 1])  # (X,)
        width = max(cands.width, refs.width)
        dots = cands.weight.new_zeros(len(pc) * self.n)  # (P * n,)
        if len(cands.ids) and len(entry):
            key, by_key = (cands.row * width + cands.ids).sort()  # (Ec,) the candidates' n-grams, findable
            wanted = pc[pair] * width + refs.ids[entry]  # (X,) the reference's n-gram in its candidate
            at = torch.searchsorted(key, wanted).clamp_(max=len(key) - 1)  # (X,)
            g_c, g_r = cands.weight[by_key[at]], refs.weight[entry]  # (X,)
            clipped = torch.where(key[at] == wanted, torch.minimum(g_c, g_r) * g_r, 0.0)  # (X,)
            dots.index_add_(0, pair * self.n + refs.order[entry], clipped)
        norms = cands.norms[pc] * refs.norms[pr]  # (P, n)
        cosine = torch.where(norms > 0, dots.view(-1, self.n) / norms.clamp_min(1e-300), 0.0)  # (P, n)
        penalty = torch.exp(-(cands.lengths[pc] - refs.lengths[pr]) ** 2 / (2 * self.sigma ** 2))  # (P,)
        return penalty * cosine.sum(1)

    def agreements(self, candidates: Sequence[Caption], ref_sets: Sequence[Sequence[Sequence[Caption]]]
                   ) -> torch.Tensor:
        """Each candidates[i]'s CIDEr-D against the union of the sets ref_sets[i] -> (N,) float64, in one pass."""
        if len(candidates) != len(ref_sets):
            raise ValueError(f"{len(candidates)} candidates but {len(ref_sets)} lists of reference sets")
        banked, other, others, count = [], [], [], []  # (candidate, first, end row) in the bank; in `others`
        other_at: dict[tuple[tuple[int, ...], ...], tuple[int, int]] = {}
        for i, sets in enumerate(ref_sets):
            keys = [key for key in (tuple(tuple(r) for r in refs) for refs in sets) if key]
            if not keys:
                raise ValueError("every candidate needs at least one reference")
            for key in keys:
                if key in self._sets:
                    banked.append((i, *self._sets[key]))
                    continue
                if key not in other_at:
                    other_at[key] = (len(candidates) + len(others), len(candidates) + len(others) + len(key))
                    others += key
                other.append((i, *other_at[key]))
            count.append(sum(map(len, keys)))
        grams = self._grams(*self._count([*candidates, *others]))  # candidates first, then references not banked
        total = torch.zeros(len(candidates), dtype=torch.float64, device=self.device)  # (N,)
        for refs, spans in ((self._bank, banked), (grams, other)):
            if spans:
                owner, first, end = torch.tensor(spans, dtype=torch.int64, device=self.device).unbind(1)  # (S,) each
                pc, pr = _spans(owner, first, end)  # (P,) each
                total.index_add_(0, pc, self._pairs(grams, refs, pc, pr))
        return 10.0 * total / (self.n * torch.tensor(count, dtype=torch.float64, device=self.device))

    def score(self, candidates: Sequence[Caption], references: Sequence[Sequence[Caption]]) -> list[float]:
        """candidates[i] scored against references[i] -> one CIDEr-D per candidate."""
        if len(candidates) != len(references):
            raise ValueError(f"{len(candidates)} candidates but {len(references)} reference sets")
        return self.agreements(candidates, [[r] for r in references]).tolist()
