"""The constrain stage, which words may come next: the next-word rules (one class each; tests/rules_oracle.py
states each literally), the photos' evidence (a veto and a bonus on object words) and Rules, built once per
decode and applied at every step of every search and of sampling. Legend: N live rows, t words so far, B images,
V vocabulary, W words a table row names, C categories.

The evidence (the encoder's ImageNet head often knows better than a Flickr8k decoder whether a dog is there):
    veto (-inf):  w names category k and p[b, k] < evidence_floor (dog: max(evidence_floor, dog_floor)), or w is a
                  person word and the person detector gives P(person) < person_floor
    bonus:        +evidence_bonus * p[b, k] if w names k and is not vetoed, until the caption has named k
With decode.evidence_detectors, p[b, k] is the larger of the head's and the word detector named k's; a word taught
on your photos (Vocab.aliases) inherits its source word's evidence.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ..concepts.detectors import PERSON, WordDetectors, detectors_of
from ..concepts.imagenet import CATEGORIES
from ..concepts.words import word_categories
from ..config import DecodeConfig
from ..vocab import (ARTICLES, BAD_LAST_WORDS, COLOUR_WORDS, FUNCTION_WORDS, NOT_AFTER_COLOUR, REPEAT_JOINERS,
                     SALAD_REPEATS, SINGULAR_ARTICLES, SpecialIds, Vocab, plural_ids, stutter_pairs, word_families)
from .reading import HeadReading

NEG = float("-inf")
RULES: tuple[str, ...] = ("block_trigrams", "block_bigrams", "block_salad", "block_repeats", "block_content_repeats")
Memory = Any  # what one rule remembers of the live rows: a tensor (N, ...) or None


def unruled(settings: DecodeConfig | None = None, **changes: Any) -> DecodeConfig:
    """`settings` (default DecodeConfig()) with every RULES setting off, then `changes` (SCST; <pad>, <start> and
    <unk> with forbid_unk stay forbidden)."""
    return dataclasses.replace(settings or DecodeConfig(), **{**{r: False for r in RULES}, **changes})


@dataclass(frozen=True)
class Lexicon:
    """The word ids the rules name, from a vocabulary (Lexicon.of) or written out (tests)."""
    function_words: tuple[int, ...] = ()  # bigrams ending in one may repeat
    bad_last: tuple[int, ...] = ()  # a caption never ends on one
    joiners: tuple[int, ...] = ()  # "X and X" is a repeat
    articles: tuple[int, ...] = ()  # no not_after_colour after an article and a colour
    colours: tuple[int, ...] = ()
    not_after_colour: tuple[int, ...] = ()
    twins: tuple[tuple[int, int], ...] = ()  # (word, family): a word, its plural, a taught word and its source
    singular_articles: tuple[int, ...] = ()  # never a plural right after one
    plurals: tuple[int, ...] = ()
    stutters: tuple[tuple[int, int], ...] = ()  # (word, longer word): "bath bathroom"

    @classmethod
    def of(cls, vocab: Vocab) -> "Lexicon":
        known = lambda words: tuple(sorted(vocab.stoi[w] for w in words if w in vocab.stoi))  # noqa: E731
        return cls(known(FUNCTION_WORDS), known(BAD_LAST_WORDS), known(REPEAT_JOINERS), known(ARTICLES),
                   known(COLOUR_WORDS), known(NOT_AFTER_COLOUR), word_families(vocab), known(SINGULAR_ARTICLES),
                   plural_ids(vocab), stutter_pairs(vocab))


def _padded(lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Lists of word ids -> (len(lists), W) long, padded with `pad` (always banned anyway)."""
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.long, device=device)


def _mask(words: tuple[int, ...], V: int, device: torch.device) -> torch.Tensor:  # (V,) True at `words`
    return torch.zeros(V, dtype=torch.bool, device=device).index_fill_(
        0, torch.tensor(list(words), dtype=torch.long, device=device), True)


