"""The search on a device: what both beam searches share (Hypothesis, `rank`, the stopping rule `searching`), the
fixed-shape beam search for a GPU, and that search and the encoder replayed as CUDA graphs (model/graphs.py).
Legend: B images, K beams, n images, G rows per image, N rows, T max_len, P regions, V vocabulary, C categories.

Fixed shapes (search.beam_search reads the host every step, which waits for a GPU's queue): every image keeps its
K rows to the end, its K best finished hypotheses stay on the device (the step and row each ends at), and each
step's words, maps and gates are kept as written (the trail), walked back once at the end. The host reads
`active.any()` every `check_every` steps. A step never writes a tensor it was given (State -> State).

Recorded (`search`, `encode`): one launch instead of ~170 a step. The search is recorded in chunks (CHECKS), each
with the walk after it; a call copies its inputs into static buffers, replays chunks until no photo searches and
reads the outputs under a lock. One recording per padded batch size (`bucket`), dtype and settings; weights and
the rules' tables stay put (weights_key, rules.tables_of); one that fails warns and runs op by op.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

import torch

from ..config import DecodeConfig
from ..model.decoder import Decoder
from ..model.graphs import Recordings, bucket, pad_rows, weights_key
from ..vocab import SpecialIds
from .rules import RowState, Rules

NEG = float("-inf")


@dataclass(frozen=True)
class Hypothesis:
    """A finished caption of the search, a value."""
    __hash__ = None  # its tensors: compared by value, never a dict key
    tokens: list[int]  # word ids, without <start>/<end>
    alphas: torch.Tensor  # (len(tokens), P): attention of each word
    log_prob: float  # sum of log-probabilities of the words (and of <end> when it was emitted)
    score: float  # log_prob after length normalisation (what the ranking uses)
    betas: torch.Tensor | None = None  # (len(tokens),): gate beta of each word
    # (len(tokens),) float32: each word's log-probability when chosen; None: unknown
    word_logps: torch.Tensor | None = None


def normalise(log_prob: float | torch.Tensor, length: int, length_penalty: float) -> float | torch.Tensor:
    """The ranking score: log_prob / length ** length_penalty (a number or a tensor)."""
    return log_prob / (max(length, 1) ** length_penalty) if length_penalty else log_prob


def with_greedy_scores(found: list[list[Hypothesis]]) -> list[list[Hypothesis]]:
    """Each hypothesis scored by its log-probability (greedy decoding's score)."""
    return [[replace(h, score=h.log_prob) for h in hyps] for hyps in found]


class Ranked(NamedTuple):
    """One step's candidates: each image's 2K best continuations, best first, and the K of them that stay alive."""
    scores: torch.Tensor  # (n, 2K) cumulative log-probs
    src: torch.Tensor  # (n, 2K) the row each continues
    ends: torch.Tensor  # (n, 2K) hypotheses that end now: <end> within the top K, and possible
    normed: torch.Tensor  # (n, 2K) scores normalised for t words + <end>
    alive_scores: torch.Tensor  # (n, K), in rank order
    alive_src: torch.Tensor  # (n, K)
    alive_words: torch.Tensor  # (n, K)
    alive_logps: torch.Tensor  # (n, K) each word's own log-prob


def rank(cum: torch.Tensor, logp: torch.Tensor, n: int, G: int, rank_2k: torch.Tensor, t: int, length_penalty: float,
         pad: int, end: int) -> Ranked:
    """Rows' scores cum (N,), the step's scores logp (N, V) of n images x G rows after t words, rank_2k = arange(2K)
    -> the step's Ranked candidates. Each of the G <= K rows has one <end> among the 2K: K of them do not end."""
    K, V = rank_2k.shape[0] // 2, logp.shape[1]
    cand = (cum.unsqueeze(1) + logp).view(n, G * V)  # (n, G*V)
    if G * V < 2 * K:  # a vocabulary smaller than 2K words: pad with impossible candidates
        cand = torch.nn.functional.pad(cand, (0, 2 * K - G * V), value=NEG)
    top_s, top_i = cand.topk(2 * K, dim=1)  # (n, 2K)
    src = torch.arange(n, device=cum.device).unsqueeze(1) * G + (top_i // V).clamp(max=G - 1)  # (n, 2K)
    word = torch.where(top_i < G * V, top_i % V, pad)  # (n, 2K)
    step_lp, is_end = logp[src, word], word == end  # (n, 2K)
    ends = is_end & (rank_2k < K) & (top_s > NEG)  # (n, 2K)
    keep = (~is_end).float() * (2 * K - rank_2k)  # prefer non-end, then better rank
    pos = keep.topk(K, dim=1).indices.sort(dim=1).values  # (n, K) positions in rank order
    return Ranked(top_s, src, ends, normalise(top_s, t + 1, length_penalty),
                  *(x.gather(1, pos) for x in (top_s, src, word, step_lp)))


def searching(best_k: torch.Tensor, best_alive: torch.Tensor, length_penalty: float) -> torch.Tensor:
    """Each image's K-th best finished score and best live one (n,) -> (n,) whether a live hypothesis could still
    win (exact with length_penalty 0: log-probabilities only decrease; with a penalty, until K have finished)."""
    done = best_k > NEG if length_penalty else best_k >= best_alive
    return ~(done | (best_alive == NEG))


# what step s wrote: source rows (N,), words (N,), word log-probs (N,) (by the rows after it), maps (N, P) and
# gates (N,) (by the rows before it)
Step = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def walk(trail: tuple[Step, ...], rows: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Hypotheses ending at row rows[m] after step lengths[m] - 1 (M,) -> their words (M, S), maps (M, S, P),
    gates (M, S), word log-probs (M, S), zero after each one's end: the trail walked back."""
    M, S = len(rows), len(trail)
    like = trail[0][3] if S else torch.zeros(0, 0, device=rows.device)
    tokens = torch.zeros(M, S, dtype=torch.long, device=rows.device)
    alphas, betas = like.new_zeros(M, S, like.shape[-1]), like.new_zeros(M, S)
    logps = torch.zeros(M, S, device=rows.device)
    at = rows  # (M,) each hypothesis's row after step s
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
    """Each image's K best finished hypotheses, with those ending at rows (B, M) after `length` words (raw, norm)."""
    K = finished[0].shape[1]
    norm = norm.masked_fill(~ok, NEG)
    top = torch.cat([finished[0], norm], 1).topk(K, dim=1).indices  # (B, K)
    new = (norm, raw, torch.full_like(rows, length), rows)
    merged = (torch.cat([old, x.to(old.dtype)], 1).gather(1, top) for old, x in zip(finished, new))
    return tuple(merged)  # type: ignore[return-value]


@dataclass(frozen=True)
class State:
    """Everything a search carries from one step to the next (a step makes a new one, writing none of these)."""
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
    active: torch.Tensor  # (B,) images still searching
    finished: Finished  # each image's K best finished hypotheses
    trail: tuple[Step, ...]  # what each step wrote

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the state, in one fixed order (Rerun.replay copies them)."""
        return (self.feat_proj, self.ctx_gates, self.images, self.rank, self.h, self.c, self.cum, self.words,
                self.tokens, *self.said.tensors(), self.active, *self.finished, *(x for st in self.trail for x in st))

    def walked(self) -> tuple[torch.Tensor, ...]:
        """On the device, for read_back: walk's tables (B*K, ...), then scores, raw log-probs, lengths (B, K)."""
        norm, raw, length, row = self.finished
        return (*walk(self.trail, row.view(-1), length.view(-1)), norm, raw, length)

    def hypotheses(self) -> list[list[Hypothesis]]:
        return read_back(self.walked())


class Search:
    """One search's fixed parts and its steps."""

    def __init__(self, decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                 rules: Rules | None = None):
        self.decoder, self.feats, self.ids, self.settings = decoder, feats, ids, settings
        self.K, self.T, self.length_penalty = settings.beam_size, settings.max_len, settings.length_penalty
        self.rules = rules or Rules(ids, settings)

    def start(self) -> State:
        """No word yet: K rows per image, only the first live."""
        d, K, feats = self.decoder, self.K, self.feats
        (B, _, _), device = feats.shape, feats.device
        images = torch.arange(B, device=device).repeat_interleave(K)  # (N,)
        h, c = (s[images] for s in d.init_state(feats))  # (N, H)
        cum = feats.new_full((B, K), NEG)
        cum[:, 0] = 0
        none = torch.zeros(B, K, dtype=torch.long, device=device)
        finished = (feats.new_full((B, K), NEG), feats.new_full((B, K), NEG), none, none.clone())
        return State(0, False, d.attention.project(feats), d.context_gates(feats), images,
                     torch.arange(2 * K, device=device), h, c, cum.view(-1),
                     torch.full((B * K,), self.ids.start, dtype=torch.long, device=device),
                     torch.zeros(B * K, 0, dtype=torch.long, device=device), self.rules.start(B * K),
                     torch.ones(B, dtype=torch.bool, device=device), finished, ())

    def advance(self, state: State, steps: int) -> State:
        """Up to `steps` steps from `state` (fewer at max_len)."""
        for _ in range(steps):
            if state.capped:
                break
            state = self.step(state)
        return state

    def step(self, s: State) -> State:
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
                       said=self.rules.advance(s.said, words, rows),
                       active=active, finished=finished,
                       trail=s.trail + ((rows, words, alive_lp.reshape(-1), alpha, beta),))


def read_back(walked: tuple[torch.Tensor, ...]) -> list[list[Hypothesis]]:
    """State.walked's tensors -> each image's finished hypotheses, best first: the search's one read."""
    tokens, alphas, betas, logps, norm, raw, length = walked
    (B, K), S = norm.shape, tokens.shape[1]
    norm, raw, length = norm.tolist(), raw.tolist(), length.tolist()  # (B, K) each
    words = tokens.view(B, K, S).tolist()  # (B, K, S)
    # on the host as arrays: each hypothesis's tensors are views of them
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
    """search.beam_search's hypotheses, with fixed shapes; `greedy_scores`: scored by log-probability."""
    found = search_on_device(decoder, feats, ids, settings, rules, check_every).hypotheses()
    return with_greedy_scores(found) if greedy_scores else found


@torch.no_grad()
def search_on_device(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                     rules: Rules | None = None, check_every: int | None = 4) -> State:
    """The search's last state (the hypotheses still on the device); check_every None: no read before max_len."""
    search = Search(decoder, feats, ids, settings, rules)
    state = search.start()
    while not state.capped:
        state = search.advance(state, check_every or settings.max_len)
        if check_every and not state.capped and not bool(state.active.any()):  # the one read inside the loop
            break
    return state


# where a recorded search reads whether any photo still searches (then max_len): most captions end by the first
CHECKS = (12, 16, 20, 24)


@dataclass
class _Chunks:
    """A search recorded chunk by chunk (CHECKS): each chunk's graph and state, and the walk after it."""
    chunks: list[tuple[Any, State]]
    walks: list[tuple[Any, tuple[torch.Tensor, ...]]]

    def run(self) -> list[list[Hypothesis]]:
        for k, (graph, state) in enumerate(self.chunks):
            graph.replay()
            if state.capped or not bool(state.active.any()):  # the one read a chunk
                break
        walk, outputs = self.walks[k]
        walk.replay()
        return read_back(outputs)


def chunk_sizes(max_len: int) -> list[int]:
    """The steps of each recorded chunk: to each of CHECKS below max_len, then to max_len."""
    ends = [c for c in CHECKS if c < max_len] + [max_len]
    return [b - a for a, b in zip([0] + ends[:-1], ends)]


def _record_search(search: Search, new_graph: Callable[[], Any]) -> _Chunks:
    """Each chunk recorded from the state the one before writes (replayed at once: the next warm-up reads real
    values), with the walk after it."""
    chunks, walks, state = [], [], None
    for size in chunk_sizes(search.T):
        graph = new_graph()
        before = state
        state = graph.record(lambda before=before, size=size:  # (bound now: a Rerun calls it again later)
                             search.advance(search.start() if before is None else before, size))
        graph.replay()
        chunks.append((graph, state))
        walk = new_graph()
        walks.append((walk, walk.record(state.walked)))
        if state.capped:
            break
    return _Chunks(chunks, walks)


def search(recordings: Recordings, decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
           rules: Rules | None = None) -> list[list[Hypothesis]]:
    """beam_search_on_device's hypotheses, its search replayed: feats (B, P, D) -> each image's, best first."""
    B, rules = len(feats), rules or Rules(ids, settings)
    evidence, n = rules.evidence, bucket(B)
    inputs = (pad_rows(feats, n),) + (() if evidence is None else  # ruled-out words (n, V), bonus (n, C), words (V, C)
                                     (pad_rows(evidence.ruled_out, n), pad_rows(evidence.bonus, n), evidence.words))
    key = ("search", tuple((tuple(x.shape), x.dtype, x.device) for x in inputs), ids, repr(settings), rules.rules,
           None if evidence is None else evidence.has_bonus)

    def record(static: tuple[torch.Tensor, ...], new_graph: Callable[[], Any]) -> _Chunks:
        ev = None
        if evidence is not None:  # the same evidence, reading the static copies
            ev = copy.copy(evidence)
            ev.ruled_out, ev.bonus, ev.words = static[1:]
        with torch.no_grad():
            return _record_search(Search(decoder, static[0], ids, settings, rules.with_evidence(ev)), new_graph)

    with torch.no_grad():
        found = recordings.run(key, inputs, weights_key(decoder), "the beam search", record, lambda out: out[:B])
    return found if found is not None else beam_search_on_device(decoder, feats, ids, settings, rules)
