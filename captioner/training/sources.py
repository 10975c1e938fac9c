"""A run's data, whatever its source: images (the encoder in the loop), the frozen-encoder feature cache,
or the lower stages' activation cache (model.tune_stages), for training and validation alike, over one
caption set or a mix (data.sources: each set its own caches, its sampling weight and its val set)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

from ..config import Config, SourceConfig
from ..data import ImageRecord
from ..data.activations import ActivationCache, build_activations, cache_name as activation_cache_name
from ..data.dataset import (ActivationDataset, FeatureDataset, ImageDataset, collate, collate_skip_missing,
                            encode_captions)
from ..data import build_mix
from ..data.features import FeatureCache, build_cache, open_cache
from ..model.show_attend_tell import ShowAttendTell
from ..model.encoder import build_preprocess
from ..vocab import Vocab
from .place import Log, Place

Mix = list[tuple[SourceConfig, list[ImageRecord]]]  # each caption set with its records of one split


def _caches(cfg: Config, model: ShowAttendTell, splits: dict[str, list[ImageRecord]], place: Place,
            source: str) -> dict[str, Any]:
    """Frozen-encoder feature caches of one caption set's splits, named after the set (one set's cache is
    never read for another; the key checks encoder and image list too); rank 0 builds, the others wait."""
    caches, prep = {}, build_preprocess(cfg.model)
    for split, recs in splits.items():
        name = prep.cache_name(source, cfg.data.cache_split(split))
        if place.main:
            caches[split] = build_cache(cfg.data.cache_dir, name, model.encoder, prep, recs, place.device,
                                        num_workers=cfg.data.num_workers, log=place.log, progress=place.progress)
        if place.world_size > 1:
            dist.barrier()
        if not place.main:
            caches[split] = build_cache(cfg.data.cache_dir, name, model.encoder, prep, recs,
                                        place.device, progress=False, log=place.log)
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


def build_data(cfg: Config, model: ShowAttendTell, vocab: Vocab, train: Mix, val: Mix, place: Place) -> RunData:
    """The run's training samples over every caption set of the mix (each with its sampling weight) and
    one validation set per caption set."""
    limit = cfg.train.val_limit
    if cfg.encoder_in_loop:  # images every step
        prep = build_preprocess(cfg.model)
        records = [r for _, recs in train for r in recs]
        caps = encode_captions(records, vocab, cfg.data.max_caption_len)
        dataset = ImageDataset(records, prep.image_size, prep.mean, prep.std, caps, augment=cfg.data.augment,
                               seed=cfg.train.seed)
        weights = [src.weight for src, recs in train for _ in recs]
        return RunData(dataset, caps, collate_skip_missing,
                       [ValSet(src.name, recs[:limit or len(recs)]) for src, recs in val], weights)
    if cfg.from_activations:
        if place.world_size > 1:
            raise ValueError("model.tune_stages (the CPU path) runs in one process; on GPUs fine-tune the whole "
                             "encoder with model.fine_tune_encoder=true")
        caches = _activation_caches(cfg, model, place)
        parts, rows, caps, weights, val_sets = _per_set(cfg, vocab, train, val, caches, place.log)
        swap = {vocab.stoi[a]: vocab.stoi[b] for a, b in (("left", "right"), ("right", "left"))
                if a in vocab.stoi and b in vocab.stoi}  # a mirror image's captions
        return RunData(ActivationDataset(parts, rows, caps, swap), caps, collate, val_sets, weights)

    def features(src: SourceConfig, splits: dict[str, list[ImageRecord]]) -> dict[str, Any]:
        return _caches(cfg, model, splits, place, src.name)

    parts, rows, caps, weights, val_sets = _per_set(cfg, vocab, train, val, features, place.log)
    return RunData(FeatureDataset(parts, rows, caps), caps, collate, val_sets, weights)


Caches = Callable[[SourceConfig, dict[str, list[ImageRecord]]], dict[str, Any]]


def _per_set(cfg: Config, vocab: Vocab, train: Mix, val: Mix, caches_of: Caches, log: Log
             ) -> tuple[list[Any], list[tuple[int, int]], list[list[list[int]]], list[float], list[ValSet]]:
    """Each caption set's caches (`caches_of(source, {"train": .., "val": ..})`: FeatureCache or
    ActivationCache per split) -> (one training part per set, (part, row) of every kept training image,
    their encoded captions, their sampling weights, one ValSet per set). Unreadable photos are left out."""
    parts, rows, caps, weights, val_sets = [], [], [], [], []
    for k, ((src, train_records), (_, val_records)) in enumerate(zip(train, val)):
        caches = caches_of(src, {"train": train_records, "val": val_records})
        c, v = caches["train"], caches["val"]
        keep = _kept(train_records, c.missing)
        if len(keep) < len(train_records):
            log(f"{src.name}: skipping {len(train_records) - len(keep)} unreadable training image(s)")
        caps += encode_captions([train_records[i] for i in keep], vocab, cfg.data.max_caption_len)
        rows += [(k, i) for i in keep]
        weights += [src.weight] * len(keep)
        val_keep = _kept(val_records, v.missing, cfg.train.val_limit)  # the cache covers all val images
        if val_records and not val_keep:  # ("no predictions to score", at the end of the first epoch, said none of it)
            raise ValueError(no_val_photo(src.name, val_records))
        val_records = [val_records[i] for i in val_keep]
        if isinstance(c, FeatureCache):
            parts.append(c.features)
            val_sets.append(ValSet(src.name, val_records, v.features[val_keep]))
        else:  # activations: + the mirror images and the pretrained logits (train.alpha_head, head agreement)
            parts.append((c.acts, c.flipped, c.logits))
            val_sets.append(ValSet(src.name, val_records, v.acts[val_keep], v.logits[val_keep, 0]))
    return parts, rows, caps, weights, val_sets


def no_val_photo(name: str, val_records: list[ImageRecord]) -> str:
    """Why a run cannot validate: every photo of a caption set's val split is unreadable or missing on disk."""
    names = ", ".join(r.image_id for r in val_records[:5]) + (" ..." if len(val_records) > 5 else "")
    return (f"{name}: none of the val split's {len(val_records)} photo(s) could be read ({names}: missing on disk or "
            "not an image), so there is nothing to validate on; put them back, or add captioned photos so that the "
            "val split (every 10th by name, without split files) holds readable ones, then rerun captioner-prepare")


