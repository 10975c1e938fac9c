"""Beam search with fixed shapes, for a GPU: the same search as search.beam_search, written so that the host
never waits for the device inside the loop.

search.beam_search drops finished images from the batch and keeps finished hypotheses in Python lists: every
step reads values back (which images are done, which rows just ended). On a CPU that costs nothing; on a GPU
each read waits for the queue, and one photo's caption was slower on an H100 than on a 2-core CPU (docs/history.md).
Here every image keeps its K rows to the end, an image that is done only stops adding hypotheses, and each
image's K best finished hypotheses live in device tensors (its ranking: search's, by normalised score) as the
step and row each ends at: the maps, gates and words each step wrote are kept as written (the trail, not copied
into every row's history each step) and walked back once at the end. The host reads `active.any()` once every
`check_every` steps (to stop early) and the results once at the end.
With decoding/rules.py's masks (no nonzero()) a step is queued without a sync.

A step never writes a tensor it was given: it reads one _State and makes the next (_Search.step), so a run of
steps is a function from one state's tensors to the next's, which captured.py records as a CUDA graph chunk by
chunk (reading between chunks whether to go on) and replays.

Legend: B images, K beams, N = B*K rows, T = max_len, P regions, A attention size, H hidden size, V vocabulary.
tests/test_device_beam.py: the same hypotheses as search.beam_search (random decoders, and the bundled model
on real photos with its stored settings), and no host sync between checks.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import DecodeConfig
from ..model.decoder import Decoder
from ..vocab import SpecialIds
from .rules import RowState, Rules
from .hypotheses import Hypothesis, normalise, rank, searching, with_greedy_scores

NEG = float("-inf")
# what step s wrote: the source rows (N,) (the row after step s - 1 each row continues), its words (N,) and word
# log-probs (N,) (aligned with the rows after step s), its attention maps (N, P) and gates (N,) (aligned with the
# rows before it: the step computed them for those)
Step = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def walk(trail: tuple[Step, ...], rows: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Hypotheses ending at row rows[m] after step lengths[m] - 1 (M,) -> their words (M, S), maps (M, S, P),
    gates (M, S) and word log-probs (M, S), S the steps of the trail, zero after each one's end: the source rows
    walked from the step a hypothesis ends at back to its first."""
    M, S = len(rows), len(trail)
    like = trail[0][3] if S else torch.zeros(0, 0, device=rows.device)
    tokens = torch.zeros(M, S, dtype=torch.long, device=rows.device)
    alphas, betas = like.new_zeros(M, S, like.shape[-1]), like.new_zeros(M, S)
    logps = torch.zeros(M, S, device=rows.device)
    at = rows  # (M,) a row after step s, from the step a hypothesis ends at down to its first
    for s in reversed(range(S)):
        step_rows, step_words, step_logps, step_alphas, step_betas = trail[s]
        here = s < lengths  # (M,) hypotheses with a word at position s
        before = step_rows[at]  # (M,) the row each continued
        tokens[:, s] = torch.where(here, step_words[at], 0)
        logps[:, s] = torch.where(here, step_logps[at].float(), 0.0)
        alphas[:, s] = torch.where(here[:, None], step_alphas[before], 0.0)
        betas[:, s] = torch.where(here, step_betas[before], 0.0)
        at = torch.where(here, before, at)
    return tokens, alphas, betas, logps


Finished = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # scores, raw log-probs, lengths, rows (B, K)


def merge(finished: Finished, rows: torch.Tensor, length: int, raw: torch.Tensor, norm: torch.Tensor,
          ok: torch.Tensor) -> Finished:
    """Each image's K best finished hypotheses by normalised score (the ranking search keeps), with candidates
    ending at the trail's rows `rows` (B, M) after `length` words, scores raw / norm (B, M), where ok."""
    K = finished[0].shape[1]
    norm = norm.masked_fill(~ok, NEG)
    top = torch.cat([finished[0], norm], 1).topk(K, dim=1).indices  # (B, K)
    new = (norm, raw, torch.full_like(rows, length), rows)
    return tuple(torch.cat([old, x.to(old.dtype)], 1).gather(1, top) for old, x in zip(finished, new))  # type: ignore[return-value]


