"""The workbench's logic on hand-made captions: rankings, cells, probabilities (no model needed)."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from captioner.decoding.captions import Caption
from captioner.ui.workbench import (cell_attention, cell_of_point, compare_rows, mark_cell, rank_words_at,
                                 unlikely_words, word_probs)


def caption(words: list[str], alphas: np.ndarray, lps: list[float]) -> Caption:
    return Caption(" ".join(words), words, alphas, float(sum(lps)) - 0.1, word_log_probs=np.array(lps, np.float32))


def test_rank_words_at_a_cell():
    a = np.full((3, 2, 2), 0.25)
    a[1] = [[0.7, 0.1], [0.1, 0.1]]
    a[2] = [[0.0, 0.0], [0.0, 1.0]]
    cap = caption(["a", "dog", "runs"], a, [-0.1, -0.5, -4.0])
    ranked = rank_words_at(cap, 0, 0)
    assert [r.word for r in ranked] == ["dog", "a", "runs"]
    assert ranked[0].lift == pytest.approx(0.7 * 4) and ranked[1].lift == pytest.approx(1.0)
    assert [r.index for r in rank_words_at(cap, 1, 1)] == [2, 0, 1]  # ties keep caption order
    np.testing.assert_allclose(cell_attention(cap, 1, 1), [0.25, 0.1, 1.0])
    with pytest.raises(IndexError):
        cell_attention(cap, 2, 0)


def test_probabilities_and_unlikely_words():
    cap = caption(["a", "dog", "zebra"], np.full((3, 2, 2), 0.25), [-0.1, -1.0, -6.0])
    np.testing.assert_allclose(word_probs(cap), np.exp([-0.1, -1.0, -6.0]), rtol=1e-6)
    assert unlikely_words(cap) == [2] and unlikely_words(cap, 0.5) == [1, 2]


def test_cell_of_point_covers_the_photo():
    assert cell_of_point(0, 0, 300, 200, 7) == (0, 0)
    assert cell_of_point(299.9, 199.9, 300, 200, 7) == (6, 6)
    assert cell_of_point(300, 200, 300, 200, 7) == (6, 6)  # the far edge stays inside
    assert cell_of_point(150, 10, 300, 200, 2) == (0, 1)


def test_mark_cell_draws_only_near_that_cell():
    img = Image.new("RGB", (140, 140), (0, 0, 0))
    out = np.asarray(mark_cell(img, 7, 2, 3, colour="#ff0000"))
    red = (out[..., 0] == 255) & (out[..., 1] == 0)
    ys, xs = np.nonzero(red)
    assert ys.min() >= 40 and ys.max() < 60 and xs.min() >= 60 and xs.max() < 80


@pytest.mark.parametrize("size", [(1, 1), (6, 6), (1, 300), (300, 1), (8, 8), (9, 9), (13, 13), (14, 14), (15, 40),
                                  (4000, 3000)])
def test_mark_cell_draws_every_cell_of_any_photo_the_parser_accepts(size):
    """A photo smaller than the grid (a 6x6 icon, a 1x300 strip) once raised "x1 must be >= x0" here and
    broke the page; every cell of every size is drawn, and a click on the drawn picture finds that cell."""
    img = Image.new("RGB", size, (0, 0, 0))
    grid = 9
    for row, col in [(0, 0), (4, 4), (8, 8), (0, 8), (8, 0)]:
        out = mark_cell(img, grid, row, col, colour="#ff0000")
        w, h = out.size
        assert w >= size[0] and h >= size[1]  # never shrunk
        red = np.asarray(out)[..., 0] == 255
        red &= np.asarray(out)[..., 1] == 0
        ys, xs = np.nonzero(red)
        assert len(xs), f"{size}: cell ({row}, {col}) not drawn"
        # the outline's centre lies in that cell of the drawn picture
        assert cell_of_point(float(xs.mean()), float(ys.mean()), w, h, grid) == (row, col)


def test_compare_rows_needs_the_same_words():
    a = caption(["a", "dog"], np.full((2, 2, 2), 0.25), [-0.1, -2.0])
    b = caption(["a", "dog"], np.full((2, 2, 2), 0.25), [-0.3, -1.0])
    rows = compare_rows(a, b)
    assert [r["likelier under"] for r in rows] == ["A", "B"]
    with pytest.raises(ValueError):
        compare_rows(a, caption(["a", "cat"], np.full((2, 2, 2), 0.25), [-0.1, -2.0]))
