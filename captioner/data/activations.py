"""Activation cache for fine-tuning the encoder's top stages on a CPU (model.tune_stages).

Most of an EfficientNet's cost is in its lower stages, which fine-tuning changes least. They are run
once per photo (and once per horizontally flipped photo) into a float16 memory map of the activations
that enter the last stride-2 stage (Lite2 at 260 px: 120 x 17 x 17, 68 KB per photo); training then
runs only the top stage(s), the head conv and the decoder. The pretrained ImageNet logits of each
photo and its flip are stored beside them: the head-preservation term (train.alpha_head) and the
agreement report read them. They always come from a freshly built PRETRAINED encoder, never from the
encoder passed in (whose top may be mid-chain): a cache rebuilt halfway through a fine-tuning chain
must not make the tuned head its own teacher.

Keyed like the feature cache (features.py): encoder name, input size, the split block, a fingerprint
of the FROZEN lower blocks' weights (the top may change: the cache stays valid through a whole chain of
fine-tuning stages), a fingerprint of the teacher (the whole pretrained backbone that made the logits)
and the image list. A mismatch is rebuilt, never silently used. A mix (data.sources) has one cache per
caption set and split, named after the set (cache_name), like its feature caches, and like them named by the
folders it holds (cache_writer.cache_base): two folders prepared under one name keep two caches.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..diskspace import reserve
from ..model.encoder import Encoder, Preprocess
from .cache_writer import cache_base, photo_loader, write_cache
from .records import ImageRecord

VERSION = 2  # 2: teacher logits from a fresh pretrained encoder, keyed by its weights


@dataclass
class ActivationCache:
    acts: np.ndarray  # (N, C, h, w) float16, memory-mapped: what enters the split block
    flipped: np.ndarray | None  # (N, C, h, w) the same for the horizontally flipped photos (data.flip)
    logits: np.ndarray  # (N, 2, K) float16 pretrained ImageNet logits of the photo and of its flip
    index: dict[str, int]
    missing: list[str]
    path: Path

    @property
    def bytes_per_photo(self) -> int:
        return int(np.prod(self.acts.shape[1:])) * 2


def cache_name(prep: Preprocess, dataset: str, split: str, split_block: int) -> str:
    """Stem of the activation cache: the grid and output stride do not enter (they act above the split)."""
    return f"{dataset}-{split}-{prep.encoder}-{prep.image_size}px-act{split_block}"


def lower_fingerprint(encoder: Encoder) -> str:
    """Hash of the weights that make the cached activations (stem and blocks below the split) and of
    the ImageNet head that made the cached logits."""
    net, h = encoder.backbone, hashlib.sha1()
    keep = ("_conv_stem.", "_bn0.", "_fc.") + tuple(f"_blocks.{i}." for i in range(encoder.split_block))
    for name, t in sorted(net.state_dict().items()):
        if name.startswith(keep):
            h.update(name.encode())
            h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def teacher_encoder(encoder: Encoder) -> Encoder:
    """A freshly built pretrained encoder like `encoder` (same name, grid, stride), in eval mode: the
    source of the cached ImageNet logits, whatever the passed encoder's top holds. A ValueError when the
    passed encoder's lower stages (what the cache stores) are not the pretrained ones."""
    teacher = Encoder(encoder.name, True, encoder.grid_size, encoder.output_stride).eval()
    if lower_fingerprint(teacher) != lower_fingerprint(encoder):
        raise ValueError(f"the lower stages of this {encoder.name} are not its pretrained ImageNet weights; the "
                         "activation cache (model.tune_stages) freezes them at those: build the model with "
                         "model.pretrained=true, or start from a file whose lower stages were never tuned")
    return teacher


