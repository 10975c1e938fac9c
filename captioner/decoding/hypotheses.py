"""What beam searches are made of, shared by search.beam_search (CPU: finished images leave the batch) and
device_beam.beam_search_on_device (GPU: fixed shapes), everything but their step loops: a finished Hypothesis,
one step's ranking (`rank`: the best 2K continuations of each image's rows, those that end now and their
normalised scores, the K that stay alive), when an image's search is over (`searching`), greedy decoding's score
for beam 1; and the CPU beam's History of the live rows (the GPU's keeps a trail of its steps instead:
device_beam.State.trail). The loops differ in what they keep: the CPU's drops finished images and lists their
hypotheses on the host, the GPU's keeps every row and its finished hypotheses in device tensors.

Legend: n images, G rows per image (1 at t = 0, then K), N = n*G rows, t words so far, V vocabulary, P regions.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class Hypothesis:
    """A finished caption of the search, a value (what decides among them and how sure: captions.Decided)."""
    __hash__ = None  # its tensors: compared by value, never a dict key
    tokens: list[int]  # word ids, without <start>/<end>
    alphas: torch.Tensor  # (len(tokens), P): attention of each word
    log_prob: float  # sum of log-probabilities of the words (and of <end> when it was emitted)
    score: float  # log_prob after length normalisation (what the ranking uses)
    betas: torch.Tensor | None = None  # (len(tokens),): gate beta of each word (how much it used the image)
    # (len(tokens),) float32: log-probability of each word when chosen (log_prob minus these = <end>'s); None: unknown
    word_logps: torch.Tensor | None = None


def normalise(log_prob: float | torch.Tensor, length: int, length_penalty: float) -> float | torch.Tensor:
    """The ranking score: log_prob / length ** length_penalty (a number, or a tensor of them: the device beam)."""
    return log_prob / (max(length, 1) ** length_penalty) if length_penalty else log_prob


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


def with_greedy_scores(found: list[list[Hypothesis]]) -> list[list[Hypothesis]]:
    """Each hypothesis scored by its log-probability (greedy decoding's score: beam 1 has one hypothesis, and its
    length-normalised score would only rescale it)."""
    return [[replace(h, score=h.log_prob) for h in hyps] for hyps in found]


class Ranked(NamedTuple):
    """One step's candidates, best first: each image's 2K best continuations (n, 2K), and the K of them that stay
    alive (n, K)."""
    scores: torch.Tensor  # (n, 2K) cumulative log-probs
    src: torch.Tensor  # (n, 2K) the row each continues
    words: torch.Tensor  # (n, 2K)
    logps: torch.Tensor  # (n, 2K) each word's own log-prob
    ends: torch.Tensor  # (n, 2K) hypotheses that end now: <end> within the top K, and possible
    normed: torch.Tensor  # (n, 2K) scores normalised for t words + <end>
    alive_scores: torch.Tensor  # (n, K)
    alive_src: torch.Tensor  # (n, K)
    alive_words: torch.Tensor  # (n, K)
    alive_logps: torch.Tensor  # (n, K)


def rank(cum: torch.Tensor, logp: torch.Tensor, n: int, G: int, rank_2k: torch.Tensor, t: int, length_penalty: float,
         pad: int, end: int) -> Ranked:
    """Rows' scores cum (N,) and the step's log-probs logp (N, V) of n images with G rows each, after t words,
    rank_2k = arange(2K) -> the step's Ranked candidates."""
    K = rank_2k.shape[0] // 2
    top_s, src, word, step_lp = candidates(cum, logp, n, G, K, pad)  # (n, 2K) each
    is_end = word == end
    ends = is_end & (rank_2k < K) & (top_s > float("-inf"))  # (n, 2K)
    return Ranked(top_s, src, word, step_lp, ends, normalise(top_s, t + 1, length_penalty),
                  *alive(top_s, src, word, step_lp, is_end, rank_2k, K))


def searching(best_k: torch.Tensor, best_alive: torch.Tensor, length_penalty: float) -> torch.Tensor:
    """Each image's K-th best finished score and best live one (n,) -> (n,) whether its search goes on: a live
    hypothesis could still beat its K finished ones (exact with length_penalty 0, since log-probabilities only
    decrease; with a penalty, until K have finished)."""
    done = best_k > float("-inf") if length_penalty else best_k >= best_alive
    return ~(done | (best_alive == float("-inf")))


def candidates(cum: torch.Tensor, logp: torch.Tensor, n: int, G: int, K: int, pad: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best 2K continuations of each image's G rows: scores (n, 2K), source rows (n, 2K),
    words (n, 2K) and the words' own log-probs (n, 2K), best first."""
    V = logp.shape[1]
    cand = (cum.unsqueeze(1) + logp).view(n, G * V)  # (n, G*V)
    if G * V < 2 * K:  # a vocabulary smaller than 2K words: pad with impossible candidates
        cand = torch.nn.functional.pad(cand, (0, 2 * K - G * V), value=float("-inf"))
    top_s, top_i = cand.topk(2 * K, dim=1)  # (n, 2K)
    src = torch.arange(n, device=cum.device).unsqueeze(1) * G + (top_i // V).clamp(max=G - 1)  # (n, 2K)
    word = torch.where(top_i < G * V, top_i % V, pad)  # (n, 2K)
    return top_s, src, word, logp[src, word]


def alive(top_s: torch.Tensor, src: torch.Tensor, word: torch.Tensor, step_lp: torch.Tensor, is_end: torch.Tensor,
           rank: torch.Tensor, K: int) -> tuple[torch.Tensor, ...]:
    """The K best continuations that do not end (>= K among the 2K: each of the G <= K rows has one
    <end>), in rank order: their scores, source rows, words and word log-probs, each (n, K)."""
    keep_score = (~is_end).float() * (2 * K - rank)  # prefer non-end, then better rank
    pos = keep_score.topk(K, dim=1).indices.sort(dim=1).values  # (n, K) positions in rank order
    return top_s.gather(1, pos), src.gather(1, pos), word.gather(1, pos), step_lp.gather(1, pos)
