"""Visual word detectors learnt from captions (Fang et al. 2015, "From Captions to Visual Concepts and
Back"): multiple-instance learning over the annotation grid with a noisy-OR.

Each word group k (e.g. "person": man, woman, boy, people, ...) has one linear scorer over a grid cell's
annotation vector; a photo holds the word when ANY cell does:

    s_ik   = w_k . (a_i - mu) / sigma + b_k                  (B, P, K) cell scores
    q_k    = 1 - prod_i (1 - sigmoid(s_ik))                  (B, K) noisy-OR, in [0, 1]
    P_k    = sigmoid(scale_k * logit(q_k) + shift_k)         (B, K) Platt-calibrated on held-out photos

Labels are "does any reference caption of the photo use a word of the group". ImageNet has no person
class, so this is the model file's only evidence that no one is in a photo (decode.person_floor).
The head is a few tensors (K x D weights) stored in the model file beside the caption model
(checkpoint.py: "detectors." tensors + a "detectors" JSON entry); training: training/detectors.py.

Legend: B images, P = G*G cells, D feature dim, K word groups, V vocabulary.
"""
from __future__ import annotations

import json
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..vocab import tokenize
from .imagenet import CATEGORIES, imagenet_head_or_none, imagenet_logits, person_classes
from .words import CATEGORY_WORDS

PERSON = "person"
# word group -> the caption words that use it (singular and plural). "person" is every person word of
# the grounding table (words.py) plus a few Flickr8k ones; the rest are frequent visual words of
# Flickr8k captions (objects, scenes, materials) that a reader of an everyday photo would expect.
GROUP_WORDS: dict[str, str] = {
    PERSON: CATEGORY_WORDS["person"] + " climber climbers swimmer swimmers dancer dancers runner runners "
                                       "cyclist cyclists hiker hikers",
    "dog": CATEGORY_WORDS["dog"],
    "ball": "ball balls football footballs soccer basketball volleyball",
    "water": "water lake river pool ocean sea waves wave splash splashes splashing",
    "grass": "grass grassy lawn",
    "snow": "snow snowy",
    "beach": "beach sand sandy shore",
    "bicycle": CATEGORY_WORDS["bicycle"],
    "car": CATEGORY_WORDS["car"],
    "street": "street streets road sidewalk city",
    "rock": "rock rocks rocky cliff boulder",
    "mountain": "mountain mountains hill hills",
    "tree": "tree trees forest woods",
    "building": "building buildings house wall",
    "field": "field fields meadow",
    "shirt": "shirt shirts t-shirt tshirt jersey",
    "hat": "hat hats helmet helmets cap caps",
    "skateboard": CATEGORY_WORDS["skateboard"],
    "horse": CATEGORY_WORDS["horse"],
    "boat": CATEGORY_WORDS["boat"],
    "bird": CATEGORY_WORDS["bird"],
}
SHOW_AT = 0.3  # a detected word joins a photo's concepts at P >= SHOW_AT, person too (every list says its threshold)


