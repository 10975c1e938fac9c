"""Features -> Captions, in stages: decode_photos (the evidence and rules built once, the search, then decide:
choose and judge), then dress (each photo's best hypothesis as a frozen Caption, with its photo's reading).
`captions_from_features` is what the API, evaluation, validation and grounding call; `sampled_captions` draws
captions instead, under the same rules, dressed the same way.

Legend: N images, P = G*G attention cells, D feature dim, L words, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..concepts.detectors import GROUP_WORDS
from ..concepts.imagenet import imagenet_head_or_none
from ..concepts.words import CATEGORY_WORDS
from ..config import DecodeConfig
from ..images import photo_notes
from ..logs import progress as progress_of
from ..model.show_attend_tell import ShowAttendTell
from ..vocab import FUNCTION_WORDS, SpecialIds, Vocab
from .choice import SIGNALS
from .confidence import SURE, UNSEEN, Decided, ObjectCheck, decide, kept, level, objects_check, why_unsure
from .reading import HeadReading, annotated, grid_side, read_heads
from .resources import Fitted, Resources
from .rules import Evidence, Lexicon, Rules, checked_detectors, photo_evidence
from .sampling import SampleSettings, Samples, sample
from .search import Hypothesis, decode

REPR_PART = 240  # characters of a Caption's repr for its text, and for its words: the repr stays a line or two
SHOWN = 3  # alternatives shown beside an unsure caption
UNLIKELY = float(np.log(0.3))  # a word the model gave under 30% is named in an unsure caption's reason
FILLERS = frozenset("top front side middle next near up down there it that while some other two one".split())
THINGS = frozenset(w for table in (CATEGORY_WORDS, GROUP_WORDS) for names in table.values() for w in names.split()
                   if "_" not in w)  # the object words of the grounding table and the word detectors


def _clipped(text: str) -> str:
    return text if len(text) <= REPR_PART else text[:REPR_PART - 3] + "..."


class Alternative(NamedTuple):
    """Another finished beam hypothesis: its text, log-probability, the beam's score (log_prob / (words + 1) **
    length_penalty; None when unknown) and, where the choice ranked the candidates, its choice and signals."""

    text: str
    log_prob: float
    score: float | None = None
    choice: float | None = None
    signals: dict[str, float] | None = None


@dataclass(frozen=True)
class Caption:
    """One caption and everything said of it, a value: made by to_captions, then each later stage's
    dataclasses.replace (dress, the sampling's and explanation's dressing, Photo's), never changed after."""
    __hash__ = None  # its lists and arrays: compared by value, never a dict key
    text: str
    words: list[str]  # no special tokens
    alphas: np.ndarray  # (L, G, G), each map sums to 1
    log_prob: float  # log p(words, <end> | image)
    alternatives: list[Alternative] = field(default_factory=list)  # the other candidates, in the beam's order
    # (L,) gate beta of each word (z = beta * sum alpha_i a_i): near 0, the word barely used the image
    betas: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    # (L,) log p(word_i | image, words before it): which words the model found unlikely
    word_log_probs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    unknown: list[int] = field(default_factory=list)  # words the vocabulary lacks (explained, fed as <unk>)
    concepts: list[tuple[str, float]] = field(default_factory=list)  # what the photo's heads see, with P
    contradicted: list[int] = field(default_factory=list)  # words naming an object the heads rule out
    # word index -> (category, P, (G, G) map): where the classifier sees what the word names (concepts/maps.py)
    concept_maps: dict[int, tuple[str, float, np.ndarray]] = field(default_factory=dict)
    detections: list[tuple[str, float]] = field(default_factory=list)  # the file's word detectors: group -> P
    score: float | None = None  # the beam's score (None: explained or sampled)
    choice: float | None = None  # the choice's weighted sum that ranked it (None: the beam's order kept)
    signals: dict[str, float] = field(default_factory=dict)  # each choice signal's value
    weights: dict[str, float] = field(default_factory=dict)  # each signal's weight in `choice`
    # P(this caption is good: per-photo CIDEr-D >= .5) from the file's fitted map, and what it was computed from
    confidence: float | None = None
    sure_signals: dict[str, float] = field(default_factory=dict)
    described: str | None = None  # how people described the training photo most like this one (its reasons quote it)
    sure_at: float | None = None  # the file's threshold of `sure`
    contributions: dict[str, float] = field(default_factory=dict)  # each signal's share of the log-odds
    unsupported: list[int] = field(default_factory=list)  # words naming an object the heads barely see: never sure
    unseen: list[int] = field(default_factory=list)  # of those, the ones they do not see (UNSEEN): the reason names
    # the photo as the model received it (width, height), the model's input side, the file's own size, and
    # whether the file was fully transparent or one flat colour: what `notes` says of the photo
    photo_size: tuple[int, int] | None = None
    input_side: int | None = None
    file_size: tuple[int, int] | None = None
    transparent: bool = False
    flat: bool = False
    settings: dict = field(default_factory=dict)  # the decode settings that made it
    model_file: str | None = None

    def __post_init__(self) -> None:  # (text, log_prob) pairs still welcome
        object.__setattr__(self, "alternatives", [Alternative(*a) for a in self.alternatives])

    def __repr__(self) -> str:
        """One line (the dataclass's own repr would print every map): the text, how sure, the words."""
        sure = "" if self.confidence is None else f", confidence={self.confidence:.2f}, sure={self.sure}"
        words, cut = repr(self.words), repr(self.words).rfind(", ", 0, REPR_PART - 5)
        if len(words) > REPR_PART:
            words = words[:cut] + ", ...]" if cut > 0 else f"<{len(self.words)} words>"
        return (f"Caption({_clipped(self.text)!r}{sure}, log_prob={self.log_prob:.2f}, words={words}, "
                f"maps={tuple(np.shape(self.alphas))})")

    @property
    def sure(self) -> bool | None:
        """Whether its level is sure (confidence.level); None without a confidence or a threshold."""
        if self.confidence is None or self.sure_at is None:
            return None
        return self.level == SURE

    @property
    def level(self) -> str | None:
        """"sure", "probably right", "may be wrong" or "probably wrong" (confidence.level); None without one."""
        if self.confidence is None or self.sure_at is None:
            return None
        return level(self.confidence, self.sure_at, bool(self.unsupported))

    @property
    def doubt(self) -> str | None:
        """Why an unsure caption is unsure, in plain words (None when sure or without a confidence)."""
        if self.sure is not False:
            return None
        others = self.different_alternatives or [a.text for a in self.alternatives[:1]]
        content = sorted((p, w) for w, p in zip(self.words, self.word_log_probs) if w not in FUNCTION_WORDS)
        unlikely = [w for p, w in content[:2] if p < UNLIKELY] or [w for _, w in content[:1]]  # least likely first
        gated = level(self.confidence, self.sure_at) == SURE  # sure but for the objects its heads barely see
        return why_unsure(self.sure_signals, others[0] if others else None, self.contributions,
                          [self.words[i] for i in self.unseen], unlikely, self.described,
                          [self.words[i] for i in self.unsupported] if gated else [])

    @property
    def different_alternatives(self) -> list[str]:
        """The alternatives that say something else (`different`): what to show beside an unsure caption."""
        return different(self.text, [a.text for a in self.alternatives])

    @property
    def comparable(self) -> bool:
        """Whether log_prob can be set against another sentence's: not with unknown words, each scored as <unk>
        (every unknown word at once, so the total is inflated)."""
        return not self.unknown

    def to_dict(self, image: str | None = None, maps: bool = True) -> dict:
        """The one JSON shape of a caption (the CLI's --json lines, the app's download, the API); per-word lists
        hold null where the caption carries none; the (L, G, G) maps when `maps`."""
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
        """Remarks for a person: each out-of-vocabulary word, why the total is not comparable, the photo's notes."""
        out = [f"‘{self.words[i]}’ is not in the model's vocabulary (fed as <unk>)" for i in self.unknown]
        if not self.comparable:
            names = ", ".join(f"‘{self.words[i]}’" for i in self.unknown)
            out.append(f"The sentence's log-probability is not comparable with other sentences' (such as the "
                       f"model's own caption): {names} scored as <unk>, the probability of any unknown word, "
                       "not of this one.")
        return out + photo_notes(self.photo_size, self.input_side, self.file_size, self.transparent, self.flat)


def content_words(text: str) -> frozenset[str]:
    """The words of a caption that say what it shows: no function word or filler, plurals as their singular."""
    words = [w for w in text.lower().split() if w not in FUNCTION_WORDS and w not in FILLERS]
    return frozenset(w[:-1] if w.endswith("s") and not w.endswith("ss") and len(w) > 3 else w for w in words)


def things(text: str) -> frozenset[str]:
    """The object words of a caption (THINGS), plurals as their singular."""
    return content_words(" ".join(w for w in text.lower().split() if w in THINGS))


def different(caption: str, alternatives: Sequence[str], n: int = SHOWN) -> list[str]:
    """Up to n of `alternatives` (in their order) worth showing beside an unsure caption: each naming another set of
    things than the caption and the ones kept before it; where none does, each naming a new content word (five
    near-identical beam lines give a person nothing to choose between)."""
    shown, out = [things(caption)], []
    for alt in alternatives:
        if len(out) < n and things(alt) not in shown:
            out.append(alt)
            shown.append(things(alt))
    if out:
        return out
    said = set(content_words(caption))
    for alt in alternatives:
        words = content_words(alt)
        if words - said and len(out) < n:
            out.append(alt)
            said |= words
    return out


def to_captions(photos: Sequence[Decided], vocab: Vocab) -> list[Caption]:
    """Each photo's decision -> its Caption: the best hypothesis's words, maps, gates and word log-probs (read to
    the host in one transfer for all the photos), the others as alternatives, its choice and how sure."""
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
                           sure_signals=dict(d.sure_signals or {}), described=d.described))
    return out


