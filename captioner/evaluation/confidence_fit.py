"""Fitting how sure a caption is (decoding/confidence.py) on val photos, and judging it out of fold.

Each val photo gives one row: the confidence signals of the caption the file chooses, its per-photo CIDEr-D
against the photo's references (the set's own document frequencies, as pycocoevalcap's compute_score gives per
photo) and whether it names an object the photo lacks (CHAIR). The map is a logistic regression with a small
ridge of

    P(CIDEr >= confidence.GOOD_CIDER)  ~  sigmoid(bias + sum_s w_s * s)

on standardised signals, the standardisation folded back into the stored weights; the map keeps every signal's
mean over the photos it was fitted on (each set weighed alike), against which a caption's reason is measured. It is judged on photos it was
not fitted on (k folds over the photos of every set at once): AUROC (good against not, and the bottom third of
CIDEr against the rest), the calibration error (10 equal-width bins), a reliability table, and CIDEr / CHAIR-s of
the surest captions at each coverage.

Legend: N photos, S signals.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from ..decoding.confidence import GOOD_CIDER, SIGNALS, SURE_FLOOR, ConfidenceMap

COVERAGES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
RIDGE = 0.01  # x N on the standardised weights: a light touch (0.1 shrank a 4-per-sd effect to 1.2 and miscalibrated)
MIN_GAIN = 0.002  # a signal whose leaving out lowers the sets' mean out-of-fold AUROC by less is not kept
SURE_PRECISION = 0.85  # the sure captions of every val set are good at least this often (out of fold)


@dataclass
class Row:
    """One val photo's chosen caption: its confidence signals, CIDEr-D and whether it names an absent object."""

    signals: dict[str, float]
    cider: float
    hallucinates: bool
    caption: str = ""
    image_id: str = ""


def _matrix(rows: Sequence[Row]) -> torch.Tensor:
    return torch.tensor([[r.signals[s] for s in SIGNALS] for r in rows], dtype=torch.float64)  # (N, S)


def fit(rows: Sequence[Row], ridge: float = RIDGE, sure_at: float = 0.5,
        weights: Sequence[float] | None = None, use: Sequence[str] = SIGNALS) -> ConfidenceMap:
    """The logistic map fitted on `rows` by Newton's method (L2 penalty `ridge` x N on the standardised weights,
    none on the bias); weights (N,): each row's weight in the likelihood (balanced_weights: each set alike); use:
    the signals it may weigh (the others get 0)."""
    cols = [SIGNALS.index(u) for u in use]
    x = _matrix(rows)[:, cols]  # (N, S')
    y = torch.tensor([float(r.cider >= GOOD_CIDER) for r in rows], dtype=torch.float64)  # (N,)
    v = torch.ones(len(rows), dtype=x.dtype) if weights is None else torch.tensor(list(weights), dtype=x.dtype)
    v = v * len(rows) / v.sum()  # (N,) summing to N: the ridge means the same with or without weights
    mean, scale = x.mean(0), x.std(0).clamp_min(1e-9)  # (S,)
    xs = torch.cat([torch.ones(len(x), 1, dtype=x.dtype), (x - mean) / scale], 1)  # (N, 1 + S)
    penalty = ridge * len(x) * torch.eye(xs.shape[1], dtype=x.dtype)
    penalty[0, 0] = 0.0
    beta = torch.zeros(xs.shape[1], dtype=x.dtype)
    for _ in range(50):
        p = torch.sigmoid(xs @ beta)  # (N,)
        grad = xs.T @ (v * (p - y)) + penalty @ beta
        hess = (xs * (v * p * (1 - p)).unsqueeze(1)).T @ xs + penalty
        step = torch.linalg.solve(hess, grad)
        beta = beta - step
        if float(step.abs().max()) < 1e-10:
            break
    w = beta[1:] / scale  # (S',)
    full = torch.zeros(len(SIGNALS), dtype=x.dtype)
    full[cols] = w
    means = (_matrix(rows) * v[:, None]).sum(0) / v.sum()  # (S,) every signal's (weighed) mean: the reasons' origin
    return ConfidenceMap(float(beta[0] - (w * mean).sum()), tuple(full.tolist()), sure_at, tuple(means.tolist()))


