"""Features -> Captions, written once. `captions_from_features` is what the public API (Captioner),
evaluation, training's validation and grounding call, and the latency benchmark times its two halves:
decode_photos (the photos' evidence built once, decoding.decode with a DecodeConfig), then dress (each
image's best hypothesis as a Caption: words, attention maps, gates, with its photo's reading).
`sampled_captions` draws captions instead (sampling.sample, under the same rules), dressed the same way.

Legend: N images, P = G*G attention cells, D feature dim, L words.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..concepts.imagenet import imagenet_head_or_none
from ..concepts.words import word_categories
from ..config import DecodeConfig
from ..logs import progress as progress_of
from ..vocab import SpecialIds
from .search import Hypothesis, decode
from .choice import BEAM_ORDER, CIDER_SIGNALS, SIGNALS, Neighbours, Weights, agreements, choose, ordered
from .alternatives import different
from .confidence import SURE, ConfidenceMap, judge, level, needs, why_unsure
from .consensus import ConsensusMemory
from .rules import Evidence, checked_detectors, photo_evidence
from .support import ObjectCheck, objects_check
from .pool import Pool
from .fitted import Fitted
from .rules import Lexicon, Rules
from .sampling import SampleSettings, Samples, sample
from .reading import HeadReading, annotated, grid_side, read_heads
from .resources import Resources
from ..model.show_attend_tell import ShowAttendTell
from ..vocab import Vocab

SMALL_PHOTO = 0.5  # a photo whose shorter side is below this share of the model's input side gets a note


REPR_PART = 240  # characters of a Caption's repr for its text, and for its words: the whole repr stays a line or two


def _clipped(text: str) -> str:
    return text if len(text) <= REPR_PART else text[:REPR_PART - 3] + "..."


class Alternative(NamedTuple):
    """Another finished beam hypothesis: its text, log-probability and the score beam search ranked it by
    (log_prob / (words + 1) ** decode.length_penalty; the log-probability itself when the penalty is 0;
    None when unknown, e.g. a Caption built by hand from (text, log_prob) pairs)."""

    text: str
    log_prob: float
    score: float | None = None
    choice: float | None = None  # what chose among the candidates (decoding/choice.py); None: the beam's order
    signals: dict[str, float] | None = None  # each signal's value that made `choice`; None with it


@dataclass(frozen=True)
class Caption:
    """One caption and everything said of it, a value: built by the decoding stages (to_captions, then dress or the
    sampling's and explanation's own dressing, then Photo's: each a dataclasses.replace), never changed after."""
    __hash__ = None  # its lists and arrays: compared by value, never a dict key
    text: str
    words: list[str]  # no special tokens
    alphas: np.ndarray  # (L, G, G), each map sums to 1, covering the whole image
    log_prob: float  # log p(words, <end> | image) under the model
    # the other finished beam hypotheses, in the order beam search ranked them (by score, not log_prob)
    alternatives: list[Alternative] = field(default_factory=list)
    # (L,) gate beta of each word in [0, 1]: the share of the attended image context that reached
    # the word (z = beta * sum alpha_i a_i); near 0 = the word barely used the image. Empty when unknown.
    betas: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    # (L,) log p(word_i | image, words before it) of each word; log_prob - their sum = <end>'s. Empty when unknown.
    # Lets a reader see WHICH words the model found unlikely, not just the sentence's total.
    word_log_probs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    # indices of words the vocabulary lacks (explained sentences only): fed to the decoder as <unk>,
    # so their maps and probabilities are those of <unk>
    unknown: list[int] = field(default_factory=list)
    # what the photo's heads see, most probable first, with P: the COCO categories the encoder's ImageNet
    # head sees at P >= concepts.imagenet.THRESHOLD, and with word detectors the detected words (person too) at the
    # same P; the photo's one list (Captioner.concepts()[i].top, Photo.concepts.top); empty without the head
    concepts: list[tuple[str, float]] = field(default_factory=list)
    # indices of words naming an object the ImageNet head rules out (P < decode.evidence_floor), whether
    # or not decoding used the evidence: what the app marks as contradicted
    contradicted: list[int] = field(default_factory=list)
    # word index -> (category, P(category), (G, G) concept map summing to 1) for each word naming a category
    # the ImageNet head sees with P >= concepts.maps.MIN_PROB: where the classifier sees what the word names
    # (concepts/maps.py), to set beside where the word looked
    concept_maps: dict[int, tuple[str, float, np.ndarray]] = field(default_factory=dict)
    # what the model file's word detectors (concepts/detectors.py) see: every group -> P, e.g. ("person", 0.97);
    # empty for files without detectors. The shown ones (person, scene words) are also in `concepts`
    detections: list[tuple[str, float]] = field(default_factory=list)
    # the score beam search ranked this caption by (see Alternative; the consensus rerank may put a caption of
    # lower score first); None for an explained sentence or a sample
    score: float | None = None
    # why this caption was chosen among the beam's (decoding/choice.py): its `choice` (the weighted sum the
    # candidates were ranked by; each alternative carries its own) and each signal's value; None / empty where the
    # beam's order was kept
    choice: float | None = None
    signals: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)  # each signal's weight in `choice` (the file's fit)
    # how sure (decoding/confidence.py): the probability that this caption is good (per-photo CIDEr-D >= .5),
    # from the model file's fitted map; None where the file has none (or the caption has no signals: no consensus
    # memory, one candidate, an explained sentence, a sample). sure_signals: what it was computed from
    confidence: float | None = None
    sure_signals: dict[str, float] = field(default_factory=dict)
    sure_at: float | None = None  # the threshold of `sure`: the model file's, fitted with its map (fitted.py)
    # each weighed signal's share of the confidence's log-odds against the val mean (ConfidenceMap.contributions),
    # empty for a map stored without means: the most negative is the reason an unsure caption gives
    contributions: dict[str, float] = field(default_factory=dict)
    # indices of words naming an object the heads barely see (support.py: support below SUPPORT_FLOOR), least
    # supported first: what an unsure caption's reason names first ("it is not sure there is a cake")
    unsupported: list[int] = field(default_factory=list)
    # (width, height) of the photo as the model received it and the model's input side S (model.image_size),
    # when the caller knew them (Captioner.caption / explain, the app): a photo whose shorter side is below
    # SMALL_PHOTO * S is enlarged a lot before the encoder sees it, and `notes` says so
    photo_size: tuple[int, int] | None = None
    input_side: int | None = None
    # (width, height) of the file, when the photo was shrunk on reading (a 5000x20 panorama is read at 1024x4:
    # the note names the size a person knows); and whether the file was fully transparent (no picture at all)
    file_size: tuple[int, int] | None = None
    transparent: bool = False
    flat: bool = False  # the photo is one flat colour (images.flat_colour): nothing to caption
    # the decode settings this caption was made with (config.decode's fields; for an explained sentence
    # the settings it was scored under) and the model file it came from, when known: every JSON says them
    settings: dict = field(default_factory=dict)
    model_file: str | None = None

    def __post_init__(self) -> None:  # (text, log_prob) pairs still welcome
        object.__setattr__(self, "alternatives", [Alternative(*a) for a in self.alternatives])

    def __repr__(self) -> str:
        """One line (the dataclass's own repr printed every attention map): the text, how sure, the words."""
        sure = "" if self.confidence is None else f", confidence={self.confidence:.2f}, sure={self.sure}"
        words, cut = repr(self.words), repr(self.words).rfind(", ", 0, REPR_PART - 5)
        if len(words) > REPR_PART:
            words = words[:cut] + ", ...]" if cut > 0 else f"<{len(self.words)} words>"
        return (f"Caption({_clipped(self.text)!r}{sure}, log_prob={self.log_prob:.2f}, words={words}, "
                f"maps={tuple(np.shape(self.alphas))})")

    @property
    def sure(self) -> bool | None:
        """Whether the caption is sure: confidence at or above the model file's fitted sure_at, never below
        confidence.SURE_FLOOR, and no object it names unsupported (None without a confidence or a threshold)."""
        if self.confidence is None or self.sure_at is None:
            return None
        return self.level == SURE

    @property
    def level(self) -> str | None:
        """What a person should do with it, in words (confidence.level): "sure", "probably right", "may be
        wrong" (check the alternatives) or "probably wrong"; None without a confidence."""
        if self.confidence is None or self.sure_at is None:
            return None
        return level(self.confidence, self.sure_at, bool(self.unsupported))

    @property
    def doubt(self) -> str | None:
        """Why an unsure caption is unsure, in plain words (None when sure or without a confidence)."""
        if self.sure is not False:
            return None
        others = self.different_alternatives or [a.text for a in self.alternatives[:1]]
        return why_unsure(self.sure_signals, others[0] if others else None, self.contributions,
                          [self.words[i] for i in self.unsupported])

    @property
    def different_alternatives(self) -> list[str]:
        """The alternatives that say something else (alternatives.different: each names a content word the
        caption and those before it do not), at most alternatives.SHOWN: what to show beside an unsure caption."""
        return different(self.text, [a.text for a in self.alternatives])

    @property
    def comparable(self) -> bool:
        """Whether log_prob is the model's probability of these very words, so it can be set against another
        sentence's (e.g. the model's own caption). False when the sentence holds words the vocabulary lacks:
        each is scored as <unk>, which stands for every unknown word at once, so such a total is inflated."""
        return not self.unknown

    def to_dict(self, image: str | None = None, maps: bool = True) -> dict:
        """The one JSON shape of a caption (captioner-caption --json lines, the app's download and the API):
        text, words with their log-probs, probabilities and gates (null where the caption carries none), the
        ranking score and the other hypotheses (each with its log-prob and score), the concepts,
        contradicted and unknown words, whether log_prob is comparable (false with unknown words), the
        notes, the decode settings it was made with and the model file; the (L, G, G) maps when `maps`."""
        n = len(self.words)
        lps = [round(float(x), 5) for x in self.word_log_probs] if len(self.word_log_probs) == n else [None] * n
        rec = {"image": image, "caption": self.text, "log_prob": float(self.log_prob),
               "score": None if self.score is None else float(self.score),
               "choice": None if self.choice is None else float(self.choice), "signals": dict(self.signals),
               "confidence": None if self.confidence is None else round(float(self.confidence), 4),
               "sure": self.sure, "level": self.level, "doubt": self.doubt,
               "words": list(self.words),
               "word_log_probs": lps, "word_probs": [None if x is None else round(math.exp(x), 5) for x in lps],
               "betas": [round(float(b), 5) for b in self.betas] if len(self.betas) == n else [None] * n,
               "alternatives": [{"caption": a.text, "log_prob": float(a.log_prob),
                                 "score": None if a.score is None else float(a.score),
                                 "choice": None if a.choice is None else float(a.choice)} for a in self.alternatives],
               "different_alternatives": self.different_alternatives,
               "unsupported_words": [self.words[i] for i in self.unsupported],
               "concepts": [{"category": c, "prob": round(float(q), 5)} for c, q in self.concepts],
               "detections": [{"word": w, "prob": round(float(q), 5)} for w, q in self.detections],
               "contradicted_words": [self.words[i] for i in self.contradicted],
               "unknown_words": [self.words[i] for i in self.unknown], "comparable": self.comparable,
               "notes": self.notes,
               "settings": dict(self.settings), "model": self.model_file,
               "grid": list(self.alphas.shape[1:])}
        if maps:
            rec["alphas"] = np.round(self.alphas, 5).tolist()
        return rec

    @property
    def notes(self) -> list[str]:
        """Human-readable remarks on the caption: one per out-of-vocabulary word, then why the total is not
        comparable (when it is not), then a photo far smaller than the model's input."""
        out = [f"‘{self.words[i]}’ is not in the model's vocabulary (fed as <unk>)" for i in self.unknown]
        if not self.comparable:
            names = ", ".join(f"‘{self.words[i]}’" for i in self.unknown)
            out.append(f"The sentence's log-probability is not comparable with other sentences' (such as the "
                       f"model's own caption): {names} scored as <unk>, the probability of any unknown word, "
                       "not of this one.")
        return out + photo_notes(self.photo_size, self.input_side, self.file_size, self.transparent, self.flat)