class Decoded(NamedTuple):
    """decode_photos' result: each photo's decision, and the evidence and objects check they were decoded and
    judged with (None without the ImageNet head)."""
    photos: list[Decided]
    evidence: Evidence | None
    check: ObjectCheck | None


@torch.no_grad()
def decode_photos(model: ShowAttendTell, feats: torch.Tensor, reading: HeadReading, vocab: Vocab,
                  settings: DecodeConfig, resources: Resources) -> Decoded:
    """Photos' features (B, P, D) on the decoder's device and their reading -> each photo's decision, the stages
    in order: the evidence and the rules (built once; the evidence bans and favours words only with
    settings.evidence), the search, then decide (the choice's order and the judge's confidence)."""
    evidence = photo_evidence(reading, model, vocab, settings)  # (B, V) ruled-out words, the bonus table
    ids, det, fitted = SpecialIds.of(vocab, settings.forbid_unk), checked_detectors(model, settings), resources.fitted
    rules = Rules(ids, settings, evidence if settings.evidence else None, Lexicon.of(vocab))  # once, for the search
    hyps = decode(model.decoder, feats, ids, settings, rules, resources.recordings.search)
    check = None if evidence is None else objects_check(reading, det, vocab, evidence.words)
    return Decoded(decide(hyps, feats, reading.probs, resources.memory, vocab, settings,
                          fitted.choice_in_use(settings), fitted.map_in_use(settings),
                          person=None if evidence is None else evidence.person,
                          categories=None if evidence is None else evidence.words, check=check), evidence, check)


