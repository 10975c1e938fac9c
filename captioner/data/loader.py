"""How a training epoch's batches are read: each rank's share of the bucketed batch order, from a
feature memory map (a slice per batch, no worker processes) or from images (a DataLoader with workers).

One item of the order is one optimizer step's photos (train.batch_images x train.accumulate): the sampler
length-sorts, shuffles and shards at that size, and MicroBatches splits each into micro-batches of
train.batch_images, so a run with accumulation k trains on exactly the photos of the run with a k-times batch.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader

from .dataset import BucketBatchSampler, FeatureDataset, ignore_stop_signals


class RankBatches:
    """Every rank takes its share of the same batch order (one batch per optimizer step); all ranks run the same
    number of steps. `start` skips the steps of the epoch already done (mid-epoch resume)."""

    def __init__(self, sampler: BucketBatchSampler, rank: int, world: int):
        self.sampler, self.rank, self.world = sampler, rank, world
        self.start = 0

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.sampler.batches()
        n = len(batches) // self.world
        mine = batches[self.rank * n:(self.rank + 1) * n] if self.world > 1 else batches
        return iter(mine[self.start:])

    def __len__(self) -> int:
        return len(self.sampler) // self.world - self.start


class MicroBatches:
    """A collate function for one optimizer step's samples: the collated micro-batches of `size` samples each, in
    the step's order (train.accumulate; one batch when the step has no more than `size`). A micro-batch whose
    images were all unreadable (collate_skip_missing's None) is left out."""

    def __init__(self, collate_fn: Callable, size: int):
        self.collate_fn, self.size = collate_fn, size

    def __call__(self, samples: list) -> list[Any]:
        parts = (self.collate_fn(samples[k:k + self.size]) for k in range(0, len(samples), self.size))
        return [b for b in parts if b is not None]


class FeatureBatches:
    """Cached features are a memory map: reading a batch is a slice, no worker processes needed. A thread reads
    and collates the next `prefetch` batches (pinned for a GPU) while the step runs, so the device does not wait
    for the disk or the conversion; the batches and their order are exactly those of reading them in turn."""

    def __init__(self, dataset: FeatureDataset, batches: RankBatches, collate_fn: Callable, pin_memory: bool = False,
                 prefetch: int = 2):
        self.dataset, self.batches, self.collate_fn = dataset, batches, collate_fn
        self.pin_memory, self.prefetch = pin_memory, prefetch

    def __len__(self) -> int:
        return len(self.batches)

    def _read(self, idx: list[int]) -> Any:
        batch = self.collate_fn([self.dataset[i] for i in idx])
        if not self.pin_memory or batch is None:
            return batch
        return [b.pin_memory() for b in batch] if isinstance(batch, list) else batch.pin_memory()

    def __iter__(self) -> Iterator[Any]:
        if self.prefetch < 1:
            yield from (self._read(idx) for idx in self.batches)
            return
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        done = threading.Event()  # the epoch's consumer left (end, break, a stop, an error): the reader ends too

        def put(item: tuple[str, Any]) -> bool:
            while not done.is_set():
                try:
                    ready.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def read() -> None:
            try:
                for idx in self.batches:
                    if not put(("batch", self._read(idx))):
                        return
                put(("end", None))
            except BaseException as e:  # handed to the consumer, raised in its thread
                put(("error", e))

        reader = threading.Thread(target=read, name="feature-batches", daemon=True)
        reader.start()
        try:
            while True:
                kind, item = ready.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise item
                yield item
        finally:
            done.set()
            reader.join(timeout=10)


def epoch_loader(dataset: Any, batches: RankBatches, collate_fn: Callable, from_features: bool,
                 num_workers: int, pin_memory: bool, seed: int = 0, micro: int = 0) -> Any:
    """The iterable of one epoch's steps (starting at batches.start): each a list of micro-batches of `micro`
    samples (MicroBatches), or one collated batch where `micro` is 0. An image loader takes its workers'
    seeds from a generator of its own (`seed`): the global one stays the training's alone."""
    collate_fn = MicroBatches(collate_fn, micro) if micro else collate_fn
    if from_features:  # activations draw their mirror images from Python's random state, which a checkpoint saves:
        # read ahead, they would draw before the saved state, so only features (no randomness) are read ahead
        return FeatureBatches(dataset, batches, collate_fn, pin_memory, prefetch=2 if isinstance(dataset, FeatureDataset) else 0)
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collate_fn, num_workers=num_workers,
                      pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed),
                      worker_init_fn=ignore_stop_signals if num_workers else None)
