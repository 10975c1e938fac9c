"""COCO concepts from the encoder's own ImageNet classifier: which objects the photo shows.

The frozen EfficientNet-Lite encoder keeps its ImageNet head (`EfficientNetLite._fc`, D -> 1000).
The annotation vectors a_i the decoder attends over are the backbone's head-conv features on the
grid, so the classifier's own logits are head(mean_i a_i): EfficientNetLite.forward computes
_fc(dropout(features(x).mean((2, 3)))), and dropout is the identity in eval mode. No second pass.

P(category) = sum of the 1000-way softmax probabilities of the ImageNet classes that are instances
of that COCO category (CATEGORY_CLASSES). Categories ImageNet-1k cannot see at all are in UNSEEN:
for them a low probability says nothing, so never read it as "absent".

Measured with the bundled model (Lite2, 260 px): 300 Flickr8k test photos, P(dog) >= 0.3 against
"a reference says dog": precision 0.94, recall 0.78 (at 0.1: 0.67 / 0.92). Categories of many
classes (dog 118, bird 59) collect 5-20% of the mass on photos ImageNet has no class for (people),
hence the default threshold 0.3 (ranking dogs by their most probable breed instead of the sum
separates them better, ROC AUC 0.98 vs 0.96, but is no probability). coco-mini (80 photos, 61 seen categories vs boxes), all categories
pooled: precision 0.72 / 0.76 / 0.54 and recall 0.08 / 0.17 / 0.24 at 0.3 / 0.1 / 0.05: what it
names is mostly there; small and background objects (cups, bottles, chairs) it rarely names.

Legend: B batch, P regions, D feature dim, C = len(CATEGORIES) concepts, K = 1000 ImageNet classes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model.packed_linear import linear

# COCO category -> the ImageNet-1k classes (exact names of torchvision's meta "categories") that are
# instances of it. "A..B" is the inclusive run of classes from A to B in ImageNet's order.
CATEGORY_CLASSES: dict[str, tuple[str, ...]] = {
    "bicycle": ("mountain bike", "bicycle-built-for-two"),
    # COCO has no van: vans and SUVs are boxed as car; the car's parts show a car
    "car": ("sports car", "convertible", "cab", "jeep", "limousine", "minivan", "racer", "beach wagon",
            "Model T", "police van", "car wheel", "grille", "car mirror"),
    "motorcycle": ("moped", "motor scooter"),
    "airplane": ("airliner", "warplane", "wing"),  # ImageNet's "wing" is an aircraft wing
    "bus": ("school bus", "trolleybus", "minibus"),
    "train": ("passenger car", "electric locomotive", "steam locomotive", "bullet train", "freight car",
              "streetcar"),  # "passenger car" is a railway carriage; COCO boxes trams as train
    "truck": ("pickup", "moving van", "tow truck", "trailer truck", "garbage truck", "fire engine", "snowplow",
              "ambulance"),
    "boat": ("canoe", "speedboat", "yawl", "fireboat", "gondola", "lifeboat", "catamaran", "trimaran",
             "schooner", "container ship", "liner", "aircraft carrier", "submarine", "pirate", "wreck",
             "paddlewheel"),  # "pirate" is the pirate ship, "wreck" a shipwreck
    "traffic light": ("traffic light",),
    "parking meter": ("parking meter",),
    "bench": ("park bench",),
    # every ImageNet bird (three runs in ImageNet's order); "kite" (21) is the bird of prey
    "bird": ("cock..great grey owl", "black grouse..black swan", "white stork..albatross"),
    "cat": ("tabby..Egyptian cat",),  # tabby, tiger cat, Persian, Siamese, Egyptian: the domestic cats
    "dog": ("Chihuahua..Mexican hairless",),  # all 118 breeds, ImageNet 151-268
    "horse": ("sorrel", "horse cart"),
    "sheep": ("ram", "bighorn"),
    "cow": ("ox", "water buffalo", "oxcart"),
    "elephant": ("tusker", "Indian elephant", "African elephant"),
    "bear": ("brown bear..sloth bear",),  # brown, American black, ice (polar), sloth bear
    "zebra": ("zebra",),
    "backpack": ("backpack",),
    "umbrella": ("umbrella",),
    "handbag": ("purse",),
    "tie": ("Windsor tie", "bow tie", "bolo tie"),
    "skis": ("ski",),
    "sports ball": ("baseball", "basketball", "croquet ball", "golf ball", "ping-pong ball", "rugby ball",
                    "soccer ball", "tennis ball", "volleyball"),
    "tennis racket": ("racket",),
    "bottle": ("beer bottle", "pop bottle", "water bottle", "wine bottle", "pill bottle"),
    "wine glass": ("red wine", "goblet"),  # "red wine" is a glass of it
    # COCO boxes a stemless glass as cup; "espresso" and "eggnog" are a cup of it
    "cup": ("espresso", "cup", "coffee mug", "eggnog", "beer glass", "measuring cup"),
    "knife": ("cleaver",),
    "spoon": ("wooden spoon",),
    "bowl": ("mixing bowl", "soup bowl"),
    "banana": ("banana",),
    "apple": ("Granny Smith",),
    "sandwich": ("cheeseburger",),  # COCO boxes burgers as sandwich
    "orange": ("orange",),
    "broccoli": ("broccoli",),
    "hot dog": ("hotdog",),
    "pizza": ("pizza",),
    "chair": ("folding chair", "rocking chair", "barber chair", "throne"),
    "couch": ("studio couch",),
    "potted plant": ("pot",),  # ImageNet's "pot" is the flowerpot (n03991062)
    "bed": ("four-poster", "crib", "quilt"),
    "dining table": ("dining table",),
    "toilet": ("toilet seat",),
    # COCO's "tv" is VOC's tvmonitor: television or computer screen. A "desktop computer" photo is a
    # monitor (with a keyboard), so tv; only the portable "laptop"/"notebook" are laptop.
    "tv": ("television", "monitor", "screen", "desktop computer", "home theater", "entertainment center"),
    "laptop": ("laptop", "notebook"),
    "mouse": ("mouse",),  # the computer mouse (n03793489); the rodent is not an ImageNet-1k class
    "remote": ("remote control",),
    "keyboard": ("computer keyboard", "typewriter keyboard", "space bar"),
    "cell phone": ("cellular telephone", "hand-held computer"),
    "microwave": ("microwave",),
    "oven": ("stove",),
    "toaster": ("toaster",),
    "sink": ("washbasin",),
    "refrigerator": ("refrigerator",),
    "book": ("book jacket", "comic book", "bookcase", "library", "bookshop"),
    "clock": ("analog clock", "wall clock", "digital clock"),
    "vase": ("vase",),
    "teddy bear": ("teddy",),
}

# COCO categories no ImageNet-1k class is an instance of: a low probability is no evidence of absence.
UNSEEN: frozenset[str] = frozenset({
    "person",  # no person class; "ballplayer", "groom", "scuba diver" are outfits seen on few people
    "fire hydrant", "stop sign",  # "street sign" is any sign, not a stop sign
    "giraffe", "suitcase", "frisbee", "snowboard", "kite",  # ImageNet's "kite" is a bird
    "baseball bat", "baseball glove", "skateboard", "surfboard", "fork", "carrot", "donut", "cake",
    "scissors", "hair drier",  # "hand blower" is the wall-mounted hand dryer
    "toothbrush",
})

# ImageNet names that sound like a COCO category but are something else -> the category they
# support here (None: none). Checked by the tests so that nobody "fixes" the table wrongly.
HOMONYMS: dict[str, str | None] = {
    "kite": "bird", "plane": None, "crane": None, "Madagascar cat": None, "hand blower": None,
    "street sign": None, "Dutch oven": None, "passenger car": "train", "pot": "potted plant",
    "Cardigan": "dog", "cardigan": None, "boxer": "dog", "custard apple": None, "mouse": "mouse",
}

CATEGORIES: tuple[str, ...] = tuple(CATEGORY_CLASSES)  # the order of every (B, C) concept vector

# Person has no ImageNet class, but clothes and outfits are worn by people: their classes' activation
# maps fall on the people in a photo. Used ONLY for concept maps (concepts/maps.py, where a person is),
# never as evidence that nobody is there (person stays UNSEEN for concepts and evidence).
PERSON_CLASSES: tuple[str, ...] = (
    "scuba diver", "groom", "ballplayer", "jersey", "sweatshirt", "suit", "miniskirt", "jean", "cardigan",
    "trench coat", "fur coat", "lab coat", "kimono", "abaya", "academic gown", "bikini", "swimming trunks",
    "maillot", "brassiere", "pajama", "poncho", "sarong", "gown", "overskirt", "hoopskirt", "military uniform",
    "bulletproof vest", "cowboy hat", "sombrero", "bonnet", "mortarboard", "crash helmet", "football helmet",
    "wig", "sunglasses", "sunglass", "stole", "feather boa", "apron", "cloak", "vestment", "bearskin",
    "knee pad", "ski mask", "snorkel", "cowboy boot", "sandal", "running shoe", "Loafer",
)
MAP_CATEGORIES: tuple[str, ...] = CATEGORIES + ("person",)  # the order of every (B, C+1) concept-map stack
THRESHOLD = 0.3  # default P(category) to name it (see the measurements above)
CLASSES_FILE = Path(__file__).with_name("imagenet_classes.txt")  # the 1000 class names, one per line


@lru_cache(maxsize=1)
def imagenet_classes() -> tuple[str, ...]:
    """The 1000 ImageNet-1k class names, index-aligned with the Lite weights: torchvision's
    ResNet50_Weights.DEFAULT.meta["categories"], kept beside this module (CLASSES_FILE; tests/test_concepts.py
    checks they are the same) so that a photo's first caption does not import torchvision."""
    names = tuple(CLASSES_FILE.read_text(encoding="utf-8").splitlines())
    if len(names) != 1000:
        raise ValueError(f"{CLASSES_FILE} holds {len(names)} class names, not ImageNet's 1000: reinstall captioner")
    return names


