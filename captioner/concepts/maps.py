"""Concept maps: where the encoder's own ImageNet classifier sees a category, on the attention grid.

A class activation map (Zhou et al. 2016) applies the classifier's weights of class k to every
annotation vector instead of to their average: M_k(i) = w_k . a_i + b_k, whose mean over the grid is
the photo's logit of k. A COCO category's map is the average of its classes' maps weighted by their
probabilities, shifted to a minimum of 0 and normalised to sum to 1 over the P regions: a distribution
on the very grid the decoder attends.

Two training terms read it (objectives.py):
- `cam_loss` (train.alpha_cam): for each reference word naming a category the photo confidently has
  (P(category) >= train.cam_min_prob), the cross-entropy -sum_i cam_i log alpha_ti of the word's
  teacher-forced attention to the category's map. Person has no ImageNet class: its map is that of the
  clothes and outfits people wear (concepts.PERSON_CLASSES), used only with train.cam_person.
- `head_kl` (train.alpha_head): when the top stages are tuned, KL(pretrained head || tuned head) on
  the photo's ImageNet distribution, so concepts, evidence and these maps stay the classifier's.

Legend: B images, P regions, D channels, K ImageNet classes, C = len(MAP_CATEGORIES), N captions.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .imagenet import imagenet_logits, map_membership


MIN_PROB = 0.1  # a concept is "confident" from here (train.cam_min_prob's default; the app shows maps from here)


def _normalise(maps: torch.Tensor) -> torch.Tensor:
    """(..., P) -> shifted to a minimum of 0 and summing to 1 (uniform where the map is flat)."""
    maps = maps - maps.amin(-1, keepdim=True)
    total = maps.sum(-1, keepdim=True)
    uniform = torch.full_like(maps, 1.0 / maps.shape[-1])
    return torch.where(total > 1e-12, maps / total.clamp_min(1e-12), uniform)


def concept_maps(head: nn.Linear, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """feats (B, P, D) -> (maps (B, C, P) each summing to 1, P(category) (B, C)) over MAP_CATEGORIES:
    the seen COCO categories, then person (the classes of clothes and outfits people wear)."""
    feats = feats.float()
    probs = imagenet_logits(head, feats).softmax(-1)  # (B, K)
    member = map_membership(feats.device)  # (C, K)
    weights = probs.unsqueeze(1) * member.unsqueeze(0)  # (B, C, K): each category's classes, by probability
    cat_probs = weights.sum(-1)  # (B, C)
    weights = weights / cat_probs.clamp_min(1e-12).unsqueeze(-1)  # (B, C, K), rows sum to 1
    class_maps = feats @ head.weight.float().t()  # (B, P, K): w_k . a_i (the bias shifts every region alike)
    maps = weights @ class_maps.transpose(1, 2)  # (B, C, P)
    return _normalise(maps), cat_probs  # (B, C, P), (B, C)


def category_maps(head: nn.Linear, feats: torch.Tensor, categories: torch.Tensor, logits: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The maps of one category per row, cheaply (only that category's classes): feats (N, P, D),
    categories (N,) indices into MAP_CATEGORIES -> (maps (N, P), P(category) (N,)). Equal to
    concept_maps(head, feats)[0][n, categories[n]]. `logits` (N, K): the rows' ImageNet logits when
    already computed (the head's classifier is then not run again)."""
    feats = feats.float()
    probs = (imagenet_logits(head, feats) if logits is None else logits.float()).softmax(-1)  # (N, K)
    weights = probs * map_membership(feats.device)[categories]  # (N, K): the row's category's classes
    cat_probs = weights.sum(-1)  # (N,)
    w = (weights / cat_probs.clamp_min(1e-12).unsqueeze(-1)) @ head.weight.float()  # (N, D): the classes' mean weight
    return _normalise((feats @ w.unsqueeze(-1)).squeeze(-1)), cat_probs  # (N, P), (N,)


def cam_loss(alphas: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor, image_index: torch.Tensor,
             maps: torch.Tensor, cat_probs: torch.Tensor, word_cats: torch.Tensor, min_prob: float
             ) -> tuple[torch.Tensor, int]:
    """alphas (N, T, P) teacher-forced attention (the map of the step that predicts targets[:, t]),
    targets (N, T), lengths (N,), image_index (N,), maps (B, C, P), cat_probs (B, C), word_cats (V, C)
    -> (mean over supervised words of -sum_i cam_i log alpha_ti, number of supervised words)."""
    T = targets.shape[1]
    mask = torch.arange(T, device=targets.device).unsqueeze(0) < lengths.unsqueeze(1)  # (N, T)
    wc = word_cats.to(maps.device)[targets]  # (N, T, C): the category a target word names (one-hot or 0)
    confident = (cat_probs >= min_prob).float()[image_index]  # (N, C)
    sup = wc * confident.unsqueeze(1) * mask.unsqueeze(-1)  # (N, T, C)
    n = int(sup.sum())
    if n == 0:
        return alphas.new_zeros(()).float(), 0
    target_maps = torch.einsum("ntc,ncp->ntp", sup, maps[image_index])  # (N, T, P): zero where unsupervised
    xent = -(target_maps * alphas.float().clamp_min(1e-8).log()).sum()  # sum over supervised words and regions
    return xent / n, n


def head_kl(head: nn.Linear, feats: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || tuned) of the ImageNet distributions, mean over the B photos; feats (B, P, D),
    teacher_logits (B, K) from the pretrained encoder (the activation cache stores them)."""
    log_p = imagenet_logits(head, feats).log_softmax(-1)  # (B, K)
    log_q = teacher_logits.float().log_softmax(-1)  # (B, K)
    return F.kl_div(log_p, log_q, log_target=True, reduction="batchmean")
