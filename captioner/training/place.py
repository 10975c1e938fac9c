"""Where and how one process of a training run runs: its device, its rank among the run's processes, where its
lines go and whether it draws progress bars. build_run makes it once; everything that needs the group (the
restore, the data's caches, the random states, the loop) takes this one object instead of five arguments.

A module of its own because it is the one name five training modules share, and no user of it is its home: run.py
builds it, but sources.py (the data side, which run.py imports) takes it too, so in run.py it would be a cycle, and
in sources.py "where this process runs" would sit in "what the run reads"."""
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