def _resolve(entry: str, index: dict[str, int]) -> list[int]:
    """One table entry ("name" or "first..last") -> ImageNet indices; unknown names are an error."""
    ends = entry.split("..")
    missing = [n for n in ends if n not in index]
    if missing or len(ends) > 2:
        raise ValueError(f"concepts table: {entry!r} is not an ImageNet class or run ({missing} unknown); "
                         "use the exact names of torchvision's ResNet50_Weights.DEFAULT.meta['categories']")
    first, last = index[ends[0]], index[ends[-1]]
    if last < first:
        raise ValueError(f"concepts table: run {entry!r} ends before it starts ({first} > {last})")
    return list(range(first, last + 1))


@lru_cache(maxsize=1)
def category_classes() -> dict[str, tuple[int, ...]]:
    """COCO category -> its ImageNet class indices; raises ValueError when a name is unknown or
    one class would support two categories."""
    index = {name: k for k, name in enumerate(imagenet_classes())}
    owner: dict[int, str] = {}
    out = {}
    for cat, entries in CATEGORY_CLASSES.items():
        idx = [k for e in entries for k in _resolve(e, index)]
        for k in idx:
            if owner.setdefault(k, cat) != cat:
                raise ValueError(f"concepts table: ImageNet class {imagenet_classes()[k]!r} ({k}) is listed "
                                 f"under both {owner[k]!r} and {cat!r}")
        out[cat] = tuple(sorted(set(idx)))
    return out


