"""Datasets and batching for training.

A sample is one IMAGE with all of its captions: the image (or its cached features) is encoded and
projected once for its ~5 captions. Batches are grouped by caption length (bucketing), and the
collate function sorts captions by length so the decoder never computes a padded position.
"""
from __future__ import annotations

import random
import signal
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from ..images import ImageError, load_image, preprocess
from ..vocab import Vocab
from .records import ImageRecord


@dataclass
class Batch:
    visual: torch.Tensor  # what the encoder sees or saw: (Bi, 3, S, S) images (encoder in the loop) or (Bi, P, D) cached features
    inputs: torch.Tensor  # (B, T) <start> w1 .. w_{n}, padded; B = all captions of the Bi images
    targets: torch.Tensor  # (B, T) w1 .. w_n <end>, padded
    lengths: torch.Tensor  # (B,) predicted tokens per caption, sorted descending
    image_index: torch.Tensor  # (B,) which image each caption belongs to
    teacher_logits: torch.Tensor | None = None  # (Bi, K) pretrained ImageNet logits (activation cache only)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Batch":
        """The batch with `fn` applied to each of its tensors (None stays None)."""
        return Batch(*(t if t is None else fn(t) for t in
                       (self.visual, self.inputs, self.targets, self.lengths, self.image_index, self.teacher_logits)))

    def pin_memory(self) -> "Batch":
        """The batch in page-locked memory: a copy to a GPU with non_blocking=True then overlaps the step."""
        return self._map(torch.Tensor.pin_memory)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))


def encode_captions(records: Sequence[ImageRecord], vocab: Vocab, max_len: int) -> list[list[list[int]]]:
    return [[vocab.encode(c, max_len) for c in r.captions] for r in records]


def collate(samples: list[tuple]) -> Batch:
    """samples: (visual, captions) or (visual, captions, teacher logits) per image. Cached float16 features become
    float32 here, once per batch (torch's conversion of the stack: a NumPy one per row was far slower)."""
    images = torch.stack([s[0] for s in samples]).float()
    caps = [(ids, i) for i, s in enumerate(samples) for ids in s[1]]
    caps.sort(key=lambda c: -len(c[0]))  # descending length: the decoder's batch shrinks over time
    T = len(caps[0][0]) - 1
    inputs = torch.zeros(len(caps), T, dtype=torch.long)
    targets = torch.zeros(len(caps), T, dtype=torch.long)
    for row, (ids, _) in enumerate(caps):
        ids_t = torch.tensor(ids)
        inputs[row, : len(ids) - 1] = ids_t[:-1]
        targets[row, : len(ids) - 1] = ids_t[1:]
    lengths = torch.tensor([len(ids) - 1 for ids, _ in caps])
    image_index = torch.tensor([i for _, i in caps])
    teacher = torch.stack([s[2] for s in samples]) if len(samples[0]) > 2 else None
    return Batch(images, inputs, targets, lengths, image_index, teacher)


class FeatureDataset(Dataset):
    """Cached encoder features (memory-mapped (N, P, D) float16 arrays, one per caption set of the mix) +
    encoded captions. `rows[i]` = (which array, row in it) of sample i; a plain int means the first array."""

    def __init__(self, features: np.ndarray | Sequence[np.ndarray], rows: Sequence[int | tuple[int, int]],
                 captions: list[list[list[int]]]):
        self.parts = [features] if isinstance(features, np.ndarray) else list(features)
        self.rows = [r if isinstance(r, tuple) else (0, r) for r in rows]
        self.captions = captions

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, list[list[int]]]:
        part, row = self.rows[i]
        # a copy (the memmap is read-only) in the cache's float16: collate converts the whole batch at once
        return torch.from_numpy(np.array(self.parts[part][row])), self.captions[i]


class ActivationDataset(Dataset):
    """Cached lower-stage activations (model.tune_stages) + encoded captions + the pretrained logits, over
    one caption set or a mix: `parts` holds each set's (acts (N, C, h, w), flipped or None, logits (N, 2, K))
    memory maps and `rows[i]` = (which part, row in it) of sample i (a plain int: the first part). With a
    flipped copy, each read takes the photo or its mirror image at random, and the captions of a mirror
    image say "right" for "left" and back (`swap`: word id -> word id)."""

    def __init__(self, parts: Sequence[tuple[np.ndarray, np.ndarray | None, np.ndarray]],
                 rows: Sequence[int | tuple[int, int]], captions: list[list[list[int]]],
                 swap: dict[int, int] | None = None):
        self.parts, self.captions, self.swap = list(parts), captions, swap or {}
        self.rows = [r if isinstance(r, tuple) else (0, r) for r in rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, list[list[int]], torch.Tensor]:
        (part, row), caps = self.rows[i], self.captions[i]
        acts, flipped, logits = self.parts[part]
        mirror = flipped is not None and random.random() < 0.5
        x = np.asarray((flipped if mirror else acts)[row], dtype=np.float32)  # (C, h, w)
        if mirror:
            caps = [[self.swap.get(w, w) for w in c] for c in caps]
        return torch.from_numpy(x), caps, torch.from_numpy(np.asarray(logits[row, int(mirror)], dtype=np.float32))


