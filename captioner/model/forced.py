"""The one teacher-forcing path of typed or reference sentences (a Photo's explain, evaluation's grounding): each
sentence's words through Decoder.teacher_force on one photo, in one batched pass. Words the vocabulary lacks are fed
as <unk>. Legend: P attention cells, D feature dim, L words, C sentences, T steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..vocab import Vocab
from .decoder import Decoder


@dataclass
class ForcedSentence:
    """One sentence teacher-forced on one photo."""

    alphas: np.ndarray  # (L, P) the map with which each word is predicted
    betas: np.ndarray  # (L,) each word's gate
    step_log_probs: np.ndarray  # (L+1,) log p of each word given the words before it, then of <end>


@torch.no_grad()
def force_sentences(decoder: Decoder, feats: torch.Tensor, vocab: Vocab, sentences: Sequence[Sequence[str]],
                    context: str = "expected") -> list[ForcedSentence]:
    """The one teacher-forcing path of typed or reference sentences (explain, grounding): feats (1, P, D) of one
    photo, C sentences of words -> one ForcedSentence each, in one batched pass. context: how a hard-attention
    decoder attends (decode.hard_context)."""
    if feats.dim() != 3 or feats.shape[0] != 1:
        raise ValueError(f"feats must be (1, P, D) for one photo, got {tuple(feats.shape)}")
    if not sentences:
        return []
    param = next(decoder.parameters())
    ids = [[vocab.stoi.get(w, vocab.unk) for w in s] for s in sentences]
    order = sorted(range(len(ids)), key=lambda j: -len(ids[j]))  # teacher_force wants lengths descending
    lengths = torch.tensor([len(ids[j]) + 1 for j in order], device=param.device)  # (C,) words + <end>
    inputs = torch.full((len(ids), int(lengths[0])), vocab.pad, dtype=torch.long, device=param.device)  # (C, T)
    targets = inputs.clone()  # (C, T): w_1 .. w_L <end>, padded
    for row, j in enumerate(order):
        inputs[row, :len(ids[j]) + 1] = torch.tensor([vocab.start] + ids[j])
        targets[row, :len(ids[j]) + 1] = torch.tensor(ids[j] + [vocab.end])
    decoder.eval()
    tf = decoder.teacher_force(feats.to(param.device, param.dtype), inputs, lengths,
                               torch.zeros(len(ids), dtype=torch.long, device=param.device),
                               context=context if decoder.hard else "expected")
    logp = torch.log_softmax(tf.logits.float(), dim=-1).gather(2, targets.unsqueeze(2)).squeeze(2)  # (C, T)
    out: list[ForcedSentence] = [None] * len(ids)  # type: ignore[list-item]
    for row, j in enumerate(order):
        n = len(ids[j])
        out[j] = ForcedSentence(tf.alphas[row, :n].float().cpu().numpy(), tf.betas[row, :n].float().cpu().numpy(),
                                logp[row, :n + 1].cpu().numpy())
    return out
