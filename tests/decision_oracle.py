"""The decision after the beam one photo and one candidate at a time: the literal arithmetic the batched decision
(confidence.decide: choice.choose over a choice.Pool, then confidence.judge) must equal. Kept here as the
oracle of tests/test_decision.py, as tests/rules_oracle.py is the rules' oracle."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from captioner.concepts.words import word_categories
from captioner.config import DecodeConfig
from captioner.decoding.choice import BEAM_ORDER, OBJECT_P, SIGNALS, WIDE, Weights
from captioner.decoding.confidence import SIGNALS as SURE_SIGNALS
from captioner.decoding.confidence import ConfidenceMap, needs
from captioner.decoding.consensus import ConsensusMemory
from captioner.decoding.device_beam import Hypothesis
from captioner.decoding.confidence import SUPPORT_FLOOR, ObjectCheck, template
from captioner.vocab import Vocab


class Judged:
    """A candidate as the oracle decides it, one at a time: the search's Hypothesis (a value; its fields read
    through) with what chose it and how sure, written as the oracle goes."""

    def __init__(self, hyp: Hypothesis):
        self.hyp = hyp
        self.choice: float | None = None
        self.signals: dict[str, float] | None = None
        self.sure_signals: dict[str, float] | None = None
        self.confidence: float | None = None

    def __getattr__(self, name: str):
        return getattr(self.__dict__["hyp"], name)

def choice_signals(cands: Sequence[Hypothesis], near: Sequence[int], wide: Sequence[int], probs: torch.Tensor | None,
            categories: torch.Tensor, memory: ConsensusMemory, weights: Weights,
            person: tuple[float, torch.Tensor] | None = None) -> torch.Tensor:
    """One photo's candidates -> their signals (n, S) in SIGNALS order; a signal of weight 0 is left 0 (not
    computed). near / wide: the memory photos nearest this one (consensus_k, WIDE x consensus_k); probs (C,): the
    head's P(category) or None without a head; categories (V, C): which words name which category; person:
    (P(person), the person words (V,) 0/1) from the file's person detector, or None."""
    out = torch.zeros(len(cands), len(SIGNALS), dtype=torch.float64)  # (n, S)
    best = max(h.score for h in cands)
    cider = memory.cider
    near_refs = [memory.captions_of(j) for j in near] if weights["consensus"] else []
    wide_refs = [memory.captions_of(j) for j in wide] if weights["wide"] else []
    tokens = [h.tokens for h in cands]
    if near_refs:  # every candidate in one call (CiderD.agreements)
        out[:, 1] = cider.agreements(tokens, [near_refs] * len(cands))
    if wide_refs:
        out[:, 2] = cider.agreements(tokens, [wide_refs] * len(cands))
    if weights["agreement"] and len(cands) > 1:
        out[:, 3] = cider.agreements(tokens, [[[c for j, c in enumerate(tokens) if j != i]] for i in range(len(cands))])
    for i, h in enumerate(cands):
        words = len(h.tokens)
        out[i, 0] = h.score - best
        out[i, 4] = h.log_prob / (words + 1)  # <end> included: a per-token mean
        out[i, 5] = words
        if probs is not None and words:
            ids = torch.tensor(h.tokens)  # (L,)
            named = categories[ids].amax(0) > 0  # (C,) the categories the caption names
            out[i, 6] = float((probs[named] - OBJECT_P).sum())
            if person is not None and bool(person[1][ids].any()):
                out[i, 6] += person[0] - OBJECT_P
            top = int(probs.argmax())
            out[i, 7] = float(named[top] and probs[top] >= OBJECT_P)
    return out



