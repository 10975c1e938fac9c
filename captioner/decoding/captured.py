"""The GPU's search recorded once and replayed: one launch for a whole decode.

device_beam.search_on_device queues about 170 small kernels a step and reads nothing back between them, yet on a
GPU its time is the host's: launching them (docs/performance.md has the counts and times). A CUDA graph records every kernel of one whole search, all max_len steps and the walk back
through the trail, once per shape, and replays them with one launch (torch.cuda.CUDAGraph). A graph reads and
writes the memory it was recorded with, so:
- its inputs are static buffers: each call copies the photos' features and their evidence (penalty, bonus, word
  table) into them before the replay;
- its outputs (device_beam._Finished.walked) are read back before the next replay, under a lock (two app
  sessions may caption at once);
- what it does may not depend on a value read from the device: the search runs all max_len steps
  (check_every=None: the same hypotheses, an image that is done adds none), recorded once per batch size,
  dtype, settings and evidence shape (evidence with and without its bonus runs different code);
- whatever else it reads must stay where it was: the decoder's parameters (a replay after an in-place update
  would read the new values without the word-gate table made from them, so any change of a parameter's
  version or address drops the graphs: `_weights_key`) and the rules' tables (processors._tables, kept for the
  process).

Recording costs a search to warm up (cuBLAS handles, the rules' tables and the allocator, made before the
recording) and one recorded: the first caption of each batch size waits about two eager searches more.
`Captioner(capture=False)` / `captioner-caption --eager` keep the eager search. A recording that fails (an
operation a graph cannot hold) warns once and that shape stays eager: the eager search is the fallback.

A CPU has no graphs: `Rerun` keeps their contract (record once with every host read refused, replay into the
same outputs), so tests/test_captured.py checks the static buffers and the capture rules without a GPU.

Legend: B images, K beams, P regions, D feature size, V vocabulary, C evidence categories.
"""
from __future__ import annotations

import copy
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from ..config import DecodeConfig
from ..model.decoder import Decoder
from ..vocab import SpecialIds
from .device_beam import beam_search_on_device, read_back, search_on_device
from .evidence import Evidence
from .hypotheses import Hypothesis

# the calls that make the host wait for a device value or a data-dependent shape (a graph cannot record one)
READS_BACK = frozenset({"item", "tolist", "cpu", "numpy", "nonzero", "argwhere", "masked_select", "equal",
                        "is_nonzero", "__bool__", "__int__", "__float__", "__index__"})
LIMIT = 8  # shapes kept recorded (each holds its own memory pool); the least recently used goes first


class CaptureError(RuntimeError):
    """An operation a graph cannot record: a read of a device value on the host."""


