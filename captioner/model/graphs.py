"""CUDA graphs, and their contract on a CPU: a recorded run replays its ~hundreds of kernel launches as one
(docs/performance.md). Shared by the recorded search and encoder (decoding/device_beam.py), the recorded training
step (training/captured_step.py) and the launch counts (bench/launches.py). A recording reads its inputs from static
buffers and its weights by address (weights_key), and nothing inside it reads the device (NoHostReads); `Rerun`
keeps that contract where there are no graphs.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

# what a graph cannot record: host reads of a device value or a data-dependent shape, and host data copied in
READS_BACK = frozenset({"item", "tolist", "cpu", "numpy", "nonzero", "argwhere", "masked_select", "equal",
                        "is_nonzero", "__bool__", "__int__", "__float__", "__index__"})
FROM_HOST = frozenset({"tensor", "as_tensor", "from_numpy"})


class CaptureError(RuntimeError):
    """An operation a graph cannot record (READS_BACK, FROM_HOST)."""


class NoHostReads(TorchFunctionMode):
    """CaptureError at the block's first READS_BACK or FROM_HOST call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS_BACK:
            raise CaptureError(f"{name} reads a device value on the host while recording")
        if name in FROM_HOST:
            raise CaptureError(f"torch.{name} copies host data to the device while recording")
        return func(*args, **(kwargs or {}))


def _leaves(out: Any) -> list[torch.Tensor]:
    """A recording's output tensors: its own `tensors()` (a search's State), else its pytree's leaves."""
    return list(out.tensors()) if hasattr(out, "tensors") else tree_leaves(out)


class CudaGraph:
    """torch.cuda.CUDAGraph: `record` warms fn up on a side stream, then records it; its outputs hold each replay's
    results. The graphs of one recording share a `pool`, replayed in the order they were recorded."""

    def __init__(self, pool: Any = None):
        self.pool = pool

    @staticmethod
    def new_pool() -> Any:
        return torch.cuda.graph_pool_handle()

    def record(self, fn: Callable[[], Any]) -> Any:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls meanwhile (an app session) are not this capture's error
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class Rerun:
    """A graph's contract on a CPU: `record` warms fn up, runs it under NoHostReads and keeps its outputs; `replay`
    runs fn again into those outputs. Reading anything but the static inputs and earlier graphs' outputs gives a
    wrong answer here as on a GPU."""

    replays = 0

    def __init__(self, pool: Any = None):
        pass

    @staticmethod
    def new_pool() -> Any:
        return None

    def record(self, fn: Callable[[], Any]) -> Any:
        fn()  # the warm-up: caches made here, as before a CUDA graph's recording
        with NoHostReads(), torch.inference_mode(False):  # outputs a later replay may write in either mode
            self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        with NoHostReads():
            for old, new in zip(_leaves(self.out), _leaves(self.fn())):
                if new is not old:  # (a state's tensors from before the chunk are its own)
                    old.copy_(new)
        self.replays += 1


def weights_key(module: torch.nn.Module) -> tuple:
    """Where a module's parameters and buffers are, and their versions: a recording reads them by address."""
    return tuple((t.data_ptr(), t._version) for t in (*module.parameters(), *module.buffers()))
