"""Beam search with fixed shapes, for a GPU: the same search as search.beam_search, written so that the host
never waits for the device inside the loop.

search.beam_search drops finished images from the batch and keeps finished hypotheses in Python lists: every
step reads values back (which images are done, which rows just ended). On a CPU that costs nothing; on a GPU
each read waits for the queue, and one photo's caption was slower on an H100 than on a 2-core CPU (docs/history.md).
Here every image keeps its K rows to the end, an image that is done only stops adding hypotheses, and each
image's K best finished hypotheses live in device tensors (its ranking: search's, by normalised score). The
host reads `active.any()` once every `check_every` steps (to stop early) and the results once at the end.
With decoding/processors.py's masks (no nonzero()) a step is queued without a sync.

Legend: B images, K beams, N = B*K rows, T = max_len, P regions, V vocabulary.
tests/test_device_beam.py: the same hypotheses as search.beam_search (random decoders, and the bundled model
on real photos with its stored settings), and no host sync between checks.
"""
from __future__ import annotations

import torch

from ..config import DecodeConfig
from ..model.decoder import Decoder
from ..vocab import SpecialIds
from .evidence import Evidence
from .processors import Rules
from .hypotheses import History, Hypothesis, alive, candidates, normalise

NEG = float("-inf")


class _Finished:
    """Each image's K best finished hypotheses by normalised score, on the device: scores (B, K), raw log-probs
    (B, K), lengths (B, K), words (B, K, T), maps (B, K, T, P), gates (B, K, T), word log-probs (B, K, T)."""

    def __init__(self, B: int, K: int, T: int, P: int, like: torch.Tensor):
        self.norm = like.new_full((B, K), NEG)
        self.raw = like.new_full((B, K), NEG)
        self.length = torch.zeros(B, K, dtype=torch.long, device=like.device)
        self.tokens = torch.zeros(B, K, T, dtype=torch.long, device=like.device)
        self.alphas, self.betas, self.logps = like.new_zeros(B, K, T, P), like.new_zeros(B, K, T), like.new_zeros(B, K, T)

    def merge(self, hist: History, rows: torch.Tensor, raw: torch.Tensor, norm: torch.Tensor, ok: torch.Tensor) -> None:
        """Candidates: hist's rows `rows` (B, M) as they are, scores raw / norm (B, M) where ok (B, M)."""
        B, K, T = self.tokens.shape
        M, t = rows.shape[1], hist.tokens.shape[1]
        norm = norm.masked_fill(~ok, NEG)
        top = torch.cat([self.norm, norm], 1).topk(K, dim=1).indices  # (B, K): search keeps the K best by score
        pad = T - t
        cand = {"tokens": torch.nn.functional.pad(hist.tokens[rows], (0, pad)),  # (B, M, T)
                "alphas": torch.nn.functional.pad(hist.alphas[rows], (0, 0, 0, pad)),  # (B, M, T, P)
                "betas": torch.nn.functional.pad(hist.betas[rows], (0, pad)),
                "logps": torch.nn.functional.pad(hist.logps[rows].to(self.logps.dtype), (0, pad))}
        length = torch.full((B, M), t, dtype=torch.long, device=rows.device)
        for name, new in (("norm", norm), ("raw", raw.to(self.raw.dtype)), ("length", length), *cand.items()):
            both = torch.cat([getattr(self, name), new.to(getattr(self, name).dtype)], 1)  # (B, K + M, ...)
            index = top.view(B, K, *([1] * (both.dim() - 2))).expand(B, K, *both.shape[2:])
            setattr(self, name, both.gather(1, index))

    def hypotheses(self) -> list[list[Hypothesis]]:
        """Read back once: each image's finished hypotheses, best first."""
        norm, raw, length = self.norm.tolist(), self.raw.tolist(), self.length.tolist()  # (B, K) each
        words = self.tokens.tolist()  # (B, K, T)
        # on the host as arrays: each hypothesis's tensors are views of them, not an op each
        alphas, betas = self.alphas.float().cpu().numpy(), self.betas.float().cpu().numpy()  # (B, K, T, P), (B, K, T)
        logps = self.logps.float().cpu().numpy()  # (B, K, T)
        out: list[list[Hypothesis]] = []
        for b in range(len(norm)):
            out.append([Hypothesis(words[b][k][:n], torch.from_numpy(alphas[b, k, :n]), raw[b][k], norm[b][k],
                                   torch.from_numpy(betas[b, k, :n]), torch.from_numpy(logps[b, k, :n]))
                        for k in range(len(norm[b])) if norm[b][k] > NEG for n in [length[b][k]]])
        return out


