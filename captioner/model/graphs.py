"""CUDA graphs, and their contract on a CPU: a recorded run replays its ~hundreds of kernel launches as one
(docs/performance.md). Shared by the recorded search and encoder (decoding/device_beam.py), the recorded training
step (training/captured_step.py) and the launch counts (bench/launches.py). A recording reads its inputs from static
buffers and its weights by address (weights_key), and nothing inside it reads the device (NoHostReads); `Rerun`
keeps that contract where there are no graphs.
"""
from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
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


LIMIT = 8  # shapes kept recorded (each holds its own memory pool); the least recently used goes first
ENCODER_LIMIT = 4  # batch sizes whose encoder pass stays recorded (each holds its activations' memory)


@dataclass
class _Entry:
    inputs: tuple[torch.Tensor, ...]  # static: each call's inputs are copied into these
    recording: Any  # what the caller's `record` made; its run() replays it


class Recordings:
    """A module's calls recorded once per key and replayed; the `limit` most recently used kept, all dropped when
    the weights change (weights_key). `graph`: CudaGraph on a GPU, Rerun on a CPU."""

    def __init__(self, graph: Any = CudaGraph, limit: int = LIMIT):
        self.make_graph, self.limit = graph, limit
        self.recorded: OrderedDict[tuple, _Entry | None] = OrderedDict()  # None: failed, run op by op
        self.weights: tuple = ()
        self.lock = threading.Lock()

    def run(self, key: tuple, inputs: tuple[torch.Tensor, ...], weights: tuple, what: str,
            record: Callable[[tuple[torch.Tensor, ...], Callable[[], Any]], Any],
            take: Callable[[Any], Any] = lambda out: out) -> Any | None:
        """key's recording run on `inputs` (copied into its static ones) -> take(its run()) (`take` reads or copies
        the outputs under the lock); the first time `record(static inputs, new_graph)` makes it. None: it could not
        be recorded (the caller runs op by op)."""
        with self.lock:
            if weights != self.weights:  # moved or trained since
                self.recorded.clear()
                self.weights = weights
            if key not in self.recorded:
                with torch.inference_mode(False):  # later calls may copy into them in either mode
                    static = tuple(x.clone() for x in inputs)
                pool = self.make_graph.new_pool()
                try:
                    self.recorded[key] = _Entry(static, record(static, lambda: self.make_graph(pool)))
                except (RuntimeError, CaptureError) as e:
                    warnings.warn(f"{what} could not be recorded as CUDA graphs ({e}); inputs of this shape run it "
                                  "op by op", RuntimeWarning, stacklevel=4)
                    self.recorded[key] = None
                while len(self.recorded) > self.limit:
                    self.recorded.popitem(last=False)
            self.recorded.move_to_end(key)
            entry = self.recorded[key]
            if entry is None:
                return None
            for static, x in zip(entry.inputs, inputs):
                static.copy_(x)
            return take(entry.recording.run())


@dataclass
class _Once:
    """One graph and its outputs: run() replays it and returns its first output."""
    graph: Any
    outputs: tuple[torch.Tensor, ...]

    def run(self) -> torch.Tensor:
        self.graph.replay()
        return self.outputs[0]


def bucket(n: int) -> int:
    """The batch size n photos are recorded at: the next power of two up to 16, then the next multiple of 16."""
    return 1 << max(n - 1, 0).bit_length() if n <= 16 else -(-n // 16) * 16


def pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (B, ...) with its last row repeated to n rows (the padded results are dropped)."""
    return x if len(x) == n else torch.cat([x, x[-1:].expand(n - len(x), *x.shape[1:])])


def encode(recordings: Recordings, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """model.encode(x) replayed: images (B, 3, S, S) -> annotation vectors (B, P, D), copied out."""
    def record(static: tuple[torch.Tensor, ...], new_graph: Callable[[], Any]) -> _Once:
        graph = new_graph()
        return _Once(graph, graph.record(lambda: (model.encode(static[0]),)))

    B, padded = len(x), pad_rows(x, bucket(len(x)))
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):  # as Captioner.encode lays images out
        padded = padded.contiguous(memory_format=torch.channels_last)
    key = ("encode", tuple(padded.shape), padded.dtype, padded.device, padded.stride())
    with torch.no_grad():
        feats = recordings.run(key, (padded,), weights_key(model.encoder), "the encoder", record,
                               lambda out: out[:B].clone())  # (B, P, D)
    return feats if feats is not None else model.encode(x)


@dataclass(frozen=True)
class Recorded:
    """One owner's recordings (a Captioner's Resources) of its encoder and its searches; None: op by op."""
    encoder: Recordings | None = None
    search: Recordings | None = None


EAGER = Recorded()  # nothing recorded: everything op by op


def recorded(graph: Any = CudaGraph) -> Recorded:
    """Fresh recordings of an encoder (ENCODER_LIMIT shapes) and a decoder's search (LIMIT), made by `graph`."""
    return Recorded(Recordings(graph, ENCODER_LIMIT), Recordings(graph, LIMIT))
