"""A run's data, whatever its source: images (the encoder in the loop), the frozen-encoder feature cache,
or the lower stages' activation cache (model.tune_stages), for training and validation alike, over one
caption set or a mix (data.sources: each set its own caches, its sampling weight and its val set)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import Config, SourceConfig
from ..data import ImageRecord
from ..data.dataset import FeatureDataset, ImageDataset, collate, collate_skip_missing, encode_captions
from ..data.features import build_cache
from ..model.captioner import CaptionModel
from ..model.encoder import build_preprocess
from ..vocab import Vocab

Log = Callable[[str], None]
Mix = list[tuple[SourceConfig, list[ImageRecord]]]  # each caption set with its records of one split


def _caches(cfg: Config, model: CaptionModel, splits: dict[str, list[ImageRecord]], device: torch.device,
            main: bool, world_size: int, log: Log, progress: bool, source: str) -> dict[str, Any]:
    """Frozen-encoder feature caches of one caption set's splits, named after the set (one set's cache is
    never read for another; the key checks encoder and image list too); rank 0 builds, the others wait."""
    caches, prep = {}, build_preprocess(cfg.model)
    for split, recs in splits.items():
        name = prep.cache_name(source, cfg.data.cache_split(split))
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
class ValSet:
    """One caption set's validation images (train.val_limit, unreadable ones left out)."""

    name: str  # the source's name: its scores are logged as "<name>/<metric>" in a mix
    records: list[ImageRecord]
    feats: Any = None  # their cached features or activations (None: encoded from the images)
    teacher: Any = None  # model.tune_stages: their pretrained ImageNet logits


@dataclass
class RunData:
    """What a run trains and validates on, whichever the source (images, features or activations)."""

    dataset: Any
    caps: list[list[list[int]]]  # encoded captions per kept training image
    collate: Callable
    val_sets: list[ValSet]
    weights: list[float] = field(default_factory=list)  # sampling weight per kept training image (empty: all 1)

    @property
    def mean_lengths(self) -> list[float]:
        return [sum(len(c) for c in cs) / len(cs) for cs in self.caps]


def _kept(records: list[ImageRecord], missing: list[str], limit: int = 0) -> list[int]:
    """Indices of the first `limit` records (0: all) whose images could be read when the cache was built."""
    gone = set(missing)
    return [i for i, r in enumerate(records[:limit or len(records)]) if r.image_id not in gone]


def build_data(cfg: Config, model: CaptionModel, vocab: Vocab, train: Mix, val: Mix, device: torch.device,
               main: bool, world_size: int, log: Log, progress: bool) -> RunData:
    """The run's training samples over every caption set of the mix (each with its sampling weight) and
    one validation set per caption set."""
    limit = cfg.train.val_limit
    if cfg.encoder_in_loop:  # images every step
        prep = build_preprocess(cfg.model)
        records = [r for _, recs in train for r in recs]
        caps = encode_captions(records, vocab, cfg.data.max_caption_len)
        dataset = ImageDataset(records, prep.image_size, prep.mean, prep.std, caps, augment=cfg.data.augment)
        weights = [src.weight for src, recs in train for _ in recs]
        return RunData(dataset, caps, collate_skip_missing,
                       [ValSet(src.name, recs[:limit or len(recs)]) for src, recs in val], weights)
    if cfg.from_activations:
        if world_size > 1:
            raise ValueError("model.tune_stages (the CPU path) runs in one process; on GPUs fine-tune the whole "
                             "encoder with model.fine_tune_encoder=true")
        if len(train) > 1:
            raise ValueError("model.tune_stages reads one caption set's activation cache; a mix (data.sources) "
                             "trains from cached features (model.tune_stages=0) or with the encoder in the loop")
        (src, train_records), (_, val_records) = train[0], val[0]
        caps = encode_captions(train_records, vocab, cfg.data.max_caption_len)
        return _activation_data(cfg, model, vocab, caps, train_records, val_records, device, log, progress, src.name)
    parts, rows, caps, weights, val_sets = [], [], [], [], []
    for k, ((src, train_records), (_, val_records)) in enumerate(zip(train, val)):
        caches = _caches(cfg, model, {"train": train_records, "val": val_records}, device, main, world_size, log,
                         progress, src.name)
        keep = _kept(train_records, caches["train"].missing)
        if len(keep) < len(train_records):
            log(f"{src.name}: skipping {len(train_records) - len(keep)} unreadable training image(s)")
        source_caps = encode_captions([train_records[i] for i in keep], vocab, cfg.data.max_caption_len)
        parts.append(caches["train"].features)
        rows += [(k, i) for i in keep]
        caps += source_caps
        weights += [src.weight] * len(keep)
        val_keep = _kept(val_records, caches["val"].missing, limit)  # the cache covers all val images
        val_sets.append(ValSet(src.name, [val_records[i] for i in val_keep], caches["val"].features[val_keep]))
    return RunData(FeatureDataset(parts, rows, caps), caps, collate, val_sets, weights)


def _activation_data(cfg: Config, model: CaptionModel, vocab: Vocab, caps: list[list[list[int]]],
                     train_records: list[ImageRecord], val_records: list[ImageRecord], device: torch.device,
                     log: Log, progress: bool, source: str) -> RunData:
    """model.tune_stages: the lower stages' activation caches (built once, valid while those weights are
    the pretrained ones) for train (+ mirror images with data.flip) and val. Single process only."""
    from ..data.activations import build_activations, cache_name
    from ..data.dataset import ActivationDataset

    prep, enc = build_preprocess(cfg.model), model.encoder
    caches = {}
    for split, recs in {"train": train_records, "val": val_records}.items():
        name = cache_name(prep, source, cfg.data.cache_split(split), enc.split_block)
        caches[split] = build_activations(cfg.data.cache_dir, name, enc, prep, recs, cfg.data.flip and split == "train",
                                          device, num_workers=cfg.data.num_workers, log=log, progress=progress)
    keep = _kept(train_records, caches["train"].missing)
    caps = [caps[i] for i in keep]
    swap = {vocab.stoi[a]: vocab.stoi[b] for a, b in (("left", "right"), ("right", "left"))
            if a in vocab.stoi and b in vocab.stoi}
    c = caches["train"]
    val_keep = _kept(val_records, caches["val"].missing, cfg.train.val_limit)
    return RunData(ActivationDataset(c.acts, c.flipped, c.logits, keep, caps, swap), caps, collate,
                   [ValSet(source, [val_records[i] for i in val_keep], caches["val"].acts[val_keep],
                           caches["val"].logits[val_keep, 0])])
