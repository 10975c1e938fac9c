"""Tokenizer and vocabulary.

The tokenizer needs no downloaded data (nltk's punkt is not available offline): lowercase,
split off punctuation, keep word-internal apostrophes and hyphens ("man's", "t-shirt").
`tokenize` (a-z and digits) builds vocabularies and encodes training captions; `tokenize_typed`
splits a sentence a person typed (Captioner.explain): every word is kept as typed, in any script
("café", "naïve", "犬"), lowercased, so a word the vocabulary lacks is reported, never mangled.
On ASCII text the two agree (tests/test_explain.py checks it on every Flickr8k caption).
"""
from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Container, Iterable, Sequence

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)

_TOKEN = re.compile(r"[a-z0-9]+(?:['\-][a-z0-9]+)*")

# words that carry grammar, not content: a caption ending in one is cut short (metrics, SCST's penalty);
# repeating a bigram that ends in one is ordinary English ("in a ... in a"), unlike "blue shirt ... blue shirt"
FUNCTION_WORDS = frozenset("a an the of with in on at to for from by and or is are his her its their".split())
COLOUR_WORDS = frozenset("white black brown red blue green yellow orange pink purple grey gray tan silver gold".split())
# word salad: a caption that ends on one of these ("a brown and white is standing in front of a",
# "... with a black and") or names a content word three times ("a brown and brown and white brown dog")
BAD_LAST_WORDS = FUNCTION_WORDS | COLOUR_WORDS
SALAD_REPEATS = 3
# "a white sitting on a toilet": a colour right after an article names a thing next ("a white dog", "a white and
# black dog"), never a verb or a preposition (an adjective with no noun: salad too)
ARTICLES = frozenset({"a", "an", "the"})
SINGULAR_ARTICLES = frozenset({"a", "an"})  # never right before a plural ("a skis", "an elephants"): a_plural
NOT_AFTER_COLOUR = (FUNCTION_WORDS - {"and", "or"}) | frozenset(
    "sitting standing laying lying running walking riding playing jumping holding looking eating flying swimming "
    "sits stands lays lies runs walks rides plays jumps holds looks eats flies swims".split())


# "X and X" ("a black and black dog"): a word said again right after one of these is a repeat too
REPEAT_JOINERS = frozenset({"and", "or"})


# a word and its plural are one content word ("a train traveling down a track tracks"): the irregular plurals,
# and plural-looking words that name another thing than their singular ("shorts" are not several "short")
IRREGULAR_PLURALS = {"men": "man", "women": "woman", "children": "child", "people": "person", "feet": "foot",
                     "teeth": "tooth", "geese": "goose", "mice": "mouse", "knives": "knife", "leaves": "leaf",
                     "wolves": "wolf", "shelves": "shelf", "calves": "calf", "oxen": "ox"}
NOT_PLURALS = frozenset("shorts glasses sunglasses woods news goods clothes".split())


def singular(word: str, known: Container[str]) -> str:
    """The singular of a plural whose singular is in `known` (a vocabulary, a caption's words): "tracks" ->
    "track", "buses" -> "bus", "puppies" -> "puppy", "men" -> "man"; any other word is itself."""
    if word in NOT_PLURALS or word in FUNCTION_WORDS:
        return word
    es = word.endswith(("ses", "xes", "zes", "ches", "shes", "oes"))  # "buses", "boxes", "watches" (not "capes")
    cands = [IRREGULAR_PLURALS.get(word, ""), word[:-3] + "y" if word.endswith("ies") else "",
             word[:-1] if word.endswith("s") else "", word[:-2] if es else ""]
    return next((c for c in cands if len(c) >= 3 and c in known and c not in FUNCTION_WORDS), word)