def beam_search_on_device(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                          evidence: Evidence | None = None, check_every: int = 4, greedy_scores: bool = False
                          ) -> list[list[Hypothesis]]:
    """search.beam_search's hypotheses, with fixed shapes (module docstring): the search, then one read. With
    beam_size 1 these are greedy_decode's words; `greedy_scores` gives them its score too (the log-probability,
    not length-normalised)."""
    found = search_on_device(decoder, feats, ids, settings, evidence, check_every).hypotheses()
    if greedy_scores:
        for hyps in found:
            for h in hyps:
                h.score = h.log_prob
    return found


@torch.no_grad()
def search_on_device(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                     evidence: Evidence | None = None, check_every: int = 4) -> _Finished:
    """The search itself: each image's finished hypotheses, still on the device."""
    K, T, length_penalty = settings.beam_size, settings.max_len, settings.length_penalty
    (B, P, _), device = feats.shape, feats.device
    rank = torch.arange(2 * K, device=device)  # (2K,)
    images = torch.arange(B, device=device).repeat_interleave(K)  # (N,) the image of each row
    feat_proj, ctx_gates = decoder.attention.project(feats), decoder.context_gates(feats)  # (B, P, A), (B, P, 4H)
    h, c = (s[images] for s in decoder.init_state(feats))  # (N, H): K rows per image from the start ...
    cum = feats.new_full((B, K), NEG)
    cum[:, 0] = 0  # ... of which only the first is live at t = 0 (search's one row per image)
    cum = cum.view(-1)  # (N,)
    words = torch.full((B * K,), ids.start, dtype=torch.long, device=device)
    hist = History(torch.zeros(B * K, 0, dtype=torch.long, device=device), feats.new_zeros(B * K, 0, P),
                    feats.new_zeros(B * K, 0), torch.zeros(B * K, 0, device=device))
    finished = _Finished(B, K, T, P, feats.new_zeros(()))
    active = torch.ones(B, dtype=torch.bool, device=device)  # images still searching (search: still in the batch)
    rules = Rules(ids, settings, evidence)  # rules.word_logp, step by step
    said = rules.start(B * K)  # what the rules remember of each row
    for t in range(T):
        emb, emb_gates = decoder.embed(words)
        logits, alpha, beta, (h, c) = decoder.step((h, c), emb, emb_gates, feats, feat_proj, settings.hard_context,
                                                   ctx_gates)
        logp = rules.scores(logits, hist.tokens, said, images)  # (N, V)
        top_s, src, word, step_lp = candidates(cum, logp, B, K, K, ids.pad)  # (B, 2K) each
        is_end = word == ids.end
        ends = is_end & (rank < K) & (top_s > NEG) & active.unsqueeze(1)  # (B, 2K)
        finished.merge(hist, src, top_s, normalise(top_s, t + 1, length_penalty), ends)
        alive_s, alive_src, alive_word, alive_lp = alive(top_s, src, word, step_lp, is_end, rank, K)  # (B, K)
        if t == T - 1:  # cap: live hypotheses end here with the word they just chose
            capped = hist.extend(alive_src.reshape(-1), alive_word.reshape(-1), alpha, beta, alive_lp.reshape(-1))
            rows = torch.arange(B * K, device=device).view(B, K)
            finished.merge(capped, rows, alive_s, normalise(alive_s, t + 1, length_penalty),
                           (alive_s > NEG) & active.unsqueeze(1))
            break
        best_alive = alive_s[:, 0]  # (B,)
        best_k = finished.norm[:, K - 1]
        done = best_k > NEG if length_penalty else best_k >= best_alive
        active = active & ~(done | (best_alive == NEG))
        rows = alive_src.reshape(-1)  # (N,)
        words, cum = alive_word.reshape(-1), alive_s.reshape(-1).masked_fill(~active.repeat_interleave(K), NEG)
        hist = hist.extend(rows, words, alpha, beta, alive_lp.reshape(-1))
        said = rules.advance(said, words, rows)  # the rules' state follows the surviving rows, as hist does
        h, c = h[rows], c[rows]
        if (t + 1) % check_every == 0 and not bool(active.any()):  # the one read inside the loop
            break
    return finished
