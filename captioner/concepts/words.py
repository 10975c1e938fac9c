"""Which caption words name which COCO category: the category -> words table and the matching rule
(the rule in full: "Word rule" in captioner/evaluation/grounding.py's docstring)."""
from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Sequence

import torch

from ..vocab import Vocab, tokenize
from .imagenet import CATEGORIES

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


def word_categories(vocab: Vocab, categories: tuple[str, ...] = CATEGORIES) -> torch.Tensor:
    """(V, C) 0/1: vocabulary word w is a one-word name of category k (two-word names are left alone:
    "hot dog" keeps its "dog"). A taught word (Vocab.aliases: "zoober" started as "train") names what its
    source word names: its row is the source's. Built once per vocabulary (a Python loop over the table that
    every caption call needed); each call gets its own copy."""
    taught = tuple((w, vocab.source(w)) for w in sorted(vocab.aliases))
    return _word_categories(tuple(vocab.itos), tuple(categories), taught).clone()


@lru_cache(maxsize=8)
def _word_categories(itos: tuple[str, ...], categories: tuple[str, ...], taught: tuple[tuple[str, str], ...] = ()
                     ) -> torch.Tensor:
    stoi = {w: i for i, w in enumerate(itos)}
    m = torch.zeros(len(itos), len(categories))  # (V, C)
    for k, cat in enumerate(categories):
        for name in CATEGORY_WORDS[cat].split():
            if "_" not in name and name in stoi:
                m[stoi[name], k] = 1.0
    for new, old in taught:  # the taught word's evidence is its source's: what supports or rules out one, the other
        m[stoi[new]] = m[stoi[old]]
    return m
