"""Greedy and beam search, batched over images and beams.

Legend: B images, K beam size, N live rows (image x beam), P regions, D feature dim, V vocabulary.

Captions decode through `decode(decoder, feats, ids, settings)`: the special token ids and a DecodeConfig
(config.decode: beam size, maximum length, length penalty, <unk> and trigram rules, a hard model's
context); it picks greedy_decode, beam_search or device_beam's search by device and beam size. Other
callers take a search directly: SCST's greedy baseline (training/objectives.py: greedy_decode, no rules)
and the benchmark (bench/inference.py). This module reads the search settings (beam_size, max_len,
length_penalty, hard_context; photo.py's explain reads hard_context too); the rules on which word may come
next (block_*, the evidence's bias) are rules.py's (Rules: built once by the caller, applied step by step);
forbid_unk is read by the callers of vocab.SpecialIds.of (captions.py, training/objectives.py,
bench/inference.py), evidence* and person_floor by evidence.py.

All step through Decoder.step, the step teacher-forced training, sampling and explain run too (the table
in decoding/__init__.py says which path runs where, and which test proves it equal to the equations).
A hypothesis that has not emitted <end> after max_len words is finished as it is (capped), so decoding
always terminates and always returns a caption. A hard-attention decoder attends as settings.hard_context
says (the expected context, or the argmax location).
"""
from __future__ import annotations

import torch

from ..config import DecodeConfig
from . import captured
from .evidence import Evidence
from .device_beam import beam_search_on_device, with_greedy_scores
from .hypotheses import History, Hypothesis, alive, candidates, normalise
from .rules import Rules
from ..vocab import SpecialIds
from ..model.decoder import Decoder


@torch.no_grad()
def greedy_decode(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                  rules: Rules | None = None) -> list[Hypothesis]:
    """feats (B, P, D), the decode's Rules (None: settings' rules without a lexicon or evidence) -> one hypothesis
    per image (settings.beam_size is not read); finished images leave the batch. With the rules' evidence,
    log_prob includes its word bias."""
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


