"""Grounding: does a word's attention fall on the object it names? In the style of Liu et al. 2017,
"Attention correctness in neural image captioning", with COCO instance boxes as the ground truth.

Legend: L words, P = gh * gw attention cells, N boxes.

For every caption word that names a COCO category present in the photo (see `match_words`):

    coverage_ij = area of cell (i, j) inside the UNION of that category's boxes / area of the cell
    mass        = sum_ij alpha_ij * coverage_ij       (alpha: the word's map, sums to 1)
    baseline    = mean_ij coverage_ij                 (the mass of a uniform map = the boxes' area share)

A summary reports the mean mass, the mean baseline, lift = mean mass / mean baseline (1 = no better
than looking everywhere) and the number of words, overall and per category. Two modes:
`ground_generated` scores the model's own captions (beam search; a wrong word is not scored, a
missed object is not penalised) and `ground_references` scores the reference captions under
teacher forcing (Decoder.forward), i.e. grounding without caption errors.

Geometry. The model sees the whole photo resized without cropping, so the gh x gw grid covers the
whole image: a box's x scales by gw / width and its y by gh / height. Coverage is exact: the union
of boxes is cut along every box edge and every cell edge into rectangles that are each either inside
or outside the union and inside one cell, and their areas are summed per cell. Crowd annotations
(iscrowd=1, e.g. "a crowd of people") count: their box is where the category is. Boxes are in the
photo's stored pixel frame; photos with an EXIF rotation (which load_image applies) are skipped.

Word rule. Captions are split with the project's tokenizer (captioner.vocab.tokenize). Each
category has a list of names (singular and plural, synonyms, e.g. men/women/children/skier ->
person, puppy -> dog, bike -> bicycle, jet -> airplane, sofa -> couch, table -> dining table,
phone -> cell phone). Names are one or two words. Scanning left to right, a two-word name is tried
before a one-word name at the same position, so "hot dog" is a hot dog, not a dog, and "teddy
bear" is a teddy bear. A two-word name is scored with the attention of its LAST word, the head
noun ("light" of "traffic light"), the step at which the model commits to the object. Words are
scored only when their category has at least one box of non-zero area in the photo.
"""
from __future__ import annotations

import contextlib
import io
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import torch

from .decoding import decode
from .vocab import tokenize

if TYPE_CHECKING:
    from .api import Captioner
    from .data.records import ImageRecord