def photo_notes(size: tuple[int, int] | None, input_side: int | None, file_size: tuple[int, int] | None = None,
                transparent: bool = False, flat: bool = False) -> list[str]:
    """Remarks on the photo itself, for a Photo and each of its Captions: a fully transparent file (no picture:
    the caption is of its blank white background), a photo of one flat colour (nothing to caption), a photo far
    smaller than the model's input (small_photo_note)."""
    out = ["The image is fully transparent: it holds no picture, so the caption describes an empty white "
           "image."] if transparent else []
    if flat and not transparent:
        out.append("The photo is a single flat colour: there is nothing in it to caption, so the caption is the "
                   "model's guess at an empty picture, not a description.")
    small = small_photo_note(size, input_side, file_size)
    return out + ([small] if small else [])


def small_photo_note(size: tuple[int, int] | None, input_side: int | None,
                     file_size: tuple[int, int] | None = None) -> str:
    """A note when the photo's shorter side is below SMALL_PHOTO x the model's input side (else ""). `size` is
    the photo as the model received it; a file shrunk on reading (its longer side to images.WORKING_SIDE) is
    named by its own size, `file_size`, with the size it was read at."""
    if not size or not input_side or min(size) >= SMALL_PHOTO * input_side:
        return ""
    (w, h), times = size, input_side / min(size)
    if file_size and tuple(file_size) != tuple(size):
        return (f"The photo is {file_size[0]}x{file_size[1]} pixels, read at {w}x{h} (its longer side brought to "
                f"{max(size)}): its shorter side is far smaller than the model's {input_side}x{input_side} input, "
                f"enlarged {times:.0f}x, so the caption rests on very little detail.")
    return (f"The photo is only {w}x{h} pixels, far smaller than the model's {input_side}x{input_side} input: it "
            f"is enlarged {times:.0f}x, so the caption rests on very little detail.")


