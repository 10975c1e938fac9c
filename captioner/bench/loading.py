"""Reading a cached batch as training reads it: the real loader (data/loader.FeatureBatches over a FeatureDataset,
collate's one float16 -> float32 conversion per batch, pinned for a GPU) on a synthetic float16 memory map of the
preset's shape (COCO: 14x14x2048, 784 KiB a photo). Timed cold (the file's pages dropped from the page cache, as
at the start of an epoch over a cache larger than RAM) and warm (in the page cache), per batch, so an epoch
estimate counts loading beside the step."""
from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .synthetic import CAPTIONS_PER_IMAGE, END, START, Preset, sample_lengths
from .timing import Timer


def bench_load_cached(preset: Preset, batch_images: int, n_batches: int, device: torch.device,
                      folder: str | Path | None = None) -> dict[str, Any]:
    """ms per batch of `batch_images` photos (+5 captions each) read from a fresh memory map in `folder` (default:
    the system's temporary folder), cold and warm, and whether the cold read really missed the page cache."""
    from ..data.dataset import BucketBatchSampler, FeatureDataset, collate
    from ..data.loader import FeatureBatches, RankBatches

    rng = np.random.default_rng(3)
    n = batch_images * n_batches
    with tempfile.TemporaryDirectory(dir=folder, prefix="captioner-load-bench-") as tmp:
        path = Path(tmp) / "features.npy"
        _write_features(path, n, preset, rng)
        feats = np.load(path, mmap_mode="r")  # (N, P, D) float16, as data/features.py opens a cache
        lengths = sample_lengths(preset, n * CAPTIONS_PER_IMAGE, rng).reshape(n, CAPTIONS_PER_IMAGE)
        caps = [[[START] + rng.integers(4, preset.vocab, size=int(L)).tolist() + [END] for L in row] for row in lengths]
        dataset = FeatureDataset(feats, list(range(n)), caps)
        sampler = BucketBatchSampler(lengths.mean(1).tolist(), batch_images, seed=3)
        loader = FeatureBatches(dataset, RankBatches(sampler, 0, 1), collate, pin_memory=device.type == "cuda",
                                prefetch=0)  # read in turn: each batch's own cost (training overlaps it with the step)
        cold_dropped = _drop_from_page_cache(path)
        cold = _timed_batches(loader, device)
        warm = _timed_batches(loader, device)
    photo_bytes = preset.regions * preset.feat_dim * 2
    return {"shape": f"{preset.grid}x{preset.grid}x{preset.feat_dim} float16", "batch_images": batch_images,
            "batch_mib": batch_images * photo_bytes / 2**20, "timed_batches": len(cold),
            "cold_ms_median": statistics.median(cold) * 1e3, "warm_ms_median": statistics.median(warm) * 1e3,
            "cold_mib_per_s": batch_images * photo_bytes / 2**20 / statistics.median(cold),
            "cold_measured": cold_dropped}


def _write_features(path: Path, n: int, preset: Preset, rng: np.random.Generator) -> None:
    """n photos of post-ReLU6-like float16 features, written in chunks (a COCO-shaped row is 784 KiB) and synced
    to disk, so the page cache can drop them."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, preset.regions, preset.feat_dim))
    for k in range(0, n, 16):
        rows = min(16, n - k)
        out[k:k + rows] = np.clip(rng.standard_normal((rows, preset.regions, preset.feat_dim), np.float32), 0, 6)
    out.flush()
    del out
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _drop_from_page_cache(path: Path) -> bool:
    """Ask the kernel to forget the file's (clean, synced) pages: the next read comes from the disk, as the first
    epoch's over a cache larger than RAM does. False where the system offers no such advice."""
    if not hasattr(os, "posix_fadvise"):
        return False
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return True


def _timed_batches(loader: Any, device: torch.device) -> list[float]:
    """Seconds per batch: read, collate, pin, and (on a GPU) the copy to the device."""
    timer, times, it = Timer(device), [], iter(loader)
    while True:
        seconds, batch = timer.run(lambda: next(it, None))
        if batch is None:  # the epoch's end
            break
        if device.type == "cuda":
            seconds += timer(lambda: batch.to(device, non_blocking=True))
        times.append(seconds)
    return times