def stutters(first: str, second: str) -> bool:
    """Whether `second`, right after `first`, says `first` again as the start of a longer word: "a bath
    bathroom", "a snow snowboarder" (`first` a content word of 3+ letters, `second` longer by 3+ letters)."""
    return (len(first) >= 3 and len(second) >= len(first) + 3 and second.startswith(first)
            and first not in FUNCTION_WORDS)


def repeats(words: Sequence[str]) -> dict[str, bool]:
    """Which kinds of repeated word a caption (its words) has: `adjacent` a word twice back to back ("an
    airplane airplane") or again as the start of the next word ("a bath bathroom", stutters), `x_and_x` a word again after "and"/"or" ("a black and black dog"), `content` a
    content word (not in FUNCTION_WORDS) said twice anywhere, its plural included ("a kitchen that is in the
    kitchen", "a track tracks"). Decoding with decode.block_repeats writes none of them (decoding/rules.py)."""
    said = set(words)
    counts = Counter(singular(w, said) for w in words if w not in FUNCTION_WORDS)
    return {"adjacent": any(a == b or stutters(a, b) for a, b in zip(words, words[1:])),
            "x_and_x": any(a == c and b in REPEAT_JOINERS for a, b, c in zip(words, words[1:], words[2:])),
            "content": bool(counts) and max(counts.values()) >= 2}


def is_salad(words: Sequence[str], known: Container[str] = ()) -> bool:
    """Whether a caption (its words) is word salad: empty, ending on a function word or a colour, a colour
    after an article with no noun ("a white sitting", NOT_AFTER_COLOUR), "a" or "an" before a plural of a word in
    `known` (a vocabulary: a_plural), or naming one content word SALAD_REPEATS times. Decoding with
    decode.block_salad never writes one."""
    if not words or words[-1] in BAD_LAST_WORDS or any(bare_colour(words[k - 2:k + 1]) for k in range(2, len(words))):
        return True
    if any(a_plural(words[k:k + 2], known) for k in range(len(words) - 1)):
        return True
    counts = Counter(w for w in words if w not in FUNCTION_WORDS)
    return bool(counts) and max(counts.values()) >= SALAD_REPEATS


def a_plural(two: Sequence[str], known: Container[str]) -> bool:
    """"a" or "an" and then a plural whose singular is in `known` (vocab.singular): ("a", "skis") where "ski" is."""
    return len(two) == 2 and two[0] in SINGULAR_ARTICLES and singular(two[1], known) != two[1]


def bare_colour(three: Sequence[str]) -> bool:
    """An article, a colour and then no noun: ("a", "white", "sitting") but not ("a", "white", "dog")."""
    return len(three) == 3 and three[0] in ARTICLES and three[1] in COLOUR_WORDS and three[2] in NOT_AFTER_COLOUR


def tokenize(text: str) -> list[str]:
    """'A dog, running!' -> ['a', 'dog', 'running']. Punctuation is dropped, as in the
    standard PTB-tokenised caption evaluation."""
    return _TOKEN.findall(text.lower())


_SEPARATORS = "'-"  # joined inside a word ("man's", "t-shirt"); a run of them splits it
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u2010": "-", "\u2011": "-"})


def tokenize_typed(text: str) -> list[str]:
    """A typed sentence -> its words, each kept as typed (NFC, lowercased): letters of any script,
    accents, digits, word-internal apostrophes and hyphens; every other character separates words.
    'Très  naïve, café!' -> ['très', 'naïve', 'café']; '!!! ...' -> []."""
    text = unicodedata.normalize("NFC", text).lower().translate(_APOSTROPHES)
    kept = "".join(c if c in _SEPARATORS or unicodedata.category(c)[0] in "LMN" else " " for c in text)
    return [w for piece in kept.split() for part in re.split(r"['\-]{2,}", piece)
            if (w := part.strip(_SEPARATORS))]