@dataclass(frozen=True)
class Decided:
    """One photo's decision (decide), a value: its candidates in the chosen order (the beam's where nothing chose),
    each one's choice and signals (choice.py; None: the beam's order kept), and how sure the first is: the
    judge's signals and confidence (confidence.py; None: not judged)."""
    hyps: tuple[Hypothesis, ...]
    choices: tuple[float, ...] | None = None
    signals: tuple[dict[str, float], ...] | None = None
    sure_signals: dict[str, float] | None = None
    confidence: float | None = None

    @property
    def best(self) -> Hypothesis:
        return self.hyps[0]

    def choice_of(self, i: int) -> tuple[float | None, dict[str, float] | None]:
        """Candidate i's choice and signals (None, None where the beam's order was kept)."""
        return (None, None) if self.choices is None else (self.choices[i], self.signals[i])


def kept(hyps: Sequence[Sequence[Hypothesis]]) -> list[Decided]:
    """Each photo's hypotheses in the beam's order, nothing chosen or judged."""
    return [Decided(tuple(h)) for h in hyps]


def to_caption(hyps: Sequence[Hypothesis], vocab: Vocab) -> Caption:
    """One image's hypotheses (best first) -> its Caption (words, maps, gates, word log-probs, the ranking
    score); the other hypotheses become `alternatives`. What the photo's heads say: reading.annotated."""
    return to_captions(kept([hyps]), vocab)[0]


