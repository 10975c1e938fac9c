"""The decoding rules as batched logits processors: rules.word_logp's scores, with a step's work that does not
grow with the words already written.

Legend: N live rows, t words so far, V vocabulary, W words one table row names, C evidence categories.

rules.py states every rule literally, from all the words written so far, and stays the oracle the tests check
this module against (tests/test_processors.py: each rule alone and all together, on random histories, and whole
decodes). Here the same rules are split by what they read:
- tables made once per vocabulary and settings: the words that may never directly follow word v (v itself and
  its stutters: block_repeats; <end> after a bad last word and plurals after "a": block_salad), the words that
  writing v bans for good (its family's content words: block_content_repeats);
- a RowState each row carries from step to step and the searches reindex with their surviving rows, as they do
  their tokens: the words banned for good (N, V), the salad's counts, the evidence categories named (N, C);
- what still reads the row's words: "X and X", "a white sitting" (its last two), repeated bigrams and trigrams
  (the earlier copies of its last one or two words).
Each step is then one log_softmax, the evidence's bias, one masked_fill of the banned words and one scatter of
every word the processors name (no nonzero(), no .item(), no loop over rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from ..config import DecodeConfig
from ..vocab import SALAD_REPEATS, SpecialIds
from .evidence import Evidence

NEG = float("-inf")


@dataclass
class RowState:
    """What the rules remember of each live row: banned (N, V) bool, the words it may never write again (or
    None); counts (N, V) of each word written (block_salad without block_content_repeats, else None); named
    (N, C), the evidence categories it has named (a bonus to earn, else None)."""
    banned: torch.Tensor | None
    counts: torch.Tensor | None
    named: torch.Tensor | None

    def reindexed(self, rows: torch.Tensor) -> "RowState":
        """The state of rows `rows` (M,): the search's surviving rows, in its order."""
        pick = lambda x: None if x is None else x[rows]  # noqa: E731
        return RowState(pick(self.banned), pick(self.counts), pick(self.named))