def _activation_caches(cfg: Config, model: ShowAttendTell, place: Place) -> Caches:
    """model.tune_stages: a caption set's lower-stage activation caches, named after the set like its
    feature caches (built once, valid while those weights are the pretrained ones), for train (+ mirror
    images with data.flip) and val. Single process only."""
    prep, enc = build_preprocess(cfg.model), model.encoder

    def caches_of(src: SourceConfig, splits: dict[str, list[ImageRecord]]) -> dict[str, ActivationCache]:
        out = {}
        for split, recs in splits.items():
            name = activation_cache_name(prep, src.name, cfg.data.cache_split(split), enc.split_block)
            out[split] = build_activations(cfg.data.cache_dir, name, enc, prep, recs,
                                           cfg.data.flip and split == "train", place.device,
                                           num_workers=cfg.data.num_workers, log=place.log, progress=place.progress)
        return out

    return caches_of


def cache_encoder(cfg: Config) -> Any:
    """The frozen encoder a run caches features with: the pretrained one, or with train.init_encoder the
    encoder of the train.init_from file."""
    from ..checkpoint import load_checkpoint, load_model_state
    from ..model.show_attend_tell import build_model
    from ..model.encoder import Encoder

    if not (cfg.train.init_from and cfg.train.init_encoder):
        return Encoder(cfg.model.encoder, cfg.model.pretrained, cfg.model.grid_size, cfg.model.output_stride)
    init = load_checkpoint(cfg.train.init_from)
    model = build_model(cfg.model, len(init.vocab), pretrained=False)
    load_model_state(model, init.model_state, cfg.train.init_from)
    return model.encoder


def missing_caches(cfg: Config) -> list[str]:
    """The frozen-encoder feature caches this run would read and nobody has built (names). A multi-process run
    asks before its process group starts: it is refused rather than left waiting while one rank builds."""
    if cfg.encoder_in_loop or cfg.from_activations:
        return []
    encoder, prep = cache_encoder(cfg), build_preprocess(cfg.model)
    missing = []
    for (src, train), (_, val) in zip(build_mix(cfg.data, "train"), build_mix(cfg.data, "val")):
        for split, recs in (("train", train), ("val", val)):
            name = prep.cache_name(src.name, cfg.data.cache_split(split))
            if open_cache(cfg.data.cache_dir, name, encoder, prep, recs) is None:
                missing.append(name)
    return missing
