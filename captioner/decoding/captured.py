"""The GPU's search and encoder recorded once and replayed: one launch for a whole decode, one for an encoder pass.

device_beam.search_on_device queues about 170 small kernels a step and reads nothing back between them, yet on a
GPU its time is the host's: launching them (docs/performance.md has the counts and times); a photo's encoder pass
is a hundred more. A CUDA graph records every kernel of one call, once per shape, and replays them with one
launch (torch.cuda.CUDAGraph): for the search, all max_len steps and the walk back through the trail; for the
encoder, model.encode. A graph reads and writes the memory it was recorded with, so (Recordings.replayed):
- its inputs are static buffers: each call copies its tensors into them before the replay (the search: the
  photos' features and their evidence's penalty, bonus and word table; the encoder: the images);
- its outputs are read (the search's walked hypotheses, device_beam._Finished.walked) or copied (the
  features) before the next replay, under the recordings' lock: two app sessions may caption at once;
- what it does may not depend on a value read from the device: the search runs all max_len steps
  (check_every=None: the same hypotheses, an image that is done adds none). One recording per batch size,
  dtype and settings; evidence with and without its bonus runs different code, so that is in the key too;
- whatever else it reads must stay where it was: the module's parameters and buffers (after an in-place update a
  replay would read the new values without the decoder's word-gate table made from them, so any change of one's
  version or address drops the recordings: weights_key) and the rules' tables (processors._tables, kept for the
  process).

Recording costs one call to warm up (cuBLAS handles, the rules' tables and the allocator, made before the
recording) and one recorded: the first caption of each batch size waits about two eager passes more.
`Captioner(capture=False)` / `captioner-caption --eager` keep everything op by op. A recording that fails (an
operation a graph cannot hold) warns once, and that shape runs op by op: the eager code is the fallback.

A module is recorded where `capture(module)` registered it (api.Captioner on a CUDA GPU: its encoder and decoder;
search.decode and Captioner.encode ask recordings_of). A CPU has no graphs: `Rerun` keeps their contract (record
once with every host read refused, replay into the same outputs), so tests/test_captured.py checks the static
buffers and the capture rules without a GPU.

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
        # thread_local: another thread's CUDA calls meanwhile (an app session captioning) are not this capture's error
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
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
    inputs: tuple[torch.Tensor, ...]  # static: each call's inputs are copied into these
    outputs: tuple[torch.Tensor, ...]  # what each replay writes


def weights_key(module: torch.nn.Module) -> tuple:
    """Where a module's parameters and buffers are and how often each was written: a recording reads them by
    address, and what was made from them (the decoder's word-gate table) only from the values they had."""
    return tuple((t.data_ptr(), t._version) for t in (*module.parameters(), *module.buffers()))


class Recordings:
    """Functions of static inputs recorded once per key and replayed (module doc); at most `limit` recordings
    kept (the least recently used goes); all dropped when the module's weights change (weights_key). `graph`
    makes a recorder: CudaGraph on a GPU, Rerun on a CPU. Hold `lock` from a replay until its outputs are read."""

    def __init__(self, graph: Callable[[], Graph] = CudaGraph, limit: int = LIMIT):
        self.make_graph, self.limit = graph, limit
        self.recorded: OrderedDict[tuple, _Recorded | None] = OrderedDict()  # None: failed, run eagerly
        self.weights: tuple = ()
        self.lock = threading.Lock()

    def replayed(self, key: tuple, inputs: tuple[torch.Tensor, ...], weights: tuple, what: str,
                 make: Callable[[tuple[torch.Tensor, ...]], Callable[[], tuple[torch.Tensor, ...]]]
                 ) -> tuple[torch.Tensor, ...] | None:
        """The outputs of key's recording replayed on `inputs` (copied into its static ones; `make(static inputs)`
        is the function recorded the first time), valid until the next replay; None where it could not be
        recorded (the caller runs eagerly)."""
        if weights != self.weights:  # moved or trained since: every recording reads stale weights
            self.recorded.clear()
            self.weights = weights
        if key not in self.recorded:
            self.recorded[key] = self._record(inputs, what, make)
            while len(self.recorded) > self.limit:
                self.recorded.popitem(last=False)
        self.recorded.move_to_end(key)
        rec = self.recorded[key]
        if rec is None:
            return None
        for static, x in zip(rec.inputs, inputs):
            static.copy_(x)
        rec.graph.replay()
        return rec.outputs

    def _record(self, inputs: tuple[torch.Tensor, ...], what: str,
                make: Callable[[tuple[torch.Tensor, ...]], Callable[[], tuple[torch.Tensor, ...]]]
                ) -> _Recorded | None:
        with torch.inference_mode(False):  # ordinary tensors: later calls may copy into them in either mode
            static = tuple(x.clone() for x in inputs)
        graph = self.make_graph()
        try:
            outputs = graph.record(make(static))
        except (RuntimeError, CaptureError) as e:
            warnings.warn(f"{what} could not be recorded as one graph ({e}); inputs of this shape run it op by op",
                          RuntimeWarning, stacklevel=5)
            return None
        return _Recorded(graph, static, outputs)


def _evidence_inputs(evidence: Evidence | None) -> tuple[torch.Tensor, ...]:
    """What a recorded search reads of a call's evidence: its penalty (B, V), bonus (B, C) and word table (V, C)."""
    return () if evidence is None else (evidence.penalty, evidence.bonus, evidence.words)


def search(recordings: Recordings, decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
           evidence: Evidence | None = None) -> list[list[Hypothesis]]:
    """beam_search_on_device's hypotheses, its search replayed: feats (B, P, D) -> each image's, best first. One
    recording per inputs' shapes, vocabulary ids, settings and evidence bonus (its code path)."""
    inputs = (feats, *_evidence_inputs(evidence))
    key = ("search", tuple((tuple(x.shape), x.dtype, x.device) for x in inputs), ids, repr(settings),
           None if evidence is None else evidence.has_bonus)

    def make(static: tuple[torch.Tensor, ...]) -> Callable[[], tuple[torch.Tensor, ...]]:
        ev = None
        if evidence is not None:  # the same evidence, reading the static copies
            ev = copy.copy(evidence)
            ev.penalty, ev.bonus, ev.words = static[1:]
        return lambda: search_on_device(decoder, static[0], ids, settings, ev, check_every=None).walked()

    with recordings.lock:
        out = recordings.replayed(key, inputs, weights_key(decoder), "the beam search", make)
        if out is not None:
            return read_back(out)  # read before the lock lets another replay write them
    return beam_search_on_device(decoder, feats, ids, settings, evidence)


def encode(recordings: Recordings, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """model.encode(x) replayed: preprocessed images (B, 3, S, S) on the device -> annotation vectors (B, P, D),
    copied out of the recording. One recording per batch shape, dtype and memory layout."""
    key = ("encode", tuple(x.shape), x.dtype, x.device, x.stride())
    with recordings.lock:
        out = recordings.replayed(key, (x,), weights_key(model.encoder), "the encoder",
                                  lambda static: lambda: (model.encode(static[0]),))
        if out is not None:
            return out[0].clone()  # (B, P, D): the next replay writes over the recording's own
    return model.encode(x)


_RECORDINGS: Any = WeakIdKeyDictionary()  # module -> its Recordings (never a reference back to the module)


def capture(module: torch.nn.Module, graph: Callable[[], Graph] = CudaGraph, limit: int = LIMIT) -> Recordings:
    """Run `module` (a Decoder's search: search.decode; an Encoder: api.Captioner.encode) through recordings from
    now on, where its callers ask recordings_of."""
    _RECORDINGS[module] = Recordings(graph, limit)
    return _RECORDINGS[module]


def recordings_of(module: torch.nn.Module) -> Recordings | None:
    """The module's recordings, or None: it runs op by op."""
    return _RECORDINGS.get(module)


def release(module: torch.nn.Module) -> None:
    """Back to op by op; the recordings and their memory are freed."""
    _RECORDINGS.pop(module, None)


__all__ = ["Recordings", "CudaGraph", "Rerun", "NoHostReads", "CaptureError", "capture", "recordings_of", "release",
           "search", "encode", "weights_key", "READS_BACK"]