@lru_cache(maxsize=4)  # a Python loop that every caption needed; shared: never modify the result in place
def membership(device: torch.device | str | None = None) -> torch.Tensor:
    """(C, K) 0/1 matrix: row c marks the ImageNet classes of CATEGORIES[c]."""
    m = torch.zeros(len(CATEGORIES), len(imagenet_classes()), device=device)
    for c, cat in enumerate(CATEGORIES):
        m[c, list(category_classes()[cat])] = 1.0
    return m


@lru_cache(maxsize=1)
def person_classes() -> tuple[int, ...]:
    """ImageNet indices of PERSON_CLASSES (unknown names are an error; none may belong to a category)."""
    index = {name: k for k, name in enumerate(imagenet_classes())}
    idx = tuple(sorted({k for e in PERSON_CLASSES for k in _resolve(e, index)}))
    taken = {k for ks in category_classes().values() for k in ks} & set(idx)
    if taken:
        raise ValueError(f"concepts table: person classes {sorted(imagenet_classes()[k] for k in taken)} also "
                         "support a COCO category")
    return idx


def map_membership(device: torch.device | str | None = None) -> torch.Tensor:
    """(C + 1, K): membership() with a last row for person (PERSON_CLASSES): MAP_CATEGORIES' classes."""
    person = torch.zeros(1, len(imagenet_classes()), device=device)
    person[0, list(person_classes())] = 1.0
    return torch.cat([membership(device), person])


