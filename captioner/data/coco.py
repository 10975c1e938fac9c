"""COCO captions through pycocotools: an annotation JSON (captions_*.json) and its image folder."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

from .records import ImageRecord


def load_coco(images: str | Path, annotations: str | Path) -> list[ImageRecord]:
    """All images of the annotation file that have captions, sorted by image id."""
    from pycocotools.coco import COCO

    annotations = Path(annotations)
    if not annotations.is_file():
        raise FileNotFoundError(f"COCO caption annotations not found: {annotations}")
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress chatter
        coco = COCO(str(annotations))
    records = []
    for img_id in sorted(coco.getImgIds()):
        info = coco.loadImgs(img_id)[0]
        caps = [a["caption"].strip() for a in coco.loadAnns(coco.getAnnIds(imgIds=img_id))]
        if caps:
            records.append(ImageRecord(str(img_id), Path(images) / info["file_name"], caps))
    return records
