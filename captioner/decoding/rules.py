"""Which words may come next: every rule decoding applies to the next-word scores, one class each, built from the
settings once (Rules) and handed to every search (search.py, device_beam.py) and to sampling (sampling.py).

Legend: N live rows (image x beam), t words written so far, V vocabulary, W words one table row names, C evidence
categories.

A rule is read like one of HF's logits processors, split by what it reads so that a step's work does not grow with
the words already written:
- `tables(V, device)`: what it looks words up in, made once per vocabulary and device (the words that may never
  follow word v, the words writing v bans for good), kept for the process (a recorded search, captured.py, reads
  them by address);
- `start` / `advance`: what it remembers of each row (a tensor, or None), which the searches reindex with their
  surviving rows as they do the rows' words (RowState);
- `bans(tokens, last, memory)`: the word ids (N, m) it rules out at this step (<pad> where a row bans nothing;
  a tuple of such tensors, concatenated once with every rule's), or None; `forever(memory)`: the (N, V) words it
  has banned for good, or None.
Each step is one log_softmax, the evidence's bonus and veto, one masked_fill per remembered ban and one scatter of
every word the rules name (no nonzero(), no .item(), no loop over rows). tests/rules_oracle.py states every rule
literally, from all the words written so far: the oracle tests/test_processors.py checks these against, rule by rule.

The rules (their settings, config.DecodeConfig): <pad> and <start> are never written, nor <unk> with forbid_unk
(Forbidden); block_trigrams, block_bigrams (repeated trigrams, repeated content bigrams), block_salad (word salad:
vocab.is_salad, a_plural, bare_colour, BAD_LAST_WORDS), block_repeats (vocab.repeats: back to back, "X and X", a
stutter), block_content_repeats (a content word or its family twice); the evidence (evidence.py) bans the words
its photo rules out (its veto: a per-photo table, Evidence.ruled_out, read by each row's image) and adds its bonus
before the bans. The words each rule names are the Lexicon's, made from the vocabulary once.

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

import copy
import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ..config import DecodeConfig
from ..vocab import (ARTICLES, BAD_LAST_WORDS, COLOUR_WORDS, FUNCTION_WORDS, NOT_AFTER_COLOUR, REPEAT_JOINERS,
                     SALAD_REPEATS, SINGULAR_ARTICLES, SpecialIds, Vocab, plural_ids, stutter_pairs, word_families)
from .evidence import Evidence

NEG = float("-inf")
RULES: tuple[str, ...] = ("block_trigrams", "block_bigrams", "block_salad", "block_repeats", "block_content_repeats")
Memory = Any  # what one rule remembers of the live rows: a tensor (N, ...) or None


def unruled(settings: DecodeConfig | None = None, **changes: Any) -> DecodeConfig:
    """`settings` (default: DecodeConfig()) with no rule on which word may come next (every RULES setting off),
    then `changes`: the model's own words, as SCST samples them. <pad>, <start> (and <unk> with forbid_unk)
    stay forbidden; the evidence is the caller's (Rules takes it separately)."""
    return dataclasses.replace(settings or DecodeConfig(), **{**{r: False for r in RULES}, **changes})


@dataclass(frozen=True)
class Lexicon:
    """The word ids the rules name, from a vocabulary (Lexicon.of) or written out (tests)."""
    function_words: tuple[int, ...] = ()  # vocab.FUNCTION_WORDS: bigrams ending in one may repeat
    bad_last: tuple[int, ...] = ()  # vocab.BAD_LAST_WORDS: a caption never ends on one (block_salad)
    joiners: tuple[int, ...] = ()  # vocab.REPEAT_JOINERS: "X and X" is a repeat (block_repeats)
    # vocab.bare_colour: after an article and a colour, none of not_after_colour (block_salad)
    articles: tuple[int, ...] = ()
    colours: tuple[int, ...] = ()
    not_after_colour: tuple[int, ...] = ()
    # (word, family) ids: a word and its plural (vocab.singular), a taught word and its source (Vocab.aliases)
    # are one family, named by its smallest id; saying one member is saying them all (block_content_repeats)
    twins: tuple[tuple[int, int], ...] = ()
    # "a" and "an" (SINGULAR_ARTICLES), and the plurals of the vocabulary's words: never one right after the other
    singular_articles: tuple[int, ...] = ()
    plurals: tuple[int, ...] = ()
    # (word, longer word) ids where the longer one right after the word stutters ("bath", "bathroom"): vocab.stutters
    stutters: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, vocab: Vocab) -> "Lexicon":
        """The ids of a Vocab's words the rules name."""
        known = lambda words: tuple(sorted(vocab.stoi[w] for w in words if w in vocab.stoi))  # noqa: E731
        return cls(known(FUNCTION_WORDS), known(BAD_LAST_WORDS), known(REPEAT_JOINERS), known(ARTICLES),
                   known(COLOUR_WORDS), known(NOT_AFTER_COLOUR), word_families(vocab), known(SINGULAR_ARTICLES),
                   plural_ids(vocab), stutter_pairs(vocab))


