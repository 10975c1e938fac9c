"""How a cache made from photos is written: the feature caches (features.py) and the activation caches
(activations.py) share this one protocol, so that an interrupted, killed or disk-full build is never mistaken
for a finished one.

1. What a killed build left behind (NAME.tmpPID.npy, diskspace.CACHE_TEMP) is removed, and so is a stale cache
   of the same name (another encoder, another photo list): its space is freed before the new one is written.
2. The arrays are written into temporary files beside their final names under diskspace.writing (the space is
   reserved first; a full disk says how much to free), then renamed into place; anything that stops the build
   removes the temporary files.
3. The .json that says what the cache holds (its key, the photos that could not be read, their folders) is
   written last and renamed into place too: a cache without it is absent, and is built again.

A cache's files are named by what they hold (cache_base): the recipe's name, and where a cache of that name holds
another folder's photos, that name plus a short hash of this one's folders (photo_folders).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from torch.utils.data import DataLoader

from ..diskspace import CACHE_TEMP, remove_stale_temps, writing
from ..model.encoder import Preprocess
from .dataset import ImageDataset, ignore_stop_signals, readable
from .records import ImageRecord

REBUILT = ": the cache is built again then (nothing else is lost)."


def photo_folders(records: Sequence[ImageRecord]) -> str:
    """8 hex digits naming the folders the photos are in (resolved): what a cache of them holds."""
    folders = sorted({str(p.resolve()) for p in {r.path.parent for r in records}})
    return hashlib.sha1("\n".join(folders).encode()).hexdigest()[:8]


def cache_base(cache_dir: str | Path, name: str, records: Sequence[ImageRecord]) -> Path:
    """The cache's path without suffix: `name`, unless the cache of that name holds another folder's photos
    (its .json's "folders"), then `name` + "-" + photo_folders(records). A cache written before the folders
    were recorded counts as this folder's (its key still checks encoder and image list)."""
    plain, mine = Path(cache_dir) / name, photo_folders(records)
    try:
        held = json.loads(plain.with_suffix(".json").read_text()).get("folders", mine)
    except (OSError, ValueError, AttributeError):  # none yet, or unreadable: this name is free
        held = mine
    return plain if held == mine else Path(cache_dir) / f"{name}-{mine}"


def photo_loader(records: Sequence[ImageRecord], prep: Preprocess, batch_size: int, num_workers: int) -> DataLoader:
    """The photos read and preprocessed in `num_workers` processes, in order; a photo that cannot be read is left
    out of its batch (dataset.readable). The workers ignore Ctrl-C: the main process alone says it stopped."""
    return DataLoader(ImageDataset(records, prep.image_size, prep.mean, prep.std), batch_size=batch_size,
                      num_workers=num_workers, collate_fn=readable,
                      worker_init_fn=ignore_stop_signals if num_workers else None)


def write_cache(meta_path: Path, arrays: dict[str, Path], needed: int,
                encode: Callable[[dict[str, Path]], np.ndarray], key: dict, records: Sequence[ImageRecord],
                stale: tuple[str, str], log: Callable[[str], None]) -> None:
    """Write a cache by the protocol above. arrays: each array's final path; needed: the bytes they take;
    encode(temporary paths) writes every array into its temporary file and returns which photos were read (N,)
    bool; key: what made the cache (the .json's "key"); stale: (the kind of cache, what a cache of the same name
    may differ in), for the line that says it is built again."""

    meta_path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(meta_path.parent, CACHE_TEMP)
    if meta_path.exists():
        log(f"{stale[0]} cache {meta_path} does not match this {stale[1]}: rebuilding")
        meta_path.unlink()
        for path in arrays.values():  # of no use any more: free their space before writing the new ones
            path.unlink(missing_ok=True)
    temps = {name: path.with_suffix(f".tmp{os.getpid()}.npy") for name, path in arrays.items()}
    try:
        with writing(next(iter(arrays.values())), needed, REBUILT):
            seen = encode(temps)
            for name, path in arrays.items():
                os.replace(temps[name], path)
    except BaseException:
        for temp in temps.values():
            temp.unlink(missing_ok=True)
        raise
    missing = [records[i].image_id for i in np.flatnonzero(~seen)]
    if missing:
        log(f"WARNING: {len(missing)} image(s) could not be read and are skipped: {', '.join(missing[:20])}"
            + (" ..." if len(missing) > 20 else ""))
    temp_meta = meta_path.with_suffix(".json.tmp")
    with writing(meta_path, 4096, REBUILT):
        temp_meta.write_text(json.dumps({"key": key, "missing": missing, "folders": photo_folders(records)}))
        os.replace(temp_meta, meta_path)