def choose(hyps: Sequence[Sequence[Hypothesis]], feats: torch.Tensor, probs: torch.Tensor | None,
           memory: ConsensusMemory | None, vocab: Vocab, settings: DecodeConfig,
           person: tuple[torch.Tensor, torch.Tensor] | None = None,
           categories: torch.Tensor | None = None, how_sure: bool | None = None, weights: Weights = BEAM_ORDER,
           fitted: ConfidenceMap | None = None, check: ObjectCheck | None = None) -> list[list[Hypothesis]]:
    """Each photo's finished hypotheses (best first by beam score) -> reordered by `choice`, highest first, each
    hypothesis's `choice` set (None when the beam's order is kept: no memory, all weights on the score, or one
    hypothesis). feats (B, P, D); probs (B, C): the head's P(category), or None; person: (P(person) (B,), person
    words (V,)) from the file's person detector (Evidence.person), or None; categories (V, C): which words name
    which category, where the caller holds the table already (Evidence.words: built once per decode), else built.
    weights: the choice's (the model file's fitted ones: resources.Fitted.choice_in_use); fitted: the confidence map
    (Fitted.map_in_use) or None. how_sure (default: where there is a map): each chosen caption's `sure_signals` set
    (confidence.signals; every signal they need computed) and, with a map, its `confidence`; check: the photos'
    objects check (confidence.py: Evidence.check), or None. settings: consensus_k."""
    how_sure = fitted is not None if how_sure is None else how_sure
    hyps = [[Judged(h) for h in hs] for hs in hyps]
    if memory is None or (weights.beam_order and not how_sure) or all(len(h) < 2 for h in hyps):
        return [list(h) for h in hyps]
    # what the confidence reads beyond the choice's own signals, computed for the chosen caption alone (a fitted map:
    # the signals it weighs; none: every one, as the fit needs); the agreement for "it hesitated" separately
    wanted = set(SURE_SIGNALS if fitted is None else needs(fitted))
    sure_extra = Weights(tuple(float(how_sure and not v and s != "agreement" and s in wanted)
                               for s, v in zip(SIGNALS, weights.values)))
    k = int(settings.consensus_k)
    wide = weights["wide"] or sure_extra["wide"]
    cosines, nearest = memory.nearest(feats, WIDE * k if wide else k)  # (B, k') nearest first
    nearest = nearest.tolist()
    if not (weights["objects"] or weights["top_object"] or how_sure):
        categories = None
    else:
        categories = (word_categories(vocab) if categories is None else categories).cpu().to(torch.bool)  # (V, C)
    w = torch.tensor(weights.values, dtype=torch.float64)  # (S,)
    out = []
    for image, cands in enumerate(hyps):
        if len(cands) < 2:
            out.append(list(cands))
            continue
        p = None if probs is None or categories is None else probs[image].float().cpu()  # (C,)
        who = None if person is None or p is None else (float(person[0][image]), person[1].cpu().bool())
        near = nearest[image]
        if weights.beam_order:  # how_sure alone: the beam's order, no choice score
            order, total = list(range(len(cands))), None
        else:
            x = choice_signals(cands, near[:k], near, p, categories, memory, weights, who)  # (n, S)
            total = (x @ w).tolist()  # (n,)
            order = sorted(range(len(cands)), key=lambda i: -total[i])  # stable on ties
            for h, t, row in zip(cands, total, x.tolist()):
                h.choice, h.signals = t, dict(zip(SIGNALS, row))
        ordered = [cands[i] for i in order]
        if how_sure:
            best = ordered[0]
            extra = dict(zip(SIGNALS, choice_signals([best], near[:k], near, p, categories, memory, sure_extra, who)[0].tolist()))
            row = {s: extra[s] if sure_extra[s] or best.signals is None else best.signals[s] for s in SIGNALS}
            row["agreement"] = float(memory.cider.agreements([best.tokens], [[[c.tokens for c in ordered[1:]]]])[0])
            margin = 0.0 if total is None else total[order[0]] - total[order[1]]
            best.sure_signals = sure_signals(best, row, margin, float(cosines[image, 0]), p, categories, who,
                                             None if check is None else photo_check(check, image),
                                             [c.tokens for c in ordered[1:]], " ".join(vocab.itos[t] for t in best.tokens))
            best.confidence = None if fitted is None else fitted(best.sure_signals)
        out.append(ordered)
    return out


