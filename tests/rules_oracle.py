"""The decoding rules written literally, from all the words written so far: the oracle tests/test_processors.py
checks decoding/rules.py's Rules against (each rule alone and all together, on random histories), and the scores
the sampling and repeat tests read a caption's words against. Never imported by captioner/.

Legend: N live rows, t words written so far, V vocabulary.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from captioner.config import DecodeConfig
from captioner.decoding.rules import Lexicon
from captioner.vocab import SALAD_REPEATS, SpecialIds

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


def _ban_salad(logp: torch.Tensor, tokens: torch.Tensor, ids: SpecialIds, lex: Lexicon) -> torch.Tensor:
    """logp (N, V), tokens (N, t) -> -inf for <end> first or after a function word or colour ("... in front
    of a", "a black and"), for a verb or preposition right after an article and a colour ("a white sitting",
    vocab.bare_colour), for a plural right after "a" or "an" ("a skis": vocab.a_plural), and for a content word
    already written SALAD_REPEATS - 1 times (vocab.is_salad)."""
    if tokens.shape[1] == 0:  # nor a caption without words
        logp[:, ids.end] = float("-inf")
        return logp
    ids_of = lambda words: _ids(words, tokens.dtype, tokens.device)  # noqa: E731
    among = lambda words: _among(words, logp.shape[1], tokens.device)  # noqa: E731
    bad = among(lex.bad_last)[tokens[:, -1]]  # (N,) rows ending on a word a caption cannot end on
    logp[:, ids.end] = logp[:, ids.end].masked_fill(bad, float("-inf"))
    if tokens.shape[1] >= 2 and lex.not_after_colour:  # "a white" is followed by a noun, not "sitting"
        bare = among(lex.articles)[tokens[:, -2]] & among(lex.colours)[tokens[:, -1]]  # (N,)
        words = ids_of(lex.not_after_colour).expand(len(tokens), -1)  # (N, m)
        logp = _ban(logp, words, bare.unsqueeze(1).expand_as(words))
    if lex.singular_articles and lex.plurals:  # "a skis"
        after_a = among(lex.singular_articles)[tokens[:, -1]]  # (N,) rows ending on "a" or "an"
        logp = logp.masked_fill(after_a.unsqueeze(1) & among(lex.plurals).unsqueeze(0), float("-inf"))
    if tokens.shape[1] >= SALAD_REPEATS - 1:
        counts = torch.zeros_like(logp).scatter_add_(1, tokens, torch.ones_like(tokens, dtype=logp.dtype))  # (N, V)
        logp = logp.masked_fill((counts >= SALAD_REPEATS - 1) & ~among(lex.function_words), float("-inf"))
    return logp


def _ban_repeats(logp: torch.Tensor, tokens: torch.Tensor, lex: Lexicon, close: bool, content: bool
                 ) -> torch.Tensor:
    """logp (N, V), tokens (N, t) -> with `close`, -inf for the last word again ("an airplane airplane"), for
    a longer word that starts with it ("a bath bathroom": lex.stutters) and for X after "X and" / "X or" ("a
    black and black dog"); with `content`, for every content word
    already written ("a kitchen that is in the kitchen"), its family included (lex.twins: no "horse" after
    "stallion", no "tracks" after "track"). vocab.repeats names these three kinds."""
    t = tokens.shape[1]
    if t == 0:
        return logp
    if close:  # back to back
        logp[torch.arange(len(tokens), device=tokens.device), tokens[:, -1]] = float("-inf")
    if close and lex.stutters:  # the last word again as the start of a longer one
        first, longer = _pairs(lex.stutters, tokens.device)  # (m,), (m,)
        logp = _ban(logp, longer.expand(len(tokens), -1), tokens[:, -1:] == first)  # where: (N, m)
    if close and t >= 2:
        joined = _among(lex.joiners, logp.shape[1], tokens.device)[tokens[:, -1]]  # (N,) rows ending "X and"
        logp = _ban(logp, tokens[:, -2:-1], joined.unsqueeze(1))
    if content:
        said = torch.zeros_like(logp, dtype=torch.bool).scatter_(1, tokens, True)  # (N, V)
        if lex.twins:  # a word, its plural, its taught twin name one thing: one said bans the whole family
            member, family = _pairs(lex.twins, tokens.device)
            said = said.float().index_add_(1, family, said[:, member].float()) > 0  # (N, V): families said
            said[:, member] = said[:, family]
        logp = logp.masked_fill(said & ~_among(lex.function_words, logp.shape[1], tokens.device), float("-inf"))
    return logp


def evidence_bias(evidence, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The evidence's bias (rules.Evidence) written literally: images (N,), tokens (N, t) so far -> (N, V): each
    category's bonus until a row has named it (0 without a bonus; the veto is a ban, evidence_veto, not a bias)."""
    if not evidence.has_bonus:
        return torch.zeros(len(images), evidence.words.shape[0])  # (N, V)
    named = evidence.words[tokens].amax(1) if tokens.shape[1] else None  # (N, C): categories named already
    return evidence.bias_after(images, named)


def evidence_veto(logp: torch.Tensor, evidence, images: torch.Tensor) -> torch.Tensor:
    """The evidence's veto written literally: -inf wherever row n's photo images[n] rules the word out."""
    return logp.masked_fill(evidence.ruled_out[images], float("-inf"))


def word_logp(logits: torch.Tensor, ids: SpecialIds, settings: DecodeConfig, tokens: torch.Tensor,
              evidence=None, images: torch.Tensor | None = None, lexicon: Lexicon = Lexicon()) -> torch.Tensor:
    """logits (N, V) of the next word, tokens (N, t) written so far, the image of each row (N,) with
    its Evidence or None, the vocabulary's Lexicon -> the scores decoding ranks words by: <pad>, <start> (and <unk>)
    forbidden, repeated trigrams (block_trigrams) and content bigrams (block_bigrams) banned, word salad
    (block_salad) ruled out, repeated words (block_repeats, block_content_repeats) banned, the evidence's bonus
    added and its veto banned."""
    lex = lexicon
    logp = _forbid(torch.log_softmax(logits.float(), dim=-1), ids.pad, ids.start, ids.unk)  # (N, V)
    logp = logp if evidence is None else evidence_veto(logp + evidence_bias(evidence, images, tokens), evidence, images)
    logp = _ban_repeated_bigrams(logp, tokens, lex.function_words) if settings.block_bigrams else logp
    logp = _ban_salad(logp, tokens, ids, lex) if settings.block_salad else logp
    if settings.block_repeats or settings.block_content_repeats:
        logp = _ban_repeats(logp, tokens, lex, settings.block_repeats, settings.block_content_repeats)
    return _ban_repeated_trigrams(logp, tokens) if settings.block_trigrams else logp
