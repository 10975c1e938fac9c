"""Frozen-encoder feature cache: encode every image once, store (N, P, D) float16 on disk as a
memory-mapped .npy, reuse it across epochs and runs.

float16 holds values up to 65,504. A pretrained encoder stays far below that; a randomly initialised
ResNet (model.pretrained=false, e.g. a smoke run without downloaded weights) does not, and rounding its
features to inf would surface as a NaN loss an epoch later. Such a cache is stored in float32 instead
(said in the log); non-finite features are refused when the cache is built, naming the encoder.

A cache is keyed by what made it: encoder name, input size, grid size and a fingerprint of the
encoder weights, plus the list of images. Anything else (another encoder, another grid, a fine-tuned
encoder, a half-written file) does not match and is rebuilt, never silently used. Its file is named by
what it holds (cache_writer.cache_base): the recipe's name (Preprocess.cache_name), and where a cache of that name holds
another folder's photos, that name plus a short hash of this one's folders: two folders prepared one after the
other under one data.name keep two caches, and neither is ever read for the other.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..config import ModelConfig
from ..diskspace import reserve
from ..logs import progress as progress_of
from ..model.encoder import Encoder, Preprocess, build_preprocess
from .cache_writer import cache_base, photo_loader, write_cache
from .records import ImageRecord


def encoder_fingerprint(encoder: Encoder) -> str:
    h = hashlib.sha1()
    for name, t in sorted(encoder.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class FeatureCache:
    features: np.ndarray  # (N, P, D) float16 (float32 where float16 cannot hold them), memory-mapped
    index: dict[str, int]  # image_id -> row
    missing: list[str]  # images that could not be read (reported, skipped)
    path: Path


def _key(encoder: Encoder, image_size: int, records: Sequence[ImageRecord]) -> dict:
    ids = hashlib.sha1("\n".join(f"{r.image_id}\t{r.path.name}" for r in records).encode()).hexdigest()[:16]
    key = {"version": 1, "encoder": encoder.name, "image_size": image_size, "grid_size": encoder.grid_size,
           "weights": encoder_fingerprint(encoder), "images": ids, "n": len(records)}
    if encoder.output_stride != 32:  # same weights, other features; stride-32 caches keep their old key
        key["output_stride"] = encoder.output_stride
    return key


def _preprocess_of(encoder: Encoder, preprocess: Preprocess | int) -> Preprocess:
    """A Preprocess as given; an int is an image size with the encoder's own normalisation
    (the older calling convention, still used by engine.py)."""
    if isinstance(preprocess, Preprocess):
        mine = (preprocess.encoder, preprocess.grid_size, preprocess.output_stride)
        if mine != (encoder.name, encoder.grid_size, encoder.output_stride):
            raise ValueError(f"preprocessing for {preprocess.encoder} (grid {preprocess.grid_size}, output stride "
                             f"{preprocess.output_stride}) given with the encoder {encoder.name} (grid "
                             f"{encoder.grid_size}, output stride {encoder.output_stride}); build both from one "
                             "model config")
        return preprocess
    return build_preprocess(ModelConfig(encoder=encoder.name, image_size=preprocess, grid_size=encoder.grid_size,
                                        output_stride=encoder.output_stride))


def open_cache(cache_dir: str | Path, name: str, encoder: Encoder, preprocess: Preprocess | int,
               records: Sequence[ImageRecord]) -> FeatureCache | None:
    """The cache for exactly these images and this encoder, or None when absent/stale/incomplete."""
    image_size = _preprocess_of(encoder, preprocess).image_size
    base = cache_base(cache_dir, name, records)
    meta_path, npy_path = base.with_suffix(".json"), base.with_suffix(".npy")
    if not meta_path.is_file() or not npy_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        return None
    if meta.get("key") != _key(encoder, image_size, records):
        return None
    try:
        feats = np.load(npy_path, mmap_mode="r")
    except (ValueError, OSError):  # truncated or corrupt .npy: rebuild rather than fail
        return None
    if feats.shape[0] != len(records):
        return None
    return FeatureCache(feats, {r.image_id: i for i, r in enumerate(records)}, meta.get("missing", []), npy_path)


@torch.no_grad()
def build_cache(cache_dir: str | Path, name: str, encoder: Encoder, preprocess: Preprocess | int,
                records: Sequence[ImageRecord], device: torch.device | str = "cpu", batch_size: int = 32,
                num_workers: int = 2, log: Callable[[str], None] = print, progress: bool = True) -> FeatureCache:
    """Open the matching cache, or (re)build it. The .json is written last, after the .npy is
    complete and renamed, so an interrupted build is never mistaken for a finished one.
    `preprocess`: build_preprocess(cfg.model) (an int image size still works: the encoder's normalisation)."""
    prep = _preprocess_of(encoder, preprocess)
    cache = open_cache(cache_dir, name, encoder, prep, records)
    if cache is not None:
        return cache
    base = cache_base(cache_dir, name, records)
    encoder = encoder.eval().to(device)
    loader = photo_loader(records, prep, batch_size, num_workers)
    shape = (len(records), encoder.grid_size ** 2, encoder.out_dim)  # (N, P, D)

    def encode(temps: dict[str, Path]) -> np.ndarray:
        return _encode_into(temps["npy"], shape, encoder, loader, device, f"encoding {name}", progress,
                            [r.image_id for r in records], log)

    write_cache(base.with_suffix(".json"), {"npy": base.with_suffix(".npy")}, int(np.prod(shape)) * 2 + 4096, encode,
                _key(encoder, prep.image_size, records), records, ("feature", "encoder/grid/image list"), log)
    cache = open_cache(cache_dir, name, encoder, prep, records)
    assert cache is not None
    return cache



def _encode_into(tmp: Path, shape: tuple[int, int, int], encoder: Encoder, loader: DataLoader,
                 device: torch.device | str, desc: str, progress: bool, image_ids: Sequence[str],
                 log: Callable[[str], None]) -> np.ndarray:
    """Encode every image into a new float16 .npy memory map at `tmp` (disk space reserved first;
    float32 from the first batch float16 cannot hold); which rows were filled (N,) bool."""
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=shape)  # (N, P, D)
    reserve(tmp, out.offset + out.nbytes)
    seen = np.zeros(shape[0], dtype=bool)
    t0, done = time.time(), 0
    for k, batch in enumerate(progress_of(loader, desc, enabled=progress)):
        if k == 3 and done:  # the first batches' pace (after warm-up) -> how long the whole cache takes
            rate = done / (time.time() - t0)
            log(f"{desc}: {rate:.1f} photos/s here, about {(shape[0] - done) / rate / 60:.1f} min for the rest "
                f"of its {shape[0]:,} photos")
        if not batch:  # no image of this batch could be read
            continue
        done += len(batch)
        x = torch.stack([s[0] for s in batch]).to(device, next(encoder.parameters()).dtype)
        idx = [s[1] for s in batch]
        feats = encoder(x.contiguous(memory_format=torch.channels_last))  # (b, P, D); channels_last is faster on CPU
        feats = _checked(feats.float().cpu().numpy(), encoder.name, [image_ids[i] for i in idx])
        if out.dtype == np.float16 and np.abs(feats).max() > F16_MAX:
            log(f"note: {encoder.name} features reach {np.abs(feats).max():.3g}, beyond float16's range "
                f"({F16_MAX:.0f}; random weights?): {desc.removeprefix('encoding ')} is stored in float32 "
                "(twice the disk)")
            out = _widen(out, tmp)
        out[idx] = feats.astype(out.dtype)
        seen[idx] = True
    out.flush()
    del out
    return seen


