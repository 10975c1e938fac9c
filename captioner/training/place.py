"""Where and how one process of a training run runs: its device, its rank among the run's processes, where its
lines go and whether it draws progress bars. build_run makes it once; everything that needs the group (the
restore, the data's caches, the random states, the loop) takes this one object instead of five arguments."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Log = Callable[[str], None]


@dataclass(frozen=True)
class Place:
    """One process of a run. Rank 0 is the main process: it alone writes files and speaks (fit gives the other
    ranks a silent log); with world_size > 1 the processes train one model with DistributedDataParallel."""

    device: torch.device
    rank: int
    world_size: int
    log: Log
    progress: bool  # tqdm bars (the main process's, and the caches' it builds)

    @property
    def main(self) -> bool:
        return self.rank == 0
