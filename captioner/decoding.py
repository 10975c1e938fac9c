"""Greedy and beam search, batched over images and beams.

Legend: B images, K beam size, N live rows (image x beam), P regions, D feature dim, V vocabulary.

All call Decoder.step, the same function teacher-forced training uses. <pad> and <start> are never
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
    betas: torch.Tensor | None = None  # (len(tokens),): gate beta of each word (how much it used the image)


def _forbid(logp: torch.Tensor, pad: int, start: int, unk: int | None = None) -> torch.Tensor:
    logp[:, pad] = float("-inf")
    logp[:, start] = float("-inf")
    if unk is not None:  # a caption for people should not say "<unk>"
        logp[:, unk] = float("-inf")
    return logp


def _normalise(log_prob: float, length: int, length_penalty: float) -> float:
    return log_prob / (max(length, 1) ** length_penalty) if length_penalty else log_prob


@torch.no_grad()
def greedy_decode(decoder: Decoder, feats: torch.Tensor, start: int, end: int, pad: int = 0,
                  max_len: int = 50, unk: int | None = None) -> list[Hypothesis]:
    """feats (B, P, D) -> one hypothesis per image; finished images leave the batch."""
    B = feats.shape[0]
    feat_proj = decoder.attention.project(feats)  # (B, P, A)
    state = decoder.init_state(feats)
    rows = torch.arange(B, device=feats.device)  # image of each live row
    words = feats.new_full((B,), start, dtype=torch.long)
    tokens: list[list[int]] = [[] for _ in range(B)]
    alphas: list[list[torch.Tensor]] = [[] for _ in range(B)]
    betas: list[list[torch.Tensor]] = [[] for _ in range(B)]
    logps = [0.0] * B
    for _ in range(max_len):
        emb, emb_gates = decoder.embed(words)
        logits, alpha, beta, state = decoder.step(state, emb, emb_gates, feats, feat_proj)
        logp = _forbid(torch.log_softmax(logits.float(), dim=-1), pad, start, unk)  # (N, V)
        best_logp, words = logp.max(dim=-1)  # (N,)
        keep = []
        for j, (img, w, lp) in enumerate(zip(rows.tolist(), words.tolist(), best_logp.tolist())):
            logps[img] += lp
            if w == end:
                continue
            tokens[img].append(w)
            alphas[img].append(alpha[j])
            betas[img].append(beta[j])
            keep.append(j)
        if len(keep) < len(rows):  # drop finished images from the batch
            k = torch.tensor(keep, dtype=torch.long, device=feats.device)
            rows, words, feats, feat_proj = rows[k], words[k], feats[k], feat_proj[k]
            state = (state[0][k], state[1][k])
        if len(rows) == 0:
            break
    P = feats.shape[1]
    return [Hypothesis(tokens[i], torch.stack(alphas[i]) if alphas[i] else feats.new_zeros(0, P), logps[i], logps[i],
                       torch.stack(betas[i]) if betas[i] else feats.new_zeros(0)) for i in range(B)]


@torch.no_grad()
def beam_search(decoder: Decoder, feats: torch.Tensor, start: int, end: int, pad: int = 0,
                beam_size: int = 3, max_len: int = 50, length_penalty: float = 0.0,
                unk: int | None = None) -> list[list[Hypothesis]]:
    """feats (B, P, D) -> for each image, its finished hypotheses best first (up to beam_size).

    All live images x K beams are one batch of rows. Each step scores the K*V continuations of
    every image at once (tensor ops, no loop over images), keeps the best 2K, records those that
    end in <end> and rank within the top K as finished, and keeps the best K others alive. An image
    leaves the batch when K finished hypotheses cannot be beaten by a live one (exact with
    length_penalty=0, since log-probabilities only decrease; with a penalty, once K have finished),
    or at max_len, where its live hypotheses are finished as they are (capped).
    """
    K = beam_size
    B, P, _ = feats.shape
    device = feats.device
    rank = torch.arange(2 * K, device=device)  # (2K,)
    # rows = (image, beam), G consecutive rows per image sharing its features (never copied per
    # beam). G = 1 at t=0, where every beam would start from the same <start>, then K.
    G = 1
    feat_proj = decoder.attention.project(feats)  # (n, P, A)
    h, c = decoder.init_state(feats)  # (N, H)
    cum = feats.new_zeros(B)  # (N,) cumulative log-prob of each row
    words = torch.full((B,), start, dtype=torch.long, device=device)
    hist_tokens = torch.zeros(B, 0, dtype=torch.long, device=device)  # (N, t)
    hist_alphas = feats.new_zeros(B, 0, P)  # (N, t, P)
    hist_betas = feats.new_zeros(B, 0)  # (N, t)
    image_ids = torch.arange(B, device=device)  # (n,) original id of each live image
    best_finished = torch.full((B, K), float("-inf"), device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]

    for t in range(max_len):
        n = len(image_ids)
        emb, emb_gates = decoder.embed(words)
        logits, alpha, beta, (h, c) = decoder.step((h, c), emb, emb_gates, feats, feat_proj)  # N = n * G rows
        logp = _forbid(torch.log_softmax(logits.float(), dim=-1), pad, start, unk)  # (N, V)
        V = logp.shape[1]
        cand = (cum.unsqueeze(1) + logp).view(n, G * V)  # (n, G*V)
        if G * V < 2 * K:  # a vocabulary smaller than 2K words: pad with impossible candidates
            cand = torch.nn.functional.pad(cand, (0, 2 * K - G * V), value=float("-inf"))
        top_s, top_i = cand.topk(2 * K, dim=1)  # (n, 2K)
        real = top_i < G * V
        src = torch.arange(n, device=device).unsqueeze(1) * G + (top_i // V).clamp(max=G - 1)  # (n, 2K) rows extended
        word = torch.where(real, top_i % V, pad)  # (n, 2K)
        is_end = word == end
        finite = top_s > float("-inf")
        # finished now: <end> among the top K
        fin = is_end & (rank < K) & finite  # (n, 2K)
        norm = top_s / float(t + 1) ** length_penalty if length_penalty else top_s  # t words + <end>
        if bool(fin.any()):
            for g, j in fin.nonzero().tolist():
                r = int(src[g, j])
                finished[int(image_ids[g])].append(
                    Hypothesis(hist_tokens[r].tolist(), hist_alphas[r], float(top_s[g, j]), float(norm[g, j]),
                               hist_betas[r]))
            merged = torch.cat([best_finished[:n], norm.masked_fill(~fin, float("-inf"))], dim=1)
            best_finished = merged.topk(K, dim=1).values  # (n, K)
        kth_finished = best_finished[:, K - 1]
        # alive: the K best non-<end> continuations (there are always >= K among 2K: each of the
        # G <= K rows has one <end>)
        keep_score = (~is_end).float() * (2 * K - rank)  # prefer non-end, then better rank
        alive = keep_score.topk(K, dim=1).indices.sort(dim=1).values  # (n, K) positions in rank order
        alive_s = top_s.gather(1, alive)  # (n, K)
        alive_src = src.gather(1, alive)
        alive_word = word.gather(1, alive)
        if t == max_len - 1:  # cap: live hypotheses end here with the word they just chose
            for g, k in (alive_s > float("-inf")).nonzero().tolist():
                r = int(alive_src[g, k])
                toks = hist_tokens[r].tolist() + [int(alive_word[g, k])]
                al = torch.cat([hist_alphas[r], alpha[r].unsqueeze(0)])
                be = torch.cat([hist_betas[r], beta[r].unsqueeze(0)])
                s_ = float(alive_s[g, k])
                finished[int(image_ids[g])].append(
                    Hypothesis(toks, al, s_, _normalise(s_, len(toks), length_penalty), be))
            break
        best_alive = alive_s[:, 0]
        if length_penalty:
            done = kth_finished > float("-inf")
        else:
            done = kth_finished >= best_alive
        done |= best_alive == float("-inf")
        keep = (~done).nonzero().squeeze(1)  # (n',) live images that go on
        if len(keep) == 0:
            break
        rows = alive_src[keep].reshape(-1)  # (n' * K,) source rows of the surviving beams
        words = alive_word[keep].reshape(-1)
        cum = alive_s[keep].reshape(-1)
        hist_tokens = torch.cat([hist_tokens[rows], words.unsqueeze(1)], dim=1)
        hist_alphas = torch.cat([hist_alphas[rows], alpha[rows].unsqueeze(1)], dim=1)
        hist_betas = torch.cat([hist_betas[rows], beta[rows].unsqueeze(1)], dim=1)
        h, c = h[rows], c[rows]
        G = K
        if len(keep) < n:  # finished images leave the batch
            feats, feat_proj = feats[keep], feat_proj[keep]
        image_ids, best_finished = image_ids[keep], best_finished[keep]
    for img in range(B):
        finished[img].sort(key=lambda hyp: -hyp.score)
        finished[img] = finished[img][:K]
    return finished


def decode(decoder: Decoder, feats: torch.Tensor, start: int, end: int, pad: int = 0, beam_size: int = 3,
           max_len: int = 50, length_penalty: float = 0.0, unk: int | None = None) -> list[list[Hypothesis]]:
    """Greedy when beam_size == 1 (a single hypothesis per image), else beam search. Passing `unk`
    forbids that token (the <unk> word), like <pad> and <start>."""
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if beam_size == 1:
        return [[h] for h in greedy_decode(decoder, feats, start, end, pad, max_len, unk)]
    return beam_search(decoder, feats, start, end, pad, beam_size, max_len, length_penalty, unk)


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


def sample(decoder: Decoder, feats: torch.Tensor, start: int, end: int, pad: int = 0, n_samples: int = 5,
           max_len: int = 20, unk: int | None = None) -> Samples:
    """Multinomial sampling of n_samples captions per image WITH gradients (self-critical training).
    feats (B, P, D); the K samples of an image share its features and W_a a_i projection (G = K
    rows per image in Decoder.step, as beams do). Runs until every sample has emitted <end> or
    max_len tokens; a capped sample has no <end>."""
    B, P, _ = feats.shape
    K = n_samples
    feat_proj = decoder.attention.project(feats)  # (B, P, A)
    h, c = decoder.init_state(feats)  # (B, H)
    state = (h.repeat_interleave(K, 0), c.repeat_interleave(K, 0))  # (B*K, H)
    words = torch.full((B * K,), start, dtype=torch.long, device=feats.device)
    alive = torch.ones(B * K, dtype=torch.bool, device=feats.device)
    banned = torch.tensor([pad, start] + ([unk] if unk is not None else []), device=feats.device)
    toks, logps, masks, alphas = [], [], [], []
    for _ in range(max_len):
        emb, emb_gates = decoder.embed(words)
        logits, alpha, _, state = decoder.step(state, emb, emb_gates, feats, feat_proj)  # (B*K, V), (B*K, P)
        # out of place (autograd needs log_softmax's output); renormalised over the allowed words
        logp = torch.log_softmax(logits.float().index_fill(1, banned, float("-inf")), dim=-1)  # (B*K, V)
        words = torch.multinomial(logp.detach().exp(), 1).squeeze(1)  # (B*K,)
        words = torch.where(alive, words, pad)
        toks.append(words)
        picked = logp.gather(1, words.unsqueeze(1)).squeeze(1)  # (B*K,): -inf for <pad> on dead rows
        logps.append(torch.where(alive, picked, torch.zeros_like(picked)))
        masks.append(alive)
        alphas.append(alpha * alive.unsqueeze(1))
        alive = alive & (words != end)
        if not bool(alive.any()):
            break
    return Samples(torch.stack(toks, 1), torch.stack(logps, 1), torch.stack(masks, 1), torch.stack(alphas, 1))
