"""The GPU's search and encoder recorded once and replayed: a few launches for a whole decode, one for an encoder
pass.

device_beam's search queues about 170 small kernels a step and reads nothing back between them, yet on a GPU its
time is the host's: launching them (docs/performance.md has the counts and times); a photo's encoder pass is a
hundred more. A CUDA graph records every kernel of a call once per shape and replays them with one launch
(torch.cuda.CUDAGraph). The encoder is one graph (model.encode). The search is recorded in chunks of steps
(CHECKS: to step 12, 16, 20, 24, then max_len), each chunk a function from one device_beam.State to the next, and
after each chunk the walk back through the trail: a call replays chunks until no photo searches (one read of
`active.any()` a chunk), then that chunk's walk. So a caption that ends by step 12 costs two launches and no
step past its chunk, where one graph of all max_len steps (30 for the bundled model) would run every step.
A graph reads and writes the memory it was recorded with, so (Recordings.run):
- its inputs are static buffers: each call copies its tensors into them before the replay (the search: the
  photos' features and their evidence's ruled-out words (the veto), bonus and word table; the encoder: the images);
- its outputs are read (the search's walked hypotheses) or copied (the features) before the next replay, under
  the recordings' lock: two app sessions may caption at once. A chunk's state stays alive and is read by the
  next chunk; the graphs of one search share a memory pool, replayed in the order they were recorded (a prefix
  of the chunks, then one walk), so what one graph frees and a later one reuses is never read across a call;
- what a chunk does may not depend on a value read from the device: the reads are between chunks. One recording
  per batch size, dtype and settings; evidence with and without its bonus runs different code, so that is in
  the key too. A batch is padded (`bucket`: to the next power of two up to 16, then to the next multiple of 16; its
  last photo repeated, the padded results dropped), so a caller's every batch size makes few recordings;
- whatever else it reads must stay where it was: the module's parameters and buffers (after an in-place update a
  replay would read the new values without the decoder's word-gate table made from them, so any change of one's
  version or address drops the recordings: weights_key) and the rules' tables (rules.tables_of, kept for the
  process).

Recording costs each graph one warm-up run (cuBLAS handles, the rules' tables and the allocator, made before the
recording) and its recording, and each chunk is replayed once as it is recorded (the next one's warm-up reads
real values): the first caption of each padded batch size waits about three eager searches and two encoder
passes more.
`Captioner(capture=False)` / `captioner-caption --eager` keep everything op by op. A recording that fails (an
operation a graph cannot hold) warns once, and that shape runs op by op: the eager code is the fallback.

Recordings belong to whoever made them, never to the module: a Captioner on a CUDA GPU makes its own (`recorded()`:
a Recorded of its encoder's and its decoder's), holds them in its decoding.resources.Resources and passes them to
what runs the module (Captioner.encode; search.decode through captions.decode_photos). So another Captioner on the
same model, recorded or op by op, never changes this one's. A CPU has no graphs: `Rerun` keeps their contract
(record once with every host read refused, replay into the same outputs), so tests/test_captured.py checks the
static buffers, the chunks and the capture rules without a GPU.

Legend: B images, K beams, P regions, D feature size, V vocabulary, C evidence categories.
"""
from __future__ import annotations

import copy
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from torch.utils._pytree import tree_leaves

import torch
from torch.overrides import TorchFunctionMode

from ..config import DecodeConfig
from ..model.decoder import Decoder
from ..vocab import SpecialIds
from .device_beam import Search, State, beam_search_on_device, read_back
from .evidence import Evidence
from .hypotheses import Hypothesis
from .rules import Rules

# the calls that make the host wait for a device value or a data-dependent shape, and those that copy host data
# to the device (a graph can record neither: the copy would be replayed from the host memory of the first call)
READS_BACK = frozenset({"item", "tolist", "cpu", "numpy", "nonzero", "argwhere", "masked_select", "equal",
                        "is_nonzero", "__bool__", "__int__", "__float__", "__index__"})
FROM_HOST = frozenset({"tensor", "as_tensor", "from_numpy"})
LIMIT = 8  # shapes kept recorded (each holds its own memory pool); the least recently used goes first
ENCODER_LIMIT = 4  # batch sizes whose encoder pass stays recorded (each holds its activations' memory)
# the steps after which a recorded search reads whether any photo still searches (then max_len): most captions
# end by the first, a batch's last by the second or third (docs/performance.md)
CHECKS = (12, 16, 20, 24)


class CaptureError(RuntimeError):
    """An operation a graph cannot record: a read of a device value on the host, or host data copied in."""


