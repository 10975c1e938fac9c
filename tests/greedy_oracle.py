"""Greedy decoding written as its own loop: at each step every live image takes the best-scoring word, and an
image leaves the batch when that word is <end>. The oracle that decoding's beam 1 (search.beam_search and
device_beam's search with beam_size 1, which decode() runs for greedy captions) is checked against: the same
words, maps, gates and log-probabilities to float rounding. Never imported by captioner/.

It steps through Decoder.step without the W_z a_i table (W_z z_t, the product), and sums each image's
log-probabilities in Python floats: beam 1 reads the table for one image and keeps its sum in float32.

Legend: B images, N live rows (one per image), P regions, D feature dim, V vocabulary.
"""
from __future__ import annotations

import torch

from captioner.config import DecodeConfig
from captioner.decoding.device_beam import Hypothesis
from captioner.decoding.rules import Rules
from captioner.model.decoder import Decoder
from captioner.vocab import SpecialIds


@torch.no_grad()
def greedy_decode(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                  rules: Rules | None = None) -> list[Hypothesis]:
    """feats (B, P, D), the decode's Rules (None: settings' rules without a lexicon or evidence) -> one hypothesis
    per image (settings.beam_size is not read), scored by its log-probability, which includes the rules'
    evidence bias."""
    B, context = feats.shape[0], settings.hard_context
    feat_proj = decoder.attention.project(feats)  # (B, P, A)
    state = decoder.init_state(feats)
    rows = torch.arange(B, device=feats.device)  # image of each live row
    words = feats.new_full((B,), ids.start, dtype=torch.long)
    tokens: list[list[int]] = [[] for _ in range(B)]
    alphas: list[list[torch.Tensor]] = [[] for _ in range(B)]
    betas: list[list[torch.Tensor]] = [[] for _ in range(B)]
    word_lps: list[list[float]] = [[] for _ in range(B)]
    logps = [0.0] * B
    hist = torch.zeros(B, 0, dtype=torch.long, device=feats.device)  # (N, t) words of the live rows
    rules = rules or Rules(ids, settings)
    said = rules.start(B)  # what the rules remember of each live row
    for _ in range(settings.max_len):
        emb, emb_gates = decoder.embed(words)
        logits, alpha, beta, state = decoder.step(state, emb, emb_gates, feats, feat_proj, context)
        logp = rules.scores(logits, hist, said, rows)  # (N, V)
        best_logp, words = logp.max(dim=-1)  # (N,)
        hist, said = torch.cat([hist, words.unsqueeze(1)], 1), rules.advance(said, words)
        keep = []
        for j, (img, w, lp) in enumerate(zip(rows.tolist(), words.tolist(), best_logp.tolist())):
            logps[img] += lp
            if w == ids.end:
                continue
            tokens[img].append(w)
            alphas[img].append(alpha[j])
            betas[img].append(beta[j])
            word_lps[img].append(lp)
            keep.append(j)
        if len(keep) < len(rows):  # drop finished images from the batch
            k = torch.tensor(keep, dtype=torch.long, device=feats.device)
            rows, words, feats, feat_proj, hist = rows[k], words[k], feats[k], feat_proj[k], hist[k]
            said = said.reindexed(k)
            state = (state[0][k], state[1][k])
        if len(rows) == 0:
            break
    P = feats.shape[1]
    return [Hypothesis(tokens[i], torch.stack(alphas[i]) if alphas[i] else feats.new_zeros(0, P), logps[i], logps[i],
                       torch.stack(betas[i]) if betas[i] else feats.new_zeros(0),
                       torch.tensor(word_lps[i], dtype=torch.float32)) for i in range(B)]