class NoHostReads(TorchFunctionMode):
    """Raises CaptureError at the first call in the block that reads a value back (READS_BACK)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS_BACK:
            raise CaptureError(f"{func.__name__} reads a device value on the host while recording")
        return func(*args, **(kwargs or {}))


class Graph(Protocol):
    def record(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]: ...

    def replay(self) -> None: ...


class CudaGraph:
    """torch.cuda.CUDAGraph: `record` warms fn up on a side stream (lazy handles and caches made outside the
    recording, as PyTorch asks), then records it; its outputs hold each replay's results."""

    def record(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class Rerun:
    """A graph's contract where there is none (a CPU): `record` runs fn with every host read refused
    (NoHostReads) and keeps its outputs; `replay` runs fn again and writes the results into those outputs. What
    fn reads besides the static inputs shows up as a wrong answer here as it would on a GPU."""

    replays = 0

    def record(self, fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        with NoHostReads(), torch.inference_mode(False):  # outputs a later replay may write in either mode
            self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        with NoHostReads():
            for old, new in zip(self.out, self.fn()):
                old.copy_(new)
        self.replays += 1


@dataclass
class _Recorded:
    graph: Graph
    inputs: tuple[torch.Tensor, ...]  # static: feats (B, P, D), with evidence its penalty (B, V), bonus (B, C), words (V, C)
    outputs: tuple[torch.Tensor, ...]  # device_beam._Finished.walked's tensors


def _inputs(feats: torch.Tensor, evidence: Evidence | None) -> tuple[torch.Tensor, ...]:
    """What a recorded search reads of this call: the features and the evidence's tensors."""
    return (feats,) if evidence is None else (feats, evidence.penalty, evidence.bonus, evidence.words)


def _key(feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig, evidence: Evidence | None) -> tuple:
    """What a recording is specific to: the inputs' shapes, dtypes and device, the vocabulary's ids, the
    settings, and whether the evidence has a bonus (its code path)."""
    shapes = tuple((tuple(x.shape), x.dtype, x.device) for x in _inputs(feats, evidence))
    return shapes, ids, repr(settings), None if evidence is None else evidence.has_bonus


def _weights_key(decoder: Decoder) -> tuple:
    """Where the decoder's parameters are and how often each was written: a recording reads them by address."""
    return tuple((p.data_ptr(), p._version) for p in decoder.parameters())


class CapturedSearches:
    """device_beam's search recorded per shape and replayed (module doc): `search` is beam_search_on_device's
    hypotheses. `graph` makes a recorder (CudaGraph on a GPU, Rerun on a CPU); at most `limit` shapes are kept."""

    def __init__(self, graph: Callable[[], Graph] = CudaGraph, limit: int = LIMIT):
        self.make_graph, self.limit = graph, limit
        self.recorded: OrderedDict[tuple, _Recorded | None] = OrderedDict()  # None: failed, decoded eagerly
        self.weights: tuple = ()
        self.lock = threading.Lock()

    def search(self, decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
               evidence: Evidence | None = None) -> list[list[Hypothesis]]:
        """feats (B, P, D) -> each image's hypotheses, best first, as beam_search_on_device finds them."""
        with self.lock:
            rec = self._recording(decoder, feats, ids, settings, evidence)
            if rec is None:
                return beam_search_on_device(decoder, feats, ids, settings, evidence)
            for static, x in zip(rec.inputs, _inputs(feats, evidence)):
                static.copy_(x)
            rec.graph.replay()
            return read_back(rec.outputs)  # read before the lock lets another replay write them

    def _recording(self, decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                   evidence: Evidence | None) -> _Recorded | None:
        """This shape's recording (made now if new; None where recording failed)."""
        weights = _weights_key(decoder)
        if weights != self.weights:  # moved or trained since: every recording reads stale weights
            self.recorded.clear()
            self.weights = weights
        key = _key(feats, ids, settings, evidence)
        if key not in self.recorded:
            self.recorded[key] = self._record(decoder, feats, ids, settings, evidence)
            while len(self.recorded) > self.limit:
                self.recorded.popitem(last=False)
            self.weights = _weights_key(decoder)  # the warm-up may have made the word-gate table
        self.recorded.move_to_end(key)
        return self.recorded[key]

    def _record(self, decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
                evidence: Evidence | None) -> _Recorded | None:
        with torch.inference_mode(False):  # ordinary tensors: later calls may copy into them in either mode
            inputs = tuple(x.clone() for x in _inputs(feats, evidence))
        static = None
        if evidence is not None:  # the same evidence, reading the static copies
            static = copy.copy(evidence)
            static.penalty, static.bonus, static.words = inputs[1:]

        def search() -> tuple[torch.Tensor, ...]:
            return search_on_device(decoder, inputs[0], ids, settings, static, check_every=None).walked()

        graph = self.make_graph()
        try:
            outputs = graph.record(search)
        except (RuntimeError, CaptureError) as e:
            warnings.warn(f"the beam search could not be recorded as one graph ({e}); photos of this batch size "
                          "decode eagerly", RuntimeWarning, stacklevel=4)
            return None
        return _Recorded(graph, inputs, outputs)


_SEARCHES: Any = WeakIdKeyDictionary()  # decoder -> its CapturedSearches (never a reference back to the decoder)


def capture(decoder: Decoder, graph: Callable[[], Graph] = CudaGraph, limit: int = LIMIT) -> CapturedSearches:
    """Decode with `decoder` off the CPU through recorded searches from now on (search.decode asks captured_of)."""
    _SEARCHES[decoder] = CapturedSearches(graph, limit)
    return _SEARCHES[decoder]


def captured_of(decoder: Decoder) -> CapturedSearches | None:
    """The decoder's recorded searches, or None: it decodes eagerly."""
    return _SEARCHES.get(decoder)


def release(decoder: Decoder) -> None:
    """Back to the eager search; the recordings and their memory are freed."""
    _SEARCHES.pop(decoder, None)


__all__ = ["CapturedSearches", "CudaGraph", "Rerun", "NoHostReads", "CaptureError", "capture", "captured_of",
           "release", "READS_BACK"]
