"""Grounding metric (captioner/evaluation/grounding.py, boxes.py;
the word table of captioner/concepts/words.py): exact box coverage, word matching, the two modes."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import captioner
from captioner.data.coco import load_coco
from captioner.config import DecodeConfig
from captioner.decoding.search import decode
from captioner.vocab import SpecialIds
from captioner.evaluation.grounding import (CATEGORY_WORDS, GroundingSummary, box_coverage, ground_generated, ground_references,
                                 ground_words, instances_path_for, load_instances, match_words, reference_alphas,
                                 word_table)

from .conftest import need_coco

TABLE = word_table(CATEGORY_WORDS)


def pixel_union(boxes: list[list[int]], width: int, height: int) -> np.ndarray:
    """(height, width) mask of the union of integer [x, y, w, h] boxes: an independent rasteriser."""
    mask = np.zeros((height, width), bool)
    for x, y, w, h in boxes:
        mask[y:y + h, x:x + w] = True
    return mask


# ----------------------------------------------------------------------------- coverage

def test_box_on_cell_boundaries_gives_exact_zero_one_coverage():
    # 7x7 grid on 640x480: cell edges at non-integer pixels; a box from cell edge 2 to 5 (x), 1 to 3 (y)
    w, h, g = 640, 480, 7
    box = [2 * w / g, 1 * h / g, 3 * w / g, 2 * h / g]
    cov = box_coverage(np.array([box]), w, h, g, g)
    expected = np.zeros((g, g))
    expected[1:3, 2:5] = 1.0
    assert np.array_equal(cov, expected)  # exactly 0 or 1, no rounding slivers


def test_box_covering_a_quarter_of_a_cell():
    cov = box_coverage(np.array([[0, 0, 25, 25]]), 100, 100, 2, 2)
    assert cov[0, 0] == pytest.approx(0.25) and cov.sum() == pytest.approx(0.25)
    # a quarter straddling four cells: 1/16 of each
    cov = box_coverage(np.array([[37.5, 37.5, 25, 25]]), 100, 100, 2, 2)
    assert np.allclose(cov, 1 / 16)


def test_overlapping_boxes_are_counted_once():
    one = box_coverage(np.array([[10, 10, 40, 30]]), 100, 80, 4, 4)
    twice = box_coverage(np.array([[10, 10, 40, 30], [10, 10, 40, 30], [20, 15, 10, 10]]), 100, 80, 4, 4)
    assert np.allclose(one, twice)
    cov = box_coverage(np.array([[0, 0, 50, 50], [25, 25, 50, 50]]), 100, 100, 2, 2)
    assert np.allclose(cov, [[1, 0.25], [0.25, 0.25]])
    assert cov.max() <= 1.0


@pytest.mark.parametrize("seed", range(5))
def test_coverage_equals_an_independent_pixel_rasteriser(seed):
    """Integer boxes: each cell's coverage times its area is the number of union pixels in it."""
    rng = np.random.default_rng(seed)
    g, cell = 5, 12
    w, h = g * cell, g * cell + 0  # cells of whole pixels, so pixel counting is exact
    boxes = [[int(rng.integers(0, w - 2)), int(rng.integers(0, h - 2)), 0, 0] for _ in range(int(rng.integers(1, 7)))]
    for b in boxes:
        b[2] = int(rng.integers(1, w - b[0] + 1))
        b[3] = int(rng.integers(1, h - b[1] + 1))
    cov = box_coverage(np.array(boxes, float), w, h, g, g)
    counts = pixel_union(boxes, w, h).reshape(g, cell, g, cell).sum(axis=(1, 3))  # (g, g) union pixels per cell
    assert np.allclose(cov * cell * cell, counts)


def test_non_square_photo_scales_x_and_y_separately():
    # a 300x100 photo on a 3x3 grid: the box of the middle third of the width, full height
    cov = box_coverage(np.array([[100, 0, 100, 100]]), 300, 100, 3, 3)
    assert np.array_equal(cov, np.array([[0, 1, 0]] * 3, float))
    # boxes sticking out of the photo are clipped to it
    assert np.array_equal(box_coverage(np.array([[-50, -50, 500, 500]]), 300, 100, 3, 3), np.ones((3, 3)))


# ----------------------------------------------------------------------------- mass and baseline

def test_all_attention_inside_the_box_gives_mass_one():
    cov = {"dog": box_coverage(np.array([[0, 0, 50, 100]]), 100, 100, 4, 4)}  # left half
    alpha = np.zeros((1, 4, 4))
    alpha[0, :, :2] = 1 / 8
    (w,) = ground_words(["dog"], alpha, cov, TABLE)
    assert w.mass == pytest.approx(1.0) and w.baseline == pytest.approx(0.5) and w.category == "dog"


def test_uniform_map_has_lift_one():
    rng = np.random.default_rng(0)
    words = []
    for k in range(10):
        boxes = rng.uniform(0, 60, size=(3, 4))
        cov = {"person": box_coverage(boxes, 120, 90, 7, 7)}
        words += ground_words(["a", "man"], np.full((2, 7, 7), 1 / 49), cov, TABLE, str(k))
    s = GroundingSummary.of(words, 10)
    assert all(w.mass == pytest.approx(w.baseline) for w in words)
    assert s.lift == pytest.approx(1.0) and s.n_words == 10
    assert s.per_category["person"]["n_words"] == 10 and s.per_category["person"]["lift"] == pytest.approx(1.0)