class ImageDataset(Dataset):
    """Images decoded and preprocessed on the fly (encoder in the loop: fine-tuning or augmentation).
    With captions=None it yields (tensor, index) for feature extraction. Unreadable images yield None.
    An augmented image's crop and flip are a function of (seed, epoch, index) alone (set_epoch): whichever loader
    worker reads it, and however far a resumed epoch skipped, it is the image an uninterrupted run trained on."""

    def __init__(self, records: Sequence[ImageRecord], image_size: int, mean, std,
                 captions: list[list[list[int]]] | None = None, augment: bool = False, seed: int = 0):
        self.records, self.captions = list(records), captions
        self.image_size, self.mean, self.std, self.augment = image_size, mean, std, augment
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose augmentations are drawn (before its loader starts: the workers copy the dataset)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        try:
            img = load_image(self.records[i].path)
        except ImageError:
            return None
        if self.augment:  # a str seed is hashed with SHA-512: the same draw in every process and Python
            img = augment(img, random.Random(f"augment/{self.seed}/{self.epoch}/{i}"))
        x = preprocess(img, self.image_size, self.mean, self.std)
        return (x, i) if self.captions is None else (x, self.captions[i])


def augment(img, rng: random.Random):
    """Mild augmentation that keeps most of the scene (captions describe the whole picture): a crop of 80-100%
    of each side and a mirror image half the time, drawn from `rng` alone."""
    from PIL import Image

    w, h = img.size
    scale = rng.uniform(0.8, 1.0)
    cw, ch = int(w * scale), int(h * scale)
    x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
    img = img.crop((x0, y0, x0 + cw, y0 + ch))
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return img


def readable(samples: list) -> list:
    """The samples of a DataLoader batch whose image could be read (ImageDataset yields None for the others)."""
    return [s for s in samples if s is not None]


def collate_skip_missing(samples: list) -> Batch | None:
    """collate() of the readable samples; None when no image of the batch could be read."""
    samples = readable(samples)
    return collate(samples) if samples else None


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of images with similar caption lengths, in a random order that depends only on
    (seed, epoch), so a resumed run replays exactly the same batches. `weights` (per image, default 1):
    an image with weight 2.5 is in an epoch 2 or 3 times (3 with probability 0.5): a mix's sampling weights.
    `min_batches` (train.min_epoch_batches): a small set is passed over several times per epoch (each pass
    shuffled and batched on its own, so no batch holds a photo twice) until the epoch has that many batches."""

    def __init__(self, lengths: Sequence[float], batch_size: int, seed: int = 0, bucket: bool = True,
                 weights: Sequence[float] | None = None, min_batches: int = 0):
        self.lengths, self.batch_size, self.seed, self.bucket = list(lengths), batch_size, seed, bucket
        self.weights = None if weights is None or all(w == 1 for w in weights) else list(weights)
        self.min_batches, self.epoch = min_batches, 0

    def _epoch_images(self, rng: random.Random) -> list[int]:
        if self.weights is None:
            return list(range(len(self.lengths)))
        return [i for i, w in enumerate(self.weights) for _ in range(int(w) + (rng.random() < w - int(w)))]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        rng = random.Random(self.seed * 100_003 + self.epoch)
        batches = self._pass(rng)
        per_pass = len(batches)
        while self.min_batches and len(batches) < self.min_batches and per_pass:
            batches += self._pass(rng)
        rng.shuffle(batches)
        return batches

    def _pass(self, rng: random.Random) -> list[list[int]]:
        """One pass over the epoch's images, in batches."""
        order = self._epoch_images(rng)
        rng.shuffle(order)
        if self.bucket:
            # sort within large random windows: batches are length-homogeneous yet vary per epoch
            window = self.batch_size * 50
            order = [i for k in range(0, len(order), window)
                     for i in sorted(order[k:k + window], key=lambda j: self.lengths[j])]
        return [order[k:k + self.batch_size] for k in range(0, len(order), self.batch_size)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches())

    def __len__(self) -> int:
        if self.weights is not None:  # the epoch's draw decides; the same (seed, epoch) draws the same
            return len(self.batches())
        per_pass = (len(self.lengths) + self.batch_size - 1) // self.batch_size
        return per_pass * max(1, -(-self.min_batches // per_pass)) if per_pass else 0


def ignore_stop_signals(_worker: int) -> None:
    """A loader worker (training's images, the cache builders') leaves Ctrl-C / SIGTERM to the main process,
    which saves the step or removes the half-written cache, says so in one line and shuts the workers down
    (a worker killed by the terminal's group Ctrl-C would otherwise print its traceback and fail the batch)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