@torch.no_grad()
def dress(decoded: Decoded, reading: HeadReading, feats: torch.Tensor, model: ShowAttendTell, vocab: Vocab,
          settings: DecodeConfig, fitted: Fitted) -> list[Caption]:
    """Each photo's decision -> its Caption, dressed with its reading (reading.annotated), the settings that made
    it, what of the file's `fitted` data chose and judged it, and the objects its heads barely see."""
    photos, evidence, check = decoded
    tokens = [d.best.tokens for d in photos]
    caps = annotated(to_captions(photos, vocab), tokens, reading, feats, model, vocab,
                     None if evidence is None else evidence.ruled_out)
    weights, sure = dict(zip(SIGNALS, fitted.choice_in_use(settings).values)), fitted.map_in_use(settings)
    weak = [[] for _ in caps] if check is None else check.unsupported(tokens)
    unseen = [[] for _ in caps] if check is None else check.unsupported(tokens, UNSEEN)
    return [dataclasses.replace(  # each caption says what made it (its JSON carries them)
        cap, unsupported=w, unseen=u, settings=dataclasses.asdict(settings), weights=dict(weights) if cap.choice
        is not None else {}, sure_at=None if sure is None else sure.sure_at,
        contributions={} if sure is None or not cap.sure_signals else sure.contributions(cap.sure_signals))
        for cap, w, u in zip(caps, weak, unseen)]


