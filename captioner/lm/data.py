"""The language model's text: sentences, the COCO categories each one names, the extended
vocabulary, length-grouped batches, and the concept noise of training.

Legend: S sentences, B batch, T steps, C concepts (COCO categories in `list(CATEGORY_WORDS)` order).

Sources: Flickr8k captions of the official split (train for training, dev for validation; the test
split is never read, so the LM cannot leak test captions into evaluation) and the COCO caption text
(captions_val2017_text.json, no photos), of which ~5% of the images are held out for validation,
all captions of an image on the same side. Sentences are tokenised with captioner.vocab.tokenize,
and the categories a sentence names are found with grounding.words.match_words (two-word names
first, so "hot dog" is not a dog). Person is never a condition: no ImageNet class observes it, so
at test time its column is always 0; training it would only teach a signal that never comes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..data.flickr8k import load_flickr8k
from ..concepts.words import CATEGORY_WORDS, match_words, word_table
from .model import extend_vocab
from ..vocab import Vocab, tokenize

CATEGORIES: list[str] = list(CATEGORY_WORDS)
UNOBSERVED: tuple[str, ...] = ("person",)  # categories the test-time classifier never reports


def flickr8k_captions(root: str | Path, split: str) -> list[str]:
    """All captions of the images of one official Flickr8k split ('train', 'val' = dev, 'test')."""
    return [c for r in load_flickr8k(root, split) for c in r.captions]


def coco_captions(path: str | Path, holdout: float = 0.05) -> tuple[list[str], list[str]]:
    """(train, val) captions of an official COCO caption JSON; every round(1 / holdout)-th image (by
    sorted id) goes to val, with all its captions."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        anns = [(a["image_id"], a["caption"]) for a in data["annotations"]]
    except FileNotFoundError:
        raise FileNotFoundError(f"COCO caption file not found: {path}") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a COCO caption JSON (needs 'annotations' with image_id and caption): {e}") from None
    every = max(1, round(1 / holdout)) if holdout > 0 else 0
    val_ids = set(sorted({i for i, _ in anns})[::every]) if every else set()
    return [c for i, c in anns if i not in val_ids], [c for i, c in anns if i in val_ids]


def observable_mask(categories: Sequence[str] = CATEGORIES, unobserved: Sequence[str] = UNOBSERVED) -> torch.Tensor:
    """(C,) bool: False for the categories never observed at test time (person)."""
    return torch.tensor([c not in unobserved for c in categories])


def named_concepts(sentences: Sequence[Sequence[str]], categories: Sequence[str] = CATEGORIES,
                   unobserved: Sequence[str] = UNOBSERVED) -> torch.Tensor:
    """Tokenised sentences (S,) -> (S, C) multi-hot float of the categories each names; the unobserved
    categories' columns are always 0."""
    table, col = word_table(categories), {c: j for j, c in enumerate(categories)}
    out = torch.zeros(len(sentences), len(categories))  # (S, C)
    for i, words in enumerate(sentences):
        for _, cat in match_words(words, table):
            out[i, col[cat]] = 1.0
    return out * observable_mask(categories, unobserved)


@dataclass
class Encoded:
    """Sentences as ids: tokens (S, T+2) = <start> w1 .. wn <end>, padded with <pad> (0)."""
    tokens: torch.Tensor  # (S, T + 2) long
    lengths: torch.Tensor  # (S,) words + 2
    concepts: torch.Tensor  # (S, C) named categories (multi-hot)

    def __len__(self) -> int:
        return self.tokens.shape[0]


