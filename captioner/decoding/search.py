"""Beam search batched over images and beams; greedy decoding is its beam 1. `decode` is how captions are decoded:
beam_search on a CPU (finished images leave the batch), device_beam's fixed-shape search elsewhere. The rules and
the evidence are rules.py's (Rules, built once by the caller); every search steps through Decoder.step. A hypothesis
without <end> after max_len words is finished as it is (capped): decoding always returns a caption.
Legend: B images, K beam size, n live images, N live rows (image x beam), t words so far, P regions, D feature dim.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import DecodeConfig
from ..model.graphs import Recordings
from . import device_beam
from .device_beam import NEG, Hypothesis, normalise, rank, searching, with_greedy_scores
from .rules import Evidence, Rules
from ..vocab import SpecialIds
from ..model.decoder import Decoder


@dataclass
class History:
    """The CPU beam's live rows so far: words (N, t), attention maps (N, t, P), gates (N, t), word log-probs (N, t)."""
    tokens: torch.Tensor
    alphas: torch.Tensor
    betas: torch.Tensor
    logps: torch.Tensor

    def extend(self, rows: torch.Tensor, words: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
               logp: torch.Tensor) -> "History":
        return History(torch.cat([self.tokens[rows], words.unsqueeze(1)], 1),
                        torch.cat([self.alphas[rows], alpha[rows].unsqueeze(1)], 1),
                        torch.cat([self.betas[rows], beta[rows].unsqueeze(1)], 1),
                        torch.cat([self.logps[rows], logp.float().unsqueeze(1)], 1))

    def finish(self, finished: list[list[Hypothesis]], image_ids: torch.Tensor, top_s: torch.Tensor, src: torch.Tensor,
               norm: torch.Tensor, ends: list[tuple[int, int]]) -> None:
        """The hypotheses ending now, ends = [(image row g, candidate j)] of the step's (n, 2K) candidates, join
        their image's finished list (one read per table, one gather per table)."""
        if not ends:
            return
        images, rows, scores, normed = image_ids.tolist(), src.tolist(), top_s.tolist(), norm.tolist()
        at = torch.tensor([rows[g][j] for g, j in ends], dtype=torch.long, device=self.tokens.device)  # (M,)
        tokens, logps = self.tokens[at].tolist(), self.logps[at].cpu().unbind(0)  # (M, t) each
        alphas, betas = self.alphas[at].unbind(0), self.betas[at].unbind(0)  # (M, t, P), (M, t)
        for (g, j), words, alpha, beta, lp in zip(ends, tokens, alphas, betas, logps):
            finished[images[g]].append(Hypothesis(words, alpha, scores[g][j], normed[g][j], beta, lp))


@torch.no_grad()
def beam_search(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                rules: Rules | None = None) -> list[list[Hypothesis]]:
    """feats (B, P, D), the decode's Rules (None: settings' without lexicon or evidence) -> each image's finished
    hypotheses, best first (up to beam_size); scores include the evidence's bonus. All live images x K beams are
    one batch of rows; an image leaves it once no live hypothesis can beat its K finished ones."""
    K, max_len, length_penalty = settings.beam_size, settings.max_len, settings.length_penalty
    (B, P, _), device = feats.shape, feats.device
    rank_2k, G = torch.arange(2 * K, device=device), 1  # (2K,); G rows (image, beam) per image: 1 at t=0, then K
    rules = rules or Rules(ids, settings)
    said = rules.start(B)  # what the rules remember of each live row
    feat_proj = decoder.attention.project(feats)  # (n, P, A)
    # (n, P, 4H) W_z a_i, or None (each step multiplies its rows by W_z): the table pays with K > 1 rows per image or
    # one image; greedy over a batch multiplies its rows faster (docs/performance.md)
    ctx_gates = decoder.context_gates(feats) if K > 1 or B == 1 else None
    h, c = decoder.init_state(feats)  # (N, H)
    cum = feats.new_zeros(B)  # (N,) cumulative log-prob of each row
    words = torch.full((B,), ids.start, dtype=torch.long, device=device)
    hist = History(torch.zeros(B, 0, dtype=torch.long, device=device), feats.new_zeros(B, 0, P), feats.new_zeros(B, 0),
                    torch.zeros(B, 0, device=device))
    image_ids = torch.arange(B, device=device)  # (n,) original id of each live image
    best_finished = torch.full((B, K), NEG, device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    for t in range(max_len):
        n = len(image_ids)
        emb, emb_gates = decoder.embed(words)
        logits, alpha, beta, (h, c) = decoder.step((h, c), emb, emb_gates, feats, feat_proj, settings.hard_context,
                                                   ctx_gates)
        r = rank(cum, rules.scores(logits, hist.tokens, said, image_ids.repeat_interleave(G, 0)), n, G, rank_2k, t,
                 length_penalty, ids.pad, ids.end)
        top_s, src, fin, norm = r.scores, r.src, r.ends, r.normed  # (n, 2K) each
        best_finished = torch.cat([best_finished[:n], norm.masked_fill(~fin, NEG)], 1).topk(K, dim=1).values  # (n, K)
        alive_s, alive_src, alive_word, alive_lp = r.alive_scores, r.alive_src, r.alive_words, r.alive_logps
        if t == max_len - 1:  # cap: live hypotheses end here with the word they just chose
            hist.finish(finished, image_ids, top_s, src, norm, fin.nonzero().tolist())
            capped = hist.extend(alive_src.reshape(-1), alive_word.reshape(-1), alpha, beta, alive_lp.reshape(-1))
            rows = torch.arange(alive_s.numel(), device=device).view_as(alive_s)  # (n, K): the capped rows
            capped.finish(finished, image_ids, alive_s, rows, normalise(alive_s, t + 1, length_penalty),
                          (alive_s > NEG).nonzero().tolist())
            break
        going = searching(best_finished[:, K - 1], alive_s[:, 0], length_penalty)  # (n,) live images that go on
        at, width = torch.cat([fin.flatten(), going]).nonzero().squeeze(1).tolist(), fin.numel()  # the one read a step
        hist.finish(finished, image_ids, top_s, src, norm, [divmod(i, 2 * K) for i in at if i < width])
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


def decode(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
           rules: Rules | None = None, recorded: Recordings | None = None) -> list[list[Hypothesis]]:
    """feats (B, P, D) -> each image's hypotheses, best first (captions, evaluation, SCST's greedy baseline).
    beam_size 1 is greedy decoding, scored by its log-probability. The evidence's bonus ranks the hypotheses (their
    score keeps it) and is taken off again: log_prob and word_logps are the model's own. recorded: the caller's
    recorded searches (a Captioner's on a GPU), replayed off the CPU; None runs op by op."""
    settings.checked()  # config.DecodeConfig.LIMITS
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
    """Each hypothesis's log_prob and word_logps without the evidence's bias (one table of biases, one read)."""
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