@torch.no_grad()
def caption_features(model: ShowAttendTell, feats: torch.Tensor, reading: HeadReading, vocab: Vocab,
                     settings: DecodeConfig, resources: Resources) -> list[Caption]:
    """One batch of photos' features (B, P, D) and their reading -> their Captions: decode, then dress, with what
    `resources` holds (the owner's fitted data, consensus memory and recordings)."""
    param = next(model.decoder.eval().parameters())
    _check_evidence(model, settings)
    feats = feats.to(param.device, param.dtype)  # (B, P, D)
    decoded = decode_photos(model, feats, reading, vocab, settings, resources)
    return dress(decoded, reading, feats, model, vocab, settings, resources.fitted)


@torch.no_grad()
def captions_from_features(model: ShowAttendTell, feats: np.ndarray | torch.Tensor, vocab: Vocab,
                           settings: DecodeConfig, resources: Resources, batch_size: int = 100,
                           progress: bool = False) -> list[Caption]:
    """Features (N, P, D) (a tensor, an array or a float16 memory map) -> N Captions, in batches of `batch_size` on
    the decoder's device and dtype, each batch's heads read (read_heads), then captioned (caption_features)."""
    param = next(model.decoder.eval().parameters())
    _check_evidence(model, settings)
    out: list[Caption] = []
    for k in progress_of(range(0, len(feats), batch_size), "decoding", enabled=progress):
        x = feats[k:k + batch_size]
        x = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x, dtype=np.float32))
        x = x.to(param.device, param.dtype)  # (b, P, D)
        out.extend(caption_features(model, x, read_heads(model, x), vocab, settings, resources))
    return out


def _check_evidence(model: ShowAttendTell, settings: DecodeConfig) -> None:
    """A ValueError when decode.evidence is asked of a model without the ImageNet head it needs."""
    if settings.evidence and imagenet_head_or_none(model) is None:
        raise ValueError(f"decode.evidence needs an encoder with an ImageNet head (efficientnet_lite0/2), not "
                         f"{getattr(model.encoder, 'name', type(model.encoder).__name__)}; set decode.evidence=false")


@torch.no_grad()
def sampled_captions(model: ShowAttendTell, feats: torch.Tensor, reading: HeadReading, vocab: Vocab,
                     settings: DecodeConfig, request: SampleSettings) -> list[list[Caption]]:
    """Photos' features (B, P, D) and their reading -> request.n Captions per photo, drawn in order under a
    caption's rules (sampling.sample) with the model's own word log-probs (score None), dressed like a caption;
    settings["sample"]: the request, its seed and the caption's index."""
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
    caps = annotated(caps, [h.tokens for h in hyps], HeadReading.together([reading.rows(b, b + 1) for b in of.tolist()]),
                     feats[of], model, vocab, ruled_out)
    caps = [dataclasses.replace(cap, score=None,  # drawn, not ranked
                                settings={**dataclasses.asdict(settings), "sample": {**request.to_dict(seed),
                                                                                     "index": i % n}})
            for i, cap in enumerate(caps)]
    return [caps[b * n:(b + 1) * n] for b in range(len(feats))]


def _sample_hypotheses(s: Samples, end: int, n: int, evidence: Evidence | None) -> list[Hypothesis]:
    """Each sampled row (B*n, T) -> a Hypothesis: its words (no <end>), maps, gates, word log-probs (the evidence's
    bonus taken off) and log_prob with <end>'s when it was drawn; read to the host once."""
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