def to_captions(photos: Sequence[Decided], vocab: Vocab) -> list[Caption]:
    """Each photo's decision -> its Caption (to_caption) with its choice and how sure, the best hypotheses' maps,
    gates and word log-probs read to the host in one transfer for all the photos (padded to the longest, then cut)."""
    best = [d.best for d in photos]
    if not best:
        return []
    lengths = [len(b.tokens) for b in best]
    pad = torch.nn.utils.rnn.pad_sequence
    on_device = pad([torch.cat([b.alphas.float(), (b.betas if b.betas is not None else b.alphas.new_zeros(n)).float()
                                [:, None]], 1) for b, n in zip(best, lengths)], batch_first=True)  # (B, L, P + 1)
    lps = pad([b.word_logps.float().cpu() if b.word_logps is not None else torch.zeros(n) for b, n in zip(best, lengths)],
              batch_first=True)  # (B, L): the beam hands them over on the host
    host = np.concatenate([on_device.cpu().numpy(), lps.numpy()[:, :on_device.shape[1], None]], -1)  # (B, L, P + 2)
    out = []
    for b, d, n, rows in zip(best, photos, lengths, host):
        words = [vocab.itos[t] for t in b.tokens]
        g = grid_side(rows.shape[-1] - 2)
        betas = rows[:n, -2].copy() if b.betas is not None else np.zeros(0, np.float32)  # (L,)
        lps = rows[:n, -1].copy() if b.word_logps is not None else np.zeros(0, np.float32)  # (L,)
        alts = [Alternative(" ".join(vocab.itos[t] for t in a.tokens), float(a.log_prob), float(a.score),
                            *d.choice_of(i)) for i, a in enumerate(d.hyps) if i]
        choice, signals = d.choice_of(0)
        out.append(Caption(" ".join(words), words, rows[:n, :-2].reshape(n, g, g).copy(), float(b.log_prob), alts,
                           betas, word_log_probs=lps, score=float(b.score), choice=choice,
                           signals=dict(signals or {}), confidence=d.confidence,
                           sure_signals=dict(d.sure_signals or {})))
    return out


