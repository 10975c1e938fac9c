"""How sure: the probability that a caption is good, from what decoding already computed.

`confidence` is the probability that the caption's per-photo CIDEr-D against that photo's references is at
least GOOD_CIDER, estimated by a logistic map of cheap signals of the chosen caption and its photo:

    confidence = sigmoid(bias + sum_s weight_s * s)

    wide       CIDEr-D of the caption with the captions of the WIDE x consensus_k nearest training photos
               (choice.py): what people said of photos like this one
    consensus  the same with the consensus_k nearest: what people said of the photos most like this one
    nearest    cosine of the photo's pooled features with its nearest training photo (consensus.py): how unlike
               anything learned the photo is
    agreement  CIDEr-D of the caption with the beam's other candidates: whether the beam hesitated
    margin     the choice's score over the runner-up's (choice.py): how clear the choice was
    log_prob   the model's log-probability per token (<end> included)
    min_word   the least probable word's log-probability
    objects    sum over the COCO categories the caption names of P(category) - OBJECT_P (choice.py)
    weakest_object  the least P(category) among the categories the caption names (a person word: the person
               detector's P where the file has one), 1 when it names none: the object most likely not there
    top_p      the encoder's head's largest P(category): whether it sees anything it knows
    length     words
    support, unsupported, disagreement, head_entropy, template
               the objects check (support.py): the least support the heads give an object the caption names,
               how many it names that they barely see, how often the beam's other candidates name other objects,
               how spread the head's P is, and Flickr8k's "in a <colour> <garment>"

The map is fitted out of fold on the val sets by `captioner-fit-selector --confidence`
(evaluation/confidence_fit.py) and stored as the model file's fitted data, with the threshold `sure_at`
(fitted.py: captioner-export --fitted); `sure` is confidence >= sure_at, and never below SURE_FLOOR whatever
a file stores. Below it a caption's `level` says in plain words what a person should do with it (LEVELS: the
confidence is calibrated, so "probably right" is at least an even chance). A file without a fitted map (or
decode.fitted_confidence false), or a caption without the signals (no consensus memory beside the file, a single
candidate), has no confidence: None, never an invented number.

Legend: N the batch's candidates (pool.Pool), B' the photos among them (each its chosen caption), S the signals here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence

import torch

from ..vocab import Vocab
from .choice import CIDER_SIGNALS, Decision, Neighbours, finite
from .choice import SIGNALS as CHOICE_SIGNALS
from .pool import Pool
from .support import ObjectCheck, candidate_support, disagreement, doubt_of_objects, entropy, template

SIGNALS = ("wide", "consensus", "nearest", "agreement", "margin", "log_prob", "min_word", "objects", "weakest_object",
           "top_p", "length", "support", "unsupported", "disagreement", "head_entropy", "template")
GOOD_CIDER = 0.5  # the label: a caption is good where its per-photo CIDEr-D is at least this
SURE_FLOOR = 0.6  # no caption is called sure below this confidence ("Sure: 43% likely" read as a contradiction)
# what an unsure caption's confidence says a person should do, from the highest level down (the first whose
# floor the confidence reaches)
LEVELS = ((0.5, "probably right"), (0.3, "may be wrong"), (0.0, "probably wrong"))
SURE = "sure"


def sure_threshold(sure_at: float) -> float:
    """The confidence at which a caption is sure: the file's fitted sure_at, never below SURE_FLOOR."""
    return max(sure_at, SURE_FLOOR)


def level(confidence: float, sure_at: float, unsupported: bool = False) -> str:
    """SURE at or above sure_threshold(sure_at) unless the caption names an object the heads barely see
    (`unsupported`: support.SUPPORT_FLOOR), else the first of LEVELS whose floor the confidence reaches."""
    if confidence >= sure_threshold(sure_at) and not unsupported:
        return SURE
    return next(name for floor, name in LEVELS if confidence >= floor)


