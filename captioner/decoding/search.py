"""Beam search, batched over images and beams; greedy decoding is its beam 1.

Legend: B images, K beam size, N live rows (image x beam), P regions, D feature dim, V vocabulary.

Captions decode through `decode(decoder, feats, ids, settings)`: the special token ids and a DecodeConfig
(config.decode: beam size, maximum length, length penalty, <unk> and trigram rules, a hard model's
context); it picks beam_search or device_beam's search by device, and with beam_size 1 scores the one
hypothesis by its log-probability (greedy's score: with_greedy_scores). SCST's greedy baseline
(training/objectives.py) is decode() with beam 1 and no rule; the benchmark (bench/inference.py) takes a search
directly. This module reads the search settings (beam_size, max_len,
length_penalty, hard_context; photo.py's explain reads hard_context too); the rules on which word may come
next (block_*, the evidence's veto and bonus) are rules.py's (Rules: built once by the caller, applied step by step);
forbid_unk is read by the callers of vocab.SpecialIds.of (captions.py, training/objectives.py,
bench/inference.py), evidence* and person_floor by rules.py.

All step through Decoder.step, the step teacher-forced training, sampling and explain run too (the table
in decoding/__init__.py says which path runs where, and which test proves it equal to the equations).
A hypothesis that has not emitted <end> after max_len words is finished as it is (capped), so decoding
always terminates and always returns a caption. A hard-attention decoder attends as settings.hard_context
says (the expected context, or the argmax location).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import DecodeConfig
from . import device_beam
from .device_beam import Hypothesis, normalise, rank, searching, with_greedy_scores
from .rules import Evidence, Rules
from ..vocab import SpecialIds
from ..model.decoder import Decoder


@dataclass
class History:
    """Words, attention maps, gates and word log-probs of every live beam row so far: (N, t), (N, t, P),
    (N, t), (N, t)."""
    tokens: torch.Tensor
    alphas: torch.Tensor
    betas: torch.Tensor
    logps: torch.Tensor

    def extend(self, rows: torch.Tensor, words: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
               logp: torch.Tensor) -> "History":
        """rows (M,) source rows, words (M,) and their log-probs logp (M,); alpha, beta indexed by rows."""
        return History(torch.cat([self.tokens[rows], words.unsqueeze(1)], 1),
                        torch.cat([self.alphas[rows], alpha[rows].unsqueeze(1)], 1),
                        torch.cat([self.betas[rows], beta[rows].unsqueeze(1)], 1),
                        torch.cat([self.logps[rows], logp.float().unsqueeze(1)], 1))

    def hypotheses(self, rows: list[int], log_probs: list[float], scores: list[float]) -> list[Hypothesis]:
        """The rows `rows` finished as they are, with their log-probs and scores: one gather per table, not one
        per hypothesis."""
        if not rows:
            return []
        at = torch.tensor(rows, dtype=torch.long, device=self.tokens.device)  # (M,)
        tokens, logps = self.tokens[at].tolist(), self.logps[at].cpu().unbind(0)  # (M, t) each
        alphas, betas = self.alphas[at].unbind(0), self.betas[at].unbind(0)  # (M, t, P), (M, t)
        return [Hypothesis(*h) for h in zip(tokens, alphas, log_probs, scores, betas, logps)]


@torch.no_grad()
def beam_search(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                rules: Rules | None = None) -> list[list[Hypothesis]]:
    """feats (B, P, D), the decode's Rules (None: settings' rules without a lexicon or evidence) -> for each image,
    its finished hypotheses best first (up to settings.beam_size). Scores include the evidence's bonus.

    All live images x K beams are one batch of rows. Each step scores the K*V continuations of
    every image at once (tensor ops, no loop over images), keeps the best 2K, records those that
    end in <end> and rank within the top K as finished, and keeps the best K others alive. An image
    leaves the batch when K finished hypotheses cannot be beaten by a live one (exact with
    length_penalty=0, since log-probabilities only decrease; with a penalty, once K have finished),
    or at max_len, where its live hypotheses are finished as they are (capped). With K = 1 this is greedy
    decoding: each step keeps the best word, and an image leaves when that word is <end>.
    """
    K, max_len, length_penalty = settings.beam_size, settings.max_len, settings.length_penalty
    (B, P, _), device = feats.shape, feats.device
    rank_2k, G = torch.arange(2 * K, device=device), 1  # (2K,); G rows (image, beam) per image: 1 at t=0, then K
    feat_proj = decoder.attention.project(feats)  # (n, P, A)
    ctx_gates = _context_table(decoder, feats, K)  # (n, P, 4H) W_z a_i, or None
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
        r = rank(cum, rules.scores(logits, hist.tokens, said, image_ids.repeat_interleave(G, 0)), n, G, rank_2k, t,
                 length_penalty, ids.pad, ids.end)
        top_s, src, fin, norm = r.scores, r.src, r.ends, r.normed  # (n, 2K) each
        best_finished = _best_finished(best_finished[:n], norm, fin)  # (n, K)
        alive_s, alive_src, alive_word, alive_lp = r.alive_scores, r.alive_src, r.alive_words, r.alive_logps
        if t == max_len - 1:  # cap: live hypotheses end here with the word they just chose
            _record_finished(finished, hist, image_ids, top_s, src, norm, fin.nonzero().tolist())
            capped = hist.extend(alive_src.reshape(-1), alive_word.reshape(-1), alpha, beta, alive_lp.reshape(-1))
            rows = torch.arange(alive_s.numel(), device=device).view_as(alive_s)  # (n, K): the capped rows
            _record_finished(finished, capped, image_ids, alive_s, rows, normalise(alive_s, t + 1, length_penalty),
                             (alive_s > float("-inf")).nonzero().tolist())
            break
        going = searching(best_finished[:, K - 1], alive_s[:, 0], length_penalty)  # (n,) live images that go on
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
            feats, feat_proj = feats[keep], feat_proj[keep]
            ctx_gates = ctx_gates if ctx_gates is None else ctx_gates[keep]
        image_ids, best_finished = image_ids[keep], best_finished[keep]
    return [sorted(f, key=lambda hyp: -hyp.score)[:K] for f in finished]


def _context_table(decoder: Decoder, feats: torch.Tensor, K: int) -> torch.Tensor | None:
    """W_z a_i (n, P, 4H), or None (each step multiplies its rows by W_z): the table pays where a step's product
    has few rows and reads all of W_z for them, K > 1 rows per image or one image's one row; greedy over a batch
    multiplies its rows faster than it builds a table per image (docs/performance.md, measured)."""
    return decoder.context_gates(feats) if K > 1 or feats.shape[0] == 1 else None


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
           rules: Rules | None = None, recorded: device_beam.Recordings | None = None) -> list[list[Hypothesis]]:
    """How captions are decoded (captions.py, evaluation, validation, SCST's greedy baseline): feats (B, P, D) ->
    for each image its hypotheses, best first. One beam search: on a CPU beam_search (finished images leave the
    batch), off it the fixed-shape search; beam_size 1 is greedy decoding (one hypothesis per image, scored by its
    log-probability). rules: the decode's Rules (rules.py; None: settings' rules without a lexicon or evidence),
    built once and handed to the search. The evidence's bonus (evidence-aware decoding: scores added to the object
    words the heads see; its veto bans words, a ban adds nothing to a score) ranks the hypotheses (their score keeps
    it) and is taken off again here: log_prob and word_logps are
    the model's own. recorded: the caller's recorded searches of this decoder (a Captioner's on a GPU:
    device_beam.py), replayed off the CPU; None runs op by op."""
    settings.checked()  # config.DecodeConfig.LIMITS: one place for every setting's range
    rules = rules or Rules(ids, settings)
    if feats.device.type == "cpu":  # finished images leave the batch: the least work on a CPU
        hyps = beam_search(decoder, feats, ids, settings, rules)
    else:  # a GPU: fixed shapes, no host sync per step (device_beam.py)
        hyps = (device_beam.search(recorded, decoder, feats, ids, settings, rules) if recorded is not None else
                device_beam.beam_search_on_device(decoder, feats, ids, settings, rules))
    if settings.beam_size == 1:
        hyps = with_greedy_scores(hyps)
    return hyps if rules.evidence is None else _without_bias(hyps, rules.evidence)


def _without_bias(hyps: list[list[Hypothesis]], evidence: Evidence) -> list[list[Hypothesis]]:
    """Each hypothesis with its log_prob and word_logps without the bias the evidence added to its words (its
    score keeps it), for every hypothesis of the batch at once (one table of biases, one read to the host)."""
    flat = [(image, h) for image, image_hyps in enumerate(hyps) for h in image_hyps]
    if not flat:
        return hyps
    bias = evidence.word_biases([i for i, _ in flat], [h.tokens for _, h in flat]).float().cpu()  # (N, L)
    width = bias.shape[1]
    lps: list[torch.Tensor | None] = [h.word_logps for _, h in flat]
    has_words = [n for n, lp in enumerate(lps) if lp is not None]
    if has_words:
        at = torch.tensor([n * width + j for n in has_words for j in range(len(flat[n][1].tokens))], dtype=torch.long)
        words = torch.cat([lps[n] for n in has_words])  # (W,) every word's log-prob, flat
        for n, fixed in zip(has_words, (words - bias.view(-1)[at]).split([len(flat[n][1].tokens) for n in has_words])):
            lps[n] = fixed
    out = iter([replace(h, log_prob=h.log_prob - total, word_logps=lp)
                for (_, h), total, lp in zip(flat, bias.double().sum(1).tolist(), lps)])
    return [[next(out) for _ in image_hyps] for image_hyps in hyps]
