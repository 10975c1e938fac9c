"""Beam search with fixed shapes, for a GPU: the same search as search.beam_search, written so that the host
never waits for the device inside the loop.

search.beam_search drops finished images from the batch and keeps finished hypotheses in Python lists: every
step reads values back (which images are done, which rows just ended). On a CPU that costs nothing; on a GPU
each read waits for the queue, and one photo's caption was slower on an H100 than on a 2-core CPU (docs/history.md).
Here every image keeps its K rows to the end, an image that is done only stops adding hypotheses, and each
image's K best finished hypotheses live in device tensors (its ranking: search's, by normalised score) as the
step and row each ends at: the maps, gates and words each step wrote are kept as written (_Trail, not copied into
every row's history each step) and walked back once at the end. The host reads `active.any()` once every
`check_every` steps (to stop early) and the results once at the end.
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
from .hypotheses import Hypothesis, alive, candidates, normalise

NEG = float("-inf")


class _Trail:
    """What each step wrote, kept as written instead of copied into every row's history each step: step s's source
    rows (N,) (the row after step s - 1 each row continues), its words (N,) and word log-probs (N,) (aligned with the
    rows after step s), its attention maps (N, P) and gates (N,) (aligned with the rows before it: the step
    computed them for those). A hypothesis is read back once, at the end, by walking the source rows from its last
    step to its first (walk)."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.words: list[torch.Tensor] = []
        self.logps: list[torch.Tensor] = []
        self.alphas: list[torch.Tensor] = []
        self.betas: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor, words: torch.Tensor, logp: torch.Tensor, alpha: torch.Tensor,
            beta: torch.Tensor) -> None:
        for store, x in ((self.rows, rows), (self.words, words), (self.logps, logp), (self.alphas, alpha),
                         (self.betas, beta)):
            store.append(x)

    def walk(self, rows: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Hypotheses ending at row rows[m] after step lengths[m] - 1 (M,) -> their words (M, S), maps (M, S, P),
        gates (M, S) and word log-probs (M, S), S the steps taken, zero after each one's end."""
        M, S = len(rows), len(self.rows)
        like = self.alphas[0] if S else torch.zeros(0, 0, device=rows.device)
        tokens = torch.zeros(M, S, dtype=torch.long, device=rows.device)
        alphas, betas = like.new_zeros(M, S, like.shape[-1]), like.new_zeros(M, S)
        logps = torch.zeros(M, S, device=rows.device)
        at = rows  # (M,) a row after step s, from the step a hypothesis ends at down to its first
        for s in reversed(range(S)):
            here = s < lengths  # (M,) hypotheses with a word at position s
            before = self.rows[s][at]  # (M,) the row each continued
            tokens[:, s] = torch.where(here, self.words[s][at], 0)
            logps[:, s] = torch.where(here, self.logps[s][at].float(), 0.0)
            alphas[:, s] = torch.where(here[:, None], self.alphas[s][before], 0.0)
            betas[:, s] = torch.where(here, self.betas[s][before], 0.0)
            at = torch.where(here, before, at)
        return tokens, alphas, betas, logps


class _Finished:
    """Each image's K best finished hypotheses by normalised score, on the device: scores (B, K), raw log-probs
    (B, K), lengths (B, K) and the row of the trail (_Trail) each ends at after its last word (B, K)."""

    def __init__(self, B: int, K: int, like: torch.Tensor, trail: _Trail):
        self.norm = like.new_full((B, K), NEG)
        self.raw = like.new_full((B, K), NEG)
        self.length = torch.zeros(B, K, dtype=torch.long, device=like.device)
        self.row = torch.zeros(B, K, dtype=torch.long, device=like.device)
        self.trail = trail

    def merge(self, rows: torch.Tensor, length: int, raw: torch.Tensor, norm: torch.Tensor, ok: torch.Tensor) -> None:
        """Candidates: the trail's rows `rows` (B, M) after `length` words, scores raw / norm (B, M) where ok."""
        B, K = self.norm.shape
        norm = norm.masked_fill(~ok, NEG)
        top = torch.cat([self.norm, norm], 1).topk(K, dim=1).indices  # (B, K): search keeps the K best by score
        for name, new in (("norm", norm), ("raw", raw), ("length", torch.full_like(rows, length)), ("row", rows)):
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, new.to(old.dtype)], 1).gather(1, top))  # (B, K)

    def walked(self) -> tuple[torch.Tensor, ...]:
        """Still on the device: each image's finished hypotheses as tensors, words (B*K, S), maps (B*K, S, P),
        gates (B*K, S), word log-probs (B*K, S), then scores, raw log-probs and lengths (B, K) (read_back reads
        them; captured.py replays the whole search into them)."""
        tokens, alphas, betas, logps = self.trail.walk(self.row.view(-1), self.length.view(-1))  # (B*K, S, ...)
        return tokens, alphas, betas, logps, self.norm, self.raw, self.length

    def hypotheses(self) -> list[list[Hypothesis]]:
        """Read back once: each image's finished hypotheses, best first."""
        return read_back(self.walked())