def test_words_of_absent_categories_are_not_scored():
    cov = {"cat": np.ones((2, 2))}
    assert ground_words(["a", "dog", "and", "a", "cat"], np.full((5, 2, 2), 0.25), cov, TABLE)[0].word == "cat"
    assert len(ground_words(["a", "dog"], np.full((2, 2, 2), 0.25), cov, TABLE)) == 0
    with pytest.raises(ValueError, match="2 words but 1"):
        ground_words(["a", "cat"], np.full((1, 2, 2), 0.25), cov, TABLE)


def test_empty_summary_is_nan_and_null_in_json():
    s = GroundingSummary.of([], 3)
    assert s.n_words == 0 and math.isnan(s.mass) and math.isnan(s.lift)
    assert s.to_dict()["lift"] is None and s.to_dict()["n_images"] == 3


# ----------------------------------------------------------------------------- word matching

@pytest.mark.parametrize("text, expected", [
    ("two men and a woman", [(1, "person"), (4, "person")]),
    ("children playing with puppies", [(0, "person"), (3, "dog")]),
    ("a skier and surfers", [(1, "person"), (3, "person")]),
    ("a bike next to a motorbike", [(1, "bicycle"), (5, "motorcycle")]),
    ("a jet above the airplanes", [(1, "airplane"), (4, "airplane")]),
    ("a sofa and a couch", [(1, "couch"), (4, "couch")]),
    ("food on the table", [(3, "dining table")]),
    ("a man eating a hot dog", [(1, "person"), (5, "hot dog")]),  # not "dog": the two-word name wins
    ("a teddy bear and a bear", [(2, "teddy bear"), (5, "bear")]),
    ("a stop sign by a traffic light", [(2, "stop sign"), (6, "traffic light")]),
    ("a fire hydrant and a tennis racket", [(2, "fire hydrant"), (6, "tennis racket")]),
    ("she holds a cell phone and a phone", [(4, "cell phone"), (7, "cell phone")]),
    ("a tv and a television", [(1, "tv"), (4, "tv")]),
    ("knives and mice and sheep", [(0, "knife"), (2, "mouse"), (4, "sheep")]),
    ("a street sign and sunglasses", []),  # ambiguous words are not matched
])
def test_word_matching(text, expected):
    from captioner.vocab import tokenize

    assert match_words(tokenize(text), TABLE) == expected


def test_every_coco_category_has_names_and_no_word_names_two(monkeypatch):
    assert len(CATEGORY_WORDS) == 80
    table = word_table(CATEGORY_WORDS)  # raises on a word claimed by two categories
    assert set(table.values()) == set(CATEGORY_WORDS)
    assert all(table[tuple(c.split())] == c for c in CATEGORY_WORDS)  # each category's own name matches
    # categories not in the table are named by themselves and their plural
    assert word_table(["unicorn"]) == {("unicorn",): "unicorn", ("unicorns",): "unicorn"}
    monkeypatch.setitem(CATEGORY_WORDS, "wolf", "wolf dog")
    with pytest.raises(ValueError, match="names two categories"):
        word_table(["dog", "wolf"])


def test_instances_file_is_found_beside_the_captions_file(tmp_path):
    assert instances_path_for(tmp_path / "captions_val2017.json") == tmp_path / "instances_val2017.json"
    with pytest.raises(FileNotFoundError, match="--instances"):
        load_instances(tmp_path / "instances_val2017.json")


# ----------------------------------------------------------------------------- with the model

def test_teacher_forcing_the_greedy_caption_reproduces_its_attention(bundled):
    """Row t of the teacher-forced maps is the map with which decoding emits word t."""
    x = torch.stack([bundled.preprocess(captioner.api.DEFAULT_CHECKPOINT.parent / "examples" / "cat.jpg")])
    feats = bundled.model.encode(x)  # (1, P, D)
    ((hyp,),) = decode(bundled.model.decoder, feats, SpecialIds.of(bundled.vocab), DecodeConfig(beam_size=1, max_len=20))
    words = [bundled.vocab.itos[t] for t in hyp.tokens]
    (alphas,) = reference_alphas(bundled, feats, [words])
    assert alphas.shape == (len(words), bundled.grid_size ** 2)
    assert np.allclose(alphas, hyp.alphas.numpy(), atol=1e-5)
    assert np.allclose(alphas.sum(1), 1.0, atol=1e-5)


def test_end_to_end_on_coco_mini(bundled):
    coco = need_coco()
    ann = coco / "annotations"
    records = load_coco(coco / "train2017", ann / "captions_train2017.json")[:6]
    instances = load_instances(instances_path_for(ann / "captions_train2017.json"))
    assert len(instances.categories) == 80 and set(instances.categories) == set(CATEGORY_WORDS)
    with torch.no_grad():
        feats = bundled.model.encode(torch.stack([bundled.preprocess(r.path) for r in records]))  # (6, P, D)
    gen = ground_generated(bundled, feats, records, instances, bundled.decode_settings(beam_size=2, max_len=20))
    ref = ground_references(bundled, feats, records, instances)
    for s in (gen, ref):
        assert s.n_images == 6
        if s.n_words:
            assert 0 <= s.mass <= 1 and 0 < s.baseline <= 1 and math.isfinite(s.lift)
            assert sum(c["n_words"] for c in s.per_category.values()) == s.n_words
    assert ref.n_words > 6  # five references per photo name its objects
