"""Object hallucination (captioner/evaluation/hallucination.py): CHAIR-s, CHAIR-i and recall on
hand-made cases whose answer is known, the grounding word rule, and the reference captions of
coco-mini (a human baseline, and a deliberate corruption whose CHAIR-s is known exactly)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from captioner.data.coco import load_coco
from captioner.evaluation.grounding import (CATEGORY_WORDS, CaptionHallucination, HallucinationSummary, Instances,
                                 boxed_categories, caption_hallucination, categories_in, load_instances,
                                 match_words, measure_hallucination, measure_references, word_table)
from captioner.vocab import tokenize

from .conftest import need_coco

TABLE = word_table(CATEGORY_WORDS)


def chair(captions: dict[str, str], boxed: dict[str, set[str]] | None, references=None) -> HallucinationSummary:
    """measure_hallucination with no references unless given (truth = the boxes alone)."""
    return measure_hallucination(captions, references or {i: [] for i in captions}, boxed)


# ----------------------------------------------------------------------------- the word rule

@pytest.mark.parametrize("text, expected", [
    ("two dogs run", {"dog"}),
    ("a puppy and three men", {"dog", "person"}),
    ("a hot dog on a plate", {"hot dog"}),
    ("a child hugs a teddy bear", {"person", "teddy bear"}),
    ("a polar bear swims", {"bear"}),
    ("a stop sign near a traffic light", {"stop sign", "traffic light"}),
    ("a view of the sky", set()),
    ("", set()),
])
def test_categories_follow_the_grounding_word_rule(text, expected):
    assert categories_in(text, TABLE) == expected
    assert categories_in(tokenize(text), TABLE) == expected  # text or tokens alike
    assert categories_in(text, TABLE) == {c for _, c in match_words(tokenize(text), TABLE)}


def test_a_hot_dog_is_not_a_dog_and_a_teddy_bear_is_not_a_bear():
    s = chair({"1": "a hot dog on a plate", "2": "a teddy bear on a bed"}, {"1": {"dog"}, "2": {"bear", "bed"}})
    assert s.per_category["hot dog"]["hallucinated"] == 1 and s.per_category["teddy bear"]["hallucinated"] == 1
    assert s.per_category["dog"]["named_when_boxed"] == 0 and s.per_category["bear"]["named_when_boxed"] == 0
    assert "dog" not in s.per_category or s.per_category["dog"]["mentions"] == 0
    ok = chair({"1": "a hot dog on a plate"}, {"1": {"hot dog"}})
    assert ok.chair_s == 0 and ok.recall == 1


# ----------------------------------------------------------------------------- CHAIR

def test_naming_only_present_objects_scores_zero():
    s = chair({"1": "two dogs and a man play with a frisbee", "2": "a cat on a couch"},
              {"1": {"dog", "person", "frisbee", "car"}, "2": {"cat", "couch"}})
    assert (s.chair_s, s.chair_i, s.n_hallucinated) == (0.0, 0.0, 0)
    assert s.n_mentions == 5


def test_one_wrong_object_in_one_of_two_captions():
    s = chair({"1": "a dog on a couch", "2": "a cat on a bed"}, {"1": {"dog", "couch"}, "2": {"cat", "couch"}})
    assert s.chair_s == 0.5
    assert s.chair_i == pytest.approx(1 / 4)
    assert s.n_captions_hallucinating == 1 and s.n_hallucinated == 1
    assert s.worst() == [("bed", 1, 1)]


def test_chair_i_counts_each_category_once_per_caption():
    # caption 1 names dog three ways (dog, dogs, puppy) and one absent frisbee: 2 mentions, 1 wrong;
    # caption 2 names an absent cat twice: 1 mention, 1 wrong. Per word it would be 2/5, per caption 2/3.
    s = chair({"1": "a dog and two dogs and a puppy near a frisbee", "2": "a cat sees another cat"},
              {"1": {"dog"}, "2": {"dog"}})
    assert (s.n_mentions, s.n_hallucinated) == (3, 2)
    assert s.chair_i == pytest.approx(2 / 3)
    assert s.chair_s == 1.0
    cat = s.per_category["cat"]
    assert (cat["mentions"], cat["hallucinated"], cat["chair_i"], cat["boxed"]) == (1, 1, 1.0, 0)
    assert math.isnan(cat["recall"])  # never boxed
    assert s.per_category["dog"]["mentions"] == 1 and s.per_category["dog"]["hallucinated"] == 0


def test_a_category_named_only_by_a_reference_is_not_a_hallucination():
    refs = {"1": ["a man holds a phone on a street"]}
    s = chair({"1": "a man talking on a cell phone"}, {"1": {"person"}}, refs)
    assert s.chair_s == 0 and s.n_hallucinated == 0
    r = caption_hallucination("1", "a man talking on a cell phone", refs["1"], {"person"}, TABLE)
    assert r.truth == {"person", "cell phone"} and r.boxed == {"person"}
    assert s.recall == 1.0  # recall counts boxed categories only: the phone is truth, not a box
    without = chair({"1": "a man talking on a cell phone"}, {"1": {"person"}})
    assert without.chair_s == 1 and without.worst() == [("cell phone", 1, 1)]


def test_recall_is_boxed_categories_named_over_boxed_summed_over_captions():
    boxed = {"1": {"dog", "cat", "car", "person"}, "2": {"bus"}}
    s = chair({"1": "a man and his dog", "2": "a red bus"}, boxed)
    assert s.recall == pytest.approx(3 / 5)  # summed, not the mean of 2/4 and 1/1
    assert (s.n_named_boxed, s.n_boxed) == (3, 5)
    assert s.per_category["cat"]["boxed"] == 1 and s.per_category["cat"]["recall"] == 0
    assert s.per_category["dog"]["recall"] == 1
    # saying less cannot look better: CHAIR stays 0 but recall falls
    terse = chair({"1": "a photo", "2": "a red bus"}, boxed)
    assert terse.chair_s == 0 and terse.recall < s.recall


def test_boxed_categories_the_table_cannot_name_do_not_count_for_recall():
    s = measure_hallucination({"1": "a dog"}, {"1": []}, {"1": {"dog", "unicorn"}}, categories=["dog", "cat"])
    assert s.recall == 1.0 and s.n_boxed == 1


def test_references_only_variant():
    refs = {"1": ["a dog runs on the grass", "a brown dog and a ball"], "2": ["a girl rides a horse"]}
    s = measure_hallucination({"1": "a dog chases a cat", "2": "a girl on a horse"}, refs, None)
    assert s.references_only and "truth: references" in str(s)
    assert s.chair_s == 0.5 and s.chair_i == pytest.approx(1 / 4)  # cat is the one wrong mention
    assert s.recall == pytest.approx(3 / 4)  # {dog, sports ball} named 1 of 2; {person, horse} 2 of 2
    ball = s.per_category["sports ball"]  # named by a reference, not by the caption
    assert (ball["mentions"], ball["boxed"], ball["named_when_boxed"], ball["recall"]) == (0, 1, 0, 0.0)
    assert math.isnan(ball["chair_i"])


def test_empty_captions_count_as_captions_without_mentions():
    s = chair({"1": "", "2": "a cat"}, {"1": {"dog"}, "2": {"dog"}})
    assert s.n_captions == 2 and s.chair_s == 0.5 and s.chair_i == 1.0
    assert s.recall == 0.0
    only_empty = chair({"1": ""}, {"1": {"dog"}})
    assert only_empty.chair_s == 0 and math.isnan(only_empty.chair_i)
    assert only_empty.to_dict()["chair_i"] is None
    nothing = chair({}, {})
    assert nothing.n_captions == 0 and all(math.isnan(v) for v in (nothing.chair_s, nothing.chair_i, nothing.recall))
    json.dumps(nothing.to_dict(), allow_nan=False)


def test_summary_is_json_ready_and_prints_one_line():
    s = chair({"1": "a dog on a bed", "2": "a cat"}, {"1": {"dog"}, "2": set()})
    d = json.loads(json.dumps(s.to_dict(), allow_nan=False))
    assert d["chair_s"] == 1.0 and d["per_category"]["cat"]["recall"] is None  # never boxed: NaN -> null
    assert d["worst"] == [{"category": "bed", "hallucinated": 1, "mentions": 1},
                          {"category": "cat", "hallucinated": 1, "mentions": 1}]
    line = str(s)
    assert "\n" not in line and "CHAIR-s 1.0000" in line and "2/2 captions" in line


def test_missing_references_or_boxes_are_errors_not_hallucinations():
    with pytest.raises(ValueError, match="no references"):
        measure_hallucination({"1": "a dog"}, {}, {"1": {"dog"}})
    with pytest.raises(ValueError, match="no boxed categories"):
        measure_hallucination({"1": "a dog"}, {"1": []}, {"2": {"dog"}})


def test_boxed_categories_from_instances():
    boxes = {"7": {"dog": np.array([[0, 0, 5, 5]]), "person": np.array([[1, 1, 0, 0], [2, 2, 3, 3]]),
                   "cat": np.zeros((0, 4))}}
    inst = Instances(Path("instances_x.json"), ["person", "dog", "cat"], boxes, {"7": (10, 10), "8": (10, 10)})
    assert boxed_categories(inst) == {"7": {"dog", "person"}, "8": set()}  # zero-area boxes count; none: empty
    assert boxed_categories(inst, ["8"]) == {"8": set()}
    with pytest.raises(ValueError, match="instances_x.json"):
        boxed_categories(inst, ["9"])


def test_records_keep_their_sets():
    r = caption_hallucination("1", "a dog and a cat", ["a dog"], {"person"}, TABLE)
    assert isinstance(r, CaptionHallucination)
    assert (r.mentioned, r.hallucinated, r.truth, r.recall_pool) == ({"dog", "cat"}, {"cat"}, {"dog", "person"},
                                                                      {"person"})
    assert caption_hallucination("1", "a dog", ["a dog"], None, TABLE).recall_pool == {"dog"}


# ----------------------------------------------------------------------------- coco-mini references

@pytest.fixture(scope="module")
def coco_refs():
    root = need_coco()
    records = load_coco(root / "train2017", root / "annotations" / "captions_train2017.json")
    boxed = boxed_categories(load_instances(root / "annotations" / "instances_train2017.json"),
                             [r.image_id for r in records])
    return {r.image_id: r.captions for r in records}, boxed


def test_reference_captions_mostly_name_true_things(coco_refs):
    refs, boxed = coco_refs
    human = measure_references(refs, boxed)  # each reference vs boxes + the other references
    assert human.n_captions == sum(len(c) for c in refs.values())
    assert human.n_mentions > human.n_captions  # COCO captions name objects
    assert human.chair_s < 0.1 and human.chair_i < 0.1
    assert 0 < human.recall < 1
    first = {i: c[0] for i, c in refs.items()}
    itself = measure_hallucination(first, refs, boxed)  # truth includes the caption itself
    assert itself.chair_s == 0 and itself.n_hallucinated == 0


def test_appending_a_dog_to_dog_free_photos_raises_chair_s_to_their_share(coco_refs):
    refs, boxed = coco_refs
    first = {i: c[0] for i, c in refs.items()}
    base = measure_hallucination(first, refs, boxed)  # 0 by construction: the truth includes the caption
    dog_free = {i for i in refs if "dog" not in boxed[i] and not any("dog" in categories_in(r, TABLE)
                                                                     for r in refs[i])}
    assert 0 < len(dog_free) < len(refs)
    bad = {i: c + " A dog." if i in dog_free else c for i, c in first.items()}
    s = measure_hallucination(bad, refs, boxed)
    assert s.chair_s == len(dog_free) / len(refs)
    assert s.n_hallucinated == s.per_category["dog"]["hallucinated"] == len(dog_free)
    assert s.chair_i == len(dog_free) / (base.n_mentions + len(dog_free))
    assert s.recall == base.recall  # the dog is boxed in none of them
    # on the leave-one-out baseline the corruption adds exactly the dog-free captions not yet hallucinating
    loo = {i: c[1:] for i, c in refs.items()}
    before = measure_hallucination(first, loo, boxed)
    after = measure_hallucination(bad, loo, boxed)
    assert len(dog_free) / len(refs) <= after.chair_s <= len(dog_free) / len(refs) + before.chair_s