def balanced_weights(sets: dict[str, list[Row]]) -> dict[str, float]:
    """Each set's row weight so that every set counts alike in the fit (Flickr8k's 1,000 val photos would
    otherwise set the base rate that COCO's few hundred are calibrated to)."""
    return {name: 1.0 / (len(sets) * len(rows)) for name, rows in sets.items() if rows}


def fit_sets(sets: dict[str, list[Row]], ridge: float = RIDGE, sure_at: float = 0.5,
             use: Sequence[str] = SIGNALS) -> ConfidenceMap:
    """The map fitted on every set's rows, each set weighed alike."""
    w = balanced_weights(sets)
    return fit([r for rows in sets.values() for r in rows], ridge, sure_at,
               [w[n] for n, rows in sets.items() for _ in rows], use)


def mean_auroc(sets: dict[str, list[Row]], confidence: dict[str, list[float]]) -> float:
    """The sets' mean AUROC of confidence for the bottom third of per-photo CIDEr against the rest."""
    out = []
    for name, rows in sets.items():
        third = sorted(r.cider for r in rows)[len(rows) // 3]
        out.append(auroc(confidence[name], [r.cider >= third for r in rows]))
    return sum(out) / len(out)


def kept_signals(sets: dict[str, list[Row]]) -> tuple[list[str], dict[str, float]]:
    """Every signal, then each left out in turn: the signals whose leaving out lowers the sets' mean
    out-of-fold AUROC by MIN_GAIN or more are kept. -> (kept, {"every signal" / "without s": mean AUROC})."""
    table = {"every signal": mean_auroc(sets, out_of_fold(sets))}
    for s in SIGNALS:
        table[f"without {s}"] = mean_auroc(sets, out_of_fold(sets, use=[u for u in SIGNALS if u != s]))
    kept = [s for s in SIGNALS if table["every signal"] - table[f"without {s}"] >= MIN_GAIN]
    return kept or list(SIGNALS), table


def out_of_fold(sets: dict[str, list[Row]], folds: int = 5, seed: int = 0, ridge: float = RIDGE,
                use: Sequence[str] = SIGNALS) -> dict[str, list[float]]:
    """Each photo's confidence from a map fitted without it (k folds over every set's photos at once, each set
    weighed alike)."""
    w = balanced_weights(sets)
    items = [(name, i) for name, rows in sets.items() for i in range(len(rows))]
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    fold_of = {j: f % folds for f, j in enumerate(order)}
    out = {name: [0.0] * len(rows) for name, rows in sets.items()}
    for f in range(folds):
        train = [(n, i) for j, (n, i) in enumerate(items) if fold_of[j] != f]
        fitted = fit([sets[n][i] for n, i in train], ridge, weights=[w[n] for n, _ in train], use=use)
        for j, (n, i) in enumerate(items):
            if fold_of[j] == f:
                out[n][i] = fitted(sets[n][i].signals)
    return out


def auroc(scores: Sequence[float], positive: Sequence[bool]) -> float:
    """The probability that a random positive scores above a random negative (ties count half); NaN without both."""
    pos = [s for s, p in zip(scores, positive) if p]
    neg = [s for s, p in zip(scores, positive) if not p]
    if not pos or not neg:
        return float("nan")
    ranked = sorted((s, i) for i, s in enumerate(pos + neg))
    ranks = [0.0] * len(ranked)
    k = 0
    while k < len(ranked):  # average ranks over ties
        j = k
        while j + 1 < len(ranked) and ranked[j + 1][0] == ranked[k][0]:
            j += 1
        for m in range(k, j + 1):
            ranks[ranked[m][1]] = (k + j) / 2 + 1
        k = j + 1
    r_pos = sum(ranks[:len(pos)])
    return (r_pos - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def reliability(confidence: Sequence[float], good: Sequence[bool], bins: int = 10) -> list[dict]:
    """Per equal-width bin of confidence: its photos, mean confidence and share of good captions."""
    out = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        idx = [i for i, c in enumerate(confidence) if lo <= c < hi or (b == bins - 1 and c == 1.0)]
        if idx:
            out.append({"bin": f"{lo:.1f}-{hi:.1f}", "photos": len(idx),
                        "confidence": sum(confidence[i] for i in idx) / len(idx),
                        "good": sum(good[i] for i in idx) / len(idx)})
    return out


def calibration_error(confidence: Sequence[float], good: Sequence[bool], bins: int = 10) -> float:
    """Expected calibration error: the photo-weighted mean over bins of |mean confidence - share good|."""
    n = max(len(confidence), 1)
    return sum(r["photos"] / n * abs(r["confidence"] - r["good"]) for r in reliability(confidence, good, bins))


def coverage(confidence: Sequence[float], rows: Sequence[Row], levels: Sequence[float] = COVERAGES) -> dict:
    """CIDEr (mean of per-photo CIDEr-D) and CHAIR-s of the surest `level` share of the photos, per level."""
    order = sorted(range(len(rows)), key=lambda i: -confidence[i])
    out = {}
    for level in levels:
        keep = order[:max(1, round(level * len(rows)))]
        out[f"{round(100 * level)}%"] = {"CIDEr": sum(rows[i].cider for i in keep) / len(keep),
                                         "CHAIR-s": sum(rows[i].hallucinates for i in keep) / len(keep)}
    return out


def seen(signals: dict[str, float]) -> bool:
    """Whether every object a caption with these confidence signals names is seen by the heads (no unsupported
    one: a caption naming one is never sure, confidence.level)."""
    return not signals.get("unsupported", 0.0)


def sure_photos(confidence: Sequence[float], rows: Sequence[Row], sure_at: float) -> list[int]:
    """The photos whose caption is sure at threshold sure_at: confidence at or above it, every object seen."""
    return [i for i, c in enumerate(confidence) if c >= sure_at and seen(rows[i].signals)]


def summary(confidence: Sequence[float], rows: Sequence[Row], sure_at: float | None = None) -> dict:
    """AUROC (good vs not; bottom third of CIDEr vs the rest), calibration error, reliability, coverage, and the
    sure captions' share, CIDEr and CHAIR-s at threshold sure_at."""
    good = [r.cider >= GOOD_CIDER for r in rows]
    third = sorted(r.cider for r in rows)[len(rows) // 3] if rows else 0.0
    out = {"photos": len(rows), "good": sum(good) / max(len(rows), 1),
           "AUROC good": auroc(confidence, good),
           "AUROC bottom third": auroc(confidence, [r.cider >= third for r in rows]),
           "calibration error": calibration_error(confidence, good),
           "reliability": reliability(confidence, good), "coverage": coverage(confidence, rows)}
    if sure_at is not None:
        sure = sure_photos(confidence, rows, sure_at)
        out["sure"] = {"share": len(sure) / max(len(rows), 1),
                       "CIDEr": sum(rows[i].cider for i in sure) / max(len(sure), 1),
                       "CHAIR-s": sum(rows[i].hallucinates for i in sure) / max(len(sure), 1),
                       "unsure CIDEr": (sum(r.cider for r in rows) - sum(rows[i].cider for i in sure))
                       / max(len(rows) - len(sure), 1)}
    return out


def threshold(confidence: dict[str, Sequence[float]], rows: dict[str, Sequence[Row]],
              precision: float = SURE_PRECISION, floor: float = SURE_FLOOR) -> float:
    """The lowest threshold at or above `floor` at which the captions of confidence >= it are good (per-photo
    CIDEr-D >= GOOD_CIDER) at least `precision` of the time, each set's share of good captions weighed alike (as
    the map's fit weighs the sets; a set with no caption there counts no share): sure means what it says, and
    covers as many photos as that allows. Where no threshold does, 1.0 (nothing is sure but a certainty). The
    objects check comes on top (sure_photos): a caption naming an object the heads barely see is not sure at any
    confidence, whatever the threshold."""
    good = {name: [r.cider >= GOOD_CIDER for r in rows[name]] for name in confidence}

    def precise(at: float) -> bool:
        shares = []
        for name, conf in confidence.items():
            sure = [g for c, g in zip(conf, good[name]) if c >= at]
            shares += [sum(sure) / len(sure)] if sure else []
        return not shares or sum(shares) / len(shares) >= precision

    return next((at for at in sorted({floor, *(c for cs in confidence.values() for c in cs if c >= floor)})
                 if precise(at)), 1.0)
