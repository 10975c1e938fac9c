"""Shallow fusion of the captioner and the concept language model (lm/model.py) over the extended
vocabulary: pure functions on log-probabilities, the rule a fused beam search would apply every step.
NOT wired into decoding yet (decoding/search.py does not call it; its conditioning on the encoder's head
also needs an adapter: this model's concepts are the 80 COCO categories of concepts/words.py, the head
gives concepts/imagenet.py's 61 seen ones in another order).

Legend: N rows (images x beams), V the captioner's vocabulary, X >= V the LM's extended vocabulary
(ids 0..V-1 are the captioner's words with the same ids; V..X-1 are the words it lacks: "new").

Score of the next word w, both models having read the same words:

    w < V, w != <unk>:  cap_logp[w] + lm_weight * lm_logp[w]
    w >= V (new):       cap_logp[<unk>] + (lm_logp[w] - logsumexp_{u >= V} lm_logp[u]) + lm_weight * lm_logp[w]
    w == <unk>:         -inf

Why the new words get the captioner's <unk>: it was trained with <unk> wherever a word too rare for
its vocabulary stood, so p_cap(<unk>) is its belief that "a word I do not know goes here", often a
rare noun. That mass is split among the new words in proportion to the LM (their share among the
new words), which knows from the photo's concepts and the sentence so far which one fits; then the
LM weight applies as to every word. <unk> itself is forbidden: its mass now belongs to the new
words, and a caption for people should not say "<unk>". With lm_weight 0 the scores are a proper
distribution over X: the captioner's, with <unk> replaced by the new words, which sum to exactly
p_cap(<unk>).

One step of fused beam search (words (N,) are ids in the extended vocabulary; both states are
reordered with the same rows afterwards; <pad>/<start> are forbidden as usual):

    cap_in = captioner_input_ids(words, V, unk)                          # (N,) ids the captioner knows
    logits, alpha, beta, dec_state = decoder.step(dec_state, *decoder.embed(cap_in), feats, feat_proj)
    lm_logp, lm_state = lm.step(lm_state, words)                         # (N, X)
    scores = fuse_scores(torch.log_softmax(logits.float(), -1), lm_logp, lm_weight, unk)  # (N, X)
"""
from __future__ import annotations

import torch


def fuse_scores(cap_logp: torch.Tensor, lm_logp: torch.Tensor, lm_weight: float, unk: int) -> torch.Tensor:
    """cap_logp (N, V) captioner log-probs, lm_logp (N, X) LM log-probs -> fused scores (N, X), float32.
    Scores, not log-probs: they sum to 1 (after exp) only for lm_weight 0."""
    V, X = cap_logp.shape[-1], lm_logp.shape[-1]
    if X < V or cap_logp.shape[:-1] != lm_logp.shape[:-1]:
        raise ValueError(f"captioner scores {tuple(cap_logp.shape)} and LM scores {tuple(lm_logp.shape)}: the LM "
                         "must score the same rows over a vocabulary that extends the captioner's")
    cap, lm = cap_logp.float(), lm_logp.float()
    known = cap + lm_weight * lm[:, :V]  # (N, V)
    if X > V:
        new_lm = lm[:, V:]  # (N, X - V)
        share = new_lm - torch.logsumexp(new_lm, dim=-1, keepdim=True)  # (N, X - V): log share among new words
        new = cap[:, unk:unk + 1] + share + lm_weight * new_lm  # (N, X - V)
        fused = torch.cat([known, new], dim=-1)  # (N, X)
    else:
        fused = known
    fused[:, unk] = float("-inf")
    return fused


def captioner_input_ids(words: torch.Tensor, captioner_vocab_size: int, unk: int) -> torch.Tensor:
    """words (...,) ids in the extended vocabulary -> ids the captioner's embedding knows: a new word
    (id >= V) becomes the captioner's <unk>, the input it saw after rare words in training."""
    return torch.where(words >= captioner_vocab_size, torch.full_like(words, unk), words)
