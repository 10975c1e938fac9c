"""Training objective, Xu et al. 2015 eq. 14:

    L = -sum_t log p(y_t | a, y_<t)  +  lambda * sum_i (1 - sum_t alpha_ti)^2

The first term counts real tokens only (words and <end>); padding never contributes. The second,
the doubly stochastic penalty, pushes the model to look at every region over the whole caption.
As in the paper (and its released code) both are summed per caption; the total is then divided by
the number of tokens so the learning rate does not depend on caption length. Reported separately:
`xent` per token and `penalty` = lambda * doubly stochastic penalty per caption.

Hard (stochastic) attention, section 4.1, adds to a batch trained on sampled locations s (eq. 11-12):

    - lambda_r * (log p(y|s,a) - b) * sum_t log p(s_t | a)  -  lambda_e * H[alpha]

the REINFORCE estimate of the locations' gradient (the reward log p(y|s,a) - b is a constant, so only
log p(s) is differentiated) and an entropy bonus on the attention maps; b is a moving average of
log p(y|s,a) per caption (`update_baseline`). Both are summed per caption and divided by the tokens,
like the penalty. `hard_attention_terms` computes them.
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
    n_tokens = int(lengths.sum())
    total, xent, penalty = eq14(logits, alphas, targets, lengths, n_tokens, alpha_c, label_smoothing)
    return LossTerms(total=total, xent=xent, penalty=penalty, n_tokens=n_tokens)


def eq14(logits: torch.Tensor, alphas: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor,
         n_tokens: int | torch.Tensor, alpha_c: float = 1.0, label_smoothing: float = 0.0
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 14 per token -> (total, xent per token, lambda x penalty per caption). Padding is masked out of sums,
    never gathered away, and `n_tokens` (lengths.sum()) may be a tensor: nothing here reads the device, so a
    recorded step (captured_step.py) runs it as caption_loss does. A caption of length 0 (a recording's padding
    row) counts nowhere: no token, and no penalty."""
    T = targets.shape[1]
    mask = torch.arange(T, device=targets.device).unsqueeze(0) < lengths.unsqueeze(1)  # (B, T)
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none",
                                label_smoothing=label_smoothing)  # (B*T,)
    xent = (per_token * mask.flatten()).sum() / n_tokens  # per real token
    real = (lengths > 0).to(per_token.dtype)  # (B,)
    penalty = attention_penalty(alphas) * real  # (B,)
    total = xent + alpha_c * penalty.sum() / n_tokens  # (sum of per-caption objectives) / tokens
    return total, xent, alpha_c * penalty.sum() / real.sum()


@dataclass
class HardTerms:
    total: torch.Tensor  # REINFORCE term - entropy bonus, per token (add it to LossTerms.total)
    reinforce: torch.Tensor  # lambda_r * mean over captions of -(log p(y|s,a) - b) sum_t log p(s_t)
    entropy: torch.Tensor  # mean over captions of sum_t H[alpha_t] (nats, before lambda_e)


def caption_log_likelihood(logits: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """log p(y | s, a) per caption, no gradient (it is the REINFORCE reward): logits (B, T, V),
    targets (B, T), lengths (B,) -> (B,), summed over real tokens (no label smoothing)."""
    with torch.no_grad():
        mask = torch.arange(targets.shape[1], device=targets.device).unsqueeze(0) < lengths.unsqueeze(1)  # (B, T)
        logp = torch.log_softmax(logits.float(), dim=-1).gather(2, targets.unsqueeze(2)).squeeze(2)  # (B, T)
        return (logp * mask).sum(dim=1)


def attention_entropy(alphas: torch.Tensor) -> torch.Tensor:
    """sum_t H[alpha_t] per caption: alphas (B, T, P), zero past each caption's end -> (B,) nats
    (-sum alpha log alpha; padding contributes 0)."""
    return torch.special.entr(alphas.float()).sum(dim=(1, 2))


def hard_attention_terms(log_lik: torch.Tensor, loc_logp: torch.Tensor, alphas: torch.Tensor, baseline: torch.Tensor,
                         n_tokens: int, reinforce: float = 1.0, entropy: float = 0.002) -> HardTerms:
    """Eq. 12 beyond the cross-entropy. log_lik (B,) from caption_log_likelihood, loc_logp (B,) =
    sum_t log alpha_t[s_t] (Decoder.teacher_force), alphas (B, T, P) zero past each caption's end,
    baseline b (scalar)."""
    advantage = (log_lik - baseline).detach()  # (B,): the reward is a constant for autograd
    pg = -(advantage * loc_logp)  # (B,)
    ent = attention_entropy(alphas)  # (B,)
    total = (reinforce * pg.sum() - entropy * ent.sum()) / n_tokens
    return HardTerms(total, reinforce * pg.mean(), ent.mean())


@torch.no_grad()
def update_baseline(baseline: torch.Tensor, log_lik: torch.Tensor, decay: float = 0.9) -> None:
    """b <- decay * b + (1 - decay) * mean_batch log p(y|s,a), in place (the authors' code: 0.9 and 0.1)."""
    baseline.mul_(decay).add_((1 - decay) * log_lik.mean().to(baseline.dtype))
