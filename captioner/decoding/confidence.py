"""How sure (the judge stage): confidence = sigmoid(bias + sum_s weight_s * s) over cheap SIGNALS (docs/confidence.md,
evaluation/confidence_fit.py), the probability that the caption's CIDEr-D is at least GOOD_CIDER. The objects check:
a caption naming an object (a COCO category or detector group) whose support (the largest P of those) is below
SUPPORT_FLOOR is never sure. Legend: B photos, B' those with a chosen caption, N the batch's candidates (choice.Pool),
S the signals here, C COCO categories, K detector groups, M = C + K object columns, V vocabulary, L words.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Callable, Sequence

import torch

from ..concepts.detectors import WordDetectors
from ..concepts.words import word_categories
from ..config import DecodeConfig
from ..vocab import Vocab
from .choice import BEAM_ORDER, CIDER_SIGNALS, Decision, Neighbours, Pool, Weights, agreements, by_signal, choose
from .choice import finite
from .choice import SIGNALS as CHOICE_SIGNALS
from .consensus import ConsensusMemory
from .device_beam import Hypothesis
from .reading import HeadReading, words_of

SIGNALS = ("wide", "consensus", "nearest", "agreement", "margin", "log_prob", "min_word", "objects", "weakest_object",
           "top_p", "length", "support", "unsupported", "disagreement", "head_entropy", "template")
GOOD_CIDER = 0.5  # the label: a caption is good where its per-photo CIDEr-D is at least this
SURE_FLOOR = 0.6  # no caption is sure below this, whatever sure_at a file stores
LEVELS = ((0.5, "probably right"), (0.3, "may be wrong"), (0.0, "probably wrong"))  # unsure: the first floor reached
SURE = "sure"
SUPPORT_FLOOR = 0.25  # support below it: "unsupported", never sure (docs/confidence.md: chosen on the val sets)
# below it a reason says "it is not sure there is ...": on the graded captions the object named was absent for 59% of
# those under .05, 35% under .1 and 15% from .1 to .2 (docs/confidence.md); above it the reason claims no absence:
# "the encoder barely sees ..." where that alone keeps a caption from sure, else what else it found
UNSEEN = 0.1
TEMPLATE = re.compile(r"\bin (a|an) (\w+ )?(red|blue|green|yellow|pink|black|white|orange|purple|brown|gray|grey"
                      r"|striped|dark|light) (\w+ )?(shirt|t-shirt|jacket|dress|hat|helmet|coat|sweater|top|shorts"
                      r"|uniform|outfit|jersey|suit|swimsuit|cap|costume|bathing)\b")
MASS = frozenset("water grass snow sand food bread meat broccoli".split())  # "there is water"


@dataclass(frozen=True)
class ObjectCheck:
    """The photos' object evidence: support (B, V) per word and columns (V, M): what each word names."""
    support: torch.Tensor  # (B, V)
    columns: torch.Tensor  # (V, M) bool

    @cached_property
    def is_object(self) -> torch.Tensor:
        """(V,) bool: the words that name something (a column), found once per check: three readers ask."""
        return self.columns.any(1)

    def unsupported(self, tokens: Sequence[Sequence[int]], floor: float = SUPPORT_FLOOR) -> list[list[int]]:
        """Each photo's caption words -> the positions of its object words below floor, least supported first."""
        weak = torch.where(self.is_object.to(self.support.device), self.support.float(), float("inf"))  # (B, V)
        support = words_of(weak, tokens)  # (n, L) on the host: inf where no object
        return [sorted((i for i, p in enumerate(row) if p < floor), key=row.__getitem__) for row in support]


def membership(vocab: Vocab, categories: torch.Tensor, det: WordDetectors | None) -> torch.Tensor:
    """(V, M) bool: each word's categories (V, C) and detector groups (a taught word: its source's)."""
    cols = [categories.bool()]
    if det is not None:
        taught = tuple((w, vocab.source(w)) for w in sorted(vocab.aliases))
        members = tuple(frozenset(det.members.get(g, ())) for g in det.groups)
        cols.append(_groups(tuple(vocab.itos), members, taught).to(categories.device))
    return torch.cat(cols, 1)  # (V, M)


