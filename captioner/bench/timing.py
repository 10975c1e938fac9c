"""Timing and memory measurement shared by the benchmark sections."""
from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .synthetic import truncate


@dataclass
class Counts:
    batch_images: int
    steps: int  # timed steps, fast cached-feature training
    naive_steps: int
    encoder_steps: int
    encoder_batch: int
    warmup: int
    eval_images: int
    naive_eval_images: int
    latency_runs: int
    calib_images: int
    calib_iters: int


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
        """(seconds that fn(*args) takes, device work included; its result)."""
        self.sync()
        t0 = time.perf_counter()
        out = fn(*args)
        self.sync()
        return time.perf_counter() - t0, out

    def __call__(self, fn: Callable[..., Any], *args: Any) -> float:
        return self.run(fn, *args)[0]


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux, bytes on macOS
    return kb / 2**20 if sys.platform == "darwin" else kb / 1024


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def time_steps(step: Callable[[Any], None], batches: list, warmup: int, timer: Timer,
               warmup_steps: int = 0) -> list[float]:
    """Run `warmup` batches untimed (truncated to `warmup_steps` words when > 0: allocator, Adam state
    and kernels warm up without paying for a whole naive step), then time the rest one by one."""
    for b in batches[:warmup]:
        step(truncate(b, warmup_steps) if warmup_steps else b)
    return [timer(step, b) for b in batches[warmup:]]


def rate(times: list[float], items_per_step: float) -> dict[str, float]:
    med = statistics.median(times)
    return {"step_ms_median": med * 1e3, "captions_per_s": items_per_step / med,
            "captions_per_s_mean": items_per_step * len(times) / sum(times), "timed_steps": len(times)}