class Decoded(NamedTuple):
    """decode_photos' result: each photo's decision (its hypotheses in the chosen order, the first judged), and the
    evidence and objects check they were decoded and judged with (None without the ImageNet head)."""
    photos: list[Decided]
    evidence: Evidence | None
    check: ObjectCheck | None


@torch.no_grad()
def decode_photos(model: ShowAttendTell, feats: torch.Tensor, reading: HeadReading, vocab: Vocab,
                  settings: DecodeConfig, resources: Resources) -> Decoded:
    """Photos' features (B, P, D) on the decoder's device and their reading -> their hypotheses (the model's own
    log-probs), the stages in order: the evidence (rules.photo_evidence: built once here, banning and favouring
    words only with settings.evidence) and the rules, the search (search.decode; its recorded searches, device_beam.py, replay it
    on a GPU), then the decision (decide: with a consensus memory in `resources`, the choice's order and the
    fitted map's confidence) with the objects check (support.objects_check)."""
    evidence = photo_evidence(reading, model, vocab, settings)  # (B, V) ruled-out words, the bonus table
    ids = SpecialIds.of(vocab, settings.forbid_unk)
    rules = Rules(ids, settings, evidence if settings.evidence else None, Lexicon.of(vocab))  # once, for the search
    hyps = decode(model.decoder, feats, ids, settings, rules, resources.recordings.search)
    check = None if evidence is None else objects_check(reading, checked_detectors(model, settings), vocab,
                                                        evidence.words)
    fitted = resources.fitted
    return Decoded(decide(hyps, feats, reading.probs, resources.memory, vocab, settings,
                          fitted.choice_in_use(settings), fitted.map_in_use(settings),
                          person=None if evidence is None else evidence.person,
                          categories=None if evidence is None else evidence.words, check=check), evidence, check)


def decide(hyps: Sequence[Sequence[Hypothesis]], feats: torch.Tensor, probs: torch.Tensor | None,
           memory: ConsensusMemory | None, vocab: Vocab | None, settings: DecodeConfig, weights: Weights = BEAM_ORDER,
           sure: ConfidenceMap | None = None, judged: Sequence[str] | None = None, *,
           person: tuple[torch.Tensor, torch.Tensor] | None = None, categories: torch.Tensor | None = None,
           check: ObjectCheck | None = None) -> list[Decided]:
    """The decision after the beam, in two stages: choose (choice.py) orders each photo's candidates by the fitted
    weights, then judge (confidence.py) computes how sure the chosen caption is: with the map `sure`, the signals
    it weighs and its confidence; with `judged`, those signals (captioner-fit-selector: every one). Both read one
    neighbourhood of the consensus memory and go to the host in one read; the hypotheses come back in the chosen
    order (Decided), with each one's choice and the first's judged signals and confidence. Without a memory, or a photo
    with two candidates, the beam's order stays and nothing is judged. feats (B, P, D); probs (B, C): the head's
    P(category), or None; person: (P(person) (B,), person words (V,)) from the file's person detector
    (Evidence.person), or None; categories (V, C): which words name which category (Evidence.words, else built
    from the vocabulary where needed); check: the photos' objects check (support.objects_check), or None."""
    how_sure = sure is not None or judged is not None
    if memory is None or (weights.beam_order and not how_sure) or all(len(h) < 2 for h in hyps):
        return kept(hyps)
    wanted = needs(sure) if judged is None else tuple(judged)
    near = Neighbours.of(memory, feats, settings.consensus_k, bool(weights["wide"]) or (how_sure and "wide" in wanted))
    if weights["objects"] or weights["top_object"] or how_sure:  # (V, C) bool
        categories = (word_categories(vocab) if categories is None else categories).to(torch.bool)
    else:
        categories = None
    pool = Pool.of(hyps, memory.vocab_size, feats.device)  # the memory speaks the model's vocabulary
    asked = [s for s in CIDER_SIGNALS if weights[s] or (how_sure and s in wanted)]
    cider = agreements(pool, near.nearest, near.k, memory, asked)  # (N, 3): one CIDEr-D pass for choice and judge
    decision = choose(pool, len(hyps), cider, probs, weights, person, categories)
    judgement = None
    if how_sure:
        judgement = judge(decision, near, cider, probs, categories, person, check, vocab, sure, wanted)
    parts = decision.host() + (() if judgement is None else judgement.host())
    host = torch.cat(parts).tolist()  # the decision's one read
    out = [Decided(tuple(h), None if c is None else tuple(c), None if x is None else tuple(x))
           for h, c, x in ordered(hyps, decision, host)]
    if judgement is not None:
        rest = host[sum(p.numel() for p in decision.host()):]
        for g, b in enumerate(decision.pool.photos):
            sure_signals, confidence = judgement.of_photo(rest, g)
            out[b] = dataclasses.replace(out[b], sure_signals=sure_signals, confidence=confidence)
    return out