@lru_cache(maxsize=8)
def _groups(itos: tuple[str, ...], members: tuple[frozenset[str], ...], taught: tuple[tuple[str, str], ...]
            ) -> torch.Tensor:
    source = dict(taught)
    return torch.tensor([[source.get(w, w) in names for names in members] for w in itos], dtype=torch.bool)  # (V, K)


def objects_check(reading: HeadReading, det: WordDetectors | None, vocab: Vocab, categories: torch.Tensor
                  ) -> ObjectCheck | None:
    """reading's probs (B, C), seen (B, K) -> each word's support, the largest P of its columns; None without a head."""
    if reading.probs is None:
        return None
    probs, seen = reading.probs.float(), None if det is None else reading.seen
    evidence = probs if seen is None else torch.cat([probs, seen.float().to(probs.device)], 1)  # (B, M)
    cols = membership(vocab, categories, det)[:, :evidence.shape[1]].to(evidence.device)  # (V, M)
    support = (evidence[:, None, :] * cols[None].float()).amax(-1)  # (B, V)
    return ObjectCheck(support, cols.bool())


def entropy(probs: torch.Tensor | None) -> torch.Tensor | float:
    """The entropy (nats) of the head's P (..., C) and "none of them", (...) float64; 0 without a head."""
    if probs is None:
        return 0.0
    p = probs.double().clamp_min(0)  # (..., C)
    p = torch.cat([p, (1 - p.sum(-1, keepdim=True)).clamp_min(0)], -1)  # (..., C + 1)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    return -(p * p.clamp_min(1e-12).log()).sum(-1)


def template(text: str) -> float:
    """1.0 where the caption has Flickr8k's "in a <colour> <garment>", else 0.0."""
    return float(bool(TEMPLATE.search(text)))


def shown(confidence: float) -> float:
    """The confidence as every place shows it: to the whole percent, half up (0.4953 -> 0.50, 0.2974 -> 0.30)."""
    return math.floor(confidence * 100 + 0.5) / 100


def level(confidence: float, sure_at: float, unsupported: bool = False) -> str:
    """SURE from max(sure_at, SURE_FLOOR) unless the caption names an unsupported object, else a LEVELS name; read
    from the shown number, so the percentage a person sees and the level always agree (50% is probably right)."""
    c = shown(confidence)
    if c >= max(sure_at, SURE_FLOOR) and not unsupported:
        return SURE
    return next(name for floor, name in LEVELS if c >= floor)


@dataclass(frozen=True)
class ConfidenceMap:
    """The fitted logistic map and the threshold of `sure`."""
    bias: float
    weights: tuple[float, ...]  # SIGNALS order
    sure_at: float
    means: tuple[float, ...] | None = None  # each signal's val mean, what contributions measure from; None: older files

    @classmethod
    def from_json(cls, data: Any) -> "ConfidenceMap":
        """{"bias", "weights": {signal: weight}, "sure_at"[, "means": {signal: mean}]} -> the map."""
        if not isinstance(data, dict) or set(data) - {"means"} != {"bias", "weights", "sure_at"}:
            raise ValueError(f"the confidence map needs bias, weights and sure_at (and may hold means), got {data!r}")
        means = data.get("means")
        means = None if means is None else by_signal(means, SIGNALS, "the confidence map's means", "the mean of {}")
        out = cls(finite(data["bias"], "its bias"), by_signal(data["weights"], SIGNALS, "the confidence map's weights"),
                  finite(data["sure_at"], "sure_at"), means)
        if not 0.0 <= out.sure_at <= 1.0:
            raise ValueError(f"the confidence map's sure_at must lie in [0, 1], got {out.sure_at}")
        return out

    def to_json(self) -> dict[str, Any]:
        means = {} if self.means is None else {"means": dict(zip(SIGNALS, self.means))}
        return {"bias": self.bias, "weights": dict(zip(SIGNALS, self.weights)), "sure_at": self.sure_at, **means}

    def __call__(self, signals: dict[str, float]) -> float:
        z = self.bias + sum(w * signals[s] for s, w in zip(SIGNALS, self.weights))
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def confidences(self, signals: torch.Tensor) -> torch.Tensor:
        """(B, S) -> (B,), one sigmoid."""
        weights = torch.tensor(self.weights, dtype=signals.dtype, device=signals.device)  # (S,)
        return torch.sigmoid(self.bias + signals @ weights)

    def rounded(self) -> "ConfidenceMap":
        """Every number to 6 decimals (as a model file stores a fit)."""
        return ConfidenceMap(round(self.bias, 6), tuple(round(w, 6) for w in self.weights), round(self.sure_at, 6),
                             None if self.means is None else tuple(round(m, 6) for m in self.means))

    def contributions(self, signals: dict[str, float]) -> dict[str, float]:
        """Each weighed signal's share of the log-odds against the val mean, w_s * (s - mean_s); {} without means."""
        if self.means is None:
            return {}
        return {s: w * (signals[s] - m) for s, w, m in zip(SIGNALS, self.weights, self.means) if w and s in signals}


