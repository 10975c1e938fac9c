"""Training the visual word detectors (concepts/detectors.py) on cached annotation vectors: noisy-OR
MIL with binary cross-entropy and Adam, then Platt calibration on held-out photos, and the measures
used to choose them (average precision, how often a floor rules a word out where it is / is not).

Legend: N photos, P cells, D feature dim, K word groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..concepts.detectors import WordDetectors


@dataclass
class FitSettings:
    epochs: int = 6
    lr: float = 1e-3
    weight_decay: float = 1e-4  # on the (standardised-feature) weights
    batch_size: int = 64
    balanced: bool = True  # weight positives by negatives/positives per group (measured: mean AP .629 vs .616 on val)
    seed: int = 0


def _rows(feats: np.ndarray | torch.Tensor, idx: np.ndarray) -> torch.Tensor:
    """Rows idx of a (N, P, D) array / float16 memory map / tensor as a float32 tensor."""
    if isinstance(feats, torch.Tensor):
        return feats[torch.as_tensor(idx)].float()
    return torch.from_numpy(np.asarray(feats[np.sort(idx)], dtype=np.float32))


def standardise(det: WordDetectors, feats: np.ndarray | torch.Tensor, sample: int = 1000) -> None:
    """Set the detectors' feature mean and 1/std from (up to `sample` photos of) the training features."""
    idx = np.linspace(0, len(feats) - 1, min(sample, len(feats))).astype(int)
    x = _rows(feats, np.unique(idx)).reshape(-1, feats.shape[-1])  # (n*P, D)
    det.mean.copy_(x.mean(0))
    det.inv_std.copy_(1 / x.std(0).clamp_min(1e-3))


def fit(det: WordDetectors, feats: np.ndarray | torch.Tensor, labels: torch.Tensor, settings: FitSettings,
        log: Callable[[str], None] = print) -> WordDetectors:
    """Fit weights and biases on features (N, P, D) and labels (N, K) (BCE on the noisy-OR)."""
    torch.manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    standardise(det, feats)
    pos = labels.mean(0).clamp(1e-3, 1 - 1e-3)  # (K,)
    pos_weight = (1 - pos) / pos if settings.balanced else torch.ones_like(pos)
    opt = torch.optim.Adam([det.weight, det.bias], lr=settings.lr)
    det.train()
    for epoch in range(settings.epochs):
        order, total = rng.permutation(len(feats)), 0.0
        for k in range(0, len(order), settings.batch_size):
            idx = order[k:k + settings.batch_size]
            idx = np.sort(idx)
            logit = det.raw_logit(_rows(feats, idx))  # (b, K)
            loss = F.binary_cross_entropy_with_logits(logit, labels[idx], pos_weight=pos_weight)
            loss = loss + settings.weight_decay * det.weight.pow(2).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        log(f"detectors epoch {epoch + 1}/{settings.epochs}: loss {total / len(feats):.4f}")
    return det.eval()


@torch.no_grad()
def raw_logits(det: WordDetectors, feats: np.ndarray | torch.Tensor, prior: torch.Tensor | None = None,
               batch_size: int = 256) -> torch.Tensor:
    """(N, P, D), prior (N,) or None -> uncalibrated logits (N, K): noisy-OR + prior_weight * prior."""
    out = torch.cat([det.raw_logit(_rows(feats, np.arange(k, min(k + batch_size, len(feats)))))
                     for k in range(0, len(feats), batch_size)])
    return out if prior is None else out + det.prior_weight * prior[:, None]


@torch.no_grad()
def probabilities(det: WordDetectors, feats: np.ndarray | torch.Tensor, prior: torch.Tensor | None = None,
                  batch_size: int = 256) -> torch.Tensor:
    """(N, P, D), prior (N,) -> calibrated probabilities (N, K)."""
    return torch.sigmoid(det.scale * raw_logits(det, feats, prior, batch_size) + det.shift)


@torch.no_grad()
def clothes_priors(head: torch.nn.Linear, feats: np.ndarray | torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """(N, P, D) -> (N,) concepts.detectors.clothes_prior of every photo."""
    from ..concepts.detectors import clothes_prior

    return torch.cat([clothes_prior(head, _rows(feats, np.arange(k, min(k + batch_size, len(feats)))))
                      for k in range(0, len(feats), batch_size)])


PRIOR_WEIGHTS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def choose_prior_weight(raw: list[torch.Tensor], prior: list[torch.Tensor], present: list[np.ndarray],
                        weights: tuple[float, ...] = PRIOR_WEIGHTS) -> tuple[float, dict[float, list[float]]]:
    """The weight a of the ImageNet head's clothes evidence (score = noisy-OR logit + a * prior) with the
    best mean average precision over the held-out sets (raw (N,), prior (N,), present (N,) each), and
    every weight's APs."""
    aps = {a: [average_precision((r + a * q).numpy(), y) for r, q, y in zip(raw, prior, present)] for a in weights}
    return max(weights, key=lambda a: float(np.mean(aps[a]))), aps


def calibrate(det: WordDetectors, logits: torch.Tensor, labels: torch.Tensor, steps: int = 300) -> None:
    """Platt scaling per group on held-out (logits (N, K), labels (N, K)): scale > 0 and shift minimise
    the cross-entropy of sigmoid(scale * logit + shift); the ranking (and so the AP) is unchanged."""
    log_scale = torch.zeros(logits.shape[1], requires_grad=True)
    shift = torch.zeros(logits.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([log_scale, shift], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(log_scale.exp() * logits + shift, labels)
        loss.backward()
        return loss

    opt.step(closure)
    det.scale.copy_(log_scale.detach().exp())
    det.shift.copy_(shift.detach())


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """AP of one ranking (scores (N,), labels (N,) 0/1): mean precision at each positive; NaN without positives."""
    labels = np.asarray(labels, bool)
    if not labels.any():
        return float("nan")
    order = np.argsort(-np.asarray(scores), kind="stable")
    hits = labels[order]
    precision = np.cumsum(hits) / np.arange(1, len(hits) + 1)
    return float(precision[hits].mean())


def floor_report(p: np.ndarray, present: np.ndarray, floors: tuple[float, ...]) -> list[dict]:
    """For each floor: share of photos WITHOUT the word where P < floor (rightly ruled out) and share of
    photos WITH it where P < floor (wrongly ruled out)."""
    p, present = np.asarray(p), np.asarray(present, bool)
    return [{"floor": f, "ruled_out_absent": float((p[~present] < f).mean()) if (~present).any() else float("nan"),
             "ruled_out_present": float((p[present] < f).mean()) if present.any() else float("nan")}
            for f in floors]


FLOORS = (0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)


def choose_floor(held_out: list[tuple[np.ndarray, np.ndarray]], max_miss: float = 0.06,
                 floors: tuple[float, ...] = FLOORS) -> float:
    """The largest floor at which, on EVERY held-out set (P(person) (N,), person present (N,)), at most
    `max_miss` of the photos with a person are ruled out (a vetoed person word where one is, is worse
    than a person word where none is); 0 (off) when even the lowest floor misses more."""
    ok = [f for f in floors
          if all(r["ruled_out_present"] <= max_miss for p, y in held_out for r in floor_report(p, y, (f,)))]
    return max(ok, default=0.0)