def read_back(walked: tuple[torch.Tensor, ...]) -> list[list[Hypothesis]]:
    """_Finished.walked's tensors -> each image's finished hypotheses, best first: the search's one read."""
    tokens, alphas, betas, logps, norm, raw, length = walked
    (B, K), S = norm.shape, tokens.shape[1]
    norm, raw, length = norm.tolist(), raw.tolist(), length.tolist()  # (B, K) each
    words = tokens.view(B, K, S).tolist()  # (B, K, S)
    # on the host as arrays: each hypothesis's tensors are views of them, not an op each
    alphas = alphas.float().cpu().numpy().reshape(B, K, *alphas.shape[1:])  # (B, K, S, P)
    betas, logps = betas.float().cpu().numpy().reshape(B, K, -1), logps.cpu().numpy().reshape(B, K, -1)
    out: list[list[Hypothesis]] = []
    for b in range(B):
        out.append([Hypothesis(words[b][k][:n], torch.from_numpy(alphas[b, k, :n]), raw[b][k], norm[b][k],
                               torch.from_numpy(betas[b, k, :n]), torch.from_numpy(logps[b, k, :n]))
                    for k in range(K) if norm[b][k] > NEG for n in [length[b][k]]])
    return out


def beam_search_on_device(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                          evidence: Evidence | None = None, check_every: int | None = 4, greedy_scores: bool = False
                          ) -> list[list[Hypothesis]]:
    """search.beam_search's hypotheses, with fixed shapes (module docstring): the search, then one read. With
    beam_size 1 these are greedy_decode's words; `greedy_scores` gives them its score too (the log-probability,
    not length-normalised)."""
    found = search_on_device(decoder, feats, ids, settings, evidence, check_every).hypotheses()
    return with_greedy_scores(found) if greedy_scores else found


def with_greedy_scores(found: list[list[Hypothesis]]) -> list[list[Hypothesis]]:
    """In place and returned: each hypothesis scored by its log-probability, as greedy_decode scores its one."""
    for hyps in found:
        for h in hyps:
            h.score = h.log_prob
    return found


@torch.no_grad()
def search_on_device(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                     evidence: Evidence | None = None, check_every: int | None = 4) -> _Finished:
    """The search itself: each image's finished hypotheses, still on the device. check_every None: all max_len
    steps without a read (what a captured search needs; the same hypotheses: an image that is done adds none)."""
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
    tokens = torch.zeros(B * K, 0, dtype=torch.long, device=device)  # (N, t): the words the rules read
    trail = _Trail()
    finished = _Finished(B, K, feats.new_zeros(()), trail)
    active = torch.ones(B, dtype=torch.bool, device=device)  # images still searching (search: still in the batch)
    rules = Rules(ids, settings, evidence)  # rules.word_logp, step by step
    said = rules.start(B * K)  # what the rules remember of each row
    for t in range(T):
        emb, emb_gates = decoder.embed(words)
        logits, alpha, beta, (h, c) = decoder.step((h, c), emb, emb_gates, feats, feat_proj, settings.hard_context,
                                                   ctx_gates)
        logp = rules.scores(logits, tokens, said, images)  # (N, V)
        top_s, src, word, step_lp = candidates(cum, logp, B, K, K, ids.pad)  # (B, 2K) each
        is_end = word == ids.end
        ends = is_end & (rank < K) & (top_s > NEG) & active.unsqueeze(1)  # (B, 2K)
        finished.merge(src, t, top_s, normalise(top_s, t + 1, length_penalty), ends)  # their t words before <end>
        alive_s, alive_src, alive_word, alive_lp = alive(top_s, src, word, step_lp, is_end, rank, K)  # (B, K)
        if t == T - 1:  # cap: live hypotheses end here with the word they just chose
            trail.add(alive_src.reshape(-1), alive_word.reshape(-1), alive_lp.reshape(-1), alpha, beta)
            finished.merge(torch.arange(B * K, device=device).view(B, K), T, alive_s,
                           normalise(alive_s, t + 1, length_penalty), (alive_s > NEG) & active.unsqueeze(1))
            break
        best_alive = alive_s[:, 0]  # (B,)
        best_k = finished.norm[:, K - 1]
        done = best_k > NEG if length_penalty else best_k >= best_alive
        active = active & ~(done | (best_alive == NEG))
        rows = alive_src.reshape(-1)  # (N,)
        words, cum = alive_word.reshape(-1), alive_s.reshape(-1).masked_fill(~active.repeat_interleave(K), NEG)
        trail.add(rows, words, alive_lp.reshape(-1), alpha, beta)
        tokens = torch.cat([tokens[rows], words[:, None]], 1)  # (N, t + 1)
        said = rules.advance(said, words, rows)  # the rules' state follows the surviving rows, as tokens do
        h, c = h[rows], c[rows]
        if check_every and (t + 1) % check_every == 0 and not bool(active.any()):  # the one read inside the loop
            break
    return finished