@dataclass(frozen=True)
class ConfidenceMap:
    """The fitted logistic map and the threshold of `sure`."""

    bias: float
    weights: tuple[float, ...]  # SIGNALS order
    sure_at: float
    # each signal's mean over the val photos it was fitted on (SIGNALS order), what a caption's contributions are
    # measured against; None in files fitted before they were stored (why_unsure then names the first weak signal)
    means: tuple[float, ...] | None = None

    @classmethod
    def from_json(cls, data: Any) -> "ConfidenceMap":
        """The map as the model file stores it ({"bias", "weights": {signal: weight}, "sure_at"} and optionally
        "means": {signal: val mean}; a signal left out weighs 0, its mean is 0); a ValueError names what is wrong
        (an unknown signal, a number that is not finite, sure_at outside [0, 1])."""
        if not isinstance(data, dict) or not {"bias", "weights", "sure_at"} <= set(data) <= {"bias", "weights",
                                                                                             "sure_at", "means"}:
            raise ValueError(f"the confidence map needs bias, weights and sure_at (and may hold means), got {data!r}")
        weights = data["weights"]
        if not isinstance(weights, dict) or set(weights) - set(SIGNALS):
            raise ValueError(f"the confidence map weighs unknown signals {sorted(set(weights) - set(SIGNALS))} "
                             f"(known: {', '.join(SIGNALS)})" if isinstance(weights, dict) else
                             f"the confidence map's weights must be a mapping, got {weights!r}")
        means = data.get("means")
        if means is not None and (not isinstance(means, dict) or set(means) - set(SIGNALS)):
            raise ValueError(f"the confidence map's means must be a mapping of known signals, got {means!r}")
        out = cls(finite(data["bias"], "its bias"), tuple(finite(weights.get(s, 0.0), s) for s in SIGNALS),
                  finite(data["sure_at"], "sure_at"),
                  None if means is None else tuple(finite(means.get(s, 0.0), f"the mean of {s}") for s in SIGNALS))
        if not 0.0 <= out.sure_at <= 1.0:
            raise ValueError(f"the confidence map's sure_at must lie in [0, 1], got {out.sure_at}")
        return out

    def to_json(self) -> dict[str, Any]:
        """The map as the model file stores it (from_json reads it back)."""
        out = {"bias": self.bias, "weights": dict(zip(SIGNALS, self.weights)), "sure_at": self.sure_at}
        if self.means is not None:
            out["means"] = dict(zip(SIGNALS, self.means))
        return out

    def __call__(self, signals: dict[str, float]) -> float:
        z = self.bias + sum(w * signals[s] for s, w in zip(SIGNALS, self.weights))
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def confidences(self, signals: torch.Tensor) -> torch.Tensor:
        """Many captions' signals (B, S) in SIGNALS order -> their confidences (B,), one sigmoid."""
        return torch.sigmoid(self.bias + signals @ torch.tensor(self.weights, dtype=signals.dtype, device=signals.device))

    def weighs(self, signal: str) -> bool:
        """Whether the map reads this signal (a weight other than 0; a signal it does not know: False)."""
        return signal in SIGNALS and self.weights[SIGNALS.index(signal)] != 0

    def rounded(self) -> "ConfidenceMap":
        """The map with every number to 6 decimals (as a model file stores a fit)."""
        return ConfidenceMap(round(self.bias, 6), tuple(round(w, 6) for w in self.weights), round(self.sure_at, 6),
                             None if self.means is None else tuple(round(m, 6) for m in self.means))

    def contributions(self, signals: dict[str, float]) -> dict[str, float]:
        """Each weighed signal's share of this caption's log-odds against the val photos' mean,
        w_s * (s - mean_s): the most negative is what lowered its confidence most. {} without stored means."""
        if self.means is None:
            return {}
        return {s: w * (signals[s] - m) for s, w, m in zip(SIGNALS, self.weights, self.means) if w and s in signals}


# what why_unsure reads where no weighed signal lowered the confidence (or the map has no stored means): its weak
# signals, in the order a person can act on
FALLBACK_REASONS = ("nearest", "agreement", "min_word", "wide")
GATE = ("unsupported",)  # what the level reads whatever the map weighs: an object the heads barely see


def needs(fitted: ConfidenceMap | None) -> tuple[str, ...]:
    """The signals a judge computes for this map, in SIGNALS order: those it weighs, the gate's and why_unsure's
    fallback; every one without a map (what captioner-fit-selector fits on)."""
    if fitted is None:
        return SIGNALS
    wanted = {s for s in SIGNALS if fitted.weighs(s)} | set(GATE) | set(FALLBACK_REASONS)
    return tuple(s for s in SIGNALS if s in wanted)


