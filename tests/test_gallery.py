"""Many photos at once (captioner/ui/gallery.py): the batch's CSV, JSON and figure ZIP, and the thumbnails."""
from __future__ import annotations

import dataclasses

import csv
import io
import json
import zipfile

import numpy as np

from captioner.decoding.captions import Caption
from captioner.ui import gallery


def cap(text: str, concepts=(), photo_size=None) -> Caption:
    words = text.split()
    return Caption(text, words, np.full((len(words), 2, 2), 0.25, np.float32), -2.5, concepts=list(concepts),
                   photo_size=photo_size, input_side=260 if photo_size else None)


ITEMS = [("a.jpg", cap("a cat on a wall", [("cat", 0.87), ("person", 0.19)])),
         ("b,c.png", cap("a dog, running", [])), ("tiny.png", cap("a blur", [], photo_size=(6, 6)))]


def test_csv_has_one_row_per_photo_with_its_caption_concepts_and_notes():
    rows = list(csv.reader(io.StringIO(gallery.batch_csv(ITEMS).decode("utf-8"))))
    assert rows[0] == ["image", "caption", "log_prob", "confidence", "sure", "level", "reason", "concepts", "notes"]
    assert [r[0] for r in rows[1:]] == ["a.jpg", "b,c.png", "tiny.png"]  # a comma in a name stays one field
    assert rows[1][1] == "a cat on a wall" and rows[1][7] == "cat 0.87; person 0.19"
    assert rows[3][8].startswith("The photo is only 6x6 pixels") and rows[1][8] == ""
    assert rows[1][3:7] == ["", "", "", ""]  # no fitted confidence: empty, never an invented number


def test_csv_says_how_sure_each_caption_is():
    sure = dataclasses.replace(cap("a cat on a wall"), confidence=0.9, sure_at=0.5)  # the model file's threshold
    unsure = dataclasses.replace(cap("a dog, running"), confidence=0.1, sure_at=0.5)
    rows = list(csv.reader(io.StringIO(gallery.batch_csv([("a.jpg", sure), ("b.jpg", unsure)]).decode("utf-8"))))
    assert [r[3:6] for r in rows[1:]] == [["0.90", "true", "sure"], ["0.10", "false", "probably wrong"]]
    assert rows[1][6] == "" and rows[2][6] == unsure.doubt != ""  # why unsure, in its own column


def test_json_is_the_one_caption_shape_per_photo():
    out = json.loads(gallery.batch_json(ITEMS))
    assert [r["image"] for r in out] == ["a.jpg", "b,c.png", "tiny.png"]
    assert out[0] == ITEMS[0][1].to_dict("a.jpg", maps=False)


def test_zip_holds_one_figure_per_photo_with_unique_names():
    items = [("x.jpg", ITEMS[0][1], None), ("x.jpg", ITEMS[1][1], None), ("y.png", ITEMS[2][1], None)]
    data = gallery.figures_zip(items, lambda image, c: c.text.encode())
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.namelist() == ["x_attention.png", "x_2_attention.png", "y_attention.png"]
        assert z.read("x_2_attention.png") == b"a dog, running"


def test_thumbnails_share_the_width_and_stay_small():
    assert gallery.thumbnail_side(2, 4) == 320 and gallery.thumbnail_side(12, 4) == 240
    assert 120 <= gallery.thumbnail_side(100, 8) <= gallery.THUMB_MAX


def test_cards_and_csv_list_every_concept_the_single_view_and_json_show():
    """A photo with four concepts: the gallery's card and CSV dropped the 4th that the single view and the JSON
    showed."""
    four = [("dog", 0.9), ("frisbee", 0.7), ("person", 0.5), ("grass", 0.31)]
    item = ("d.jpg", cap("a dog catches a frisbee", four))
    row = list(csv.reader(io.StringIO(gallery.batch_csv([item]).decode("utf-8"))))[1]
    listed = [c.split()[0] for c in row[7].split("; ")]
    assert listed == [c for c, _ in four] == [c["category"] for c in json.loads(gallery.batch_json([item]))[0]["concepts"]]
    assert gallery.top_concepts(item[1]) == row[7]
