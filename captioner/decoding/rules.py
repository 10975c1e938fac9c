"""Which words may come next: every rule decoding applies to the next-word scores, in one place
(word_logp), used by greedy and beam search alike (search.py) and so by every caption.

Legend: N live rows (image x beam), t words written so far, V vocabulary.

<pad> and <start> are never generated (nor <unk> with decode.forbid_unk); the decode.block_* settings (RULES)
ban repeated trigrams, repeated content bigrams, word salad and repeated words (vocab.repeats: back to back,
"X and X", a content word twice); the evidence's word bias (evidence.py) is added before the bans.

Which rules each decode uses, said here once:
- a caption (the API, the CLI, the app, evaluation, training's validation, the benchmark): config.decode as the
  model file or the recipe says it (a rule a recipe leaves out is off; a model file written before a rule was
  stored decodes as it always has: config.DecodeConfig.UNSTORED, filled in by checkpoint.load_checkpoint);
- a sampled caption (Photo.sample, captions.sampled_captions): a caption's, drawn from these scores;
- SCST's samples (sampling.sample) and its greedy baseline: no rule (`unruled`), the policy's own words, so that
  the baseline is compared with samples drawn under the same (no) rules;
- the search tests and a test of what a model has learned (test_overfit): `unruled` too.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any

import torch

from ..config import DecodeConfig
from ..vocab import SALAD_REPEATS, SpecialIds
from .evidence import Evidence


RULES: tuple[str, ...] = ("block_trigrams", "block_bigrams", "block_salad", "block_repeats", "block_content_repeats")


def unruled(settings: DecodeConfig | None = None, **changes: Any) -> DecodeConfig:
    """`settings` (default: DecodeConfig()) with no rule on which word may come next (every RULES setting off),
    then `changes`: the model's own words, as SCST samples them. <pad>, <start> (and <unk> with forbid_unk)
    stay forbidden; the evidence is the caller's (greedy_decode and beam_search take it separately)."""
    return dataclasses.replace(settings or DecodeConfig(), **{**{r: False for r in RULES}, **changes})


def _forbid(logp: torch.Tensor, pad: int, start: int, unk: int | None = None) -> torch.Tensor:
    logp[:, pad] = float("-inf")
    logp[:, start] = float("-inf")
    if unk is not None:  # a caption for people should not say "<unk>"
        logp[:, unk] = float("-inf")
    return logp