@torch.no_grad()
def dress(decoded: Decoded, reading: HeadReading, feats: torch.Tensor, model: ShowAttendTell, vocab: Vocab,
          settings: DecodeConfig, fitted: Fitted) -> list[Caption]:
    """Each photo's decoded hypotheses -> its Caption, dressed with its reading (reading.annotated: concepts,
    detections, the contradicted words of the evidence's mask, concept maps), the settings that made it and what
    of the model file's `fitted` data it was chosen and judged by (the choice's weights, sure_at, the map's
    contributions) and the objects its heads barely see (the objects check: support.py)."""
    photos, evidence, check = decoded
    tokens = [d.best.tokens for d in photos]
    caps = annotated(to_captions(photos, vocab), tokens, reading, feats, model, vocab,
                     None if evidence is None else evidence.ruled_out)
    weights, sure = dict(zip(SIGNALS, fitted.choice_in_use(settings).values)), fitted.map_in_use(settings)
    weak = [[] for _ in caps] if check is None else check.unsupported(tokens)
    return [dataclasses.replace(  # each caption says what made it (its JSON carries them)
        cap, unsupported=w, settings=dataclasses.asdict(settings), weights=dict(weights) if cap.choice is not None
        else {}, sure_at=None if sure is None else sure.sure_at,
        contributions={} if sure is None or not cap.sure_signals else sure.contributions(cap.sure_signals))
        for cap, w in zip(caps, weak)]


@torch.no_grad()
def captions_from_features(model: ShowAttendTell, feats: np.ndarray | torch.Tensor, vocab: Vocab,
                           settings: DecodeConfig, resources: Resources, batch_size: int = 100,
                           progress: bool = False, reading: HeadReading | None = None) -> list[Caption]:
    """Features (N, P, D) (a tensor, an array or a float16 memory map) -> N Captions, decoded in batches
    of `batch_size` images on the decoder's device and in its dtype: decode, then dress, with what `resources`
    holds (the owner's fitted data, consensus memory and recordings: resources.py). Where the encoder
    keeps its ImageNet head, settings.evidence vetoes and favours words and each Caption carries its photo's reading
    (reading.annotated); `reading`: the photos' HeadReading when already made (Photo), else read per batch."""
    param = next(model.decoder.eval().parameters())
    _check_evidence(model, settings)
    out: list[Caption] = []
    for k in progress_of(range(0, len(feats), batch_size), "decoding", enabled=progress):
        x = feats[k:k + batch_size]
        x = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x, dtype=np.float32))
        x = x.to(param.device, param.dtype)  # (b, P, D)
        r = read_heads(model, x) if reading is None else reading.rows(k, k + len(x))
        out.extend(dress(decode_photos(model, x, r, vocab, settings, resources), r, x, model, vocab, settings,
                         resources.fitted))
    return out


def _check_evidence(model: ShowAttendTell, settings: DecodeConfig) -> None:
    """A ValueError when decode.evidence is asked of a model without the ImageNet head it needs."""
    if settings.evidence and imagenet_head_or_none(model) is None:
        raise ValueError(f"decode.evidence needs an encoder with an ImageNet head (efficientnet_lite0/2), not "
                         f"{getattr(model.encoder, 'name', type(model.encoder).__name__)}; set decode.evidence=false")