# COCO category -> the caption words naming it (one or two words each, singular and plural).
# Ambiguous words are left out on purpose: "glasses" (eyewear), "ski" (mostly "ski slope"),
# "board", "bag", "light", "sign", "baseball" (the game), "pitcher" (the jug), "van".
CATEGORY_WORDS: dict[str, str] = {
    "person": "person persons people man men woman women boy boys girl girls child children kid kids "
              "player players skier skiers surfer surfers skateboarder skateboarders snowboarder snowboarders "
              "guy guys lady ladies baby babies toddler toddlers adult adults teenager teenagers teen teens "
              "gentleman gentlemen rider riders biker bikers batter batters catcher catchers umpire umpires "
              "worker workers chef chefs policeman policemen officer officers soldier soldiers tourist tourists "
              "pedestrian pedestrians student students crowd crowds someone spectator spectators "
              "father fathers mother mothers son sons daughter daughters brother brothers sister sisters",
    "bicycle": "bicycle bicycles bike bikes",
    "car": "car cars automobile automobiles taxi taxis jeep jeeps suv suvs sedan sedans",
    "motorcycle": "motorcycle motorcycles motorbike motorbikes motor_bike motor_bikes dirt_bike dirt_bikes "
                  "scooter scooters moped mopeds",
    "airplane": "airplane airplanes plane planes jet jets aircraft airliner airliners aeroplane aeroplanes "
                "jetliner jetliners",
    "bus": "bus buses busses",
    "train": "train trains locomotive locomotives",
    "truck": "truck trucks lorry lorries",
    "boat": "boat boats ship ships sailboat sailboats kayak kayaks canoe canoes yacht yachts ferry ferries",
    "traffic light": "traffic_light traffic_lights stoplight stoplights stop_light stop_lights "
                     "traffic_signal traffic_signals",
    "fire hydrant": "fire_hydrant fire_hydrants hydrant hydrants",
    "stop sign": "stop_sign stop_signs",
    "parking meter": "parking_meter parking_meters meter meters",
    "bench": "bench benches",
    "bird": "bird birds pigeon pigeons seagull seagulls gull gulls duck ducks goose geese parrot parrots "
            "swan swans eagle eagles owl owls",
    "cat": "cat cats kitten kittens kitty kitties",
    "dog": "dog dogs puppy puppies pup pups",
    "horse": "horse horses pony ponies foal foals",
    "sheep": "sheep lamb lambs",
    "cow": "cow cows cattle bull bulls calf calves ox oxen",
    "elephant": "elephant elephants",
    "bear": "bear bears polar_bear polar_bears grizzly grizzlies",
    "zebra": "zebra zebras",
    "giraffe": "giraffe giraffes",
    "backpack": "backpack backpacks back_pack back_packs knapsack knapsacks rucksack rucksacks",
    "umbrella": "umbrella umbrellas parasol parasols",
    "handbag": "handbag handbags hand_bag hand_bags purse purses",
    "tie": "tie ties necktie neckties bow_tie bow_ties",
    "suitcase": "suitcase suitcases suit_case suit_cases luggage",
    "frisbee": "frisbee frisbees",
    "skis": "skis",
    "snowboard": "snowboard snowboards snow_board snow_boards",
    "sports ball": "sports_ball sports_balls ball balls soccer_ball soccer_balls tennis_ball tennis_balls football footballs "
                   "basketball basketballs volleyball volleyballs",
    "kite": "kite kites",
    "baseball bat": "baseball_bat baseball_bats bat bats",
    "baseball glove": "baseball_glove baseball_gloves glove gloves mitt mitts baseball_mitt baseball_mitts",
    "skateboard": "skateboard skateboards skate_board skate_boards",
    "surfboard": "surfboard surfboards surf_board surf_boards",
    "tennis racket": "tennis_racket tennis_rackets racket rackets racquet racquets tennis_racquet tennis_racquets",
    "bottle": "bottle bottles",
    "wine glass": "wine_glass wine_glasses glass",
    "cup": "cup cups mug mugs",
    "fork": "fork forks",
    "knife": "knife knives",
    "spoon": "spoon spoons",
    "bowl": "bowl bowls",
    "banana": "banana bananas",
    "apple": "apple apples",
    "sandwich": "sandwich sandwiches",
    "orange": "orange oranges",
    "broccoli": "broccoli broccolis",
    "carrot": "carrot carrots",
    "hot dog": "hot_dog hot_dogs hotdog hotdogs",
    "pizza": "pizza pizzas",
    "donut": "donut donuts doughnut doughnuts",
    "cake": "cake cakes cupcake cupcakes",
    "chair": "chair chairs",
    "couch": "couch couches sofa sofas",
    "potted plant": "potted_plant potted_plants plant plants houseplant houseplants",
    "bed": "bed beds",
    "dining table": "dining_table dining_tables table tables",
    "toilet": "toilet toilets",
    "tv": "tv tvs television televisions monitor monitors",
    "laptop": "laptop laptops laptop_computer laptop_computers",
    "mouse": "mouse mice",
    "remote": "remote remotes remote_control remote_controls controller controllers",
    "keyboard": "keyboard keyboards",
    "cell phone": "cell_phone cell_phones cellphone cellphones phone phones smartphone smartphones "
                  "mobile_phone mobile_phones",
    "microwave": "microwave microwaves",
    "oven": "oven ovens stove stoves",
    "toaster": "toaster toasters",
    "sink": "sink sinks",
    "refrigerator": "refrigerator refrigerators fridge fridges",
    "book": "book books",
    "clock": "clock clocks",
    "vase": "vase vases",
    "scissors": "scissors",
    "teddy bear": "teddy_bear teddy_bears teddy teddies teddybear teddybears stuffed_animal stuffed_animals",
    "hair drier": "hair_drier hair_driers hair_dryer hair_dryers hairdryer hairdryers blow_dryer blow_dryers",
    "toothbrush": "toothbrush toothbrushes",
}

Phrase = tuple[str, ...]  # one or two tokens


def word_table(categories: Iterable[str]) -> dict[Phrase, str]:
    """Phrase (1 or 2 tokens) -> category, for the given category names (e.g. those of an instance
    file). A category missing from CATEGORY_WORDS is named by its own tokens and their plural "+s"."""
    table: dict[Phrase, str] = {}
    for cat in categories:
        names = CATEGORY_WORDS.get(cat)
        if names is None:
            toks = tokenize(cat)
            phrases = [tuple(toks), tuple(toks[:-1] + [toks[-1] + "s"])] if toks else []
        else:
            phrases = [tuple(n.split("_")) for n in names.split()]
        for ph in phrases:
            if not 1 <= len(ph) <= 2:
                raise ValueError(f"category {cat!r}: name {' '.join(ph)!r} has {len(ph)} words; use 1 or 2")
            if table.get(ph, cat) != cat:
                raise ValueError(f"{' '.join(ph)!r} names two categories: {table[ph]!r} and {cat!r}")
            table[ph] = cat
    return table


