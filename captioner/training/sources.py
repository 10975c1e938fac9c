"""A run's data, whatever its source: images (the encoder in the loop), the frozen-encoder feature cache,
or the lower stages' activation cache (model.tune_stages), for training and validation alike."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import Config
from ..data import ImageRecord
from ..data.dataset import FeatureDataset, ImageDataset, collate, collate_skip_missing, encode_captions
from ..data.features import build_cache
from ..model.captioner import CaptionModel
from ..model.encoder import build_preprocess
from ..vocab import Vocab

Log = Callable[[str], None]


def _caches(cfg: Config, model: CaptionModel, splits: dict[str, list[ImageRecord]], device: torch.device,
            main: bool, world_size: int, log: Log, progress: bool) -> dict[str, Any]:
    """Frozen-encoder feature caches of the splits; rank 0 builds, the others wait and open them."""
    caches, prep = {}, build_preprocess(cfg.model)
    for split, recs in splits.items():
        name = prep.cache_name(cfg.data.dataset, cfg.data.cache_split(split))
        if main:
            caches[split] = build_cache(cfg.data.cache_dir, name, model.encoder, prep, recs,
                                        device, num_workers=cfg.data.num_workers, log=log, progress=progress)
        if world_size > 1:
            dist.barrier()
        if not main:
            caches[split] = build_cache(cfg.data.cache_dir, name, model.encoder, prep, recs,
                                        device, progress=False, log=log)
    return caches


@dataclass
class RunData:
    """What a run trains and validates on, whichever the source (images, features or activations)."""

    dataset: Any
    caps: list[list[list[int]]]  # encoded captions per kept training image
    collate: Callable
    val_records: list[ImageRecord]  # the validated images (train.val_limit, unreadable ones left out)
    val_feats: Any = None  # their cached features or activations (None: encoded from the images)
    val_teacher: Any = None  # model.tune_stages: their pretrained ImageNet logits

    @property
    def mean_lengths(self) -> list[float]:
        return [sum(len(c) for c in cs) / len(cs) for cs in self.caps]


def _kept(records: list[ImageRecord], missing: list[str], limit: int = 0) -> list[int]:
    """Indices of the first `limit` records (0: all) whose images could be read when the cache was built."""
    gone = set(missing)
    return [i for i, r in enumerate(records[:limit or len(records)]) if r.image_id not in gone]


def build_data(cfg: Config, model: CaptionModel, vocab: Vocab, train_records: list[ImageRecord],
          val_records: list[ImageRecord], device: torch.device, main: bool, world_size: int, log: Log,
          progress: bool) -> RunData:
    caps = encode_captions(train_records, vocab, cfg.data.max_caption_len)
    if cfg.encoder_in_loop:  # images every step
        prep = build_preprocess(cfg.model)
        dataset = ImageDataset(train_records, prep.image_size, prep.mean, prep.std, caps, augment=cfg.data.augment)
        return RunData(dataset, caps, collate_skip_missing, val_records[:cfg.train.val_limit or len(val_records)])
    if cfg.from_activations:
        if world_size > 1:
            raise ValueError("model.tune_stages (the CPU path) runs in one process; on GPUs fine-tune the whole "
                                "encoder with model.fine_tune_encoder=true")
        return _activation_data(cfg, model, vocab, caps, train_records, val_records, device, log, progress)
    caches = _caches(cfg, model, {"train": train_records, "val": val_records}, device, main, world_size, log,
                     progress)
    keep = _kept(train_records, caches["train"].missing)
    if len(keep) < len(train_records):
        log(f"skipping {len(train_records) - len(keep)} unreadable training image(s)")
    caps = [caps[i] for i in keep]
    val_keep = _kept(val_records, caches["val"].missing, cfg.train.val_limit)  # the cache covers all val images
    return RunData(FeatureDataset(caches["train"].features, keep, caps), caps, collate,
                   [val_records[i] for i in val_keep], caches["val"].features[val_keep])


def _activation_data(cfg: Config, model: CaptionModel, vocab: Vocab, caps: list[list[list[int]]],
                     train_records: list[ImageRecord], val_records: list[ImageRecord], device: torch.device,
                     log: Log, progress: bool) -> RunData:
    """model.tune_stages: the lower stages' activation caches (built once, valid while those weights are
    the pretrained ones) for train (+ mirror images with data.flip) and val. Single process only."""
    from ..data.activations import build_activations, cache_name
    from ..data.dataset import ActivationDataset

    prep, enc = build_preprocess(cfg.model), model.encoder
    caches = {}
    for split, recs in {"train": train_records, "val": val_records}.items():
        name = cache_name(prep, cfg.data.dataset, cfg.data.cache_split(split),
                          enc.split_block)
        caches[split] = build_activations(cfg.data.cache_dir, name, enc, prep, recs, cfg.data.flip and split == "train",
                                          device, num_workers=cfg.data.num_workers, log=log, progress=progress)
    keep = _kept(train_records, caches["train"].missing)
    caps = [caps[i] for i in keep]
    swap = {vocab.stoi[a]: vocab.stoi[b] for a, b in (("left", "right"), ("right", "left"))
            if a in vocab.stoi and b in vocab.stoi}
    c = caches["train"]
    val_keep = _kept(val_records, caches["val"].missing, cfg.train.val_limit)
    return RunData(ActivationDataset(c.acts, c.flipped, c.logits, keep, caps, swap), caps, collate,
                   [val_records[i] for i in val_keep], caches["val"].acts[val_keep],
                   caches["val"].logits[val_keep, 0])