def _padded(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Lists of word ids -> (len(lists), W) long, each row padded with `pad` (banning <pad> again changes
    nothing: it is always forbidden)."""
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.long, device=device)


def _after_word(ids: SpecialIds, V: int, repeats: bool, salad: bool) -> list[list[int]]:
    """For each word v (and, as row V, for no word yet), the words that may never come right after it."""
    after: list[list[int]] = [[] for _ in range(V + 1)]
    if repeats:
        for v in range(V):
            after[v].append(v)  # back to back
        for first, longer in ids.stutters:  # "a bath bathroom"
            after[first].append(longer)
    if salad:
        after[V].append(ids.end)  # a caption without words
        for v in ids.bad_last:  # "... in front of a" <end>
            after[v].append(ids.end)
        if ids.singular_articles and ids.plurals:  # "a skis"
            for v in ids.singular_articles:
                after[v].extend(ids.plurals)
    return after


def _said_bans(ids: SpecialIds, V: int) -> list[list[int]]:
    """For each word v, the words that writing it bans for good (block_content_repeats): rules._ban_repeats's
    families applied to v alone (the rule is a union over the words written, so a row's bans are the union of
    these), function words left out."""
    family = dict(ids.twins)  # member -> family
    members: dict[int, list[int]] = {}
    for m, f in ids.twins:
        members.setdefault(f, []).append(m)
    function = set(ids.function_words)
    out = []
    for v in range(V):
        said = {v} if v not in family else set()  # a member's own column is overwritten by its family's
        said.update(m for m in members.get(v, ()))  # the family v names is said
        if v in family:  # v said: its family is said, and so is every member of that family
            said.update(m for m in members.get(family[v], ()))
            if family[v] not in family:  # (a family that is itself a member takes its own family's column)
                said.add(family[v])
        out.append(sorted(w for w in said if w not in function))
    return out


@lru_cache(maxsize=None)
def _tables(ids: SpecialIds, V: int, rules: tuple[bool, ...], device: torch.device) -> dict[str, torch.Tensor]:
    """Every per-vocabulary table the processors look words up in, made once per vocabulary, rule set and
    device; never written to, and kept for the process (a recorded search, captured.py, reads them by address)."""
    trigrams, bigrams, salad, repeats, content = rules
    mask = lambda words: torch.zeros(V, dtype=torch.bool, device=device).index_fill_(  # noqa: E731
        0, torch.tensor(list(words), dtype=torch.long, device=device), True)
    t = {"after": _padded(_after_word(ids, V, repeats, salad), ids.pad, device),  # (V + 1, W)
         "forbidden": torch.tensor([[ids.pad, ids.start] + ([ids.unk] if ids.unk is not None else [])],
                                   dtype=torch.long, device=device),  # (1, 2 or 3)
         "function": mask(ids.function_words), "joiner": mask(ids.joiners), "article": mask(ids.articles)}  # (V,)
    colour = [list(ids.not_after_colour) if v in set(ids.colours) else [] for v in range(V)]
    t["not_after_colour"] = _padded(colour, ids.pad, device)  # (V, m): for a colour, what may not follow "a <it>"
    t["content"] = torch.where(t["function"], ids.pad, torch.arange(V, device=device))  # (V,): pad for a function word
    t["pad"] = torch.tensor(ids.pad, device=device)  # () where a row bans nothing (a tensor: no op to make it)
    if content:
        t["said"] = _padded(_said_bans(ids, V), ids.pad, device)  # (V, F)
    return t


class Rules:
    """rules.word_logp for one decode, as processors: `start` each row's state, `scores` a step, `advance` the
    state with the words chosen (and the rows that survive)."""

    def __init__(self, ids: SpecialIds, settings: DecodeConfig, evidence: Evidence | None = None):
        self.ids, self.evidence = ids, evidence
        s = settings
        self.on = (s.block_trigrams, s.block_bigrams, s.block_salad, s.block_repeats, s.block_content_repeats)
        self.t: dict[str, torch.Tensor] = {}  # the tables, for the vocabulary and device of the first logits
        self.V = 0
        self.bonus = evidence is not None and evidence.has_bonus
        self.count_salad = s.block_salad and not s.block_content_repeats  # with it, a word said once is banned
        # each (tokens (N, t), their last words (N,) or None before any) -> word ids to ban (N, m), or None
        self.processors: list[Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor | None]] = [
            self._forbidden, self._after_last]
        if s.block_repeats or (s.block_salad and ids.not_after_colour):
            self.processors.append(self._after_pair)
        if s.block_bigrams or s.block_trigrams:
            self.processors.append(self._repeated_pairs)

    def start(self, n: int) -> RowState:
        """The state of n rows with no word written yet (what needs the vocabulary is made at the first word)."""
        named = self.evidence.words.new_zeros(n, self.evidence.words.shape[1]) if self.bonus else None  # (n, C)
        return RowState(None, None, named)

    def scores(self, logits: torch.Tensor, tokens: torch.Tensor, state: RowState,
               images: torch.Tensor | None = None) -> torch.Tensor:
        """word_logp(logits, ids, settings, tokens, evidence, images), with tokens' RowState `state`: logits (N, V),
        tokens (N, t), images (N,) -> (N, V)."""
        if not self.t:
            self.V, self.t = logits.shape[1], _tables(self.ids, logits.shape[1], self.on, logits.device)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
        if self.evidence is not None:  # before the bans: -inf stays -inf
            logp = logp + self.evidence.bias_after(images, state.named if tokens.shape[1] else None)
        if state.banned is not None:
            logp = logp.masked_fill_(state.banned, NEG)
        last = tokens[:, -1] if tokens.shape[1] else None  # (N,)
        bans = [b for b in (p(tokens, last) for p in self.processors) if b is not None]
        return logp.scatter_(1, torch.cat(bans, 1) if len(bans) > 1 else bans[0], NEG)  # (N, V)

    def advance(self, state: RowState, words: torch.Tensor, rows: torch.Tensor | None = None) -> RowState:
        """The state after each row `rows` (M,) of `state` (all, in order, when None) wrote words (M,), scored by
        `scores` first (as every search does); the state passed in is spent (its tensors may be written)."""
        state = state if rows is None else state.reindexed(rows)
        if state.banned is None and (self.on[4] or self.count_salad):  # the first word
            state.banned = torch.zeros(len(words), self.V, dtype=torch.bool, device=words.device)  # (M, V)
            if self.count_salad:
                state.counts = torch.zeros(len(words), self.V, dtype=torch.int16, device=words.device)  # (M, V)
        if state.banned is not None and self.on[4]:
            state.banned.scatter_(1, self.t["said"][words], True)  # (M, F): the word's family, for good
        if state.counts is not None:
            w = words.unsqueeze(1)  # (M, 1)
            state.counts.scatter_add_(1, w, torch.ones_like(w, dtype=state.counts.dtype))
            again = state.counts.gather(1, w) >= SALAD_REPEATS - 1  # (M, 1): a content word said that often
            state.banned.scatter_(1, torch.where(again, self.t["content"][w], self.t["pad"]), True)
        if state.named is not None:
            state.named = torch.maximum(state.named, self.evidence.words[words])  # (M, C)
        return state

    def _forbidden(self, tokens: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
        """<pad>, <start> (and <unk>): never written."""
        return self.t["forbidden"].expand(len(tokens), -1)  # (N, 2 or 3)

    def _after_last(self, tokens: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
        """The words that may never follow the row's last word (or, before any, begin it)."""
        if last is None:
            return self.t["after"][self.V].expand(len(tokens), -1)  # (N, W)
        return self.t["after"][last]  # (N, W)

    def _after_pair(self, tokens: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor | None:
        """X after "X and" (block_repeats); a verb or preposition after "a white" (block_salad)."""
        if tokens.shape[1] < 2:
            return None
        prev = tokens[:, -2:-1]  # (N, 1)
        out = []
        if self.on[3]:
            out.append(torch.where(self.t["joiner"][last].unsqueeze(1), prev, self.t["pad"]))  # (N, 1)
        if self.on[2] and self.ids.not_after_colour:
            out.append(torch.where(self.t["article"][prev], self.t["not_after_colour"][last], self.t["pad"]))  # (N, m)
        return out[0] if len(out) == 1 else torch.cat(out, 1)

    def _repeated_pairs(self, tokens: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor | None:
        """The words that followed earlier copies of the last word: a content one (block_bigrams), or any after
        the last two words (block_trigrams)."""
        t = tokens.shape[1]
        if t < 2 or (t < 3 and not self.on[1]):
            return None
        follow = tokens[:, 1:]  # (N, t-1): the word after each earlier one
        match = tokens[:, :-1] == tokens[:, -1:]  # (N, t-1): earlier copies of the last word
        why = None
        if self.on[1]:  # a content word after it again
            why = ~self.t["function"][follow]  # (N, t-1)
        if self.on[0] and t >= 3:  # any word after the last two again
            two = torch.nn.functional.pad(tokens[:, :-2] == tokens[:, -2:-1], (1, 0))  # (N, t-1)
            why = two if why is None else why | two
        return torch.where(match & why, follow, self.t["pad"])  # (N, t-1)
