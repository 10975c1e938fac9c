"""A warm start over a larger vocabulary (train.extend_vocab): a model file's weights grown to the
extended vocabulary, old words first with the ids they had (Vocab.extended).

Old words keep their rows of the embedding E and of the output layer L_o, so before any training the
extended model gives every old word the same logit it had. A new word starts as the average old word:
its embedding is the old embeddings' mean plus a little seeded noise (two new words must not be
interchangeable to the LSTM), its output row the old rows' mean, and its output bias the lowest old
bias, so no new word starts out more likely than the rarest old one.
"""
from __future__ import annotations

import torch

from ..vocab import SPECIALS

GROWN = ("decoder.embedding.weight", "decoder.out_vocab.weight", "decoder.out_vocab.bias")  # (V, ...) tensors


def grow_vocabulary(weights: dict[str, torch.Tensor], new_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`weights` (a model file's tensors) with the vocabulary-sized tensors grown to `new_size` rows."""
    old_size = weights["decoder.embedding.weight"].shape[0]
    if new_size < old_size:
        raise ValueError(f"the extended vocabulary ({new_size}) is smaller than the model's ({old_size})")
    if new_size == old_size:
        return dict(weights)
    n, words = new_size - old_size, slice(len(SPECIALS), old_size)  # the specials are not words to average
    gen = torch.Generator().manual_seed(seed)
    out = dict(weights)
    emb = weights["decoder.embedding.weight"].float()  # (V, E)
    noise = torch.randn(n, emb.shape[1], generator=gen) * emb[words].std(0) * 0.1  # (n, E)
    out["decoder.embedding.weight"] = _cat(emb, emb[words].mean(0).expand(n, -1) + noise, weights, GROWN[0])
    w = weights["decoder.out_vocab.weight"].float()  # (V, E)
    out["decoder.out_vocab.weight"] = _cat(w, w[words].mean(0).expand(n, -1), weights, GROWN[1])
    b = weights["decoder.out_vocab.bias"].float()  # (V,)
    out["decoder.out_vocab.bias"] = _cat(b, b[words].min().expand(n), weights, GROWN[2])
    return out


def _cat(old: torch.Tensor, rows: torch.Tensor, weights: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    return torch.cat([old, rows]).to(weights[key].dtype)
