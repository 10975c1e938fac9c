"""Folder captioning reads every format the image parser reads (images.FORMATS): a folder's .tif and .ppm
photos were skipped by a narrower list of its own."""
from __future__ import annotations

import json

from PIL import Image

import captioner
from captioner.cli.caption import find_images, image_extensions, main
from captioner.images import file_extensions

CAT = captioner.DEFAULT_CHECKPOINT.parent / "examples" / "cat.jpg"


def test_folder_formats_are_the_parsers():
    assert set(image_extensions()) == {f".{e.lower()}" for e in file_extensions()}
    assert {".tif", ".tiff", ".ppm"} <= set(image_extensions())


def test_a_folder_of_tif_and_ppm_photos_is_captioned(tmp_path, capsys):
    cat = Image.open(CAT).convert("RGB")
    for name in ("a.tif", "b.ppm", "c.png"):
        cat.save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not a photo")
    found, _ = find_images([str(tmp_path)])
    assert [rel for _, rel in found] == ["a.tif", "b.ppm", "c.png"]
    assert main([str(tmp_path), "--json", "--beam-size", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert sorted(r["image"].rsplit("/", 1)[-1] for r in lines) == ["a.tif", "b.ppm", "c.png"]
    assert all(r["caption"] for r in lines)
