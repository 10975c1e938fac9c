"""Additive attention, Xu et al. 2015: soft (deterministic, section 4.2) and hard (stochastic, 4.1).

Legend: B images, G hidden states per image (beams; 1 in training), P regions, D annotation dim,
H LSTM hidden dim, A attention dim.

    e_ti    = w^T tanh(W_a a_i + W_h h_{t-1}) + b       (eq. 4, f_att as an MLP)
    alpha_t = softmax(e_t)                              (eq. 5)
    beta_t  = sigmoid(f_beta(h_{t-1}))                  (the gating scalar of 4.2.1)
    soft:  z_t = beta_t * sum_i alpha_ti a_i            (eq. 6: the expected context)
    hard:  z_t = beta_t * a_{s_t},  s_t ~ Multinoulli(alpha_t)   (eq. 8-9, gated like the soft one)

Both contexts are `glimpse(feats, weights, beta)` with weights = alpha (soft) or the one-hot of the
chosen location (hard), and the location is chosen in one place, `locate`.

`AdditiveAttention.weights` is what every path runs (training, every search, sampling, explain). It
computes eq. 4 through tanh(x) = 2 sigmoid(2x) - 1, the same number: PyTorch's CPU tanh kernel is several
times slower than its sigmoid, and the (N, P, A) elementwise part of eq. 4 is the largest cost of a step
after the matrix products. So `project` keeps 2 W_a a_i (once per image: the factor 2 costs nothing per
step), and without autograd on a CPU eq. 4 is evaluated a few images at a time in one reused buffer of
about BLOCK_ELEMENTS elements that stays in cache (a beam step over 100 images x 3 beams would otherwise
write and re-read a 50 MB temporary). `weights(..., literal=True)` is eq. 4 as written above (halving the
projection back is exact in floating point): the oracle tests check the step against (tests/test_model.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..config import HARD_CONTEXTS
from .packed_linear import Linear

BLOCK_ELEMENTS = 1 << 18  # elements of the buffer eq. 4 is evaluated in without autograd on a CPU (1 MiB fp32)
CONTEXTS = (*HARD_CONTEXTS, "sample")  # how z_t is formed from alpha_t (see `locate`); "sample" only in training


class AdditiveAttention(nn.Module):
    """The f_att of eq. 4-5 and the gate of 4.2.1: alpha and beta for each hidden state. How the context
    z is then formed (soft: the expected context; hard: one location) is `locate` + `glimpse`."""

    def __init__(self, feat_dim: int, hidden_dim: int, attention_dim: int):
        super().__init__()
        self.feat_proj = Linear(feat_dim, attention_dim)  # W_a (with the MLP hidden layer's bias)
        self.hidden_proj = Linear(hidden_dim, attention_dim, bias=False)  # W_h
        self.score = nn.Linear(attention_dim, 1)  # w, b (plain products: a one-column layer)
        self.gate = nn.Linear(hidden_dim, 1)  # f_beta: one scalar per step, as in the paper

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """2 W_a a_i: feats (B, P, D) -> (B, P, A), the doubled input of eq. 4's sigmoid form. It does not
        depend on t: once per image, not per step."""
        return 2 * self.feat_proj(feats)  # (B, P, A)

    def weights(self, feats: torch.Tensor, feat_proj: torch.Tensor, h: torch.Tensor, literal: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """feats (B, P, D), feat_proj (B, P, A) from `project`, h (B*G, H) -> alpha (B*G, P) (eq. 4-5)
        and the gate beta (B*G,): how much of the attended context reaches the word (0 = the word did
        not use the image). The G rows of an image (consecutive) share its annotations. literal: eq. 4
        with tanh as the paper writes it and plain products (the test oracle) instead of its sigmoid form."""
        B, P, _ = feats.shape
        G = h.shape[0] // B
        hp = self.hidden_proj(h, literal).view(B, G, 1, -1)  # (B, G, 1, A): W_h h_{t-1}
        if literal:
            u = feat_proj.unsqueeze(1) / 2 + hp  # (B, G, P, A): W_a a_i + W_h h_{t-1}
            e = self.score(torch.tanh(u)).view(B * G, P)  # (B*G, P): eq. 4
        else:  # w^T tanh(u) = 2 w^T sigmoid(2u) - sum(w), 2u = 2 W_a a_i + 2 W_h h_{t-1}
            w = self.score.weight.t()  # (A, 1)
            if torch.is_grad_enabled() or feats.device.type != "cpu":
                s = torch.sigmoid(feat_proj.unsqueeze(1) + 2 * hp) @ w  # (B, G, P, 1)
            else:
                s = _sigmoid_scores_blocked(feat_proj, 2 * hp, w)  # (B, G, P, 1)
            e = 2 * s.view(B * G, P) + (self.score.bias - w.sum())  # (B*G, P): eq. 4
        alpha = torch.softmax(e, dim=-1)  # (B*G, P): eq. 5
        beta = torch.sigmoid(self.gate(h)).squeeze(1)  # (B*G,): the gate of 4.2.1
        return alpha, beta


def _sigmoid_scores_blocked(feat_proj: torch.Tensor, hp2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sigmoid(feat_proj + hp2) @ w without autograd, a block of images at a time in one buffer.
    feat_proj (B, P, A) = 2 W_a a_i, hp2 (B, G, 1, A) = 2 W_h h, w (A, 1) -> (B, G, P, 1)."""
    B, P, A = feat_proj.shape
    G = hp2.shape[1]
    block = max(1, BLOCK_ELEMENTS // (G * P * A))  # images per block
    buf = feat_proj.new_empty(min(block, B), G, P, A)
    out = feat_proj.new_empty(B, G, P, 1)
    for k in range(0, B, block):
        n = min(block, B - k)
        u = torch.add(feat_proj[k:k + n].unsqueeze(1), hp2[k:k + n], out=buf[:n])  # (n, G, P, A): 2u
        torch.matmul(u.sigmoid_(), w, out=out[k:k + n])
    return out


def locate(alpha: torch.Tensor, context: str) -> torch.Tensor | None:
    """The location each row attends to, or None for the expected (soft) context. alpha (N, P) ->
    (N,) region indices: "sample" draws s_t ~ Multinoulli(alpha_t) (hard attention in training,
    eq. 8), "argmax" takes the most probable region (a deterministic hard decoding)."""
    if context == "expected":
        return None
    if context == "sample":
        return torch.multinomial(alpha.detach().float(), 1).squeeze(1)  # (N,): no gradient through the draw
    if context == "argmax":
        return alpha.argmax(dim=-1)  # (N,)
    raise ValueError(f"attention context must be one of {CONTEXTS}, got '{context}'")


def glimpse(feats: torch.Tensor, weights: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """z = beta * sum_i w_i a_i: feats (B, P, D), weights (B*G, P) = alpha (eq. 6) or the one-hot of
    a location (hard: z = beta a_s, eq. 8), beta (B*G,) -> (B*G, D). A one-hot carries no gradient
    to alpha: hard attention's scores learn only from the REINFORCE term (loss.hard_attention_terms)."""
    B, P, _ = feats.shape
    G = weights.shape[0] // B
    context = torch.bmm(weights.view(B, G, P), feats).view(B * G, -1)  # (B*G, D)
    return beta.unsqueeze(1) * context
