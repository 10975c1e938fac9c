"""The textbook variants the benchmark compares against. They live here, not in the model: the
model has one (fast) path, and these wrap it without changing what it computes.

- RecomputingAttention: W_a a_i recomputed at every decoder step (textbook loops do this), instead
  of once per image. Same numbers, more work.
- naive_decoder(decoder): a copy of a trained decoder that attends that way (beam search "naive").
- naive_loss: teacher forcing over every padded position with the recomputing attention.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..config import Config
from ..training.loss import LossTerms, caption_loss
from ..model.attention import AdditiveAttention
from ..model.decoder import Decoder


class RecomputingAttention(nn.Module):
    """AdditiveAttention that ignores the cached projection and recomputes 2 W_a a_i from the features
    at every call (every step)."""

    def __init__(self, inner: AdditiveAttention):
        super().__init__()
        self.inner = inner

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        return feats.new_empty(*feats.shape[:2], 0)  # (B, P, 0): nothing cached, `weights` recomputes it

    def weights(self, feats: torch.Tensor, feat_proj: torch.Tensor, h: torch.Tensor):
        return self.inner.weights(feats, self.inner.project(feats), h)


def make_naive(decoder: Decoder) -> Decoder:
    """Switch `decoder` (in place) to the recomputing attention; parameters are kept."""
    if not isinstance(decoder.attention, RecomputingAttention):
        decoder.attention = RecomputingAttention(decoder.attention)  # type: ignore[assignment]
    return decoder


def naive_decoder(decoder: Decoder) -> Decoder:
    """A copy of `decoder` that recomputes W_a a_i at every step (the original is untouched)."""
    return make_naive(copy.deepcopy(decoder))


def naive_loss(decoder: Decoder, feats: torch.Tensor, batch, cfg: Config) -> LossTerms:
    """Teacher forcing that computes every padded position (all captions run T steps); the
    padded positions are masked out of the loss and the attention penalty afterwards."""
    T = batch.inputs.shape[1]
    full = torch.full_like(batch.lengths, T)
    logits, alphas, _, _ = decoder.teacher_force(feats, batch.inputs, full, batch.image_index)
    valid = torch.arange(T, device=alphas.device)[None, :] < batch.lengths[:, None]  # (B, T)
    return caption_loss(logits, alphas * valid.unsqueeze(-1), batch.targets, batch.lengths, cfg.train.alpha_c,
                        cfg.train.label_smoothing)