@dataclass(frozen=True)
class State:
    """Everything a search carries from one step to the next; a step makes a new one and writes none of these."""
    t: int  # steps taken
    capped: bool  # the search reached max_len: no step follows
    feat_proj: torch.Tensor  # (B, P, A): W_a a_i, once per search
    ctx_gates: torch.Tensor  # (B, P, 4H): W_z a_i, once per search
    images: torch.Tensor  # (N,) the image of each row
    rank: torch.Tensor  # (2K,) 0 .. 2K - 1
    h: torch.Tensor  # (N, H)
    c: torch.Tensor  # (N, H)
    cum: torch.Tensor  # (N,) each row's score, -inf where it is not live
    words: torch.Tensor  # (N,) each row's last word
    tokens: torch.Tensor  # (N, t): the words the rules read
    said: RowState  # what the rules remember of each row
    active: torch.Tensor  # (B,) images still searching (search: still in the batch)
    finished: Finished  # each image's K best finished hypotheses
    trail: tuple[Step, ...]  # what each step wrote

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the state, in one fixed order (captured.Rerun copies a replay's into the recorded)."""
        return (self.feat_proj, self.ctx_gates, self.images, self.rank, self.h, self.c, self.cum, self.words,
                self.tokens, *self.said.tensors(), self.active, *self.finished, *(x for step in self.trail for x in step))

    def walked(self) -> tuple[torch.Tensor, ...]:
        """Still on the device: each image's finished hypotheses as tensors, words (B*K, S), maps (B*K, S, P),
        gates (B*K, S), word log-probs (B*K, S), then scores, raw log-probs and lengths (B, K) (read_back reads
        them)."""
        norm, raw, length, row = self.finished
        return (*walk(self.trail, row.view(-1), length.view(-1)), norm, raw, length)

    def hypotheses(self) -> list[list[Hypothesis]]:
        """Read back once: each image's finished hypotheses, best first."""
        return read_back(self.walked())


class Search:
    """One search's fixed parts (decoder, features, ids, settings, the decode's Rules with its evidence; None:
    settings' rules without a lexicon or evidence) and its steps."""

    def __init__(self, decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                 rules: Rules | None = None):
        self.decoder, self.feats, self.ids, self.settings = decoder, feats, ids, settings
        self.K, self.T, self.length_penalty = settings.beam_size, settings.max_len, settings.length_penalty
        self.rules = rules or Rules(ids, settings)

    def start(self) -> State:
        """No word yet: K rows per image, of which only the first is live (search's one row per image at t = 0)."""
        d, K, feats = self.decoder, self.K, self.feats
        (B, _, _), device = feats.shape, feats.device
        images = torch.arange(B, device=device).repeat_interleave(K)  # (N,)
        h, c = (s[images] for s in d.init_state(feats))  # (N, H)
        cum = feats.new_full((B, K), NEG)
        cum[:, 0] = 0
        finished = (feats.new_full((B, K), NEG), feats.new_full((B, K), NEG),
                    torch.zeros(B, K, dtype=torch.long, device=device), torch.zeros(B, K, dtype=torch.long, device=device))
        return State(0, False, d.attention.project(feats), d.context_gates(feats), images,
                     torch.arange(2 * K, device=device), h, c, cum.view(-1),
                     torch.full((B * K,), self.ids.start, dtype=torch.long, device=device),
                     torch.zeros(B * K, 0, dtype=torch.long, device=device), self.rules.start(B * K),
                     torch.ones(B, dtype=torch.bool, device=device), finished, ())

    def advance(self, state: State, steps: int) -> State:
        """Up to `steps` steps from `state` (fewer where max_len comes first)."""
        for _ in range(steps):
            if state.capped:
                break
            state = self.step(state)
        return state

    def step(self, s: State) -> State:
        """One word for every row: the next state."""
        d, K, T, t = self.decoder, self.K, self.T, s.t
        B, lp = s.active.shape[0], self.length_penalty
        emb, emb_gates = d.embed(s.words)
        logits, alpha, beta, (h, c) = d.step((s.h, s.c), emb, emb_gates, self.feats, s.feat_proj,
                                             self.settings.hard_context, s.ctx_gates)
        logp = self.rules.scores(logits, s.tokens, s.said, s.images)  # (N, V)
        r = rank(s.cum, logp, B, K, s.rank, t, lp, self.ids.pad, self.ids.end)
        ends = r.ends & s.active.unsqueeze(1)  # (B, 2K): of images still searching
        finished = merge(s.finished, r.src, t, r.scores, r.normed, ends)  # their t words before <end>
        alive_s, alive_src, alive_word, alive_lp = r.alive_scores, r.alive_src, r.alive_words, r.alive_logps
        if t == T - 1:  # cap: live hypotheses end here with the word they just chose
            trail = s.trail + ((alive_src.reshape(-1), alive_word.reshape(-1), alive_lp.reshape(-1), alpha, beta),)
            finished = merge(finished, torch.arange(B * K, device=s.cum.device).view(B, K), T, alive_s,
                             normalise(alive_s, t + 1, lp), (alive_s > NEG) & s.active.unsqueeze(1))
            return replace(s, t=T, capped=True, finished=finished, trail=trail)
        active = s.active & searching(finished[0][:, K - 1], alive_s[:, 0], lp)  # (B,)
        rows = alive_src.reshape(-1)  # (N,)
        words, cum = alive_word.reshape(-1), alive_s.reshape(-1).masked_fill(~active.repeat_interleave(K), NEG)
        return replace(s, t=t + 1, h=h[rows], c=c[rows], cum=cum, words=words,
                       tokens=torch.cat([s.tokens[rows], words[:, None]], 1),  # (N, t + 1)
                       said=self.rules.advance(s.said, words, rows),  # the rules' state follows the surviving rows
                       active=active, finished=finished,
                       trail=s.trail + ((rows, words, alive_lp.reshape(-1), alpha, beta),))


def read_back(walked: tuple[torch.Tensor, ...]) -> list[list[Hypothesis]]:
    """State.walked's tensors -> each image's finished hypotheses, best first: the search's one read."""
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
                          rules: Rules | None = None, check_every: int | None = 4, greedy_scores: bool = False
                          ) -> list[list[Hypothesis]]:
    """search.beam_search's hypotheses, with fixed shapes (module docstring): the search, then one read. With
    beam_size 1 these are greedy decoding's words; `greedy_scores` gives them its score too (the log-probability,
    not length-normalised: hypotheses.with_greedy_scores)."""
    found = search_on_device(decoder, feats, ids, settings, rules, check_every).hypotheses()
    return with_greedy_scores(found) if greedy_scores else found


@torch.no_grad()
def search_on_device(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                     rules: Rules | None = None, check_every: int | None = 4) -> State:
    """The search itself: its last state, each image's finished hypotheses still on the device. check_every None:
    all max_len steps without a read (the same hypotheses: an image that is done adds none)."""
    search = Search(decoder, feats, ids, settings, rules)
    state = search.start()
    while not state.capped:
        state = search.advance(state, check_every or settings.max_len)
        if check_every and not state.capped and not bool(state.active.any()):  # the one read inside the loop
            break
    return state