@lru_cache(maxsize=4)
def _teacher_fingerprint(name: str, grid_size: int, output_stride: int) -> str:
    teacher = Encoder(name, True, grid_size, output_stride)
    h = hashlib.sha1()
    for key, t in sorted(teacher.backbone.state_dict().items()):
        h.update(key.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _key(encoder: Encoder, prep: Preprocess, records: Sequence[ImageRecord], flip: bool) -> dict:
    ids = hashlib.sha1("\n".join(f"{r.image_id}\t{r.path.name}" for r in records).encode()).hexdigest()[:16]
    return {"version": VERSION, "encoder": encoder.name, "image_size": prep.image_size,
            "split_block": encoder.split_block, "weights": lower_fingerprint(encoder), "images": ids,
            "n": len(records), "flip": flip,
            "teacher": _teacher_fingerprint(encoder.name, encoder.grid_size, encoder.output_stride)}


def _paths(cache_dir: str | Path, name: str, records: Sequence[ImageRecord]) -> dict[str, Path]:
    """The cache's files, named by what they hold like the feature caches (cache_writer.cache_base): `name`, or
    `name` + a hash of the photos' folders when the cache of that name holds another folder's photos."""
    base = cache_base(cache_dir, name, records)
    name = base.name
    return {"meta": base.with_suffix(".json"), "acts": base.with_suffix(".npy"),
            "flipped": base.parent / f"{name}-flip.npy", "logits": base.parent / f"{name}-logits.npy"}


def open_activations(cache_dir: str | Path, name: str, encoder: Encoder, prep: Preprocess,
                     records: Sequence[ImageRecord], flip: bool) -> ActivationCache | None:
    """The cache for exactly these images, lower weights and flip setting, or None. A cache built with
    flips serves a run without them too."""
    paths = _paths(cache_dir, name, records)
    if not paths["meta"].is_file():
        return None
    try:
        meta = json.loads(paths["meta"].read_text())
    except json.JSONDecodeError:
        return None
    key = meta.get("key", {})
    if {**key, "flip": flip} != _key(encoder, prep, records, flip) or (flip and not key.get("flip")):
        return None
    try:
        acts = np.load(paths["acts"], mmap_mode="r")
        flipped = np.load(paths["flipped"], mmap_mode="r") if key.get("flip") else None
        logits = np.load(paths["logits"], mmap_mode="r")
    except (ValueError, OSError):  # missing, truncated or corrupt: rebuild rather than fail
        return None
    if acts.shape[0] != len(records) or logits.shape[0] != len(records):
        return None
    return ActivationCache(acts, flipped if flip else None, logits, {r.image_id: i for i, r in enumerate(records)},
                           meta.get("missing", []), paths["acts"])


@torch.no_grad()
def build_activations(cache_dir: str | Path, name: str, encoder: Encoder, prep: Preprocess,
                      records: Sequence[ImageRecord], flip: bool, device: torch.device | str = "cpu",
                      batch_size: int = 32, num_workers: int = 2, log: Callable[[str], None] = print,
                      progress: bool = True) -> ActivationCache:
    """Open the matching cache or (re)build it; the .json is written last, so an interrupted build is
    never mistaken for a finished one. `encoder` must hold the pretrained weights below the split."""
    cache = open_activations(cache_dir, name, encoder, prep, records, flip)
    if cache is not None:
        return cache
    paths = _paths(cache_dir, name, records)
    teacher = teacher_encoder(encoder).to(device)
    encoder = encoder.eval().to(device)
    loader = photo_loader(records, prep, batch_size, num_workers)
    views = ["acts", "flipped"] if flip else ["acts"]
    with torch.no_grad():  # what enters the split block for one photo: (1, C, h, w)
        probe = encoder.below_split(torch.zeros(1, 3, prep.image_size, prep.image_size, device=device))
    shape = (len(records), *probe.shape[1:])  # (N, C, h, w)
    K = encoder.backbone._fc.out_features
    needed = len(views) * int(np.prod(shape)) * 2 + len(records) * 2 * K * 2 + 3 * 4096

    def encode(temps: dict[str, Path]) -> np.ndarray:
        seen, logits = _encode_into(temps, shape, views, encoder, teacher, loader, device, f"encoding {name}", progress)
        np.save(temps["logits"], logits)
        return seen

    arrays = {w: paths[w] for w in [*views, "logits"]}
    write_cache(paths["meta"], arrays, needed, encode, _key(encoder, prep, records, flip), records,
                ("activation", "encoder/image list/flip setting"), log)
    cache = open_activations(cache_dir, name, encoder, prep, records, flip)
    assert cache is not None
    return cache



def _encode_into(tmps: dict[str, Path], shape: tuple[int, ...], views: list[str], encoder: Encoder,
                 teacher: Encoder, loader: DataLoader, device: torch.device | str, desc: str, progress: bool
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Run the lower stages on every photo (and its flip) into new float16 memory maps at tmps[view]
    (disk space reserved first); (which rows were filled (N,) bool, the PRETRAINED teacher's logits (N, 2, K))."""
    from tqdm import tqdm

    head = teacher.backbone._fc
    outs = {}
    for w in views:
        outs[w] = np.lib.format.open_memmap(tmps[w], mode="w+", dtype=np.float16, shape=shape)  # (N, C, h, w)
        reserve(tmps[w], outs[w].offset + outs[w].nbytes)
    seen = np.zeros(shape[0], dtype=bool)
    logits = np.zeros((shape[0], 2, head.out_features), dtype=np.float16)
    for batch in tqdm(loader, desc=desc, disable=not progress, unit="batch"):
        if not batch:
            continue
        x = torch.stack([s[0] for s in batch]).to(device).contiguous(memory_format=torch.channels_last)
        idx = [s[1] for s in batch]
        for v, view in enumerate(views):
            a = encoder.below_split(x if view == "acts" else x.flip(-1))  # (b, C, h, w)
            outs[view][idx] = a.float().cpu().numpy().astype(np.float16)
            pooled = teacher.backbone.upper(a, encoder.split_block).mean((2, 3))  # (b, 1280): the PRETRAINED top
            logits[idx, v] = head(pooled).float().cpu().numpy().astype(np.float16)  # (b, K)
        seen[idx] = True
    if not seen.any():
        raise ValueError(f"no image of {desc.removeprefix('encoding ')} could be read")
    for w in views:
        outs[w].flush()
    del outs
    return seen, logits
