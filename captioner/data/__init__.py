"""Datasets: every loader returns list[ImageRecord]; a run's mix is a list of (source, records)."""
from __future__ import annotations

from ..config import DataConfig, SourceConfig
from .coco import load_coco, read_split_file
from .flickr8k import load_flickr8k
from .karpathy import load_karpathy
from .records import ImageRecord

__all__ = ["ImageRecord", "load_coco", "load_flickr8k", "load_karpathy", "build_records", "build_mix"]


def _source_records(src: SourceConfig, split: str) -> list[ImageRecord]:
    if src.dataset == "flickr8k":
        return load_flickr8k(src.root, split)
    if src.dataset == "karpathy":
        return load_karpathy(src.images, src.annotations, split)
    if src.dataset != "coco":
        raise ValueError(f"unknown dataset '{src.dataset}'; choose flickr8k, coco or karpathy")
    split_file = {"train": src.train_split, "val": src.val_split}.get(split, "")
    if split_file:  # one captions file, its photos divided by split files (e.g. coco-paired)
        return load_coco(src.images, src.annotations, only=read_split_file(split_file))
    if split == "train":
        return load_coco(src.images, src.annotations)
    if split == "val":
        if not src.val_annotations:
            raise ValueError(f"source '{src.name}': COCO validation needs val_annotations (captions_val*.json) "
                             "or a val_split file naming photos of annotations")
        return load_coco(src.val_images or src.images, src.val_annotations)
    raise ValueError("COCO has no public test captions: evaluate on the val split, a split file or a Karpathy split")


def build_records(cfg: DataConfig | SourceConfig, split: str, limit: int | None = None) -> list[ImageRecord]:
    """The records of `split` ('train', 'val', 'test') of one caption set: a SourceConfig, or a DataConfig
    naming a single set (its dataset/root/images keys). `limit` (default: a DataConfig's data.limit) keeps
    the first N."""
    if isinstance(cfg, DataConfig):
        sources = cfg.source_list()
        if len(sources) > 1:
            raise ValueError("data.sources names several caption sets: use build_mix for a mixed run")
        limit = cfg.limit if limit is None else limit
        src = sources[0]
    else:
        src = cfg
    records = _source_records(src, split)
    if not records:
        raise ValueError(f"dataset '{src.dataset}' ({src.name}) has no images with captions in split '{split}'")
    return records[:limit] if limit else records


def build_mix(cfg: DataConfig, split: str) -> list[tuple[SourceConfig, list[ImageRecord]]]:
    """Each caption set of the run with its records of `split` (data.limit applies to each set)."""
    return [(src, build_records(src, split, cfg.limit)) for src in cfg.source_list()]
