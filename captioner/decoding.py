"""Greedy and beam search, batched over images and beams.

Legend: B images, K beam size, N live rows (image x beam), P regions, D feature dim, V vocabulary.

Both call Decoder.step, the same function teacher-forced training uses. <pad> and <start> are never
generated. A hypothesis that has not emitted <end> after max_len words is finished as it is
(capped), so decoding always terminates and always returns a caption.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model.decoder import Decoder


@dataclass
class Hypothesis:
    tokens: list[int]  # word ids, without <start>/<end>
    alphas: torch.Tensor  # (len(tokens), P): attention of each word
    log_prob: float  # sum of log-probabilities of the words (and of <end> when it was emitted)
    score: float  # log_prob after length normalisation (what the ranking uses)


def _forbid(logp: torch.Tensor, pad: int, start: int) -> torch.Tensor:
    logp[:, pad] = float("-inf")
    logp[:, start] = float("-inf")
    return logp


def _normalise(log_prob: float, length: int, length_penalty: float) -> float:
    return log_prob / (max(length, 1) ** length_penalty) if length_penalty else log_prob


@torch.no_grad()
def greedy_decode(decoder: Decoder, feats: torch.Tensor, start: int, end: int, pad: int = 0,
                  max_len: int = 50) -> list[Hypothesis]:
    """feats (B, P, D) -> one hypothesis per image; finished images leave the batch."""
    B = feats.shape[0]
    feat_proj = decoder.attention.project(feats)  # (B, P, A)
    state = decoder.init_state(feats)
    rows = torch.arange(B, device=feats.device)  # image of each live row
    words = feats.new_full((B,), start, dtype=torch.long)
    tokens: list[list[int]] = [[] for _ in range(B)]
    alphas: list[list[torch.Tensor]] = [[] for _ in range(B)]
    logps = [0.0] * B
    for _ in range(max_len):
        emb, emb_gates = decoder.embed(words)
        logits, alpha, state = decoder.step(state, emb, emb_gates, feats, feat_proj)
        logp = _forbid(torch.log_softmax(logits.float(), dim=-1), pad, start)  # (N, V)
        best_logp, words = logp.max(dim=-1)  # (N,)
        keep = []
        for j, (img, w, lp) in enumerate(zip(rows.tolist(), words.tolist(), best_logp.tolist())):
            logps[img] += lp
            if w == end:
                continue
            tokens[img].append(w)
            alphas[img].append(alpha[j])
            keep.append(j)
        if len(keep) < len(rows):  # drop finished images from the batch
            k = torch.tensor(keep, dtype=torch.long, device=feats.device)
            rows, words, feats, feat_proj = rows[k], words[k], feats[k], feat_proj[k]
            state = (state[0][k], state[1][k])
        if len(rows) == 0:
            break
    P = feats.shape[1]
    return [Hypothesis(tokens[i], torch.stack(alphas[i]) if alphas[i] else feats.new_zeros(0, P), logps[i], logps[i])
            for i in range(B)]


@torch.no_grad()
def beam_search(decoder: Decoder, feats: torch.Tensor, start: int, end: int, pad: int = 0,
                beam_size: int = 3, max_len: int = 50, length_penalty: float = 0.0) -> list[list[Hypothesis]]:
    """feats (B, P, D) -> for each image, its finished hypotheses best first (up to beam_size).

    Each step scores all K*V continuations of every image at once, keeps the best 2K, moves those
    ending in <end> (ranked within the top K) to the finished list and keeps the best K others
    alive. An image leaves the batch when it has K finished hypotheses that no live one can beat
    (exact with length_penalty=0, since log-probabilities only decrease), or at max_len, when its
    live hypotheses are finished as they are.
    """
    K = beam_size
    B, P, _ = feats.shape
    device = feats.device
    feat_proj = decoder.attention.project(feats)  # (B, P, A)
    h, c = decoder.init_state(feats)  # (B, H)
    # live rows, grouped by image; every image starts with one row (the <start> prefix)
    img_of_row = torch.arange(B, device=device)  # (N,)
    words = torch.full((B,), start, dtype=torch.long, device=device)  # (N,)
    cum = torch.zeros(B, device=device)  # (N,) cumulative log-prob
    hist_tokens = torch.zeros(B, 0, dtype=torch.long, device=device)  # (N, t)
    hist_alphas = feats.new_zeros(B, 0, P)  # (N, t, P)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    active = list(range(B))  # image ids still decoding, in row-group order
    row_feats, row_proj = feats, feat_proj  # (N, P, D), (N, P, A)

    for t in range(max_len):
        emb, emb_gates = decoder.embed(words)
        logits, alpha, (h, c) = decoder.step((h, c), emb, emb_gates, row_feats, row_proj)
        logp = _forbid(torch.log_softmax(logits.float(), dim=-1), pad, start)  # (N, V)
        V = logp.shape[1]
        cand = (cum.unsqueeze(1) + logp)  # (N, V)
        # group rows by image: pad every image to the same number of rows with -inf
        counts = torch.bincount(img_of_row, minlength=B)[active]  # rows per active image
        n_img, width = len(active), int(counts.max())
        group_start = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(img_of_row), device=device) - group_start.repeat_interleave(counts)
        grid = cand.new_full((n_img, width, V), float("-inf"))
        grid[torch.arange(n_img, device=device).repeat_interleave(counts), slot] = cand
        top_scores, top_idx = grid.view(n_img, -1).topk(min(2 * K, width * V), dim=1)  # (n_img, 2K)
        src_row = group_start.unsqueeze(1) + top_idx // V  # (n_img, 2K) rows the candidates extend
        top_word = top_idx % V
        last = t == max_len - 1

        top_scores_l, src_l, word_l = top_scores.tolist(), src_row.tolist(), top_word.tolist()
        keep_rows, keep_words, keep_scores, still_active = [], [], [], []
        for g, img in enumerate(active):
            alive = []
            for rank, (s, r, w) in enumerate(zip(top_scores_l[g], src_l[g], word_l[g])):
                if s == float("-inf"):
                    break
                if w == end:
                    if rank < K:
                        n_words = hist_tokens.shape[1]
                        finished[img].append(Hypothesis(hist_tokens[r].tolist(), hist_alphas[r], s,
                                                        _normalise(s, n_words + 1, length_penalty)))
                elif len(alive) < K:
                    alive.append((r, w, s))
            if last:  # cap: live hypotheses end here, with the word they just chose
                for r, w, s in alive:
                    toks = hist_tokens[r].tolist() + [w]
                    al = torch.cat([hist_alphas[r], alpha[r].unsqueeze(0)])
                    finished[img].append(Hypothesis(toks, al, s, _normalise(s, len(toks), length_penalty)))
                continue
            done = False
            if len(finished[img]) >= K:
                finished[img].sort(key=lambda hyp: -hyp.score)
                best_alive = alive[0][2] if alive else float("-inf")
                worst_kept = finished[img][K - 1].score
                # exact for length_penalty=0; with a penalty, K finished hypotheses end the search
                done = length_penalty != 0 or best_alive <= worst_kept
            if done or not alive:
                continue
            still_active.append(img)
            for r, w, s in alive:
                keep_rows.append(r)
                keep_words.append(w)
                keep_scores.append(s)
        if not still_active:
            break
        idx = torch.tensor(keep_rows, dtype=torch.long, device=device)
        words = torch.tensor(keep_words, dtype=torch.long, device=device)
        cum = torch.tensor(keep_scores, device=device, dtype=cum.dtype)
        hist_tokens = torch.cat([hist_tokens[idx], words.unsqueeze(1)], dim=1)
        hist_alphas = torch.cat([hist_alphas[idx], alpha[idx].unsqueeze(1)], dim=1)
        h, c = h[idx], c[idx]
        row_feats, row_proj = row_feats[idx], row_proj[idx]
        new_img_of_row = img_of_row[idx]
        img_of_row, active = new_img_of_row, still_active
        # keep img_of_row indexable by image id for bincount: ids stay the original ones
    for img in range(B):
        finished[img].sort(key=lambda hyp: -hyp.score)
        finished[img] = finished[img][:K]
    return finished


def decode(decoder: Decoder, feats: torch.Tensor, start: int, end: int, pad: int = 0, beam_size: int = 3,
           max_len: int = 50, length_penalty: float = 0.0) -> list[list[Hypothesis]]:
    """Greedy when beam_size == 1 (a single hypothesis per image), else beam search."""
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if beam_size == 1:
        return [[h] for h in greedy_decode(decoder, feats, start, end, pad, max_len)]
    return beam_search(decoder, feats, start, end, pad, beam_size, max_len, length_penalty)