def _ban_repeated_trigrams(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logp (N, V), tokens (N, t) written so far -> logp with -inf for every word w that would
    repeat a trigram: (tokens[-2], tokens[-1], w) already occurs in the row ("a man in a red shirt
    is wearing a red shirt" cannot write its second "shirt")."""
    if tokens.shape[1] < 3:
        return logp
    last = tokens[:, -2:]  # (N, 2): the bigram a new word would extend
    match = (tokens[:, :-2] == last[:, :1]) & (tokens[:, 1:-1] == last[:, 1:])  # (N, t-2): earlier copies
    return _ban(logp, tokens[:, 2:], match)  # the words that followed them


def _ban_repeated_bigrams(logp: torch.Tensor, tokens: torch.Tensor, function_words: tuple[int, ...]) -> torch.Tensor:
    """logp (N, V), tokens (N, t) -> -inf for every content word w that would repeat a bigram:
    (tokens[-1], w) already occurs in the row ("a brown and white and white", "a blue shirt and blue
    shirt"). Bigrams ending in a function word ("in a ... in a") stay allowed."""
    if tokens.shape[1] < 2:
        return logp
    match = tokens[:, :-1] == tokens[:, -1:]  # (N, t-1): earlier copies of the last word
    words = tokens[:, 1:]  # (N, t-1): the words that followed them
    content = ~_among(function_words, logp.shape[1], words.device)[words]  # (N, t-1)
    return _ban(logp, words, match & content)


@lru_cache(maxsize=64)
def _ids(words: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(m,) the word ids as a tensor, made once per word list and device: every step of every decode asks again,
    and building a small tensor costs more than the lookup it serves. Never written to."""
    return torch.tensor(words, dtype=dtype, device=device)


@lru_cache(maxsize=64)
def _among(words: tuple[int, ...], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(V,) True at `words`: indexed by a row's words, whether each is among them (one lookup where torch.isin
    sorts at every step). Made once per word list and device; never written to."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # (V,)
    mask[list(words)] = True
    return mask


@lru_cache(maxsize=16)
def _pairs(pairs: tuple[tuple[int, int], ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(m,) the first and (m,) the second ids of id pairs (vocab.word_families' members and families,
    vocab.stutter_pairs' words and longer words), made once per vocabulary."""
    return (torch.tensor([a for a, _ in pairs], dtype=torch.long, device=device),
            torch.tensor([b for _, b in pairs], dtype=torch.long, device=device))


def _ban(logp: torch.Tensor, words: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """logp (N, V) with -inf at each row's words (N, m) where `where` (N, m) holds, in place: a minimum with -inf
    there and +inf elsewhere, one op and no nonzero() (which would wait for the device at every step on a GPU)."""
    inf = torch.full_like(words, float("inf"), dtype=logp.dtype)  # (N, m)
    return logp.scatter_reduce_(1, words, torch.where(where, -inf, inf), reduce="amin")


def _ban_salad(logp: torch.Tensor, tokens: torch.Tensor, ids: SpecialIds) -> torch.Tensor:
    """logp (N, V), tokens (N, t) -> -inf for <end> first or after a function word or colour ("... in front
    of a", "a black and"), for a verb or preposition right after an article and a colour ("a white sitting",
    vocab.bare_colour), for a plural right after "a" or "an" ("a skis": vocab.a_plural), and for a content word
    already written SALAD_REPEATS - 1 times (vocab.is_salad)."""
    if tokens.shape[1] == 0:  # nor a caption without words
        logp[:, ids.end] = float("-inf")
        return logp
    ids_of = lambda words: _ids(words, tokens.dtype, tokens.device)  # noqa: E731
    among = lambda words: _among(words, logp.shape[1], tokens.device)  # noqa: E731
    bad = among(ids.bad_last)[tokens[:, -1]]  # (N,) rows ending on a word a caption cannot end on
    logp[:, ids.end] = logp[:, ids.end].masked_fill(bad, float("-inf"))
    if tokens.shape[1] >= 2 and ids.not_after_colour:  # "a white" is followed by a noun, not "sitting"
        bare = among(ids.articles)[tokens[:, -2]] & among(ids.colours)[tokens[:, -1]]  # (N,)
        words = ids_of(ids.not_after_colour).expand(len(tokens), -1)  # (N, m)
        logp = _ban(logp, words, bare.unsqueeze(1).expand_as(words))
    if ids.singular_articles and ids.plurals:  # "a skis"
        after_a = among(ids.singular_articles)[tokens[:, -1]]  # (N,) rows ending on "a" or "an"
        logp = logp.masked_fill(after_a.unsqueeze(1) & among(ids.plurals).unsqueeze(0), float("-inf"))
    if tokens.shape[1] >= SALAD_REPEATS - 1:
        counts = torch.zeros_like(logp).scatter_add_(1, tokens, torch.ones_like(tokens, dtype=logp.dtype))  # (N, V)
        logp = logp.masked_fill((counts >= SALAD_REPEATS - 1) & ~among(ids.function_words), float("-inf"))
    return logp


def _ban_repeats(logp: torch.Tensor, tokens: torch.Tensor, ids: SpecialIds, close: bool, content: bool
                 ) -> torch.Tensor:
    """logp (N, V), tokens (N, t) -> with `close`, -inf for the last word again ("an airplane airplane"), for
    a longer word that starts with it ("a bath bathroom": ids.stutters) and for X after "X and" / "X or" ("a
    black and black dog"); with `content`, for every content word
    already written ("a kitchen that is in the kitchen"), its family included (ids.twins: no "horse" after
    "stallion", no "tracks" after "track"). vocab.repeats names these three kinds."""
    t = tokens.shape[1]
    if t == 0:
        return logp
    if close:  # back to back
        logp[torch.arange(len(tokens), device=tokens.device), tokens[:, -1]] = float("-inf")
    if close and ids.stutters:  # the last word again as the start of a longer one
        first, longer = _pairs(ids.stutters, tokens.device)  # (m,), (m,)
        logp = _ban(logp, longer.expand(len(tokens), -1), tokens[:, -1:] == first)  # where: (N, m)
    if close and t >= 2:
        joined = _among(ids.joiners, logp.shape[1], tokens.device)[tokens[:, -1]]  # (N,) rows ending "X and"
        logp = _ban(logp, tokens[:, -2:-1], joined.unsqueeze(1))
    if content:
        said = torch.zeros_like(logp, dtype=torch.bool).scatter_(1, tokens, True)  # (N, V)
        if ids.twins:  # a word, its plural, its taught twin name one thing: one said bans the whole family
            member, family = _pairs(ids.twins, tokens.device)
            said = said.float().index_add_(1, family, said[:, member].float()) > 0  # (N, V): families said
            said[:, member] = said[:, family]
        logp = logp.masked_fill(said & ~_among(ids.function_words, logp.shape[1], tokens.device), float("-inf"))
    return logp


def word_logp(logits: torch.Tensor, ids: SpecialIds, settings: DecodeConfig, tokens: torch.Tensor,
              evidence: Evidence | None = None, images: torch.Tensor | None = None) -> torch.Tensor:
    """logits (N, V) of the next word, tokens (N, t) written so far, the image of each row (N,) with
    its Evidence (evidence.py) or None -> the scores decoding ranks words by: <pad>, <start> (and <unk>)
    forbidden, repeated trigrams (block_trigrams) and content bigrams (block_bigrams) banned, word salad
    (block_salad) ruled out, the evidence's word bias added.
    Every rule on which words may come next lives here."""
    logp = _forbid(torch.log_softmax(logits.float(), dim=-1), ids.pad, ids.start, ids.unk)  # (N, V)
    logp = logp if evidence is None else logp + evidence.bias(images, tokens)
    logp = _ban_repeated_bigrams(logp, tokens, ids.function_words) if settings.block_bigrams else logp
    logp = _ban_salad(logp, tokens, ids) if settings.block_salad else logp
    if settings.block_repeats or settings.block_content_repeats:
        logp = _ban_repeats(logp, tokens, ids, settings.block_repeats, settings.block_content_repeats)
    return _ban_repeated_trigrams(logp, tokens) if settings.block_trigrams else logp
