"""Explain any sentence: teacher-force it through the decoder on one photo's features and return
it as a Caption, with the same fields decoding fills (attention maps, gates, log-probability) plus
each word's log-probability. Decoding a caption and explaining its text give the same maps, gates
and probabilities (tests/test_explain.py), so the app can show a typed sentence exactly as it would
show a generated one.

Legend: P = G*G attention cells, D feature dim, L words, V vocabulary.

A typed sentence is split by vocab.tokenize_typed: every word is kept in `words` as typed (accents and
any script, lowercased; "café" stays "café"). Out-of-vocabulary words are fed to the decoder as <unk>
and listed in Caption.unknown (one note each): the maps and probabilities shown for them are those of
<unk>. A sentence with no words is an error (NoWordsError), never a score of <end> alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .captions import Caption, grid_side
from ..model.decoder import Decoder
from ..vocab import Vocab, tokenize_typed


class NoWordsError(ValueError):
    """The sentence to explain has no words (empty or only punctuation); the message says so."""


def sentence_words(text: str) -> list[str]:
    """A typed sentence -> its words (tokenize_typed); NoWordsError when it has none."""
    words = tokenize_typed(text)
    if not words:
        shown = text.strip()[:40]
        raise NoWordsError(f"the sentence {shown!r} has no words to explain: type at least one word"
                           if shown else "the sentence is empty: type at least one word to explain")
    return words


@dataclass
class ForcedSentence:
    """One sentence teacher-forced on one photo."""

    alphas: np.ndarray  # (L, P) the map with which each word is predicted
    betas: np.ndarray  # (L,) each word's gate
    step_log_probs: np.ndarray  # (L+1,) log p of each word given the words before it, then of <end>


@torch.no_grad()
def force_sentences(decoder: Decoder, feats: torch.Tensor, vocab: Vocab, sentences: Sequence[Sequence[str]],
                    context: str = "expected") -> list[ForcedSentence]:
    """The one teacher-forcing path of typed or reference sentences (explain, grounding): feats (1, P, D)
    of one photo, C sentences of words -> one ForcedSentence each, in one batched pass. Words the
    vocabulary lacks are fed as <unk>. context: how a hard-attention decoder attends (decode.hard_context)."""
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


def explain_features(decoder: Decoder, feats: torch.Tensor, vocab: Vocab, words: Sequence[str],
                     context: str = "expected") -> Caption:
    """feats (1, P, D) of one photo, tokenised words (L,) -> Caption of exactly those words: alphas
    (L, G, G), betas (L,), word_log_probs (L,), log_prob = their sum + log p(<end>).
    context: how a hard-attention decoder attends (decode.hard_context); a soft one ignores it."""
    words = list(words)
    if not words:
        raise NoWordsError("no words to explain: a sentence needs at least one word")
    (forced,) = force_sentences(decoder, feats, vocab, [words], context)
    L, g = len(words), grid_side(feats.shape[1])
    unknown = [i for i, w in enumerate(words) if w not in vocab.stoi]
    lp = forced.step_log_probs  # (L+1,)
    return Caption(" ".join(words), words, forced.alphas.reshape(L, g, g), float(lp.sum(dtype=np.float64)), [],
                   forced.betas, lp[:L].astype(np.float32), unknown)