class Rule:
    """One next-word rule: `tables(V, device)` made once per process (a recorded search reads them by address),
    `advance` what it remembers of each row, `bans` this step's banned ids (N, m) (<pad>: none), `forever` the
    (N, V) words banned for good. A step's work does not grow with the words written; nothing is read back.
    By default a rule remembers and bans nothing."""

    def tables(self, V: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {}

    def advance(self, memory: Memory, words: torch.Tensor, t: dict[str, torch.Tensor], V: int) -> Memory:
        return memory  # after rows wrote words (M,); memory already reindexed to them, and writable

    def forever(self, memory: Memory) -> torch.Tensor | None:
        return None

    def bans(self, tokens: torch.Tensor, last: torch.Tensor | None, memory: Memory, t: dict[str, torch.Tensor]
             ) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        return None


@lru_cache(maxsize=None)
def tables_of(rule: Rule, V: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A rule's tables, made once per rule, V and device; never written to."""
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
    """block_trigrams: no w repeating a trigram (tokens[-2], tokens[-1], w) of the row."""
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
    """block_bigrams: no content word w repeating a bigram (tokens[-1], w) of the row ("a blue shirt and blue
    shirt"); bigrams ending in a function word may repeat."""
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
    """block_salad: no <end> first or after a BAD_LAST_WORDS word ("in front of a"), nothing of not_after_colour
    after an article and a colour ("a white sitting"), no plural after "a"/"an" ("a skis"), no content word
    written SALAD_REPEATS - 1 times (`count`: only without block_content_repeats, which bans it sooner)."""
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
                "not_after_colour": _padded(colour, pad, device),  # (V, m): what may not follow "a <colour>"
                "content": torch.where(function, pad, torch.arange(V, device=device)),  # (V,): pad for a function word
                "pad": torch.tensor(pad, device=device)}  # (): a row that bans nothing

    def advance(self, memory, words, t, V):
        if not self.count:
            return None
        if memory is None:  # the first word: (counts (M, V), banned (M, V))
            memory = (torch.zeros(len(words), V, dtype=torch.int16, device=words.device),
                      torch.zeros(len(words), V, dtype=torch.bool, device=words.device))
        counts, banned = memory
        w = words.unsqueeze(1)  # (M, 1)
        counts.scatter_add_(1, w, torch.ones_like(w, dtype=counts.dtype))
        again = counts.gather(1, w) >= SALAD_REPEATS - 1  # (M, 1)
        banned.scatter_(1, torch.where(again, t["content"][w], t["pad"]), True)
        return memory

    def forever(self, memory):
        return None if memory is None else memory[1]

    def bans(self, tokens, last, memory, t):
        after = t["after"][-1].expand(len(tokens), -1) if last is None else t["after"][last]  # (N, W)
        if tokens.shape[1] < 2 or not self.lex.not_after_colour:
            return after
        prev = tokens[:, -2:-1]  # (N, 1)
        return after, torch.where(t["article"][prev], t["not_after_colour"][last], t["pad"])  # (N, m)


@dataclass(frozen=True)
class Repeats(Rule):
    """block_repeats: not the last word again, nor a stutter of it ("bath bathroom"), nor X after "X and"."""
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
    """block_content_repeats: no content word or member of its family (Lexicon.twins) written twice; remembered
    as each row's words banned for good (N, V)."""
    pad: int
    lex: Lexicon

    def tables(self, V, device):
        """"said" (V, F): what writing v bans for good: v, its family and the family's members (no function word)."""
        lex = self.lex
        family = dict(lex.twins)  # member -> family
        members: dict[int, list[int]] = {}
        for m, f in lex.twins:
            members.setdefault(f, []).append(m)
        function, out = set(lex.function_words), []
        for v in range(V):
            said = {v} if v not in family else set()
            said.update(members.get(v, ()))  # the family v names
            if v in family:  # v's family and its every member
                said.update(members.get(family[v], ()))
                if family[v] not in family:
                    said.add(family[v])
            out.append(sorted(w for w in said if w not in function))
        return {"said": _padded(out, self.pad, device)}  # (V, F)

    def advance(self, memory, words, t, V):
        if memory is None:
            memory = torch.zeros(len(words), V, dtype=torch.bool, device=words.device)  # (M, V)
        return memory.scatter_(1, t["said"][words], True)  # (M, F): the word's family, for good

    def forever(self, memory):
        return memory


def ruled_out_words(probs: torch.Tensor, words: torch.Tensor, floor: float | torch.Tensor,
                    person: tuple[torch.Tensor, torch.Tensor] | None = None, person_floor: float = 0.0) -> torch.Tensor:
    """probs (B, C), words (V, C), floor (one or (C,)) -> (B, V) 1 where the word names a category below its floor,
    or (person: P(person) (B,), person words (V,)) is a person word with P(person) < person_floor > 0."""
    out = (probs < floor).float() @ words.t().to(probs)  # (B, V)
    if person is None or person_floor <= 0:
        return out
    below = (person[0].to(probs) < person_floor).float()[:, None] * person[1].to(probs)[None, :]  # (B, V)
    return (out + below).clamp(max=1)


def checked_detectors(model: torch.nn.Module, settings: DecodeConfig) -> WordDetectors | None:
    """The model's word detectors; a ValueError when person_floor needs a person detector it lacks."""
    det = detectors_of(model)
    if settings.person_floor > 0 and (det is None or PERSON not in det.groups):
        raise ValueError(f"decode.person_floor={settings.person_floor} needs a model file with a person detector "
                         "(captioner-train-detectors writes one); set decode.person_floor=0 for this model")
    return det


def person_word_mask(vocab: Vocab, det: WordDetectors) -> torch.Tensor:
    """(V,) 0/1: the person detector's words and the words taught from them (cached; each call its own copy)."""
    taught = tuple((w, vocab.source(w)) for w in sorted(vocab.aliases))
    return _person_words(tuple(vocab.itos), frozenset(det.members.get(PERSON, ())), taught).clone()


@lru_cache(maxsize=8)
def _person_words(itos: tuple[str, ...], names: frozenset[str], taught: tuple[tuple[str, str], ...]) -> torch.Tensor:
    source = dict(taught)
    return torch.tensor([float(w in names or source.get(w, w) in names) for w in itos])  # (V,)


class Evidence:
    """The photos' veto and bonus: probs (B, C), words (V, C) (word_categories), person (P(person) (B,), person
    words (V,)) or None, seen (B, C) what rules a category out if not probs -> `ruled_out` (B, V), `bonus` (B, C)."""

    def __init__(self, probs: torch.Tensor, words: torch.Tensor, settings: DecodeConfig,
                 person: tuple[torch.Tensor, torch.Tensor] | None = None, seen: torch.Tensor | None = None):
        self.words = words.to(probs)  # (V, C)
        self.person = person  # read by the choice
        floors = torch.full((probs.shape[1],), float(settings.evidence_floor))  # (C,)
        if probs.shape[1] == len(CATEGORIES):  # dog's raised: Flickr8k's wrong dogs have P(dog) .05-.5
            floors[CATEGORIES.index("dog")] = max(settings.evidence_floor, settings.dog_floor)
        floors = floors.to(probs)
        out = ruled_out_words(probs if seen is None else seen.to(probs), self.words, floors, person,
                              settings.person_floor)  # (B, V)
        self.ruled_out = out > 0  # (B, V): banned by Rules, marked contradicted on a Caption
        self.bonus = settings.evidence_bonus * probs * (probs >= floors).float()  # (B, C)
        self.has_bonus = bool(settings.evidence_bonus) and bool((self.bonus > 0).any())  # else no bias at all

    def bias_after(self, images: torch.Tensor, named: torch.Tensor | None) -> torch.Tensor:
        """images (N,), categories each row has named (N, C) 0/1 or None -> the bias (N, V) of each next word:
        each category's bonus until the row has named it."""
        bonus = self.bonus[images]  # (N, C)
        if named is not None:
            bonus = bonus * (1 - named)
        return bonus @ self.words.t()  # (N, V)

    def word_bias(self, image: int, tokens: list[int]) -> torch.Tensor:
        """(L,) the bias each word of an image's caption got when chosen (decoding score - model log-prob)."""
        return self.word_biases([image], [tokens])[0, :len(tokens)]

    def word_biases(self, images: list[int], tokens: list[list[int]]) -> torch.Tensor:
        """word_bias of many captions at once: caption i of image images[i] -> (N, L), 0 after its end."""
        (V, C), L = self.words.shape, max(map(len, tokens), default=0)
        out = self.bonus.new_zeros(len(tokens), L)  # (N, L)
        if not self.has_bonus or not L:
            return out
        t = torch.tensor([w + [V] * (L - len(w)) for w in tokens], dtype=torch.long).view(len(tokens), L)
        t, image = t.to(self.words.device), torch.tensor(images, dtype=torch.long).to(self.words.device)  # (N,)
        named = torch.cat([self.words, self.words.new_zeros(1, C)])[t]  # (N, L, C); padding names none
        before = torch.cat([torch.zeros_like(named[:, :1]), named.cummax(1).values[:, :-1]], 1)  # (N, L, C)
        return ((self.bonus[image][:, None, :] * (1 - before)) * named).sum(-1)  # (N, L): bias_after at each step


def detected_probs(probs: torch.Tensor, det: WordDetectors | None, detections: torch.Tensor | None
                   ) -> torch.Tensor:
    """probs (B, C) -> (B, C): where a word detector is named after category k ("horse"), the larger of the
    head's P(k) and the detector's (the head has one horse class; the detector sees most horses)."""
    if det is None or detections is None:
        return probs
    out = probs.clone()
    for k, cat in enumerate(CATEGORIES):
        if cat in det.groups:
            out[:, k] = torch.maximum(probs[:, k], detections[:, det.groups.index(cat)].to(probs))
    return out


def photo_evidence(reading: HeadReading, model: torch.nn.Module, vocab: Vocab, settings: DecodeConfig
                   ) -> Evidence | None:
    """The photos' Evidence from their reading (None without the ImageNet head): decoding applies it with
    decode.evidence; a Caption's contradicted words are its `ruled_out` either way."""
    det = checked_detectors(model, settings)
    if reading.probs is None:
        return None
    words = word_categories(vocab).to(reading.probs.device)  # (V, C)
    person = None
    if det is not None and reading.seen is not None:
        person = (reading.seen[:, det.groups.index(PERSON)], person_word_mask(vocab, det).to(reading.probs.device))
    seen = None
    if settings.evidence_detectors:
        seen = detected_probs(reading.probs, det, reading.seen)
    elif vocab.aliases and det is not None and reading.seen is not None:  # a taught word's category: its detector
        taught = words[[vocab.stoi[w] for w in vocab.aliases]].amax(0) > 0  # (C,) categories a taught word names
        seen = torch.where(taught, detected_probs(reading.probs, det, reading.seen), reading.probs)  # (B, C)
    return Evidence(reading.probs, words, settings, person, seen)


@dataclass
class RowState:
    """What the rules remember of the live rows: a memory per rule, the categories each has named (N, C) or None."""
    memory: tuple[Memory, ...]
    named: torch.Tensor | None

    def reindexed(self, rows: torch.Tensor) -> "RowState":
        pick = lambda x: None if x is None else tuple(y[rows] for y in x) if isinstance(x, tuple) else x[rows]  # noqa
        return RowState(tuple(pick(m) for m in self.memory), pick(self.named))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        flat = [y for m in self.memory if m is not None for y in (m if isinstance(m, tuple) else (m,))]
        return (*flat, *(() if self.named is None else (self.named,)))


class Rules:
    """One decode's rules from its settings, Lexicon and Evidence (or None): `start` the rows' state, `scores` a
    step, `advance` the state with the words chosen."""

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
        """These rules with another Evidence (a recorded search's static copy)."""
        out = copy.copy(self)
        out.evidence = evidence
        return out

    def start(self, n: int) -> RowState:
        """The state of n rows with no word written yet."""
        named = self.evidence.words.new_zeros(n, self.evidence.words.shape[1]) if self.bonus else None  # (n, C)
        return RowState(tuple(None for _ in self.rules), named)

    def scores(self, logits: torch.Tensor, tokens: torch.Tensor, state: RowState,
               images: torch.Tensor | None = None) -> torch.Tensor:
        """logits (N, V), tokens (N, t), their RowState, each row's image (N,) -> scores (N, V): log-probabilities
        plus the evidence's bonus, every ban (the veto among them) -inf."""
        if not self.t:
            self.V = logits.shape[1]
            self.t = tuple(tables_of(r, self.V, logits.device) for r in self.rules)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
        if self.bonus:  # before the bans: -inf stays -inf
            logp = logp + self.evidence.bias_after(images, state.named if tokens.shape[1] else None)
        if self.evidence is not None:  # the veto
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
        """The state after rows `rows` (M,) of `state` (None: all) wrote words (M,), scored by `scores` first; the
        state passed in is spent (its tensors may be written)."""
        state = state if rows is None else state.reindexed(rows)
        memory = tuple(r.advance(m, words, t, self.V) for r, m, t in zip(self.rules, state.memory, self.t))
        named = state.named
        if named is not None:
            named = torch.maximum(named, self.evidence.words[words])  # (M, C)
        return RowState(memory, named)