def _padded(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Lists of word ids -> (len(lists), W) long, each row padded with `pad` (banning <pad> again changes
    nothing: it is always forbidden)."""
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.long, device=device)


def _mask(words: tuple[int, ...], V: int, device: torch.device) -> torch.Tensor:
    """(V,) True at `words`."""
    return torch.zeros(V, dtype=torch.bool, device=device).index_fill_(
        0, torch.tensor(list(words), dtype=torch.long, device=device), True)


class Rule:
    """One next-word rule (the module's docstring): by default it remembers nothing and bans nothing."""

    def tables(self, V: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {}

    def start(self, n: int, device: torch.device) -> Memory:
        return None

    def advance(self, memory: Memory, words: torch.Tensor, t: dict[str, torch.Tensor], V: int) -> Memory:
        """The memory after each row wrote words (M,) (memory already reindexed to those rows; it may be written)."""
        return memory

    def forever(self, memory: Memory) -> torch.Tensor | None:
        return None

    def bans(self, tokens: torch.Tensor, last: torch.Tensor | None, memory: Memory, t: dict[str, torch.Tensor]
             ) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        return None


@lru_cache(maxsize=None)
def tables_of(rule: Rule, V: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A rule's tables, made once per rule, vocabulary size and device and kept for the process; never written to."""
    return rule.tables(V, device)


@dataclass(frozen=True)
class Forbidden(Rule):
    """<pad>, <start> (and <unk> when given): never written."""
    ids: SpecialIds

    def tables(self, V: int, device: torch.device) -> dict[str, torch.Tensor]:
        words = [self.ids.pad, self.ids.start] + ([self.ids.unk] if self.ids.unk is not None else [])
        return {"forbidden": torch.tensor([words], dtype=torch.long, device=device)}  # (1, 2 or 3)

    def bans(self, tokens, last, memory, t):
        return t["forbidden"].expand(len(tokens), -1)  # (N, 2 or 3)


@dataclass(frozen=True)
class RepeatedTrigrams(Rule):
    """block_trigrams: no word w that would repeat a trigram, (tokens[-2], tokens[-1], w) already in the row ("a man
    in a red shirt is wearing a red shirt" cannot write its second "shirt")."""
    pad: int

    def bans(self, tokens, last, memory, t):
        if tokens.shape[1] < 3:
            return None
        follow = tokens[:, 1:]  # (N, t-1): the word after each earlier one
        match = tokens[:, :-1] == tokens[:, -1:]  # (N, t-1): earlier copies of the last word
        two = torch.nn.functional.pad(tokens[:, :-2] == tokens[:, -2:-1], (1, 0))  # (N, t-1): ... after the one before
        return torch.where(match & two, follow, self.pad)  # (N, t-1)


@dataclass(frozen=True)
class RepeatedBigrams(Rule):
    """block_bigrams: no content word w that would repeat a bigram, (tokens[-1], w) already in the row ("a brown and
    white and white", "a blue shirt and blue shirt"); bigrams ending in a function word ("in a ... in a") may."""
    pad: int
    function_words: tuple[int, ...]

    def tables(self, V, device):
        return {"function": _mask(self.function_words, V, device)}  # (V,)

    def bans(self, tokens, last, memory, t):
        if tokens.shape[1] < 2:
            return None
        follow = tokens[:, 1:]  # (N, t-1)
        match = tokens[:, :-1] == tokens[:, -1:]  # (N, t-1): earlier copies of the last word
        return torch.where(match & ~t["function"][follow], follow, self.pad)  # (N, t-1)


@dataclass(frozen=True)
class Salad(Rule):
    """block_salad: no <end> first or after a function word or colour ("... in front of a", "a black and"), no verb
    or preposition right after an article and a colour ("a white sitting", vocab.bare_colour), no plural right after
    "a" or "an" ("a skis", vocab.a_plural), no content word already written SALAD_REPEATS - 1 times (vocab.is_salad;
    counted only where block_content_repeats does not already ban a word said once: `count`)."""
    ids: SpecialIds
    lex: Lexicon
    count: bool

    def tables(self, V, device):
        lex, pad, after = self.lex, self.ids.pad, [[] for _ in range(V + 1)]  # row V: before any word
        after[V].append(self.ids.end)  # a caption without words
        for v in lex.bad_last:
            after[v].append(self.ids.end)
        if lex.singular_articles and lex.plurals:  # "a skis"
            for v in lex.singular_articles:
                after[v].extend(lex.plurals)
        colour = [list(lex.not_after_colour) if v in set(lex.colours) else [] for v in range(V)]
        function = _mask(lex.function_words, V, device)  # (V,)
        return {"after": _padded(after, pad, device),  # (V + 1, W)
                "article": _mask(lex.articles, V, device),  # (V,)
                "not_after_colour": _padded(colour, pad, device),  # (V, m): for a colour, what may not follow "a <it>"
                "content": torch.where(function, pad, torch.arange(V, device=device)),  # (V,): pad for a function word
                "pad": torch.tensor(pad, device=device)}  # (): a row that bans nothing (a tensor: no op to make it)

    def advance(self, memory, words, t, V):
        if not self.count:
            return None
        if memory is None:  # the first word: (counts (M, V), banned (M, V))
            memory = (torch.zeros(len(words), V, dtype=torch.int16, device=words.device),
                      torch.zeros(len(words), V, dtype=torch.bool, device=words.device))
        counts, banned = memory
        w = words.unsqueeze(1)  # (M, 1)
        counts.scatter_add_(1, w, torch.ones_like(w, dtype=counts.dtype))
        again = counts.gather(1, w) >= SALAD_REPEATS - 1  # (M, 1): a content word said that often
        banned.scatter_(1, torch.where(again, t["content"][w], t["pad"]), True)
        return memory

    def forever(self, memory):
        return None if memory is None else memory[1]

    def bans(self, tokens, last, memory, t):
        after = t["after"][-1].expand(len(tokens), -1) if last is None else t["after"][last]  # (N, W)
        if tokens.shape[1] < 2 or not self.lex.not_after_colour:
            return after
        prev = tokens[:, -2:-1]  # (N, 1): "a white" is followed by a noun, not "sitting"
        return after, torch.where(t["article"][prev], t["not_after_colour"][last], t["pad"])  # (N, m)


@dataclass(frozen=True)
class Repeats(Rule):
    """block_repeats: not the last word again ("an airplane airplane"), nor a longer word that starts with it ("a
    bath bathroom": Lexicon.stutters), nor X after "X and" / "X or" ("a black and black dog")."""
    pad: int
    lex: Lexicon

    def tables(self, V, device):
        after: list[list[int]] = [[v] for v in range(V)] + [[]]  # row V: before any word
        for first, longer in self.lex.stutters:
            after[first].append(longer)
        return {"after": _padded(after, self.pad, device), "joiner": _mask(self.lex.joiners, V, device),
                "pad": torch.tensor(self.pad, device=device)}

    def bans(self, tokens, last, memory, t):
        if last is None:
            return None
        after = t["after"][last]  # (N, W)
        if tokens.shape[1] < 2:
            return after
        prev = tokens[:, -2:-1]  # (N, 1)
        return after, torch.where(t["joiner"][last].unsqueeze(1), prev, t["pad"])  # (N, W), (N, 1)


@dataclass(frozen=True)
class ContentRepeats(Rule):
    """block_content_repeats: no content word already written ("a kitchen that is in the kitchen"), its family
    included (Lexicon.twins: no "horse" after "stallion", no "tracks" after "track"). Remembered as each row's
    words banned for good (N, V): writing v bans `said_bans(v)`."""
    pad: int
    lex: Lexicon

    def tables(self, V, device):
        return {"said": _padded(said_bans(self.lex, V), self.pad, device)}  # (V, F)

    def advance(self, memory, words, t, V):
        if memory is None:
            memory = torch.zeros(len(words), V, dtype=torch.bool, device=words.device)  # (M, V)
        return memory.scatter_(1, t["said"][words], True)  # (M, F): the word's family, for good

    def forever(self, memory):
        return memory


def said_bans(lex: Lexicon, V: int) -> list[list[int]]:
    """For each word v, the words that writing it bans for good: its family (a member's own column is its family's;
    a family that is itself a member takes its own family's), function words left out. The rule is a union over
    the words written, so a row's bans are the union of these."""
    family = dict(lex.twins)  # member -> family
    members: dict[int, list[int]] = {}
    for m, f in lex.twins:
        members.setdefault(f, []).append(m)
    function = set(lex.function_words)
    out = []
    for v in range(V):
        said = {v} if v not in family else set()
        said.update(members.get(v, ()))  # the family v names is said
        if v in family:  # v said: its family is said, and so is every member of that family
            said.update(members.get(family[v], ()))
            if family[v] not in family:
                said.add(family[v])
        out.append(sorted(w for w in said if w not in function))
    return out


@dataclass
class RowState:
    """What the rules remember of each live row: one memory per rule (Rules.rules' order), and `named` (N, C), the
    evidence categories each row has named (a bonus to earn), or None."""
    memory: tuple[Memory, ...]
    named: torch.Tensor | None

    def reindexed(self, rows: torch.Tensor) -> "RowState":
        """The state of rows `rows` (M,): the search's surviving rows, in its order."""
        pick = lambda x: None if x is None else tuple(y[rows] for y in x) if isinstance(x, tuple) else x[rows]  # noqa
        return RowState(tuple(pick(m) for m in self.memory), pick(self.named))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the state, in one fixed order (device_beam.State.tensors)."""
        flat = [y for m in self.memory if m is not None for y in (m if isinstance(m, tuple) else (m,))]
        return (*flat, *(() if self.named is None else (self.named,)))


class Rules:
    """Every rule of one decode, built once from its settings (the vocabulary's Lexicon, the photos' Evidence or
    None): `start` each row's state, `scores` a step, `advance` the state with the words chosen (and the rows that
    survive). One object serves a whole search or sampling run."""

    def __init__(self, ids: SpecialIds, settings: DecodeConfig, evidence: Evidence | None = None,
                 lexicon: Lexicon = Lexicon()):
        s, lex, pad = settings, lexicon, ids.pad
        self.ids, self.evidence = ids, evidence
        self.bonus = evidence is not None and evidence.has_bonus
        self.rules: tuple[Rule, ...] = tuple(r for on, r in (
            (True, Forbidden(ids)),
            (s.block_repeats, Repeats(pad, lex)),
            (s.block_salad, Salad(ids, lex, count=not s.block_content_repeats)),
            (s.block_content_repeats, ContentRepeats(pad, lex)),
            (s.block_bigrams, RepeatedBigrams(pad, lex.function_words)),
            (s.block_trigrams, RepeatedTrigrams(pad))) if on)
        self.t: tuple[dict[str, torch.Tensor], ...] = ()  # each rule's tables, for the first logits' vocabulary
        self.V = 0

    def with_evidence(self, evidence: Evidence | None) -> "Rules":
        """These rules with another Evidence (a recorded search's static copy of the same one)."""
        out = copy.copy(self)
        out.evidence = evidence
        return out

    def start(self, n: int) -> RowState:
        """The state of n rows with no word written yet (what needs the vocabulary is made at the first word)."""
        named = self.evidence.words.new_zeros(n, self.evidence.words.shape[1]) if self.bonus else None  # (n, C)
        return RowState(tuple(None for _ in self.rules), named)

    def scores(self, logits: torch.Tensor, tokens: torch.Tensor, state: RowState,
               images: torch.Tensor | None = None) -> torch.Tensor:
        """logits (N, V), tokens (N, t) written so far with their RowState `state`, the image of each row (N,) ->
        the scores (N, V) a search ranks words by: log-probabilities, the evidence's bonus added, every ban (the
        evidence's veto among them) -inf."""
        if not self.t:
            self.V = logits.shape[1]
            self.t = tuple(tables_of(r, self.V, logits.device) for r in self.rules)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
        if self.bonus:  # the evidence's bonus, a bias, before the bans: -inf stays -inf
            logp = logp + self.evidence.bias_after(images, state.named if tokens.shape[1] else None)
        if self.evidence is not None:  # its veto, a ban: the words each row's photo rules out
            logp = logp.masked_fill_(self.evidence.ruled_out[images], NEG)
        last = tokens[:, -1] if tokens.shape[1] else None  # (N,)
        bans = []
        for rule, memory, t in zip(self.rules, state.memory, self.t):
            banned = rule.forever(memory)
            if banned is not None:
                logp = logp.masked_fill_(banned, NEG)
            b = rule.bans(tokens, last, memory, t)
            bans.extend(() if b is None else b if isinstance(b, tuple) else (b,))
        return logp.scatter_(1, torch.cat(bans, 1) if len(bans) > 1 else bans[0], NEG)  # (N, V)

    def advance(self, state: RowState, words: torch.Tensor, rows: torch.Tensor | None = None) -> RowState:
        """The state after each row `rows` (M,) of `state` (all, in order, when None) wrote words (M,), scored by
        `scores` first (as every search does); the state passed in is spent (its tensors may be written)."""
        state = state if rows is None else state.reindexed(rows)
        memory = tuple(r.advance(m, words, t, self.V) for r, m, t in zip(self.rules, state.memory, self.t))
        named = state.named
        if named is not None:
            named = torch.maximum(named, self.evidence.words[words])  # (M, C)
        return RowState(memory, named)