def match_words(words: Sequence[str], table: dict[Phrase, str]) -> list[tuple[int, str]]:
    """Tokens -> [(index of the scored word, category)]: two-word names before one-word names at
    each position; a two-word name is scored at its last word (the head noun)."""
    out, i = [], 0
    while i < len(words):
        for n in (2, 1):
            cat = table.get(tuple(words[i:i + n])) if i + n <= len(words) else None
            if cat is not None:
                out.append((i + n - 1, cat))
                i += n
                break
        else:
            i += 1
    return out


def _snap(v: np.ndarray) -> np.ndarray:
    """Grid coordinates within 1e-9 of an integer become that integer, so a box drawn exactly on a
    cell edge in pixels stays exactly on it after scaling (no sliver of coverage from rounding)."""
    r = np.round(v)
    return np.where(np.abs(v - r) < 1e-9, r, v)


def box_coverage(boxes: np.ndarray, width: float, height: float, grid_h: int, grid_w: int) -> np.ndarray:
    """boxes (N, 4) as COCO [x, y, w, h] in pixels of a width x height photo -> (grid_h, grid_w) fraction
    of each cell's area inside the union of the boxes (exact; overlaps are counted once)."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    sx, sy = grid_w / float(width), grid_h / float(height)
    x0 = _snap(np.clip(boxes[:, 0] * sx, 0, grid_w))  # (N,) in cell units
    x1 = _snap(np.clip((boxes[:, 0] + boxes[:, 2]) * sx, 0, grid_w))
    y0 = _snap(np.clip(boxes[:, 1] * sy, 0, grid_h))
    y1 = _snap(np.clip((boxes[:, 1] + boxes[:, 3]) * sy, 0, grid_h))
    xs = np.unique(np.concatenate([x0, x1, np.arange(grid_w + 1)]))  # (X,) every box and cell edge
    ys = np.unique(np.concatenate([y0, y1, np.arange(grid_h + 1)]))  # (Y,)
    mx, my = (xs[1:] + xs[:-1]) / 2, (ys[1:] + ys[:-1]) / 2  # (X-1,), (Y-1,) centres of the pieces
    inside_x = (x0[:, None] < mx) & (mx < x1[:, None])  # (N, X-1)
    inside_y = (y0[:, None] < my) & (my < y1[:, None])  # (N, Y-1)
    covered = (inside_y[:, :, None] & inside_x[:, None, :]).any(axis=0)  # (Y-1, X-1): in the union
    area = np.diff(ys)[:, None] * np.diff(xs)[None, :] * covered  # (Y-1, X-1)
    cell_y = np.minimum(my.astype(int), grid_h - 1)  # each piece lies inside exactly one cell
    cell_x = np.minimum(mx.astype(int), grid_w - 1)
    cov = np.zeros((grid_h, grid_w))
    np.add.at(cov, (cell_y[:, None], cell_x[None, :]), area)
    return np.clip(cov, 0.0, 1.0)  # a cell has area 1 in cell units


@dataclass
class WordGrounding:
    image_id: str
    word: str  # the scored token (a two-word name's head noun)
    category: str
    mass: float  # attention inside the category's boxes
    baseline: float  # the uniform map's mass (area share of the boxes)


def ground_words(words: Sequence[str], alphas: np.ndarray, coverage: dict[str, np.ndarray],
                 table: dict[Phrase, str], image_id: str = "") -> list[WordGrounding]:
    """One caption: words (L,), alphas (L, gh, gw) each summing to 1, coverage {category: (gh, gw)}
    for the categories in the photo -> one record per word that names one of them."""
    alphas = np.asarray(alphas, dtype=np.float64)
    if len(alphas) != len(words):
        raise ValueError(f"{len(words)} words but {len(alphas)} attention maps")
    out = []
    for i, cat in match_words(words, table):
        cov = coverage.get(cat)
        if cov is None:
            continue
        if alphas[i].shape != cov.shape:
            raise ValueError(f"attention map {alphas[i].shape} and box coverage {cov.shape} differ in shape")
        out.append(WordGrounding(image_id, words[i], cat, float((alphas[i] * cov).sum()), float(cov.mean())))
    return out


@dataclass
class GroundingSummary:
    mass: float  # mean over words of the attention inside the boxes
    baseline: float  # mean over words of the boxes' area share
    lift: float  # mass / baseline (1: no better than a uniform map); NaN without words
    n_words: int
    n_images: int  # images with instance annotations that were scored
    per_category: dict[str, dict[str, float]] = field(default_factory=dict)  # same keys per category

    @classmethod
    def of(cls, words: Sequence[WordGrounding], n_images: int) -> "GroundingSummary":
        by_cat: dict[str, list[WordGrounding]] = defaultdict(list)
        for w in words:
            by_cat[w.category].append(w)
        return cls(*_means(words), len(words), n_images,
                   {c: dict(zip(("mass", "baseline", "lift"), _means(ws)), n_words=len(ws))
                    for c, ws in sorted(by_cat.items(), key=lambda kv: -len(kv[1]))})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; NaN (no words) becomes null."""
        clean = lambda v: None if isinstance(v, float) and math.isnan(v) else v  # noqa: E731
        return {"mass": clean(self.mass), "baseline": clean(self.baseline), "lift": clean(self.lift),
                "n_words": self.n_words, "n_images": self.n_images,
                "per_category": {c: {k: clean(v) for k, v in d.items()} for c, d in self.per_category.items()}}

    def __str__(self) -> str:
        return (f"mass {self.mass:.4f}  baseline {self.baseline:.4f}  lift {self.lift:.2f}  "
                f"words {self.n_words} in {self.n_images} images")


