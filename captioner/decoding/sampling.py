"""Multinomial sampling of captions WITH gradients, for self-critical training (objectives.py).

Legend: B images, K samples per image, n live images, P regions, V vocabulary, T steps.

The K samples of an image are K consecutive rows sharing its features and W_a a_i projection
(Decoder.step with G = K rows per image, as beams do). An image leaves the batch once all its
samples have ended, so late steps run on the few images still writing; results are scattered back
to fixed (B*K, T) tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..vocab import SpecialIds
from ..model.decoder import Decoder
from ..model.fast import inference


@dataclass
class Samples:
    """K captions sampled per image, rows image-major (image b's samples are rows b*K .. b*K+K-1)."""
    tokens: torch.Tensor  # (B*K, T) sampled ids, <end> included where emitted, <pad> after it
    log_probs: torch.Tensor  # (B*K, T) log p of each sampled token (differentiable), 0 past the end
    mask: torch.Tensor  # (B*K, T) bool: real tokens (words and the <end> that closed the caption)
    alphas: torch.Tensor  # (B*K, T, P) attention of each token, 0 past the end

    def captions(self, end: int) -> list[list[int]]:
        """Word ids of each sample, without <end>."""
        return [[w for w, m in zip(row, keep) if m and w != end]
                for row, keep in zip(self.tokens.tolist(), self.mask.tolist())]


def sample(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, n_samples: int = 5, max_len: int = 20) -> Samples:
    """feats (B, P, D) -> n_samples captions per image, drawn from the model's distribution
    renormalised without <pad>, <start> (and <unk> when given). Runs until every sample has
    emitted <end> or max_len tokens; a capped sample has no <end>."""
    (B, P, _), K, dev = feats.shape, n_samples, feats.device
    start, end, pad, unk = ids.start, ids.end, ids.pad, ids.unk
    N = B * K
    decoder = inference(decoder)  # Decoder.step computed faster (model/fast.py); with autograd, as today
    feat_proj = decoder.attention.project(feats)  # (B, P, A)
    h, c = decoder.init_state(feats)  # (B, H)
    state = (h.repeat_interleave(K, 0), c.repeat_interleave(K, 0))  # (N, H)
    words = torch.full((N,), start, dtype=torch.long, device=dev)
    alive = torch.ones(N, dtype=torch.bool, device=dev)  # over the live images' rows (n*K,)
    rows = torch.arange(N, device=dev)  # (n*K,) original row of each live row
    banned = torch.tensor([pad, start] + ([unk] if unk is not None else []), device=dev)
    toks, logps, masks, alphas = [], [], [], []
    for _ in range(max_len):
        emb, emb_gates = decoder.embed(words)
        # a hard-attention model samples its words with the expected context, as it is decoded at test
        # time: SCST optimises the captions decoding writes, and word sampling is the only randomness
        logits, alpha, _, state = decoder.step(state, emb, emb_gates, feats, feat_proj, "expected")  # (n*K, V), (n*K, P)
        # out of place (autograd needs log_softmax's output); renormalised over the allowed words
        logp = torch.log_softmax(logits.float().index_fill(1, banned, float("-inf")), dim=-1)  # (n*K, V)
        words = torch.where(alive, torch.multinomial(logp.detach().exp(), 1).squeeze(1), pad)  # (n*K,)
        picked = logp.gather(1, words.unsqueeze(1)).squeeze(1)  # (n*K,): -inf for <pad> on ended rows
        picked = torch.where(alive, picked, torch.zeros_like(picked))
        toks.append(words.new_full((N,), pad).index_copy(0, rows, words))  # back to all B*K rows
        logps.append(picked.new_zeros(N).index_put((rows,), picked))
        masks.append(alive.new_zeros(N).index_copy(0, rows, alive))
        alphas.append(alpha.new_zeros(N, P).index_put((rows,), alpha * alive.unsqueeze(1)))
        alive = alive & (words != end)
        live_images = alive.view(-1, K).any(1)  # (n,)
        if not bool(live_images.any()):
            break
        if not bool(live_images.all()):  # images whose K samples all ended leave the batch
            keep = live_images.nonzero().squeeze(1)  # (n',)
            r = (keep.unsqueeze(1) * K + torch.arange(K, device=dev)).reshape(-1)  # (n'*K,)
            feats, feat_proj = feats[keep], feat_proj[keep]
            state, words, alive, rows = (state[0][r], state[1][r]), words[r], alive[r], rows[r]
    return Samples(torch.stack(toks, 1), torch.stack(logps, 1), torch.stack(masks, 1), torch.stack(alphas, 1))