# why_unsure's weak signals where none lowered the confidence (or no means), in the order a person can act on:
# (signal, its value where missing, below what it is weak: about the val sets' lowest tenth; val medians noted)
WEAK = (("nearest", 1.0, 0.55),  # the cosine with the nearest training photo (.60-.68)
        ("agreement", 1.0, 3.0),  # CIDEr-D with the beam's other candidates (5.3-5.8)
        ("min_word", 0.0, -3.5),  # its least probable word under 3% (-2.1 to -2.9)
        ("wide", 1.0, 0.2))  # CIDEr-D with what people said of the nearest photos (.35-.40)
FALLBACK_REASONS = tuple(s for s, _, _ in WEAK)


def needs(fitted: ConfidenceMap | None) -> tuple[str, ...]:
    """The signals judged for this map: those it weighs, unsupported (the level's) and FALLBACK_REASONS; or all."""
    if fitted is None:
        return SIGNALS
    return tuple(s for s, w in zip(SIGNALS, fitted.weights) if w != 0 or s == "unsupported" or s in FALLBACK_REASONS)


class Chosen:
    """What the judge reads of a batch's chosen captions (B'), each signal computed when asked (SIGNAL_OF)."""
    def __init__(self, decision: Decision, near: Neighbours, cider: torch.Tensor, probs: torch.Tensor | None,
                 categories: torch.Tensor | None, person: tuple[torch.Tensor, torch.Tensor] | None,
                 check: ObjectCheck | None, vocab: Vocab):
        self.decision, self.near, self.cider_of = decision, near, cider  # cider (N, 3): choice.agreements
        self.pool, self.best = decision.pool, decision.best  # (B',) each photo's chosen row
        self.photos = torch.tensor(self.pool.photos, dtype=torch.int64, device=self.best.device)  # (B',)
        self.probs = None if probs is None or categories is None else probs.to(decision.signals)[self.photos]  # (B', C)
        self.categories, self.person, self.check, self.vocab = categories, person, check, vocab

    @cached_property
    def _support(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B',) float64 each: the least support of the caption's object words (1 where none, or without a check)
        and how many are below SUPPORT_FLOOR."""
        if self.check is None:
            ones = torch.ones(len(self.best), dtype=torch.float64, device=self.best.device)
            return ones, torch.zeros_like(ones)
        tokens = self.pool.tokens[self.best]  # (B', L)
        is_object = self.pool.padded(self.check.is_object, False)[tokens]  # (B', L)
        support = self.check.support.float()  # (B, V)
        support = torch.cat([support, support.new_ones(len(support), 1)], 1)  # (B, V + 1): the padding supported
        support = support.to(self.best.device)[self.photos].gather(1, tokens)  # (B', L)
        least = torch.where(is_object, support, float("inf")).amin(1)  # (B',)
        return (torch.where(least.isinf(), 1.0, least.double()),
                (is_object & (support < SUPPORT_FLOOR)).sum(1).double())

    def disagreement(self) -> torch.Tensor:
        """(B',) the share of each photo's other candidates naming other objects than the chosen one."""
        out = torch.zeros(len(self.best), dtype=torch.float64, device=self.best.device)  # (B',)
        if self.check is None:
            return out
        objects = self.pool.named(self.check.columns)  # (N, M)
        sizes = torch.tensor(self.pool.sizes, device=self.pool.photo.device)  # (B',)
        group = torch.repeat_interleave(torch.arange(len(self.best), device=self.best.device), sizes)  # (N,)
        differs = (objects != objects[self.best][group]).any(1)  # (N,)
        return out.index_add(0, group, differs.double()) / (sizes - 1).clamp_min(1)

    def weakest_object(self) -> torch.Tensor:
        """(B',) the least P of the categories each names (a person word: the person detector's), 1 where none."""
        if self.probs is None:
            return torch.ones(len(self.best), dtype=torch.float64, device=self.best.device)
        named = self.pool.named(self.categories)[self.best]  # (B', C)
        least = torch.where(named, self.probs, float("inf")).amin(1)  # (B',)
        if self.person is not None:
            says_person = self.pool.named(self.person[1].reshape(-1, 1))[self.best, 0]  # (B',)
            least = torch.minimum(least, torch.where(says_person, self.person[0].to(least)[self.photos], float("inf")))
        return torch.where(least.isinf(), 1.0, least)


# how the judge computes each signal for the chosen captions: (B',) float64 (or a float for all)
SIGNAL_OF: dict[str, Callable[[Chosen], torch.Tensor | float]] = {
    **{s: lambda c, i=i: c.cider_of.to(c.decision.signals)[c.best, i] for i, s in enumerate(CIDER_SIGNALS)},
    **{s: lambda c, s=s: c.decision.signals[c.best, CHOICE_SIGNALS.index(s)] for s in ("log_prob", "objects")},
    "nearest": lambda c: c.near.cosines[:, 0].to(c.decision.signals)[c.photos],
    "margin": lambda c: (torch.zeros_like(c.decision.total[c.best]) if c.decision.weights.beam_order
                         else c.decision.total[c.best] - c.decision.total[c.decision.runner]),  # over the runner-up's
    "min_word": lambda c: c.pool.min_word[c.best],
    "weakest_object": Chosen.weakest_object,
    "top_p": lambda c: 0.0 if c.probs is None else c.probs.amax(1),
    "length": lambda c: c.pool.lengths[c.best],
    "support": lambda c: c._support[0],
    "unsupported": lambda c: c._support[1],
    "disagreement": Chosen.disagreement,
    "head_entropy": lambda c: entropy(c.probs),
    "template": lambda c: torch.tensor([template(" ".join(c.vocab.itos[t] for t in w)) for w in c.pool.words],
                                       dtype=torch.float64).to(c.best.device)[c.best],
}


@dataclass(frozen=True)
class Judgement:
    """The signals computed (`names`) as (B', S) (the others 0) and, with a map, the confidences (B',)."""
    names: tuple[str, ...]
    signals: torch.Tensor
    confidence: torch.Tensor | None

    def host(self) -> tuple[torch.Tensor, ...]:
        """Flat for one read: the signals (B' * S,), the confidences (B',)."""
        return (self.signals.flatten(),) + (() if self.confidence is None else (self.confidence,))


def judge(decision: Decision, near: Neighbours, cider: torch.Tensor, probs: torch.Tensor | None,
          categories: torch.Tensor | None, person: tuple[torch.Tensor, torch.Tensor] | None,
          check: ObjectCheck | None, vocab: Vocab, fitted: ConfidenceMap | None,
          wanted: Sequence[str] | None = None) -> Judgement:
    """The chosen captions' signals `wanted` (default needs(fitted)) and the map's confidence, nothing read to the
    host. cider (N, 3): choice.agreements; probs (B, C), categories (V, C), person, check: or None."""
    wanted = needs(fitted) if wanted is None else tuple(s for s in SIGNALS if s in set(wanted))
    chosen = Chosen(decision, near, cider, probs, categories, person, check, vocab)
    x = torch.zeros(len(decision.best), len(SIGNALS), dtype=torch.float64, device=decision.best.device)  # (B', S)
    for name in wanted:
        x[:, SIGNALS.index(name)] = SIGNAL_OF[name](chosen)
    return Judgement(wanted, x, None if fitted is None else fitted.confidences(x))


ABSENT = "the encoder barely sees one of the objects it names"
REASONS = {"wide": "people described photos like this one differently",
           "consensus": "people described the photos most like this one differently",
           "nearest": "few photos like this one among those it learned from",
           "agreement": "the beam's captions disagree with this one",
           "disagreement": "its other captions name other things", "min_word": "some of its words are guesses",
           "objects": "the encoder barely sees the objects it names", "weakest_object": ABSENT, "support": ABSENT,
           "margin": "it barely preferred this caption to another",
           "log_prob": "the model found these words unlikely for this photo",
           "top_p": "the encoder recognises little in this photo", "unsupported": ABSENT,
           "length": "good captions are rarely this long or short",
           "head_entropy": "the encoder is torn between what this photo might show",
           "template": "it reads like a stock phrase (a person in a coloured garment)"}


def _plural(word: str) -> bool:
    return word.endswith("s") and not word.endswith("ss") and word not in MASS


def _listed(words: Sequence[str]) -> str:
    """["dogs", "cake"] -> "dogs or a cake"."""
    return " or ".join(w if _plural(w) or w in MASS else ("an " if w[0] in "aeiou" else "a ") + w for w in words)


def why_unsure(signals: dict[str, float], alternative: str | None, contributions: dict[str, float] | None = None,
               unsupported: Sequence[str] = (), unlikely: Sequence[str] = (), described: str | None = None,
               barely: Sequence[str] = ()) -> str:
    """Why unsure, about this photo: an object the heads do not see ("it is not sure there is a cake or a table"),
    else one they `barely` see where that alone keeps it from sure ("the encoder barely sees a person in this
    photo"), else the signal that lowered the confidence most (contributions), else the first weak one (WEAK), each
    said with what it found: the words it found `unlikely`, how people `described` the most similar training photo,
    the other caption it hesitated over. Never only that a signal is weak: at worst the unlikely words or the
    description."""
    if unsupported:
        return "it is not sure there " + ("are " if _plural(unsupported[0]) else "is ") + _listed(unsupported)
    if barely:
        return f"the encoder barely sees {_listed(barely)} in this photo"
    worst = min(contributions, key=contributions.__getitem__) if contributions else None
    if worst is None or contributions[worst] >= 0:
        worst = next((s for s, missing, weak in WEAK if signals.get(s, missing) < weak
                      and (alternative or s != "agreement")), None)
    said = {"agreement": alternative and f"it hesitated between this and “{alternative}”",
            "log_prob": unlikely and "the model found " + " and ".join(f"“{w}”" for w in unlikely) + " unlikely for this photo",
            "consensus": described and f"the photos most like this one were described as “{described}”",
            "wide": described and f"photos like this one were described as “{described}”",
            "nearest": described and f"few photos like this one among those it learned from (the nearest: “{described}”)"}
    said["min_word"] = said["log_prob"]
    if worst is not None:
        return said.get(worst) or REASONS[worst]
    return said["agreement"] or said["log_prob"] or said["consensus"] or "its signals are weaker than for the ones it gets right"


@dataclass(frozen=True)
class Decided:
    """One photo's decision: its candidates in the chosen order (the beam's where nothing chose), their choices and
    choice signals (None: the beam's order kept), the judge's signals and confidence of the first (None: not judged)."""
    hyps: tuple[Hypothesis, ...]
    choices: tuple[float, ...] | None = None
    signals: tuple[dict[str, float], ...] | None = None
    sure_signals: dict[str, float] | None = None
    confidence: float | None = None
    described: str | None = None  # how people described the training photo most like this one (judged only)

    @property
    def best(self) -> Hypothesis:
        return self.hyps[0]

    def choice_of(self, i: int) -> tuple[float | None, dict[str, float] | None]:
        """Candidate i's choice and signals (None, None where the beam's order was kept)."""
        return (None, None) if self.choices is None else (self.choices[i], self.signals[i])


def kept(hyps: Sequence[Sequence[Hypothesis]]) -> list[Decided]:
    """Each photo's hypotheses in the beam's order, nothing chosen or judged."""
    return [Decided(tuple(h)) for h in hyps]


def decide(hyps: Sequence[Sequence[Hypothesis]], feats: torch.Tensor, probs: torch.Tensor | None,
           memory: ConsensusMemory | None, vocab: Vocab | None, settings: DecodeConfig, weights: Weights = BEAM_ORDER,
           sure: ConfidenceMap | None = None, judged: Sequence[str] | None = None, *,
           person: tuple[torch.Tensor, torch.Tensor] | None = None, categories: torch.Tensor | None = None,
           check: ObjectCheck | None = None) -> list[Decided]:
    """choose orders each photo's candidates by `weights`, then judge says how sure the first is (the signals `sure`
    weighs, or `judged`): one neighbourhood, one CIDEr-D pass, one read. Without a memory or two candidates: kept.
    feats (B, P, D); probs (B, C), person (P(person) (B,), person words (V,)), categories (V, C): or None."""
    how_sure = sure is not None or judged is not None
    if memory is None or (weights.beam_order and not how_sure) or all(len(h) < 2 for h in hyps):
        return kept(hyps)
    wanted = needs(sure) if judged is None else tuple(judged)
    near = Neighbours.of(memory, feats, settings.consensus_k, bool(weights["wide"]) or (how_sure and "wide" in wanted))
    objects = bool(weights["objects"] or weights["top_object"] or how_sure)
    categories = (word_categories(vocab) if categories is None else categories).to(torch.bool) if objects else None
    pool = Pool.of(hyps, memory.vocab_size, feats.device)  # the memory speaks the model's vocabulary
    asked = [s for s in CIDER_SIGNALS if weights[s] or (how_sure and s in wanted)]
    cider = agreements(pool, near.nearest, near.k, memory, asked)  # (N, 3): one CIDEr-D pass for choice and judge
    decision = choose(pool, len(hyps), cider, probs, weights, person, categories)
    judgement = (judge(decision, near, cider, probs, categories, person, check, vocab, sure, wanted) if how_sure
                 else None)
    host = torch.cat(decision.host() + (() if judgement is None else judgement.host())).tolist()  # the one read
    said = [_described(memory, near.nearest[b][:near.k], vocab) for b in range(len(hyps))]  # for the reason
    return _ordered(hyps, decision, judgement, host, said)


def _described(memory: ConsensusMemory, nearest: Sequence[int], vocab: Vocab | None) -> str | None:
    """The first caption without an unknown word of the nearest training photos (nearest first), as text."""
    said = (c for j in nearest for c in memory.captions_of(j) if vocab is not None and vocab.unk not in c)
    return next((" ".join(vocab.itos[t] for t in c) for c in said), None)


def _ordered(hyps: Sequence[Sequence[Hypothesis]], decision: Decision, judgement: Judgement | None,
             host: list[float], said: Sequence[str | None]) -> list[Decided]:
    """The one read -> each photo's Decided (the choice's part where it chose, the judge's where judged)."""
    pool, n, s, w = decision.pool, len(decision.pool), len(CHOICE_SIGNALS), len(SIGNALS)
    rows, totals = [host[i * s:(i + 1) * s] for i in range(n)], host[n * s:n * s + n]
    ranked, rest = [int(r) for r in host[n * s + n:n * s + 2 * n]], host[n * (s + 2):]  # rest: the judge's
    out = kept(hyps)
    for g, (b, at) in enumerate(zip(pool.photos, pool.starts)):  # a photo's rows are at, at + 1, ...
        rows_of = ranked[at:at + len(hyps[b])]
        chose = {} if decision.weights.beam_order else {"choices": tuple(totals[r] for r in rows_of),
                                               "signals": tuple(dict(zip(CHOICE_SIGNALS, rows[r])) for r in rows_of)}
        judged = {} if judgement is None else {
            "sure_signals": {x: rest[g * w + SIGNALS.index(x)] for x in judgement.names},
            "confidence": None if judgement.confidence is None else rest[len(pool.photos) * w + g], "described": said[b]}
        out[b] = Decided(tuple(hyps[b][r - at] for r in rows_of), **chose, **judged)
    return out
