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

from typing import Sequence

import numpy as np
import torch

from .captions import Caption, grid_side
from .model.decoder import Decoder
from .vocab import Vocab, tokenize_typed


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


@torch.no_grad()
def explain_features(decoder: Decoder, feats: torch.Tensor, vocab: Vocab, words: Sequence[str],
                     context: str = "expected") -> Caption:
    """feats (1, P, D) of one photo, tokenised words (L,) -> Caption of exactly those words: alphas
    (L, G, G), betas (L,), word_log_probs (L,), log_prob = their sum + log p(<end>).
    context: how a hard-attention decoder attends (decode.hard_context); a soft one ignores it."""
    if feats.dim() != 3 or feats.shape[0] != 1:
        raise ValueError(f"feats must be (1, P, D) for one photo, got {tuple(feats.shape)}")
    words = list(words)
    if not words:
        raise NoWordsError("no words to explain: a sentence needs at least one word")
    ids = [vocab.stoi.get(w, vocab.unk) for w in words]
    unknown = [i for i, w in enumerate(words) if w not in vocab.stoi]
    param = next(decoder.parameters())
    x = feats.to(param.device, param.dtype)  # (1, P, D)
    inputs = torch.tensor([[vocab.start] + ids], device=param.device)  # (1, L+1): <start> w_1 .. w_L
    targets = torch.tensor(ids + [vocab.end], device=param.device)  # (L+1,): w_1 .. w_L <end>
    lengths = torch.tensor([len(ids) + 1], device=param.device)
    decoder.eval()
    tf = decoder.teacher_force(x, inputs, lengths, context=context if decoder.hard else "expected")
    logp = torch.log_softmax(tf.logits[0].float(), dim=-1)  # (L+1, V)
    step_lp = logp.gather(1, targets.unsqueeze(1)).squeeze(1).cpu().numpy()  # (L+1,)
    g = grid_side(tf.alphas.shape[-1])
    L = len(words)
    alphas = tf.alphas[0, :L].float().cpu().numpy().reshape(L, g, g)  # (L, G, G)
    betas = tf.betas[0, :L].float().cpu().numpy()  # (L,)
    return Caption(" ".join(words), words, alphas, float(step_lp.sum(dtype=np.float64)), [], betas,
                   step_lp[:L].astype(np.float32), unknown)