def _means(words: Sequence[WordGrounding]) -> tuple[float, float, float]:
    if not words:
        return math.nan, math.nan, math.nan
    mass = float(np.mean([w.mass for w in words]))
    base = float(np.mean([w.baseline for w in words]))
    return mass, base, mass / base if base > 0 else math.nan


# ---------------------------------------------------------------- COCO instance annotations

@dataclass
class Instances:
    path: Path
    categories: list[str]  # names, in the file's order
    boxes: dict[str, dict[str, np.ndarray]]  # image id (text) -> category -> (N, 4) [x, y, w, h] pixels
    sizes: dict[str, tuple[int, int]]  # image id -> (width, height) of the stored photo

    def coverage(self, image_id: str, grid_h: int, grid_w: int) -> dict[str, np.ndarray]:
        """category -> (grid_h, grid_w) coverage, for the categories with boxes of non-zero area."""
        w, h = self.sizes[image_id]
        out = {}
        for cat, b in self.boxes.get(image_id, {}).items():
            cov = box_coverage(b, w, h, grid_h, grid_w)
            if cov.sum() > 0:
                out[cat] = cov
        return out


def instances_path_for(captions_json: str | Path) -> Path:
    """captions_X.json -> instances_X.json in the same folder (whether or not it exists)."""
    p = Path(captions_json)
    name = p.name.replace("captions_", "instances_", 1) if p.name.startswith("captions_") else "instances_" + p.name
    return p.with_name(name)


def load_instances(path: str | Path) -> Instances:
    """A COCO instances_*.json (through pycocotools) -> boxes per image and category."""
    from pycocotools.coco import COCO

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"COCO instance annotations not found: {path}. Download annotations_trainval2017.zip "
                                "from cocodataset.org (it holds instances_*.json beside captions_*.json) or pass "
                                "--instances PATH.")
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress chatter
        coco = COCO(str(path))
    if not coco.dataset.get("categories"):
        raise ValueError(f"{path} has no 'categories': is it an instances_*.json (not captions_*.json)?")
    names = {c["id"]: c["name"] for c in coco.loadCats(coco.getCatIds())}
    grouped: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for a in coco.loadAnns(coco.getAnnIds(iscrowd=None)):
        grouped[str(a["image_id"])][names[a["category_id"]]].append(a["bbox"])
    boxes = {img: {c: np.asarray(b, dtype=np.float64).reshape(-1, 4) for c, b in cats.items()}
             for img, cats in grouped.items()}
    sizes = {str(i["id"]): (int(i["width"]), int(i["height"])) for i in coco.loadImgs(coco.getImgIds())}
    return Instances(path, [names[k] for k in sorted(names)], boxes, sizes)


def _usable(records: Sequence["ImageRecord"], instances: Instances) -> list[int]:
    """Indices of the records whose photo the instance file describes in the frame the model sees."""
    from PIL import Image

    from .images import _TRANSPOSE, _orientation

    keep = []
    for i, r in enumerate(records):
        if r.image_id not in instances.sizes:
            continue
        try:
            with Image.open(r.path) as im:
                if _orientation(im) in _TRANSPOSE:  # load_image rotates it: the boxes would not line up
                    continue
        except OSError:
            continue
        keep.append(i)
    if records and not keep:
        raise ValueError(f"none of the {len(records)} images is described by {instances.path}; pass the instances "
                         "file of the same split as the captions (--instances PATH)")
    return keep


