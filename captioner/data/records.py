"""One record type for every dataset: an image file and its reference captions."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ImageRecord:
    image_id: str  # unique within a dataset (file name for Flickr, COCO id as text)
    path: Path
    captions: list[str] = field(default_factory=list)