class NoHostReads(TorchFunctionMode):
    """Raises CaptureError at the first call in the block that reads a value back (READS_BACK) or makes a tensor
    of host data (FROM_HOST)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS_BACK:
            raise CaptureError(f"{name} reads a device value on the host while recording")
        if name in FROM_HOST:
            raise CaptureError(f"torch.{name} copies host data to the device while recording")
        return func(*args, **(kwargs or {}))


class Graph(Protocol):
    def record(self, fn: Callable[[], Any]) -> Any: ...

    def replay(self) -> None: ...


def _leaves(out: Any) -> list[torch.Tensor]:
    """The tensors of what a recorded function returned: a search State's, or a tuple's."""
    return list(out.tensors()) if isinstance(out, State) else tree_leaves(out)


class CudaGraph:
    """torch.cuda.CUDAGraph: `record` warms fn up on a side stream (lazy handles and caches made outside the
    recording, as PyTorch asks), then records it; its outputs hold each replay's results. Graphs made with the same
    `pool` share their memory: the graphs of one recording, replayed in the order they were recorded."""

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
        # thread_local: another thread's CUDA calls meanwhile (an app session captioning) are not this capture's error
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class Rerun:
    """A graph's contract where there is none (a CPU): `record` warms fn up as CudaGraph does, then runs it with
    every host read and host copy refused (NoHostReads) and keeps its outputs; `replay` runs fn again and writes
    the results into those outputs. What fn reads besides the static inputs and the outputs of the graphs before it
    shows up as a wrong answer here as it would on a GPU."""

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
    """Where a module's parameters and buffers are and how often each was written: a recording reads them by
    address, and what was made from them (the decoder's word-gate table) only from the values they had."""
    return tuple((t.data_ptr(), t._version) for t in (*module.parameters(), *module.buffers()))


@dataclass
class _Entry:
    inputs: tuple[torch.Tensor, ...]  # static: each call's inputs are copied into these
    recording: Any  # what the caller's `record` made; its run() replays it


class Recordings:
    """A module's calls recorded once per key and replayed (module doc); at most `limit` recordings kept (the
    least recently used goes); all dropped when the module's weights change (weights_key). `graph` makes the
    recorders: CudaGraph on a GPU, Rerun on a CPU."""

    def __init__(self, graph: Any = CudaGraph, limit: int = LIMIT):
        self.make_graph, self.limit = graph, limit
        self.recorded: OrderedDict[tuple, _Entry | None] = OrderedDict()  # None: failed, run op by op
        self.weights: tuple = ()
        self.lock = threading.Lock()

    def run(self, key: tuple, inputs: tuple[torch.Tensor, ...], weights: tuple, what: str,
            record: Callable[[tuple[torch.Tensor, ...], Callable[[], Graph]], Any],
            take: Callable[[Any], Any] = lambda out: out) -> Any | None:
        """key's recording run on `inputs` (copied into its static inputs) -> take(what its run() returns), under
        the lock (two callers never replay into the same outputs: `take` reads or copies them). The first time,
        `record(static inputs, new_graph)` makes it (its graphs from new_graph share one memory pool); None where it
        could not be recorded (the caller runs op by op)."""
        with self.lock:
            if weights != self.weights:  # moved or trained since: every recording reads stale weights
                self.recorded.clear()
                self.weights = weights
            if key not in self.recorded:
                self.recorded[key] = self._record(inputs, what, record)
                while len(self.recorded) > self.limit:
                    self.recorded.popitem(last=False)
            self.recorded.move_to_end(key)
            entry = self.recorded[key]
            if entry is None:
                return None
            for static, x in zip(entry.inputs, inputs):
                static.copy_(x)
            return take(entry.recording.run())

    def _record(self, inputs: tuple[torch.Tensor, ...], what: str,
                record: Callable[[tuple[torch.Tensor, ...], Callable[[], Graph]], Any]) -> _Entry | None:
        with torch.inference_mode(False):  # ordinary tensors: later calls may copy into them in either mode
            static = tuple(x.clone() for x in inputs)
        pool = self.make_graph.new_pool()
        try:
            return _Entry(static, record(static, lambda: self.make_graph(pool)))
        except (RuntimeError, CaptureError) as e:
            warnings.warn(f"{what} could not be recorded as CUDA graphs ({e}); inputs of this shape run it op by op",
                          RuntimeWarning, stacklevel=5)
            return None


@dataclass
class _Once:
    """One graph and its outputs: run() replays it and returns its first output (the next replay writes over it)."""
    graph: Graph
    outputs: tuple[torch.Tensor, ...]

    def run(self) -> torch.Tensor:
        self.graph.replay()
        return self.outputs[0]


@dataclass
class _Chunks:
    """A search recorded chunk by chunk (CHECKS): each chunk's graph with the state it writes, and after each the
    walk back through the trail with its outputs. run() replays chunks until no photo searches (one read a chunk),
    then that chunk's walk, and reads the hypotheses."""
    chunks: list[tuple[Graph, State]]
    walks: list[tuple[Graph, tuple[torch.Tensor, ...]]]

    def run(self) -> list[list[Hypothesis]]:
        for k, (graph, state) in enumerate(self.chunks):
            graph.replay()
            if state.capped or not bool(state.active.any()):  # the one read a chunk
                break
        walk, outputs = self.walks[k]
        walk.replay()
        return read_back(outputs)


def chunk_sizes(max_len: int) -> list[int]:
    """The steps of each recorded chunk: up to each of CHECKS below max_len, then to max_len."""
    ends = [c for c in CHECKS if c < max_len] + [max_len]
    return [b - a for a, b in zip([0] + ends[:-1], ends)]


def _record_search(search: Search, new_graph: Callable[[], Graph]) -> _Chunks:
    """Each chunk recorded from the state the one before writes (and replayed at once, so the next one's warm-up
    reads real values), and the walk after each."""
    chunks, walks, state = [], [], None
    for size in chunk_sizes(search.T):
        graph = new_graph()
        before = state
        state = graph.record(lambda before=before, size=size:  # (bound now: a Rerun calls it again later)
                             search.advance(search.start() if before is None else before, size))
        graph.replay()
        chunks.append((graph, state))
        walk = new_graph()
        walks.append((walk, walk.record(state.walked)))
        if state.capped:
            break
    return _Chunks(chunks, walks)


def bucket(n: int) -> int:
    """The batch size a batch of n photos is recorded at: the next power of two up to 16, then the next multiple
    of 16 (evaluation's 100 photos: 112, not 128), so that a caller's every batch size makes few recordings (each
    costs a few eager passes to make) and pads little."""
    return 1 << max(n - 1, 0).bit_length() if n <= 16 else -(-n // 16) * 16


def _padded(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (B, ...) with its last row repeated to n rows: a padded photo is searched or encoded like the last one,
    independently of the others, and its results are dropped."""
    return x if len(x) == n else torch.cat([x, x[-1:].expand(n - len(x), *x.shape[1:])])


def _evidence_inputs(evidence: Evidence | None, n: int) -> tuple[torch.Tensor, ...]:
    """What a recorded search reads of a call's evidence, padded to n photos: its ruled-out words (n, V) bool (the
    veto), bonus (n, C) and word table (V, C)."""
    return () if evidence is None else (_padded(evidence.ruled_out, n), _padded(evidence.bonus, n), evidence.words)


def search(recordings: Recordings, decoder: Decoder, feats: torch.Tensor, ids: SpecialIds, settings: DecodeConfig,
           rules: Rules | None = None) -> list[list[Hypothesis]]:
    """beam_search_on_device's hypotheses, its search replayed: feats (B, P, D) -> each image's, best first. One
    recording per padded batch size (bucket), dtype, vocabulary ids, settings, rules and evidence bonus (its code
    path)."""
    B, rules = len(feats), rules or Rules(ids, settings)
    evidence = rules.evidence
    inputs = (_padded(feats, bucket(B)), *_evidence_inputs(evidence, bucket(B)))
    key = ("search", tuple((tuple(x.shape), x.dtype, x.device) for x in inputs), ids, repr(settings), rules.rules,
           None if evidence is None else evidence.has_bonus)

    def record(static: tuple[torch.Tensor, ...], new_graph: Callable[[], Graph]) -> _Chunks:
        ev = None
        if evidence is not None:  # the same evidence, reading the static copies
            ev = copy.copy(evidence)
            ev.ruled_out, ev.bonus, ev.words = static[1:]
        with torch.no_grad():
            return _record_search(Search(decoder, static[0], ids, settings, rules.with_evidence(ev)), new_graph)

    with torch.no_grad():
        found = recordings.run(key, inputs, weights_key(decoder), "the beam search", record, lambda out: out[:B])
    return found if found is not None else beam_search_on_device(decoder, feats, ids, settings, rules)


def encode(recordings: Recordings, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """model.encode(x) replayed: preprocessed images (B, 3, S, S) on the device -> annotation vectors (B, P, D),
    copied out of the recording. One recording per padded batch size (bucket), dtype and memory layout."""
    def record(static: tuple[torch.Tensor, ...], new_graph: Callable[[], Graph]) -> _Once:
        graph = new_graph()
        return _Once(graph, graph.record(lambda: (model.encode(static[0]),)))

    B, padded = len(x), _padded(x, bucket(len(x)))
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):  # as Captioner.encode lays images out
        padded = padded.contiguous(memory_format=torch.channels_last)
    key = ("encode", tuple(padded.shape), padded.dtype, padded.device, padded.stride())
    with torch.no_grad():
        feats = recordings.run(key, (padded,), weights_key(model.encoder), "the encoder", record,
                               lambda out: out[:B].clone())  # (B, P, D): the next replay writes over the recording's
    return feats if feats is not None else model.encode(x)


@dataclass(frozen=True)
class Recorded:
    """One owner's recordings (a Captioner's, in its decoding.resources.Resources): its encoder's passes (`encode`)
    and its decoder's searches (`search`); None runs that one op by op."""

    encoder: Recordings | None = None
    search: Recordings | None = None


EAGER = Recorded()  # nothing recorded: everything op by op


def recorded(graph: Any = CudaGraph) -> Recorded:
    """Fresh recordings of an encoder (ENCODER_LIMIT shapes) and a decoder's search (LIMIT), made by `graph`: each
    shape is recorded at its first call."""
    return Recorded(Recordings(graph, ENCODER_LIMIT), Recordings(graph, LIMIT))


__all__ = ["Recordings", "Recorded", "EAGER", "CudaGraph", "Rerun", "NoHostReads", "CaptureError", "recorded",
           "search", "encode", "bucket", "chunk_sizes", "weights_key", "READS_BACK", "CHECKS"]
