"""Datasets: every loader returns list[ImageRecord]."""
from __future__ import annotations

from ..config import DataConfig
from .coco import load_coco
from .flickr8k import load_flickr8k
from .karpathy import load_karpathy
from .records import ImageRecord

__all__ = ["ImageRecord", "load_coco", "load_flickr8k", "load_karpathy", "build_records"]


def build_records(cfg: DataConfig, split: str) -> list[ImageRecord]:
    """The records of `split` ('train', 'val', 'test') for the dataset named in the config."""
    if cfg.dataset == "flickr8k":
        records = load_flickr8k(cfg.root, split)
    elif cfg.dataset == "coco":
        if split == "train":
            records = load_coco(cfg.images, cfg.annotations)
        elif split == "val":
            if not cfg.val_annotations:
                raise ValueError("data.val_annotations is not set: COCO validation needs captions_val*.json")
            records = load_coco(cfg.val_images or cfg.images, cfg.val_annotations)
        else:
            raise ValueError("COCO has no public test captions: evaluate on the val split or use a Karpathy split")
    elif cfg.dataset == "karpathy":
        records = load_karpathy(cfg.images, cfg.annotations, split)
    else:
        raise ValueError(f"unknown dataset '{cfg.dataset}'; choose flickr8k, coco or karpathy")
    if not records:
        raise ValueError(f"dataset '{cfg.dataset}' has no images with captions in split '{split}'")
    return records[: cfg.limit] if cfg.limit else records