F16_MAX = float(np.finfo(np.float16).max)  # 65504


def _checked(feats: np.ndarray, encoder: str, image_ids: Sequence[str]) -> np.ndarray:
    """The batch's features, or a ValueError when the encoder produced NaN or inf for one of its images."""
    bad = ~np.isfinite(feats).reshape(len(feats), -1).all(axis=1)
    if bad.any():
        raise ValueError(f"the encoder {encoder} produced NaN/inf features for {int(bad.sum())} image(s) (e.g. "
                         f"{image_ids[int(np.flatnonzero(bad)[0])]}); nothing was cached. Its weights are broken or "
                         "diverged: use model.pretrained=true, or check the checkpoint it was loaded from")
    return feats


def _widen(out: np.memmap, tmp: Path) -> np.memmap:
    """The float16 memory map `out` (written so far) copied into a float32 one at the same path."""
    wide_tmp = tmp.with_suffix(".f32.npy")
    wide = np.lib.format.open_memmap(wide_tmp, mode="w+", dtype=np.float32, shape=out.shape)
    reserve(wide_tmp, wide.offset + wide.nbytes)
    for i in range(0, len(out), 256):
        wide[i:i + 256] = out[i:i + 256]
    del out
    os.replace(wide_tmp, tmp)
    return wide


def cache_name(dataset: str, split: str, encoder: str, image_size: int, grid_size: int) -> str:
    """Prefer build_preprocess(cfg.model).cache_name(dataset, split): the same name from one place."""
    return build_preprocess(ModelConfig(encoder=encoder, image_size=image_size, grid_size=grid_size)).cache_name(
        dataset, split)
