"""Fitting the choice among the beam's captions (decoding/choice.py) on val photos, and judging it out of fold.

Each val photo gives a pool of candidates (the beam's finished captions), each candidate its signals
(choice.signals) and its CIDEr against the photo's references (pycocoevalcap's formula, document frequencies
from the set's references: a candidate's CIDEr is what evaluation would report for it). The weights are the least
squares fit of

    CIDEr(c) - mean CIDEr of the photo's candidates  ~  sum_s weight_s * (s(c) - mean s of the photo's candidates)

with a small ridge: only differences within a photo matter to a choice, so both sides are centred per photo. The
fitted weights are judged by the CIDEr of the candidates they choose on photos they were not fitted on (k folds over
the photos of every set at once, repeated over seeds), beside the pool's oracle (the best candidate of each photo),
the beam's first, a random candidate and the file's current choice.

Legend: n a photo's candidates, S signals.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from ..decoding.choice import SIGNALS


@dataclass
class Pool:
    """One photo's candidates: their signals (n, S) in SIGNALS order and their CIDEr (n,)."""

    signals: torch.Tensor
    cider: torch.Tensor
    shipped: int = 0  # the candidate the file's current choice picks
    texts: tuple[str, ...] = ()  # the candidates' words (for CHAIR of a choice)


def candidate_cider(references: Sequence[Sequence[str]], candidates: Sequence[Sequence[str]]) -> list[list[float]]:
    """For each photo, the CIDEr of each of its candidate captions against its references, with the document
    frequencies of all these photos' references (as pycocoevalcap's corpus CIDEr of the set computes them)."""
    from pycocoevalcap.cider.cider_scorer import CiderScorer

    from .ptb import ptb_tokenize

    refs = [[ptb_tokenize(r) for r in rs] for rs in references]
    out = [[0.0] * len(c) for c in candidates]
    for slot in range(max(len(c) for c in candidates)):  # one scorer per slot: its df is the references' alone
        scorer = CiderScorer(n=4, sigma=6.0)
        for r, c in zip(refs, candidates):
            scorer += (ptb_tokenize(c[min(slot, len(c) - 1)]), r)
        _, scores = scorer.compute_score()
        for i, (c, s) in enumerate(zip(candidates, scores)):
            if slot < len(c):
                out[i][slot] = float(s)
    return out


def fit(pools: Sequence[Pool], use: Sequence[str], ridge: float = 1e-3) -> torch.Tensor:
    """(S,) weights over SIGNALS (0 for the signals not in `use`) fitted on `pools`; the signals are scaled to unit
    variance for the ridge and the weights scaled back."""
    cols = [SIGNALS.index(s) for s in use]
    x = torch.cat([p.signals[:, cols] - p.signals[:, cols].mean(0) for p in pools])  # (N, S')
    y = torch.cat([p.cider - p.cider.mean() for p in pools])  # (N,)
    scale = x.std(0).clamp_min(1e-9)  # (S',)
    xs = x / scale
    w = torch.linalg.solve(xs.T @ xs + ridge * len(xs) * torch.eye(len(cols), dtype=xs.dtype), xs.T @ y) / scale
    out = torch.zeros(len(SIGNALS), dtype=torch.float64)
    out[cols] = w.double()
    return out


def chosen_cider(pool: Pool, weights: torch.Tensor) -> float:
    """The CIDEr of the candidate the weights choose (the first of equals, as choice.choose)."""
    return float(pool.cider[int((pool.signals @ weights).argmax())])


def out_of_fold(sets: dict[str, list[Pool]], use: Sequence[str], folds: int = 5, seeds: int = 3,
                ridge: float = 1e-3) -> dict[str, float]:
    """Each set's mean CIDEr of the candidates chosen by weights fitted without the photo (k folds over every
    set's photos at once), averaged over `seeds` shuffles."""
    items = [(name, p) for name, pools in sets.items() for p in pools]
    totals = {name: 0.0 for name in sets}
    for seed in range(seeds):
        order = list(range(len(items)))
        random.Random(seed).shuffle(order)
        fold_of = {j: f % folds for f, j in enumerate(order)}
        for f in range(folds):
            w = fit([p for j, (_, p) in enumerate(items) if fold_of[j] != f], use, ridge)
            for j, (name, p) in enumerate(items):
                if fold_of[j] == f:
                    totals[name] += chosen_cider(p, w)
    return {name: totals[name] / (seeds * len(pools)) for name, pools in sets.items()}


def chosen_texts(pools: Sequence[Pool], weights: torch.Tensor) -> list[str]:
    """The caption the weights choose for each photo."""
    return [p.texts[int((p.signals @ weights).argmax())] for p in pools]


def baselines(pools: Sequence[Pool], seed: int = 0) -> dict[str, float]:
    """The pool's oracle (best candidate), the beam's first, a random candidate (the mean over the pool) and the
    file's current choice: mean CIDEr over the photos."""
    n = max(len(pools), 1)
    return {"best of pool": sum(float(p.cider.max()) for p in pools) / n,
            "beam's first": sum(float(p.cider[0]) for p in pools) / n,
            "random": sum(float(p.cider.mean()) for p in pools) / n,
            "current choice": sum(float(p.cider[p.shipped]) for p in pools) / n}


def as_fitted(weights: torch.Tensor) -> dict[str, float]:
    """Fitted weights over SIGNALS -> the choice as a model file stores it (decoding/resources.py: {signal: weight}),
    scaled so that the beam's score and the consensus weigh 1 together (a positive scale does not change a choice).
    ValueError when the fit gives the beam's score no positive weight or the consensus a negative one (a choice
    that prefers what the beam finds less likely, or captions unlike what people say: use fewer signals)."""
    w_score, w_cons = float(weights[0]), float(weights[1])
    if w_score <= 0 or w_cons < 0:
        raise ValueError(f"the fit weighs the beam's score {w_score:.3g} and the consensus {w_cons:.3g}: the choice "
                         "needs the first positive and the second not negative (use fewer signals)")
    scale = w_score + w_cons
    return {s: round(v / scale, 6) for s, v in zip(SIGNALS, weights.tolist())}