@dataclass
class VocabStats:
    size: int
    n_captions: int
    n_tokens: int
    unk_rate: float
    length_mean: float
    length_percentiles: dict[str, int]
    truncated: int

    def __str__(self) -> str:
        p = self.length_percentiles
        return (
            f"vocabulary: {self.size} words (incl. 4 specials) from {self.n_captions} captions, "
            f"{self.n_tokens} tokens; UNK rate {self.unk_rate:.2%}; caption length mean "
            f"{self.length_mean:.1f}, p50 {p['p50']}, p90 {p['p90']}, p99 {p['p99']}, max {p['max']}; "
            f"{self.truncated} captions longer than the cap"
        )


class Vocab:
    def __init__(self, words: Sequence[str], aliases: dict[str, str] | None = None):
        """`aliases`: a word taught from an old one (training/new_words.py: "stallion" started as "horse") ->
        that old word. The two name one thing: saying both is a repeat (decode.block_content_repeats)."""
        if tuple(words[:4]) != SPECIALS:
            raise ValueError(f"vocabulary must start with {SPECIALS}, got {list(words[:4])}")
        self.itos: list[str] = list(words)
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("vocabulary has duplicate words")
        self.aliases: dict[str, str] = {}
        for new, old in (aliases or {}).items():
            self.alias(new, old)

    def alias(self, new: str, old: str) -> None:
        """Record that `new` stands for `old` (both vocabulary words; saved with the vocabulary)."""
        if new not in self.stoi or old not in self.stoi:
            raise ValueError(f"vocabulary alias {new!r} -> {old!r}: both must be vocabulary words")
        self.aliases[new] = old

    def source(self, word: str) -> str:
        """The old word a taught word stands for, following aliases to the end ("stallion" -> "horse"); any
        other word is its own source. Evidence-aware decoding gives a taught word its source's evidence."""
        seen = {word}
        while word in self.aliases and self.aliases[word] not in seen:
            word = self.aliases[word]
            seen.add(word)
        return word

    pad = property(lambda self: 0)
    start = property(lambda self: 1)
    end = property(lambda self: 2)
    unk = property(lambda self: 3)

    def __len__(self) -> int:
        return len(self.itos)

    @classmethod
    def build(cls, captions: Iterable[str], min_count: int = 5) -> "Vocab":
        counts = Counter(w for c in captions for w in tokenize(c))
        # sorted by frequency then alphabetically: the same captions always give the same ids
        words = sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))
        return cls(list(SPECIALS) + words)

    def extended(self, captions: Iterable[str], min_count: int = 5) -> "Vocab":
        """This vocabulary plus the words of `captions` seen >= min_count times that it lacks, appended in
        build()'s order: every old word keeps its id (a warm start keeps its embedding and output rows)."""
        new = [w for w in Vocab.build(captions, min_count).itos[len(SPECIALS):] if w not in self.stoi]
        return Vocab(self.itos + new, self.aliases)

    def encode(self, caption: str, max_len: int | None = None) -> list[int]:
        """Caption -> [<start>, w1, ..., wn, <end>] ids, truncating to max_len words."""
        words = tokenize(caption)
        if max_len is not None:
            words = words[:max_len]
        return [self.start] + [self.stoi.get(w, self.unk) for w in words] + [self.end]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Ids -> words, stopping at <end>, skipping <start>/<pad>."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.end:
                break
            if i in (self.start, self.pad):
                continue
            out.append(self.itos[i])
        return out

    def stats(self, captions: Sequence[str], max_len: int = 50) -> VocabStats:
        lengths, unk, total = [], 0, 0
        for c in captions:
            words = tokenize(c)
            lengths.append(len(words))
            total += len(words)
            unk += sum(1 for w in words if w not in self.stoi)
        lengths.sort()
        pct = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))] if lengths else 0  # noqa: E731
        return VocabStats(
            size=len(self),
            n_captions=len(captions),
            n_tokens=total,
            unk_rate=unk / max(total, 1),
            length_mean=total / max(len(captions), 1),
            length_percentiles={"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": lengths[-1] if lengths else 0},
            truncated=sum(1 for n in lengths if n > max_len),
        )

    def to_json(self) -> str:
        return json.dumps({"itos": self.itos, **({"aliases": self.aliases} if self.aliases else {})})

    @classmethod
    def from_json(cls, text: str) -> "Vocab":
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("itos"), list):
            raise ValueError("vocabulary JSON must be an object with an 'itos' list of words")
        if not all(isinstance(w, str) for w in data["itos"]):
            raise ValueError("vocabulary JSON: every entry of 'itos' must be a string")
        aliases = data.get("aliases", {})
        if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
            raise ValueError("vocabulary JSON: 'aliases' must map words to words")
        return cls(data["itos"], aliases)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Vocab":
        return cls.from_json(Path(path).read_text())