class Chosen:
    """What the judge reads of a batch's chosen captions (one per photo of the Decision: B'), each signal computed
    only when asked (SIGNAL_OF) and the shared work once: the chosen rows, the objects check's support."""

    def __init__(self, decision: Decision, near: Neighbours, cider: torch.Tensor, probs: torch.Tensor | None,
                 categories: torch.Tensor | None, person: tuple[torch.Tensor, torch.Tensor] | None,
                 check: ObjectCheck | None, vocab: Vocab):
        self.decision, self.near, self.cider_of = decision, near, cider  # cider (N, 3): choice.agreements
        self.pool, self.best = decision.pool, decision.best  # (B',) each photo's chosen row
        self.photos = torch.tensor(self.pool.photos, dtype=torch.int64, device=self.best.device)  # (B',)
        self.probs = None if probs is None or categories is None else probs.to(decision.signals)[self.photos]  # (B', C)
        self.categories, self.person, self.check, self.vocab = categories, person, check, vocab

    def choice_signal(self, name: str) -> torch.Tensor:
        """(B',) a signal the choice computed for every candidate (choice.SIGNALS), at the chosen rows."""
        return self.decision.signals[self.best, CHOICE_SIGNALS.index(name)]

    def cider(self, name: str) -> torch.Tensor:
        """(B',) consensus, wide or agreement of the chosen captions (computed for the judge where it wants them)."""
        return self.cider_of.to(self.decision.signals)[self.best, CIDER_SIGNALS.index(name)]

    @cached_property
    def _support(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B',) each: the least support of the chosen captions' objects, and how many the heads barely see."""
        if self.check is None:  # without a check no object is doubted
            return (torch.ones(len(self.best), dtype=torch.float64, device=self.best.device),
                    torch.zeros(len(self.best), dtype=torch.float64, device=self.best.device))
        return candidate_support(self.pool, self.best, self.photos, self.check)

    def margin(self) -> torch.Tensor:
        """(B',) the choice's score over the runner-up's (0 where the beam's order was kept)."""
        d = self.decision
        return d.total[d.best] - d.total[d.runner] if d.chose else torch.zeros_like(d.total[d.best])

    def template(self) -> torch.Tensor:
        """(B',) 1 where the chosen caption reads like Flickr8k's "in a <colour> <garment>"."""
        texts = [" ".join(self.vocab.itos[t] for t in self.pool.words[r]) for r in range(len(self.pool))]
        return torch.tensor([template(t) for t in texts], dtype=torch.float64).to(self.best.device)[self.best]


# every confidence signal by name: how the judge computes it for the chosen captions (B',) float64
SIGNAL_OF: dict[str, Callable[[Chosen], torch.Tensor | float]] = {
    "wide": lambda c: c.cider("wide"),
    "consensus": lambda c: c.cider("consensus"),
    "nearest": lambda c: c.near.cosines[:, 0].to(c.decision.signals)[c.photos],
    "agreement": lambda c: c.cider("agreement"),
    "margin": Chosen.margin,
    "log_prob": lambda c: c.choice_signal("log_prob"),
    "min_word": lambda c: c.pool.min_word[c.best],
    "objects": lambda c: c.choice_signal("objects"),
    "weakest_object": lambda c: weakest_object(c.pool, c.best, c.photos, c.probs, c.categories, c.person),
    "top_p": lambda c: 0.0 if c.probs is None else c.probs.amax(1),
    "length": lambda c: c.pool.lengths[c.best],
    "support": lambda c: c._support[0],
    "unsupported": lambda c: c._support[1],
    "disagreement": lambda c: disagreement(c.pool, c.best, c.check),
    "head_entropy": lambda c: entropy(c.probs) if c.probs is not None else 0.0,
    "template": Chosen.template,
}


@dataclass(frozen=True)
class Judgement:
    """How sure, for each photo of a Decision (B'): the signals computed (`names`, SIGNALS order) as (B', S) in
    SIGNALS order (a signal not computed: 0) and, with a map, each chosen caption's confidence (B',)."""
    names: tuple[str, ...]
    signals: torch.Tensor
    confidence: torch.Tensor | None

    def host(self) -> tuple[torch.Tensor, ...]:
        """What the chosen captions carry, flat for one read: the signals (B', S), then the confidences (B',)."""
        return (self.signals.flatten(),) + (() if self.confidence is None else (self.confidence,))

    def of_photo(self, host: list[float], g: int) -> tuple[dict[str, float], float | None]:
        """Judgement.host read to the host -> photo g's computed signals by name, and its confidence or None."""
        width, n = len(SIGNALS), len(self.signals)
        row = host[g * width:(g + 1) * width]
        return ({s: row[SIGNALS.index(s)] for s in self.names},
                None if self.confidence is None else host[n * width + g])


def judge(decision: Decision, near: Neighbours, cider: torch.Tensor, probs: torch.Tensor | None,
          categories: torch.Tensor | None, person: tuple[torch.Tensor, torch.Tensor] | None,
          check: ObjectCheck | None, vocab: Vocab, fitted: ConfidenceMap | None,
          wanted: Sequence[str] | None = None) -> Judgement:
    """How sure each photo's chosen caption is: the signals `wanted` (default: needs(fitted), those the map weighs)
    computed by name (SIGNAL_OF) and the map's confidence, one sigmoid for the batch; nothing read to the host.
    near: the consensus neighbourhood the choice read; cider (N, 3): the candidates' CIDEr-D signals
    (choice.agreements, the wanted ones computed); probs (B, C), categories (V, C) bool, person ((B,), (V,)): what
    the heads see, or None; check: the photos' objects check (support.py), or None."""
    wanted = needs(fitted) if wanted is None else tuple(s for s in SIGNALS if s in set(wanted))
    chosen = Chosen(decision, near, cider, probs, categories, person, check, vocab)
    x = torch.zeros(len(decision.best), len(SIGNALS), dtype=torch.float64, device=decision.best.device)  # (B', S)
    for name in wanted:
        x[:, SIGNALS.index(name)] = SIGNAL_OF[name](chosen)
    return Judgement(wanted, x, None if fitted is None else fitted.confidences(x))


def weakest_object(pool: Pool, best: torch.Tensor, photos: torch.Tensor, probs: torch.Tensor | None,
                   categories: torch.Tensor | None, person: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """(B',) the least P among the categories each chosen caption names (person words: the person detector's P),
    1 where it names none (or there is no head)."""
    if probs is None or categories is None:
        return torch.ones(len(best), dtype=torch.float64, device=best.device)
    named = pool.named(categories)[best]  # (B', C)
    least = torch.where(named, probs, float("inf")).amin(1)  # (B',)
    if person is not None:
        says_person = pool.named(person[1].reshape(-1, 1))[best, 0]  # (B',)
        least = torch.minimum(least, torch.where(says_person, person[0].to(least)[photos], float("inf")))
    return torch.where(least.isinf(), 1.0, least)


# below these a signal is weak: about the lowest tenth of the val sets' photos (coco-paired val, Flickr8k val,
# coco-mini), what why_unsure names for a map fitted before the val means were stored
FEW_LIKE = 0.55  # nearest: the photo's cosine with its nearest training photo (val medians .60-.68)
HESITATED = 3.0  # agreement: CIDEr-D with the beam's other candidates (val medians 5.3-5.8)
GUESSED = -3.5  # min_word: its least probable word under 3% (val medians -2.1 to -2.9)
UNLIKE_PEOPLE = 0.2  # wide: CIDEr-D with what people said of the nearest training photos (val medians .35-.40)
# what each signal says when it lowered a caption's confidence most, in words a person can act on ("agreement":
# the hesitation, with the alternative where there is one)
REASONS = {"wide": "people described photos like this one differently",
           "consensus": "people described the photos most like this one differently",
           "nearest": "few photos like this one among those it learned from",
           "agreement": "the beam's captions disagree with this one",
           "margin": "it barely preferred this caption to another",
           "log_prob": "the model found these words unlikely for this photo",
           "min_word": "some of its words are guesses",
           "objects": "the encoder barely sees the objects it names",
           "weakest_object": "the encoder barely sees one of the objects it names",
           "support": "the encoder barely sees one of the objects it names",
           "unsupported": "the encoder barely sees one of the objects it names",
           "top_p": "the encoder recognises little in this photo",
           "length": "good captions are rarely this long or short",
           "disagreement": "its other captions name other things",
           "head_entropy": "the encoder is torn between what this photo might show",
           "template": "it reads like a stock phrase (a person in a coloured garment)"}


def why_unsure(signals: dict[str, float], alternative: str | None, contributions: dict[str, float] | None = None,
               unsupported: Sequence[str] = ()) -> str:
    """A plain-words reason for an unsure caption. An object the check found unsupported comes first ("it is not
    sure there is a cake": support.doubt_of_objects); then, with the map's contributions (ConfidenceMap.
    contributions: w_s * (s - val mean)), the signal that lowered the confidence most (REASONS; the hesitation
    names the alternative); without them (a map fitted before the means were stored) the first weak signal, in the
    order a person can act on (an unusual photo, a hesitation, a guessed word, a caption unlike what people say)."""
    if unsupported:
        return doubt_of_objects(unsupported)
    if contributions:
        worst = min(contributions, key=contributions.__getitem__)
        if contributions[worst] < 0:
            if worst == "agreement" and alternative:
                return f"it hesitated between this and “{alternative}”"
            return REASONS[worst]
    if signals.get("nearest", 1.0) < FEW_LIKE:
        return "few photos like this one among those it learned from"
    if alternative and signals.get("agreement", 1.0) < HESITATED:
        return f"it hesitated between this and “{alternative}”"
    if signals.get("min_word", 0.0) < GUESSED:
        return "some of its words are guesses"
    if signals.get("wide", 1.0) < UNLIKE_PEOPLE:
        return "people described photos like this one differently"
    return "its signals are weaker than for the captions it gets right"
