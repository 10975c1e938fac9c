"""What a caption costs the device in launches and waits, counted rather than timed (`captioner-benchmark --only
launches`): on a GPU each aten op is a kernel launch and each read of a value a wait that drains the queue, so these
counts are what a CPU can say about the GPU's pace.

    ops     every aten op dispatched (TorchDispatchMode)
    kernels the ops that compute (ops less views: view, slice, select, unsqueeze, expand ... change a tensor's
            shape metadata and launch nothing on a GPU)
    syncs   the ops that read a value or a data-dependent shape back: _local_scalar_dense (.item(), float()),
            nonzero, equal, is_nonzero
    reads   every tolist / item / cpu / numpy call from captioner's code: on a CPU tensor the dispatcher never sees
            them (no op), on a GPU each is a transfer that waits

Counted for one caption of a photo already read (Photo.caption) and for caption_batch of up to BATCH photos, reading
included; with `device_search` the CPU runs the GPU's search (decoding/device_beam.py) as a GPU would, and with
`captured` that search recorded and replayed (decoding/device_beam.py) as a CUDA graph is: one launch (OneLaunch).
On a GPU a replayed graph dispatches no aten op, so the same counts there hold the graph as none.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..decoding import device_beam as recording
from ..model.graphs import Recordings
from ..model.graphs import Rerun

SYNCS = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default",
                   "aten.is_nonzero.default"})
READS = ("tolist", "item", "cpu", "numpy")
BATCH = 32
PACKAGE = str(Path(__file__).resolve().parents[1])


class Dispatched(TorchDispatchMode):
    """ops, kernels and syncs dispatched inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.kernels = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.kernels += not getattr(func, "is_view", False)
        self.syncs += str(func) in SYNCS
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted_reads() -> Iterator[list[int]]:
    """Counts, in a one-element list, the READS calls made on tensors from captioner's own code in the block."""
    count = [0]
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrapped(name: str):
        original = originals[name]

        def read(self, *args, **kwargs):
            count[0] += sys._getframe(1).f_code.co_filename.startswith(PACKAGE)
            return original(self, *args, **kwargs)
        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, wrapped(name))
        yield count
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class OneLaunch(Rerun):
    """A recorded search (decoding/device_beam.py) replayed on a CPU and counted as a GPU counts a CUDA graph: one
    launch, whatever it runs (the ops it reruns here reach no counter)."""
    launched = 0

    def replay(self) -> None:
        with _disable_current_modes():
            super().replay()
        OneLaunch.launched += 1


@contextlib.contextmanager
def device_search(enabled: bool, recorded: Any = None) -> Iterator[None]:
    """With enabled, decoding on a CPU takes the GPU's fixed-shape search (search.decode picks it off the CPU).
    With `recorded` (a Captioner) too, the search and that Captioner's encoder are recorded and replayed as one
    launch each, as on a GPU (decoding/device_beam.py, over OneLaunch)."""
    from ..decoding import device_beam, search

    cpu_search = search.beam_search
    if enabled or recorded is not None:
        searches = Recordings(OneLaunch)
        search.beam_search = lambda decoder, feats, ids, settings, rules=None: \
            recording.search(searches, decoder, feats, ids, settings, rules) if recorded is not None else \
            device_beam.beam_search_on_device(decoder, feats, ids, settings, rules)
    held = None if recorded is None else recorded.resources
    if held is not None:  # the Captioner's encoder recorded for the block: its own recordings, put back after
        recorded.resources = dataclasses.replace(held, recordings=dataclasses.replace(
            held.recordings, encoder=Recordings(OneLaunch)))
    try:
        yield
    finally:
        search.beam_search = cpu_search
        if held is not None:
            recorded.resources = held


def count(work) -> dict[str, int]:
    """ops, kernels, syncs and reads of work(); a recorded search's replay counts as one op and one kernel
    (graph_launches says how many)."""
    mode, before = Dispatched(), OneLaunch.launched
    with counted_reads() as reads, mode:
        work()
    graphs = OneLaunch.launched - before
    return {"ops": mode.ops + graphs, "kernels": mode.kernels + graphs, "syncs": mode.syncs, "reads": reads[0],
            "graph_launches": graphs}


def bench_launches(captioner: Any, photos: Sequence[Path], gpu_search: bool = False, captured: bool = False
                   ) -> dict[str, Any]:
    """One caption of photos[0] (read first) and caption_batch of up to BATCH photos -> their counts (module doc),
    each after one uncounted run (the first run builds caches; with `captured`, it records the batch's shape)."""
    batch = [str(p) for p in photos[:BATCH]]
    photo = captioner.read(batch[0])
    with device_search(gpu_search, captioner if captured else None):
        photo.caption()
        one = count(photo.caption)
        captioner.caption_batch(batch if captured else batch[:2])
        many = count(lambda: captioner.caption_batch(batch))
    on_gpu = captioner.device.type != "cpu"
    name = "device_beam recorded" if captured or (on_gpu and captioner.resources.recordings.search is not None) else \
        "device_beam" if gpu_search or on_gpu else "cpu beam"
    return {"search": name, "one_caption": one, "batch_photos": len(batch), "batch": many,
            "batch_ops_per_photo": many["ops"] / len(batch), "batch_kernels_per_photo": many["kernels"] / len(batch)}


def bench_train_launches(preset: Any, batch_images: int = 16) -> dict[str, Any]:
    """One cross-entropy training step on a synthetic batch of `preset`'s shapes (bench/synthetic.py), op by op
    (engine.train_step) and recorded (train.capture: training/captured_step.py, its replay one launch, then
    engine.finish_step): ops, kernels and syncs of each, after one uncounted step (the recorded one records the
    shape there). Adam runs multi-tensor (foreach), as it does on a GPU by default; optimizer_host_reads: the syncs
    of its step alone, reads of its host-side step counters that make a GPU wait for nothing."""
    from ..config import Config
    from ..training.captured_step import CapturedStep
    from ..training.engine import finish_step, train_step
    from ..training.objectives import CrossEntropy
    from .synthetic import make_batches
    from .training import decoder_model

    cfg, cpu = Config(), torch.device("cpu")
    batch = make_batches(preset, 1, batch_images, True, 1)[0]
    model = decoder_model(preset, False).train()
    optimizer = torch.optim.Adam(model.decoder.parameters(), lr=cfg.train.lr, foreach=True)
    objective = CrossEntropy(cfg)
    captured = CapturedStep(model, cfg, cpu, OneLaunch, None)  # float32, as the op-by-op step
    steps = {"op_by_op": lambda: train_step(lambda b: objective(model, b), optimizer, batch, cfg, cpu),
             "recorded": lambda: finish_step(optimizer, captured(batch), cfg)}
    out: dict[str, Any] = {"preset": preset.name, "batch_images": batch_images, "captions": len(batch.inputs),
                           "words": batch.inputs.shape[1]}
    for name, step in steps.items():
        step()
        out[name] = count(step)
    # Adam reads its step counters (host tensors unless capturable): "syncs" on a CPU, no wait for a GPU
    out["optimizer_host_reads"] = count(optimizer.step)["syncs"]
    return out


__all__ = ["Dispatched", "OneLaunch", "count", "counted_reads", "device_search", "bench_launches",
           "bench_train_launches"]
