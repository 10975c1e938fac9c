"""Karpathy split JSON (dataset_coco.json / dataset_flickr8k.json / dataset_flickr30k.json).

Format: {"images": [{"filepath"?: "val2014", "filename": "...", "split": "train|val|test|restval",
"sentences": [{"raw": "..."}], "cocoid"?|"imgid": ...}]}. 'restval' is used for training, as usual.
"""
from __future__ import annotations

import json
from pathlib import Path

from .records import ImageRecord


def load_karpathy(images: str | Path, annotations: str | Path, split: str) -> list[ImageRecord]:
    want = {"train": ("train", "restval"), "val": ("val",), "test": ("test",)}
    if split not in want:
        raise ValueError(f"split must be train, val or test, got '{split}'")
    try:
        data = json.loads(Path(annotations).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{annotations} could not be read as a Karpathy split JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or "images" not in data:
        raise ValueError(f"{annotations}: not a Karpathy split file (no 'images' list)")
    records = []
    for item in data["images"]:
        if item.get("split") not in want[split]:
            continue
        rel = Path(item.get("filepath", "")) / item["filename"]
        image_id = str(item.get("cocoid", item.get("imgid", item["filename"])))
        caps = [s["raw"].strip() for s in item.get("sentences", [])]
        if caps:
            records.append(ImageRecord(image_id, Path(images) / rel, caps))
    return records
