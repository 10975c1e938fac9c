"""Captions drawn from the model's distribution, K per image (K consecutive rows sharing its features): for SCST
(with gradients, training/objectives.py) and for people (Photo.sample: temperature, top-k, nucleus, seeded).
Legend: B images, K samples per image, n live images, N rows, P regions, V vocabulary, T steps.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..vocab import SpecialIds
from ..model.decoder import Decoder

CHECK_EVERY = 4  # off the CPU: steps between two reads of "is any sample still writing?"


class Scores(Protocol):
    """What words are drawn from (rules.Rules, Renormalised): the live rows' `scores` (N, V), a state per row
    (`start`, `advance`; its `reindexed(rows)` follows the rows that stay)."""

    def start(self, n: int) -> Any: ...

    def scores(self, logits: torch.Tensor, tokens: torch.Tensor, state: Any, images: torch.Tensor) -> torch.Tensor: ...

    def advance(self, state: Any, words: torch.Tensor) -> Any: ...


def _real(x: object) -> bool:  # a real number (numpy's too), not a bool
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _whole(x: object) -> bool:  # a whole number (numpy's too), not a bool
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class Draw:
    """How each word is drawn from the step's scores: divided by temperature (> 0), cut to the top_k best (0: every
    word), then to the nucleus (the fewest best words holding probability top_p; 1: every word), renormalised."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def checked(self) -> "Draw":
        """These settings, or a ValueError that says which one is wrong and what it may be."""
        if not (_real(self.temperature) and 0 < self.temperature < math.inf):
            raise ValueError(f"temperature must be a number above 0 (1 = the model's own distribution, small values "
                             f"approach greedy decoding), got {self.temperature!r}")
        if not (_whole(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be a whole number >= 0 (0 = no top-k cut, 1 = greedy), got {self.top_k!r}")
        if not (_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must lie in (0, 1] (1 = no nucleus cut, tiny = greedy), got {self.top_p!r}")
        return self

    @property
    def plain(self) -> bool:
        return self.temperature == 1 and self.top_k == 0 and self.top_p >= 1

    def probs(self, logp: torch.Tensor) -> torch.Tensor:
        """Log-scores (N, V) -> the probabilities (N, V) a word is drawn with."""
        logp = logp.detach().float() / self.temperature  # (N, V); -inf stays -inf
        if 0 < self.top_k < logp.shape[1]:
            kth = logp.topk(self.top_k, dim=1).values[:, -1:]  # (N, 1): the k-th best score
            logp = logp.masked_fill(logp < kth, float("-inf"))
        if self.top_p < 1:
            p, order = torch.softmax(logp, dim=1).sort(dim=1, descending=True)  # (N, V) best first
            outside = (p.cumsum(1) - p) >= self.top_p  # (N, V): the words before it already hold top_p
            logp = logp.masked_fill(outside.scatter(1, order, outside), float("-inf"))  # back to word order
        return torch.softmax(logp, dim=1)  # (N, V)


@dataclass(frozen=True)
class SampleSettings:
    """What a person asks for (Photo.sample, captioner-caption --sample): n captions, drawn as `draw` says, from
    a generator seeded with `seed` (None: a fresh one, reported). The same seed and device, the same captions."""

    n: int = 5
    draw: Draw = Draw()
    seed: int | None = None

    def checked(self) -> "SampleSettings":
        """These settings, or a ValueError that says which one is wrong and what it may be."""
        if not (_whole(self.n) and self.n >= 1):
            raise ValueError(f"n must be a whole number >= 1 (how many captions to sample), got {self.n!r}")
        if self.seed is not None and not (_whole(self.seed) and self.seed >= 0):
            raise ValueError(f"seed must be a whole number >= 0 (or None for a fresh one), got {self.seed!r}")
        self.draw.checked()
        return self

    def generator(self, device: torch.device) -> tuple[torch.Generator, int]:
        """A generator of its own on `device` (never torch's global one) and the seed it got."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            return gen, gen.seed()
        return gen.manual_seed(int(self.seed)), int(self.seed)

    def to_dict(self, seed: int) -> dict:
        """A sampled Caption's `sample` entry, with the seed used."""
        d = self.draw
        return {"n": int(self.n), "temperature": float(d.temperature), "top_k": int(d.top_k), "top_p": float(d.top_p),
                "seed": seed}


@dataclass
class Samples:
    """K captions sampled per image, rows image-major."""
    tokens: torch.Tensor  # (B*K, T) sampled ids, <end> included where emitted, <pad> after it
    log_probs: torch.Tensor  # (B*K, T) score of each sampled token (differentiable), 0 past the end
    mask: torch.Tensor  # (B*K, T) bool: real tokens (words and the <end> that closed the caption)
    alphas: torch.Tensor  # (B*K, T, P) attention of each token, 0 past the end
    betas: torch.Tensor  # (B*K, T) gate beta of each token, 0 past the end

    def captions(self, end: int) -> list[list[int]]:
        """Word ids of each sample, without <end>."""
        return [[w for w, m in zip(row, keep) if m and w != end]
                for row, keep in zip(self.tokens.tolist(), self.mask.tolist())]


class Renormalised:
    """SCST's scores: log-probabilities renormalised without <pad>, <start> (and <unk>), out of place (autograd).
    They remember nothing: the rows' state is the scores themselves."""

    def __init__(self, ids: SpecialIds, device: torch.device):
        self.banned = torch.tensor([ids.pad, ids.start] + ([ids.unk] if ids.unk is not None else []), device=device)

    def start(self, n: int) -> "Renormalised":
        return self

    def reindexed(self, rows: torch.Tensor) -> "Renormalised":
        return self

    def scores(self, logits: torch.Tensor, tokens: torch.Tensor, state: Any, images: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float().index_fill(1, self.banned, float("-inf")), dim=-1)  # (N, V)

    def advance(self, state: Any, words: torch.Tensor) -> Any:
        return state


def sample(decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, n_samples: int = 5, max_len: int = 20, *,
           draw: Draw = Draw(), rules: Scores | None = None, generator: torch.Generator | None = None,
           context: str = "expected", check_every: int | None = None) -> Samples:
    """feats (B, P, D) -> n_samples captions per image, words drawn from `rules`' scores (default Renormalised) as
    `draw` says, with `generator` (None: torch's global state), until <end> or max_len; each token's log_prob is
    the score of the word drawn (the model's own, before the draw's changes). context: a hard model's.
    check_every (default 0 on a CPU, CHECK_EVERY elsewhere): 0 drops finished images (a read every step); k > 0
    keeps fixed shapes and reads every k steps (the draws come in another order: other samples for a seed)."""
    if check_every is None:
        check_every = 0 if feats.device.type == "cpu" else CHECK_EVERY
    (B, P, _), K, dev = feats.shape, n_samples, feats.device
    end, pad = ids.end, ids.pad
    rules = rules or Renormalised(ids, dev)
    N = B * K
    feat_proj = decoder.attention.project(feats)  # (B, P, A)
    h, c = decoder.init_state(feats)  # (B, H)
    state = (h.repeat_interleave(K, 0), c.repeat_interleave(K, 0))  # (N, H)
    words = torch.full((N,), ids.start, dtype=torch.long, device=dev)
    alive = torch.ones(N, dtype=torch.bool, device=dev)  # over the live images' rows (n*K,)
    rows = torch.arange(N, device=dev)  # (n*K,) original row of each live row
    hist = torch.zeros(N, 0, dtype=torch.long, device=dev)  # (n*K, t) the live rows' tokens so far
    said = rules.start(N)  # what the rules remember of each live row
    toks, logps, masks, alphas, betas = [], [], [], [], []
    for _ in range(max_len):
        emb, emb_gates = decoder.embed(words)
        logits, alpha, beta, state = decoder.step(state, emb, emb_gates, feats, feat_proj, context)  # (nK, V), (nK, P)
        logp = rules.scores(logits, hist, said, rows // K)  # (n*K, V)
        probs = logp.detach().exp() if draw.plain else draw.probs(logp)  # (n*K, V)
        words = torch.where(alive, torch.multinomial(probs, 1, generator=generator).squeeze(1), pad)  # (n*K,)
        picked = logp.gather(1, words.unsqueeze(1)).squeeze(1)  # (n*K,): -inf for <pad> on ended rows
        picked = torch.where(alive, picked, torch.zeros_like(picked))
        toks.append(words.new_full((N,), pad).index_copy(0, rows, words))  # back to all B*K rows
        logps.append(picked.new_zeros(N).index_put((rows,), picked))
        masks.append(alive.new_zeros(N).index_copy(0, rows, alive))
        alphas.append(alpha.new_zeros(N, P).index_put((rows,), alpha * alive.unsqueeze(1)))
        betas.append(beta.new_zeros(N).index_put((rows,), beta * alive))
        hist, said = torch.cat([hist, words.unsqueeze(1)], 1), rules.advance(said, words)
        alive = alive & (words != end)
        if check_every:  # fixed shapes: the one read inside the loop, every check_every steps
            if (len(toks)) % check_every == 0 and not bool(alive.any()):
                break
            continue
        live_images = alive.view(-1, K).any(1)  # (n,)
        if not bool(live_images.any()):
            break
        if not bool(live_images.all()):  # images whose K samples all ended leave the batch
            keep = live_images.nonzero().squeeze(1)  # (n',)
            r = (keep.unsqueeze(1) * K + torch.arange(K, device=dev)).reshape(-1)  # (n'*K,)
            feats, feat_proj = feats[keep], feat_proj[keep]
            state, words, alive, rows, hist = (state[0][r], state[1][r]), words[r], alive[r], rows[r], hist[r]
            said = said.reindexed(r)
    return Samples(torch.stack(toks, 1), torch.stack(logps, 1), torch.stack(masks, 1), torch.stack(alphas, 1),
                   torch.stack(betas, 1))
