"""Soft (deterministic) additive attention, Xu et al. 2015, section 4.2.

Legend: B batch, P regions, D annotation dim, H LSTM hidden dim, A attention dim.

    e_ti    = w^T tanh(W_a a_i + W_h h_{t-1})          (eq. 4, f_att as an MLP)
    alpha_t = softmax(e_t)                              (eq. 5)
    z_t     = beta_t * sum_i alpha_ti a_i               (eq. 6 + the gating scalar of 4.2.1)
    beta_t  = sigmoid(f_beta(h_{t-1}))
"""
from __future__ import annotations

import torch
import torch.nn as nn


class SoftAttention(nn.Module):
    def __init__(self, feat_dim: int, hidden_dim: int, attention_dim: int):
        super().__init__()
        self.feat_proj = nn.Linear(feat_dim, attention_dim)  # W_a
        self.hidden_proj = nn.Linear(hidden_dim, attention_dim, bias=False)  # W_h
        self.score = nn.Linear(attention_dim, 1)  # w
        self.gate = nn.Linear(hidden_dim, 1)  # f_beta: one scalar per step, as in the paper

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """W_a a_i does not depend on t: compute it once per image, not once per step."""
        return self.feat_proj(feats)  # (B, P, A)

    def forward(
        self, feats: torch.Tensor, feat_proj: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """feats (B, P, D), feat_proj (B, P, A), h (B*G, H) -> context z (B*G, D), alpha (B*G, P).

        G >= 1 hidden states per image (G = beam size in beam search; 1 in training) share the
        image's annotations, so beams never copy the (P, D) features of their image.
        """
        B, P, _ = feats.shape
        G = h.shape[0] // B
        hp = self.hidden_proj(h).view(B, G, 1, -1)  # (B, G, 1, A)
        e = self.score(torch.tanh(feat_proj.unsqueeze(1) + hp)).view(B * G, P)  # (B*G, P)
        alpha = torch.softmax(e, dim=-1)  # (B*G, P)
        context = torch.bmm(alpha.view(B, G, P), feats).view(B * G, -1)  # (B*G, D)
        beta = torch.sigmoid(self.gate(h))  # (B*G, 1)
        return beta * context, alpha