def sure_signals(best: Hypothesis, choice: dict[str, float], margin: float, nearest_cosine: float,
            probs: torch.Tensor | None, categories: torch.Tensor | None,
            person: tuple[float, torch.Tensor] | None, check: PhotoCheck | None = None,
            others: Sequence[Sequence[int]] = (), text: str = "") -> dict[str, float]:
    """The signals of a photo's chosen caption -> {signal: value}. choice: its choice signals (choice.signals,
    every one the map reads computed); margin: its choice score over the runner-up's; nearest_cosine: the photo's
    cosine with its nearest training photo; probs (C,): the head's P(category), or None without a head;
    categories (V, C) bool: which words name which category; person: (P(person), the person words (V,) 0/1)
    from the file's person detector, or None; check: the photo's objects check (confidence.py), or None; others: the
    beam's other candidates' tokens; text: the caption (its template)."""
    lps = best.word_logps
    return {"wide": choice["wide"], "consensus": choice["consensus"], "nearest": float(nearest_cosine),
            "agreement": choice["agreement"], "margin": float(margin), "log_prob": choice["log_prob"],
            "min_word": float(lps.min()) if lps is not None and len(lps) else 0.0,
            "objects": choice["objects"], "weakest_object": weakest_object(best.tokens, probs, categories, person),
            "top_p": 0.0 if probs is None else float(probs.max()), "length": float(len(best.tokens)),
            **object_signals(best.tokens, others, check, probs), "template": template(text)}



def weakest_object(tokens: Sequence[int], probs: torch.Tensor | None, categories: torch.Tensor | None,
                   person: tuple[float, torch.Tensor] | None) -> float:
    """The least P among the categories the words name (person words: the person detector's P), 1 for none."""
    if probs is None or categories is None or not tokens:
        return 1.0
    ids = torch.tensor(list(tokens))  # (L,)
    named = categories[ids].amax(0) > 0  # (C,)
    out = [float(probs[named].min())] if bool(named.any()) else []
    if person is not None and bool(person[1][ids].any()):
        out.append(float(person[0]))
    return min(out, default=1.0)



def object_signals(tokens: Sequence[int], others: Sequence[Sequence[int]], check: PhotoCheck | None,
                   probs: torch.Tensor | None) -> dict[str, float]:
    """support, unsupported, disagreement (see the module's doc) of a caption's tokens against its photo's check,
    the beam's other candidates `others`; head_entropy of probs (C,). Without a check: no object is doubted
    (support 1, unsupported 0, disagreement 0)."""
    out = {"support": 1.0, "unsupported": 0.0, "disagreement": 0.0, "head_entropy": entropy(probs)}
    if check is None:
        return out
    named = check.named(tokens)
    if named:
        out["support"] = float(check.support[torch.tensor([tokens[i] for i in named])].min())
        out["unsupported"] = float(len(check.unsupported(tokens)))
    if others:
        mine = check.objects(tokens)
        out["disagreement"] = sum(check.objects(o) != mine for o in others) / len(others)
    return out




def entropy(probs: torch.Tensor | None) -> float:
    """The entropy (nats) of the head's P over the COCO categories and the rest ("none of them"); 0 without a head."""
    if probs is None:
        return 0.0
    p = probs.double().clamp_min(0)  # (C,)
    p = torch.cat([p, (1 - p.sum()).clamp_min(0).reshape(1)])  # (C + 1,)
    p = p / p.sum().clamp_min(1e-12)
    return float(-(p * p.clamp_min(1e-12).log()).sum())


def photo_check(check: ObjectCheck, image: int) -> "PhotoCheck":
    return PhotoCheck(check.support[image].float().cpu(), check.columns.cpu())


@dataclass(frozen=True)
class PhotoCheck:
    """One photo's object evidence: support (V,) and columns (V, M) bool."""

    support: torch.Tensor  # (V,)
    columns: torch.Tensor  # (V, M) bool

    @cached_property
    def _names(self) -> list[bool]:
        """(V,) whether each word names an object, read to the host once (not once a word)."""
        return self.columns.any(1).tolist()

    @cached_property
    def _supports(self) -> list[float]:
        """(V,) support, read to the host once."""
        return self.support.tolist()

    def named(self, tokens: Sequence[int]) -> list[int]:
        """The positions of the words that name an object."""
        return [i for i, t in enumerate(tokens) if self._names[t]]

    def unsupported(self, tokens: Sequence[int], floor: float = SUPPORT_FLOOR) -> list[int]:
        """The positions of the object words whose support is below floor, least supported first."""
        weak = [i for i in self.named(tokens) if self._supports[tokens[i]] < floor]
        return sorted(weak, key=lambda i: self._supports[tokens[i]])

    def objects(self, tokens: Sequence[int]) -> frozenset[int]:
        """The object columns (categories, detector groups) the words name."""
        if not tokens:
            return frozenset()
        return frozenset(torch.nonzero(self.columns[torch.tensor(list(tokens))].any(0)).flatten().tolist())


