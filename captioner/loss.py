"""Training objective, Xu et al. 2015 eq. 14:

    L = -sum_t log p(y_t | a, y_<t)  +  lambda * sum_i (1 - sum_t alpha_ti)^2

The first term counts real tokens only (words and <end>); padding never contributes. The second,
the doubly stochastic penalty, pushes the model to look at every region over the whole caption.
As in the paper (and its released code) both are summed per caption; the total is then divided by
the number of tokens so the learning rate does not depend on caption length. Reported separately:
`xent` per token and `penalty` = lambda * doubly stochastic penalty per caption.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossTerms:
    total: torch.Tensor
    xent: torch.Tensor  # mean cross-entropy per real token
    penalty: torch.Tensor  # lambda * mean over captions of sum_i (1 - sum_t alpha_ti)^2 (doubly stochastic)
    n_tokens: int


def attention_penalty(alphas: torch.Tensor) -> torch.Tensor:
    """alphas (B, T, P), zero past each caption's end -> (B,) sum_i (1 - sum_t alpha_ti)^2."""
    return ((1.0 - alphas.float().sum(dim=1)) ** 2).sum(dim=1)


def caption_loss(logits: torch.Tensor, alphas: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor,
                 alpha_c: float = 1.0, label_smoothing: float = 0.0) -> LossTerms:
    """logits (B, T, V), alphas (B, T, P) zero past each length, targets (B, T), lengths (B,)."""
    T = targets.shape[1]
    mask = torch.arange(T, device=targets.device).unsqueeze(0) < lengths.unsqueeze(1)  # (B, T)
    n_tokens = int(mask.sum())
    xent = F.cross_entropy(logits[mask].float(), targets[mask], label_smoothing=label_smoothing)  # per token
    penalty = attention_penalty(alphas)  # (B,)
    total = xent + alpha_c * penalty.sum() / n_tokens  # (sum of per-caption objectives) / tokens
    return LossTerms(total=total, xent=xent, penalty=alpha_c * penalty.mean(), n_tokens=n_tokens)