# ---------------------------------------------------------------- the two modes

@torch.no_grad()
def ground_generated(model: "Captioner", feats: torch.Tensor | np.ndarray, records: Sequence["ImageRecord"],
                     instances: Instances, beam_size: int = 3, max_len: int = 50, length_penalty: float | None = None,
                     batch_size: int = 100) -> GroundingSummary:
    """Grounding of the model's own captions: feats (N, P, D) of records (N,), decoded by beam search
    (greedy for beam_size 1) exactly as evaluation decodes them; alphas from the best hypothesis."""
    keep = _usable(records, instances)
    lp = model.config.decode.length_penalty if length_penalty is None else length_penalty
    unk = model.vocab.unk if model.config.decode.forbid_unk else None
    dec, table, g = model.model.decoder.eval(), word_table(instances.categories), model.grid_size
    dtype = next(dec.parameters()).dtype
    scored: list[WordGrounding] = []
    for k in range(0, len(keep), batch_size):
        idx = keep[k:k + batch_size]
        x = torch.as_tensor(np.asarray(feats[idx], dtype=np.float32)).to(model.device, dtype)  # (b, P, D)
        hyps = decode(dec, x, model.vocab.start, model.vocab.end, model.vocab.pad, beam_size, max_len, lp, unk)
        for i, h in zip(idx, hyps):
            words = [model.vocab.itos[t] for t in h[0].tokens]
            alphas = h[0].alphas.float().cpu().numpy().reshape(len(words), g, g)  # (L, G, G)
            scored += ground_words(words, alphas, instances.coverage(records[i].image_id, g, g), table,
                                   records[i].image_id)
    return GroundingSummary.of(scored, len(keep))


@torch.no_grad()
def reference_alphas(model: "Captioner", feats: torch.Tensor, captions: Sequence[Sequence[str]],
                     max_len: int = 50) -> list[np.ndarray]:
    """Teacher forcing on tokenised captions of ONE image: feats (1, P, D), captions (C,) of words ->
    for each caption (min(len, max_len), P) attention, row t being the map with which word t is
    predicted (the same step at which decoding would emit it)."""
    dec, v = model.model.decoder.eval(), model.vocab
    words = [list(c)[:max_len] for c in captions]
    order = sorted(range(len(words)), key=lambda j: -len(words[j]))  # Decoder.forward wants lengths descending
    lengths = torch.tensor([len(words[j]) + 1 for j in order], device=model.device)  # words + <end>
    T = int(lengths[0]) if len(order) else 0
    inputs = torch.full((len(order), T), v.pad, dtype=torch.long, device=model.device)  # (C, T)
    for row, j in enumerate(order):
        inputs[row, :len(words[j]) + 1] = torch.tensor([v.start] + [v.stoi.get(w, v.unk) for w in words[j]])
    if not order:
        return []
    x = feats.to(model.device, next(dec.parameters()).dtype)
    _, alphas = dec(x, inputs, lengths, image_index=torch.zeros(len(order), dtype=torch.long, device=model.device))
    out: list[np.ndarray] = [np.zeros(0)] * len(words)
    for row, j in enumerate(order):
        out[j] = alphas[row, :len(words[j])].float().cpu().numpy()  # (L, P)
    return out


@torch.no_grad()
def ground_references(model: "Captioner", feats: torch.Tensor | np.ndarray, records: Sequence["ImageRecord"],
                      instances: Instances, max_len: int = 50) -> GroundingSummary:
    """Grounding of the reference captions under teacher forcing (no caption errors): every word of
    every reference that names a category in the photo."""
    keep = _usable(records, instances)
    table, g = word_table(instances.categories), model.grid_size
    scored: list[WordGrounding] = []
    for i in keep:
        caps = [tokenize(c) for c in records[i].captions]
        x = torch.as_tensor(np.asarray(feats[i:i + 1], dtype=np.float32))  # (1, P, D)
        cov = instances.coverage(records[i].image_id, g, g)
        for words, a in zip(caps, reference_alphas(model, x, caps, max_len)):
            words = words[:len(a)]
            scored += ground_words(words, a.reshape(len(words), g, g), cov, table, records[i].image_id)
    return GroundingSummary.of(scored, len(keep))