def group_members(groups: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Group name -> its words (GROUP_WORDS, else a COCO category's words (CATEGORY_WORDS), else the name
    and its plural)."""
    return {g: tuple(GROUP_WORDS.get(g, CATEGORY_WORDS.get(g, f"{g} {g}s")).split()) for g in groups}


def caption_labels(captions: Sequence[Sequence[str]], members: dict[str, Sequence[str]]) -> torch.Tensor:
    """captions[n]: the reference captions of photo n -> (N, K) 0/1: some caption uses a word of group k."""
    out = torch.zeros(len(captions), len(members))
    for n, caps in enumerate(captions):
        words = {w for c in caps for w in tokenize(c)}
        for k, names in enumerate(members.values()):
            out[n, k] = float(not words.isdisjoint(names))
    return out


def noisy_or_logit(cell_scores: torch.Tensor) -> torch.Tensor:
    """Cell scores (B, P, K) -> logit(q) (B, K), q = 1 - prod_i (1 - sigmoid(s_i)), computed stably:
    -log(1 - q) = S = sum_i softplus(s_i) and logit(q) = log(exp(S) - 1)."""
    total = F.softplus(cell_scores.float()).sum(1).clamp_min(1e-12)  # (B, K) = -log(1 - q)
    return total + torch.log(-torch.expm1(-total))  # (B, K)


class WordDetectors(nn.Module):
    """K word-group detectors over annotation vectors (B, P, D) -> calibrated P(word | photo) (B, K)."""

    def __init__(self, groups: Sequence[str], dim: int, members: dict[str, Sequence[str]] | None = None):
        super().__init__()
        if not groups or len(set(groups)) != len(groups):
            raise ValueError(f"word detectors need distinct group names, got {list(groups)}")
        self.groups = list(groups)
        self.members = {g: tuple(ws) for g, ws in (members or group_members(groups)).items()}
        k = len(self.groups)
        self.weight = nn.Parameter(torch.zeros(k, dim))  # (K, D)
        self.bias = nn.Parameter(torch.full((k,), -5.0))  # (K,) one cell alone rarely holds the word
        self.register_buffer("mean", torch.zeros(dim))  # (D,) feature standardisation (training set)
        self.register_buffer("inv_std", torch.ones(dim))  # (D,)
        self.register_buffer("scale", torch.ones(k))  # (K,) Platt calibration, scale > 0 keeps the order
        self.register_buffer("shift", torch.zeros(k))  # (K,)
        # (K,) weight of the ImageNet head's own evidence: log P(the clothes people wear) (imagenet.PERSON_CLASSES);
        # chosen on held-out photos (0 for every group but person): Flickr8k's negatives are dogs, the
        # head has seen everyday scenes
        self.register_buffer("prior_weight", torch.zeros(k))

    def cell_scores(self, feats: torch.Tensor) -> torch.Tensor:
        """(B, P, D) -> (B, P, K) per-cell scores s_ik."""
        x = (feats.to(self.weight.dtype) - self.mean) * self.inv_std  # (B, P, D)
        return x @ self.weight.t() + self.bias  # (B, P, K)

    def raw_logit(self, feats: torch.Tensor) -> torch.Tensor:
        """(B, P, D) -> logit of the uncalibrated noisy-OR (B, K) (what training fits)."""
        return noisy_or_logit(self.cell_scores(feats))

    def fused_logit(self, feats: torch.Tensor, prior: torch.Tensor | None = None) -> torch.Tensor:
        """(B, P, D), prior (B,) log P(clothes) or None -> the noisy-OR logit + prior_weight * prior (B, K)."""
        z = self.raw_logit(feats)  # (B, K)
        return z if prior is None else z + self.prior_weight.float() * prior.float()[:, None]

    def forward(self, feats: torch.Tensor, prior: torch.Tensor | None = None) -> torch.Tensor:
        """(B, P, D), prior (B,) (clothes_prior) -> calibrated probabilities (B, K) in [0, 1]. Without the
        prior a detector whose prior_weight is not 0 is an error (its calibration assumed the prior)."""
        if prior is None and bool(self.prior_weight.ne(0).any()):
            raise ValueError("these word detectors use the ImageNet head's evidence: pass prior=clothes_prior(...)")
        return torch.sigmoid(self.scale.float() * self.fused_logit(feats, prior) + self.shift.float())

    def info(self) -> dict:
        """What the model file stores beside the tensors (JSON): groups, their words, dimensions."""
        return {"version": 1, "groups": self.groups, "members": {g: list(w) for g, w in self.members.items()},
                "dim": int(self.weight.shape[1])}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], info: dict | str) -> "WordDetectors":
        """The head stored by a model file (tensors without their "detectors." prefix, info())."""
        info = json.loads(info) if isinstance(info, str) else info
        try:
            det = cls(info["groups"], int(info["dim"]), info["members"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"word detectors: corrupt description ({e!r}); expected groups, members and dim") from None
        own = det.state_dict()
        if set(tensors) != set(own) or any(tensors[k].shape != own[k].shape for k in own):
            raise ValueError(f"word detectors: stored tensors {sorted((k, tuple(v.shape)) for k, v in tensors.items())}"
                             f" do not fit {len(det.groups)} groups of dimension {info['dim']}")
        det.load_state_dict({k: v.float() for k, v in tensors.items()})
        return det.eval()


def clothes_prior(head: nn.Linear, feats: torch.Tensor) -> torch.Tensor:
    """(B, P, D) -> (B,) log of the ImageNet head's probability of the clothes and outfits people wear."""
    return clothes_prior_of(imagenet_logits(head, feats))


def clothes_prior_of(logits: torch.Tensor) -> torch.Tensor:
    """The head's ImageNet logits (B, 1000) -> (B,) clothes_prior."""
    logp = logits.float().log_softmax(-1)  # (B, 1000)
    return logp[:, list(person_classes())].logsumexp(-1)


def detect_words(model: nn.Module, feats: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor | None:
    """A ShowAttendTell's word detections (B, K) for annotation vectors (B, P, D); None without detectors.
    `logits`: the ImageNet head's logits (B, 1000) of these photos when already computed (not again)."""
    det = detectors_of(model)
    if det is None:
        return None
    if logits is None:
        head = imagenet_head_or_none(model)
        logits = None if head is None else imagenet_logits(head, feats)  # (B, 1000)
    return det(feats, None if logits is None else clothes_prior_of(logits))


def detectors_of(model: nn.Module) -> WordDetectors | None:
    """The word detectors a ShowAttendTell carries (its `detectors` attribute, set by captioner.load), or None."""
    det = getattr(model, "detectors", None)
    return det if isinstance(det, WordDetectors) else None


def attach(model: nn.Module, detectors: WordDetectors | None) -> None:
    """Give a ShowAttendTell its word detectors (a submodule: saved with its state as "detectors.*",
    moved with .to()); None removes them."""
    if detectors is None:
        if hasattr(model, "detectors"):
            del model.detectors
        return
    p = next(model.parameters())
    model.detectors = detectors.to(device=p.device, dtype=p.dtype).eval()


def shown_groups(detectors: WordDetectors) -> list[int]:
    """Indices of the groups shown as concepts: those naming no category the ImageNet head sees (its
    probability is the evidence decoding uses for those; a second number would contradict it)."""
    seen = {w for c in CATEGORIES for w in CATEGORY_WORDS[c].split()}
    return [k for k, g in enumerate(detectors.groups)
            if g not in CATEGORIES and seen.isdisjoint(detectors.members[g])]


def with_detections(concepts: list[tuple[str, float]], detectors: WordDetectors, probs: Sequence[float],
                    at: float = SHOW_AT) -> list[tuple[str, float]]:
    """One photo's ImageNet concepts [(category, P)] + its shown detections (probs (K,): its detectors' P, on the
    host) -> one list, most probable first: the detected words at P >= `at` (person too: a list said to hold what is
    seen at P >= `at` holds nothing below it)."""
    p = list(probs)  # (K,)
    extra = [(detectors.groups[k], round(p[k], 4)) for k in shown_groups(detectors) if p[k] >= at]
    return sorted(concepts + extra, key=lambda cp: -cp[1])