def encode(sentences: Sequence[Sequence[str]], vocab: Vocab, categories: Sequence[str] = CATEGORIES) -> Encoded:
    """Tokenised sentences -> Encoded; words outside the vocabulary become <unk>."""
    T = max((len(s) for s in sentences), default=0) + 2
    tokens = torch.zeros(len(sentences), T, dtype=torch.long)  # (S, T + 2)
    for i, s in enumerate(sentences):
        ids = [vocab.start] + [vocab.stoi.get(w, vocab.unk) for w in s] + [vocab.end]
        tokens[i, :len(ids)] = torch.tensor(ids)
    lengths = torch.tensor([len(s) + 2 for s in sentences], dtype=torch.long)
    return Encoded(tokens, lengths, named_concepts(sentences, categories))


@dataclass
class Corpus:
    vocab: Vocab  # extended: the captioner's words first
    train: Encoded
    val: Encoded
    counts: dict[str, int]  # sentences per source and side


def build_corpus(flickr_root: str | Path, coco_json: str | Path, captioner_vocab: Vocab, min_count: int = 5,
                 max_len: int = 30, holdout: float = 0.05) -> Corpus:
    """Training and validation sentences of both sources, and the extended vocabulary built from the
    TRAINING sentences only. Sentences longer than max_len words (rare run-ons) and empty ones are dropped."""
    coco_train, coco_val = coco_captions(coco_json, holdout)
    raw = {"flickr8k_train": flickr8k_captions(flickr_root, "train"), "coco_train": coco_train,
           "flickr8k_val": flickr8k_captions(flickr_root, "val"), "coco_val": coco_val}
    toks = {k: [t for t in map(tokenize, v) if 0 < len(t) <= max_len] for k, v in raw.items()}
    train = toks["flickr8k_train"] + toks["coco_train"]
    val = toks["flickr8k_val"] + toks["coco_val"]
    vocab = extend_vocab(captioner_vocab, train, min_count)
    return Corpus(vocab, encode(train, vocab), encode(val, vocab), {k: len(v) for k, v in toks.items()})


def batches(data: Encoded, batch_size: int, generator: torch.Generator | None = None
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(inputs (B, T), targets (B, T), concepts (B, C)) batches of sentences of similar length, so
    little padding is computed. With a generator: random batches in random order (training); without:
    a fixed order (evaluation)."""
    n = len(data)
    jitter = torch.rand(n, generator=generator) if generator is not None else torch.zeros(n)
    order = torch.argsort(data.lengths.float() + jitter)  # by length, ties broken at random
    chunks = list(order.split(batch_size))
    if generator is not None:
        chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=generator).tolist()]
    for idx in chunks:
        T = int(data.lengths[idx].max())
        seq = data.tokens[idx, :T]  # (B, T + 1 words incl. <start>/<end>)
        yield seq[:, :-1], seq[:, 1:], data.concepts[idx]


def corrupt_concepts(named: torch.Tensor, observable: torch.Tensor, drop: float = 0.3, distractors: float = 2.0,
                     low: float = 0.3, generator: torch.Generator | None = None) -> torch.Tensor:
    """Training-time condition from the named categories: named (B, C) multi-hot -> (B, C) in [0, 1].

    Each named category is kept with probability 1 - drop, at a value drawn from U(low, 1); each
    category the sentence does not name becomes a distractor with probability distractors / C, at a
    value from U(0, low); unobservable columns are 0.

    Why: at test time the condition is a classifier's soft probabilities, not a clean multi-hot.
    The classifier misses objects the caption will name (drop teaches the LM to still speak, and
    name objects, from the words alone), reports objects with any confidence (random values teach
    "more probable, more likely to be named" rather than "exactly 1"), and reports objects that are
    not there or that a caption would not mention, usually with low probability (distractors teach
    that a weak signal is a hint, not an order). The values of present and absent categories
    overlap only at `low`, so the LM can still tell a confident detection from noise.
    """
    rand = lambda: torch.rand(named.shape, generator=generator)  # noqa: E731
    kept = (named > 0) & (rand() >= drop)  # (B, C)
    extra = (named <= 0) & (rand() < distractors / named.shape[1])  # (B, C)
    values = kept * (low + (1 - low) * rand()) + extra * (low * rand())
    return values * observable
