"""COCO captions through pycocotools: an annotation JSON (captions_*.json) and its image folder,
optionally only the photos a split file names (one file name per line, e.g. coco-paired's split_val.txt)."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

from .records import ImageRecord


def read_split_file(path: str | Path) -> list[str]:
    """The file names a split file lists, one per line (blank lines ignored)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"split file not found: {path}")
    return [n.strip() for n in path.read_text(encoding="utf-8-sig").splitlines() if n.strip()]


def open_coco(path: Path, what: str):
    """pycocotools' COCO of a JSON file, quietly; a file that is not JSON (or not readable) is a ValueError that
    names it and says what it should be (json's own "Expecting value: line 1 column 1" names neither)."""
    from pycocotools.coco import COCO

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress chatter
            coco = COCO(str(path))
    except (ValueError, UnicodeDecodeError, OSError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{path} could not be read as {what} ({type(e).__name__}: {e}); pass the JSON file "
                         "from cocodataset.org's annotations") from None
    return coco


def load_coco(images: str | Path, annotations: str | Path, only: list[str] | None = None) -> list[ImageRecord]:
    """The images of the annotation file that have captions, sorted by image id; with `only` (file names
    from a split file) just those, each of which must have captions in the file and a photo in `images`."""
    annotations = Path(annotations)
    if not annotations.is_file():
        raise FileNotFoundError(f"COCO caption annotations not found: {annotations}")
    coco = open_coco(annotations, "a COCO captions_*.json")
    records = []
    for img_id in sorted(coco.getImgIds()):
        info = coco.loadImgs(img_id)[0]
        caps = [a["caption"].strip() for a in coco.loadAnns(coco.getAnnIds(imgIds=img_id))]
        if caps:
            records.append(ImageRecord(str(img_id), Path(images) / info["file_name"], caps))
    return records if only is None else _named(records, only, annotations, Path(images))


def _named(records: list[ImageRecord], names: list[str], annotations: Path, images: Path) -> list[ImageRecord]:
    """The records of the split file's names, in id order; a name without captions or without a photo is an
    error naming the first such file and how many there are."""
    by_name = {r.path.name: r for r in records}
    no_caps = [n for n in names if n not in by_name]
    if no_caps:
        raise ValueError(f"{len(no_caps)} photo(s) of the split file have no captions in {annotations}, first "
                         f"{no_caps[0]}: use the split file that belongs to this captions file")
    missing = [n for n in names if not (images / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} photo(s) named by the split file are not in {images}, first "
                                f"{images / missing[0]}: point images at the folder that holds them")
    wanted = set(names)
    return [r for r in records if r.path.name in wanted]