@torch.no_grad()
def beam_search(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                rules: Rules | None = None) -> list[list[Hypothesis]]:
    """feats (B, P, D), the decode's Rules (None: settings' rules without a lexicon or evidence) -> for each image,
    its finished hypotheses best first (up to settings.beam_size). Scores include the evidence's word bias.

    All live images x K beams are one batch of rows. Each step scores the K*V continuations of
    every image at once (tensor ops, no loop over images), keeps the best 2K, records those that
    end in <end> and rank within the top K as finished, and keeps the best K others alive. An image
    leaves the batch when K finished hypotheses cannot be beaten by a live one (exact with
    length_penalty=0, since log-probabilities only decrease; with a penalty, once K have finished),
    or at max_len, where its live hypotheses are finished as they are (capped).
    """
    K, max_len, length_penalty, end = settings.beam_size, settings.max_len, settings.length_penalty, ids.end
    (B, P, _), device = feats.shape, feats.device
    rank, G = torch.arange(2 * K, device=device), 1  # (2K,); G rows (image, beam) per image: 1 at t=0, then K
    feat_proj, ctx_gates = decoder.attention.project(feats), decoder.context_gates(feats)  # (n, P, A), (n, P, 4H)
    h, c = decoder.init_state(feats)  # (N, H)
    cum = feats.new_zeros(B)  # (N,) cumulative log-prob of each row
    words = torch.full((B,), ids.start, dtype=torch.long, device=device)
    hist = History(torch.zeros(B, 0, dtype=torch.long, device=device), feats.new_zeros(B, 0, P), feats.new_zeros(B, 0),
                    torch.zeros(B, 0, device=device))
    image_ids = torch.arange(B, device=device)  # (n,) original id of each live image
    best_finished = torch.full((B, K), float("-inf"), device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    rules = rules or Rules(ids, settings)
    said = rules.start(B)  # what the rules remember of each live row
    for t in range(max_len):
        n = len(image_ids)
        emb, emb_gates = decoder.embed(words)
        logits, alpha, beta, (h, c) = decoder.step((h, c), emb, emb_gates, feats, feat_proj, settings.hard_context, ctx_gates)
        top_s, src, word, step_lp = candidates(
            cum, rules.scores(logits, hist.tokens, said, image_ids.repeat_interleave(G, 0)), n, G, K, ids.pad)
        is_end = word == end
        fin = is_end & (rank < K) & (top_s > float("-inf"))  # (n, 2K) hypotheses that end now
        norm = normalise(top_s, t + 1, length_penalty)  # (n, 2K): t words + <end>
        best_finished = _best_finished(best_finished[:n], norm, fin)  # (n, K)
        alive_s, alive_src, alive_word, alive_lp = alive(top_s, src, word, step_lp, is_end, rank, K)  # (n, K) each
        if t == max_len - 1:  # cap: live hypotheses end here with the word they just chose
            _record_finished(finished, hist, image_ids, top_s, src, norm, fin.nonzero().tolist())
            capped = hist.extend(alive_src.reshape(-1), alive_word.reshape(-1), alpha, beta, alive_lp.reshape(-1))
            _record_finished(finished, capped, image_ids, alive_s, torch.arange(alive_s.numel()).view_as(alive_s),
                             normalise(alive_s, t + 1, length_penalty), (alive_s > float("-inf")).nonzero().tolist())
            break
        best_alive = alive_s[:, 0]
        done = best_finished[:, K - 1] > float("-inf") if length_penalty else best_finished[:, K - 1] >= best_alive
        going = ~(done | (best_alive == float("-inf")))  # (n,) live images that go on
        at, width = torch.cat([fin.flatten(), going]).nonzero().squeeze(1).tolist(), fin.numel()  # the one read a step
        _record_finished(finished, hist, image_ids, top_s, src, norm, [divmod(i, 2 * K) for i in at if i < width])
        if at[-1:] < [width]:  # no image goes on
            break
        keep = torch.tensor([i - width for i in at if i >= width], dtype=torch.long, device=device)  # (n',)
        rows = alive_src[keep].reshape(-1)  # (n' * K,) source rows of the surviving beams
        words, cum = alive_word[keep].reshape(-1), alive_s[keep].reshape(-1)
        hist = hist.extend(rows, words, alpha, beta, alive_lp[keep].reshape(-1))
        said = rules.advance(said, words, rows)  # the rules' state follows the surviving rows, as hist does
        h, c, G = h[rows], c[rows], K  # from now on each live image has K rows
        if len(keep) < n:  # finished images leave the batch
            feats, feat_proj, ctx_gates = feats[keep], feat_proj[keep], ctx_gates[keep]
        image_ids, best_finished = image_ids[keep], best_finished[keep]
    return [sorted(f, key=lambda hyp: -hyp.score)[:K] for f in finished]


def _best_finished(best: torch.Tensor, norm: torch.Tensor, fin: torch.Tensor) -> torch.Tensor:
    """The K best finished scores per live image (n, K), with the step's ending candidates (norm, where fin (n, 2K))."""
    merged = torch.cat([best, norm.masked_fill(~fin, float("-inf"))], dim=1)  # (n, 3K)
    return merged.topk(best.shape[1], dim=1).values


def _record_finished(finished: list[list[Hypothesis]], hist: "History", image_ids: torch.Tensor, top_s: torch.Tensor,
                     src: torch.Tensor, norm: torch.Tensor, ends: list[tuple[int, int]]) -> None:
    """The hypotheses ending now, ends = [(image row g, candidate j)] of the step's (n, 2K) candidates (scores top_s,
    normalised norm, source rows src), join their image's finished list."""
    if not ends:
        return
    images, rows, scores, normed = image_ids.tolist(), src.tolist(), top_s.tolist(), norm.tolist()  # read once
    ended = hist.hypotheses([rows[g][j] for g, j in ends], [scores[g][j] for g, j in ends],
                            [normed[g][j] for g, j in ends])
    for (g, _), hyp in zip(ends, ended):
        finished[images[g]].append(hyp)


def decode(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
           rules: Rules | None = None, recorded: captured.Recordings | None = None) -> list[list[Hypothesis]]:
    """How captions are decoded (captions.py, evaluation, validation): feats (B, P, D) -> for each image its
    hypotheses, best first. Greedy when settings.beam_size == 1 (one hypothesis per image), else beam search;
    off the CPU the fixed-shape search for both. rules: the decode's Rules (rules.py; None: settings' rules
    without a lexicon or evidence), built once and handed to the search. The evidence's bias (evidence-aware
    decoding: scores added to object words) ranks the hypotheses (their score keeps it) and is taken off again
    here: log_prob and word_logps are the model's own. recorded: the caller's recorded searches of this decoder (a
    Captioner's on a GPU: captured.py), replayed off the CPU; None runs op by op."""
    settings.checked()  # config.DecodeConfig.LIMITS: one place for every setting's range
    rules = rules or Rules(ids, settings)
    if feats.device.type != "cpu":  # a GPU: fixed shapes, no host sync per step (device_beam.py; beam 1 = greedy)
        hyps = (captured.search(recorded, decoder, feats, ids, settings, rules) if recorded is not None else
                beam_search_on_device(decoder, feats, ids, settings, rules))
        if settings.beam_size == 1:
            with_greedy_scores(hyps)
    elif settings.beam_size == 1:  # on a CPU finished images leave the batch: the least work
        hyps = [[h] for h in greedy_decode(decoder, feats, ids, settings, rules)]
    else:
        hyps = beam_search(decoder, feats, ids, settings, rules)
    if rules.evidence is not None:
        _remove_bias(hyps, rules.evidence)
    return hyps


def _remove_bias(hyps: list[list[Hypothesis]], evidence: Evidence) -> None:
    """In place: each hypothesis's log_prob and word_logps without the bias the evidence added to its words, for
    every hypothesis of the batch at once (one table of biases, one read to the host)."""
    flat = [(image, h) for image, image_hyps in enumerate(hyps) for h in image_hyps]
    if not flat:
        return
    bias = evidence.word_biases([i for i, _ in flat], [h.tokens for _, h in flat]).float().cpu()  # (N, L)
    width = bias.shape[1]
    for (_, h), total in zip(flat, bias.double().sum(1).tolist()):
        h.log_prob -= total
    has_words = [n for n, (_, h) in enumerate(flat) if h.word_logps is not None]
    if not has_words:
        return
    at = torch.tensor([n * width + j for n in has_words for j in range(len(flat[n][1].tokens))], dtype=torch.long)
    words = torch.cat([flat[n][1].word_logps for n in has_words])  # (W,) every word's log-prob, flat
    fixed = (words - bias.view(-1)[at]).split([len(flat[n][1].tokens) for n in has_words])
    for n, lps in zip(has_words, fixed):
        flat[n][1].word_logps = lps
