"""How a training epoch's batches are read: each rank's share of the bucketed batch order, from a
feature memory map (a slice per batch, no worker processes) or from images (a DataLoader with workers).
"""
from __future__ import annotations

import signal
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader

from .dataset import BucketBatchSampler, FeatureDataset


class RankBatches:
    """Every rank takes its share of the same batch order; all ranks run the same number of steps.
    `start` skips the batches of the epoch already done (mid-epoch resume)."""

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


class FeatureBatches:
    """Cached features are a memory map: reading a batch is a slice, no worker processes needed."""

    def __init__(self, dataset: FeatureDataset, batches: RankBatches, collate_fn: Callable):
        self.dataset, self.batches, self.collate_fn = dataset, batches, collate_fn

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for idx in self.batches:
            yield self.collate_fn([self.dataset[i] for i in idx])


def epoch_loader(dataset: Any, batches: RankBatches, collate_fn: Callable, from_features: bool,
                 num_workers: int, pin_memory: bool, seed: int = 0) -> Any:
    """The iterable of one epoch's batches (starting at batches.start). An image loader takes its workers'
    seeds from a generator of its own (`seed`): the global one stays the training's alone."""
    if from_features:
        return FeatureBatches(dataset, batches, collate_fn)
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collate_fn, num_workers=num_workers,
                      pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed),
                      worker_init_fn=ignore_stop_signals if num_workers else None)


def ignore_stop_signals(_worker: int) -> None:
    """A loader worker leaves Ctrl-C / SIGTERM to the main process, which saves the step and shuts it down
    (a worker killed by the terminal's Ctrl-C would otherwise fail the batch being read)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