def imagenet_head_or_none(model: nn.Module) -> nn.Linear | None:
    """The encoder's ImageNet classifier, or None when it keeps none (ResNet, a stand-in encoder)."""
    try:
        return encoder_head(model)
    except ValueError:
        return None


def encoder_head(model: nn.Module) -> nn.Linear:
    """The ImageNet classifier of a ShowAttendTell's encoder (EfficientNet-Lite keeps it; ResNet does not)."""
    head = getattr(getattr(model.encoder, "backbone", None), "_fc", None)
    if not isinstance(head, nn.Linear) or head.out_features != len(imagenet_classes()):
        raise ValueError(f"encoder {getattr(model.encoder, 'name', '?')!r} keeps no 1000-way ImageNet head; "
                         "concepts need an efficientnet_lite0/efficientnet_lite2 encoder")
    return head


def imagenet_logits(head: nn.Linear, feats: torch.Tensor) -> torch.Tensor:
    """Annotation vectors (B, P, D) -> the classifier's ImageNet logits (B, K), in float32. Exact when
    the grid is the backbone's own (no adaptive pooling to another grid size). A float32 head is the packed
    product (model/packed_linear.py): a photo's logits are the same whatever other photos share its batch."""
    pooled = feats.float().mean(1)  # (B, D): the classifier's global average pool
    if head.weight.dtype == torch.float32:
        return linear(head, pooled)  # (B, K)
    return F.linear(pooled, head.weight.float(), None if head.bias is None else head.bias.float())  # (B, K)


def category_probs(logits: torch.Tensor) -> torch.Tensor:
    """The classifier's ImageNet logits (B, K) -> P(category) (B, C): the sum of the K-way softmax probabilities
    of its classes. Each row lies in [0, 1] and sums to at most 1 (the classes of no category take the rest).
    The one formula: the photo's reading (decoding/reading.py) and its Concepts both come from here."""
    cls = logits.float().softmax(-1)  # (B, K)
    return cls @ membership(cls.device).T  # (B, C)


@dataclass
class Concepts:
    """What the encoder's ImageNet head says about one photo."""

    top: list[tuple[str, float]]  # COCO categories with P >= threshold, most probable first
    classes: list[tuple[str, float]]  # the most probable ImageNet classes, e.g. ("tabby", 0.62)
    probs: dict[str, float] = field(default_factory=dict)  # every category in CATEGORIES -> P

    @classmethod
    def unseen(cls) -> "Concepts":
        """What an encoder without the ImageNet head sees: nothing (the same empty list as its Captions')."""
        return cls([], [], {})

    def prob(self, category: str) -> float:
        """P(category); an error for categories ImageNet cannot see (UNSEEN) or that are not COCO's."""
        if category not in self.probs:
            why = ("ImageNet-1k has no class for it (UNSEEN)" if category in UNSEEN else
                   "the model's encoder keeps no ImageNet head" if not self.probs else "not a COCO category")
            raise KeyError(f"no concept probability for {category!r}: {why}")
        return self.probs[category]


@torch.no_grad()
def concepts_of(logits: torch.Tensor, threshold: float = THRESHOLD, top_k: int = 5) -> list[Concepts]:
    """The head's ImageNet logits (B, K) -> one Concepts per photo: the categories at or above `threshold`
    (category_probs), most probable first, and the `top_k` ImageNet classes by name."""
    cp = category_probs(logits).cpu().numpy()  # (B, C)
    val, idx = logits.float().softmax(-1).topk(top_k, dim=-1)  # (B, top_k)
    val, idx = val.tolist(), idx.tolist()  # read to the host once for the batch
    names = imagenet_classes()
    out = []
    for b in range(len(cp)):
        order = np.argsort(-cp[b], kind="stable")
        top = [(CATEGORIES[c], round(float(cp[b, c]), 4)) for c in order if cp[b, c] >= threshold]
        classes = [(names[k], float(v)) for v, k in zip(val[b], idx[b])]
        out.append(Concepts(top, classes, {cat: float(p) for cat, p in zip(CATEGORIES, cp[b])}))
    return out