@dataclass(frozen=True)
class SpecialIds:
    """The token ids decoding (decoding/search.py, sampling.py) treats specially: <start> begins, <end> finishes,
    <pad> and <start> are never generated, and <unk> (when given) is never generated either. The words the
    decoding rules name are decoding/rules.py's (Lexicon)."""
    start: int
    end: int
    pad: int = 0
    unk: int | None = None

    @classmethod
    def of(cls, vocab: "Vocab", forbid_unk: bool = True) -> "SpecialIds":
        """From a Vocab; forbid_unk is config.decode.forbid_unk (a caption for people never says "<unk>")."""
        return cls(vocab.start, vocab.end, vocab.pad, vocab.unk if forbid_unk else None)


def plural_ids(vocab: Vocab) -> tuple[int, ...]:
    """The ids of the vocabulary's plurals whose singular it holds (vocab.singular), made once per vocabulary."""
    return _plurals(tuple(vocab.itos))


def word_families(vocab: Vocab) -> tuple[tuple[int, int], ...]:
    """(word id, family id) for every vocabulary word in a family of several: plurals with their singular
    ("tracks", "track"), taught words with their source ("stallion", "horse"); a family is named by its
    smallest id, and chains join ("stallions" -> "stallion" -> "horse"). Built once per vocabulary and its
    aliases (a loop over every word's plural form, which each decode asked for again)."""
    return _word_families(tuple(vocab.itos), tuple(sorted(vocab.aliases.items())))


def stutter_pairs(vocab: Vocab) -> tuple[tuple[int, int], ...]:
    """(word id, longer word id) for every pair of vocabulary words where the longer one, right after the word,
    stutters (stutters: "bath" then "bathroom"), made once per vocabulary."""
    return _stutter_pairs(tuple(vocab.itos))


@lru_cache(maxsize=8)
def _plurals(itos: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of the vocabulary's plurals whose singular it holds (vocab.singular), made once per vocabulary."""
    known = frozenset(itos)
    return tuple(i for i, w in enumerate(itos) if singular(w, known) != w)


@lru_cache(maxsize=8)
def _stutter_pairs(itos: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    stoi = {w: i for i, w in enumerate(itos)}
    return tuple((stoi[w[:k]], i) for i, w in enumerate(itos) for k in range(3, len(w) - 2)
                 if w[:k] in stoi and stutters(w[:k], w))


@lru_cache(maxsize=8)
def _word_families(itos: tuple[str, ...], aliases: tuple[tuple[str, str], ...]) -> tuple[tuple[int, int], ...]:
    stoi = {w: i for i, w in enumerate(itos)}
    family = list(range(len(itos)))

    def root(i: int) -> int:
        while family[i] != i:
            i = family[i]
        return i

    pairs = [(stoi[new], stoi[old]) for new, old in aliases]
    pairs += [(i, stoi[one]) for i, w in enumerate(itos) if (one := singular(w, stoi)) != w]
    for a, b in pairs:
        ra, rb = root(a), root(b)
        family[max(ra, rb)] = min(ra, rb)
    return tuple((i, root(i)) for i in range(len(itos)) if root(i) != i)