@torch.no_grad()
def sampled_captions(model: ShowAttendTell, feats: torch.Tensor, reading: HeadReading, vocab: Vocab,
                     settings: DecodeConfig, request: SampleSettings) -> list[list[Caption]]:
    """Photos' features (B, P, D) on the decoder's device and their reading -> request.n Captions per photo, drawn
    in that order (sampling.sample), each word as request.draw says, from request's own seeded generator.

    The rules are a caption's (rules.Rules with `settings`: <unk> with forbid_unk, the block_* rules, the
    evidence's veto and bonus with decode.evidence), applied before temperature and truncation, so top_k=1 is
    greedy decoding; switch a rule off for one call like any decode setting (Photo.sample(block_salad=False)).
    Each Caption carries words, (L, G, G) maps, gates and the model's own word log-probs and log_prob (the
    evidence's bonus taken off, as decode does; score None), dressed like a caption (reading.annotated); its
    settings record `settings` and, under "sample", request.to_dict with the seed used and the caption's index.
    One generator draws for the whole batch: a photo sampled alone (Photo.sample) gets the same captions whatever
    else is read with it."""
    _check_evidence(model, settings)
    request.checked()
    settings.checked()
    model.decoder.eval()
    ids = SpecialIds.of(vocab, settings.forbid_unk)
    evidence = photo_evidence(reading, model, vocab, settings)  # (B, V) ruled-out words, the bonus table
    bias = evidence if settings.evidence else None
    generator, seed = request.generator(feats.device)
    n = int(request.n)  # a plain int (numpy's are welcome in the request)
    s = sample(model.decoder, feats, ids, n, settings.max_len, draw=request.draw,
               rules=Rules(ids, settings, bias, Lexicon.of(vocab)), generator=generator, context=settings.hard_context)
    hyps = _sample_hypotheses(s, ids.end, n, bias)
    caps = to_captions(kept([[h] for h in hyps]), vocab)
    of = torch.arange(len(feats), device=feats.device).repeat_interleave(n)  # (B*n,) photo of each sample
    ruled_out = None if evidence is None else evidence.ruled_out[of.to(evidence.ruled_out.device)]  # (B*n, V)
    caps = annotated(caps, [h.tokens for h in hyps], HeadReading.cat([reading.rows(b, b + 1) for b in of.tolist()]),
                     feats[of], model, vocab, ruled_out)
    caps = [dataclasses.replace(cap, score=None,  # drawn, not ranked
                                settings={**dataclasses.asdict(settings), "sample": {**request.to_dict(seed),
                                                                                     "index": i % n}})
            for i, cap in enumerate(caps)]
    return [caps[b * n:(b + 1) * n] for b in range(len(feats))]


def _sample_hypotheses(s: Samples, end: int, n: int, evidence: Evidence | None) -> list[Hypothesis]:
    """Each sampled row (B*n, T) -> a Hypothesis: its words (no <end>), maps, gates and word log-probs, log_prob
    with <end>'s when it was drawn; the evidence's bonus (when decoding added one) taken off the words' scores, for
    every row at once (Evidence.word_biases), read to the host once."""
    rows = []
    for toks, mask in zip(s.tokens.tolist(), s.mask.tolist()):
        length = sum(mask)
        ended = length > 0 and toks[length - 1] == end
        rows.append((toks[:length - int(ended)], ended))  # the words, and whether <end> was drawn
    lps = s.log_probs.float()  # (B*n, T)
    if evidence is not None and rows:
        bias = evidence.word_biases([r // n for r in range(len(rows))], [w for w, _ in rows]).float()  # (B*n, L)
        lps = lps - torch.nn.functional.pad(bias.to(lps.device), (0, lps.shape[1] - bias.shape[1]))
    lps = lps.cpu().numpy()  # (B*n, T): the one read
    out = []
    for r, (words, ended) in enumerate(rows):
        L = len(words)
        word_lps = torch.from_numpy(lps[r, :L].copy())  # (L,)
        log_prob = float(word_lps.sum()) + (float(lps[r, L]) if ended else 0.0)  # <end>'s carries no bias
        out.append(Hypothesis(words, s.alphas[r, :L], log_prob, log_prob, s.betas[r, :L], word_lps))
    return out
