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
included; with `device_search` the CPU runs the GPU's search (decoding/device_beam.py) as a GPU would.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


@contextlib.contextmanager
def device_search(enabled: bool) -> Iterator[None]:
    """With enabled, decoding on a CPU takes the GPU's fixed-shape search (search.decode picks it off the CPU)."""
    from ..decoding import device_beam, search

    cpu_search = search.beam_search
    if enabled:
        search.beam_search = lambda decoder, feats, ids, settings, evidence=None: \
            device_beam.beam_search_on_device(decoder, feats, ids, settings, evidence)
    try:
        yield
    finally:
        search.beam_search = cpu_search


def count(work) -> dict[str, int]:
    """ops, kernels, syncs and reads of work()."""
    mode = Dispatched()
    with counted_reads() as reads, mode:
        work()
    return {"ops": mode.ops, "kernels": mode.kernels, "syncs": mode.syncs, "reads": reads[0]}


def bench_launches(captioner: Any, photos: Sequence[Path], gpu_search: bool = False) -> dict[str, Any]:
    """One caption of photos[0] (read first) and caption_batch of up to BATCH photos -> their counts (module doc),
    each after one uncounted run (the first run builds caches)."""
    batch = [str(p) for p in photos[:BATCH]]
    photo = captioner.read(batch[0])
    with device_search(gpu_search):
        photo.caption()
        one = count(photo.caption)
        captioner.caption_batch(batch[:2])
        many = count(lambda: captioner.caption_batch(batch))
    return {"search": "device_beam" if gpu_search or captioner.device.type != "cpu" else "cpu beam",
            "one_caption": one, "batch_photos": len(batch), "batch": many,
            "batch_ops_per_photo": many["ops"] / len(batch), "batch_kernels_per_photo": many["kernels"] / len(batch)}


__all__ = ["Dispatched", "count", "counted_reads", "device_search", "bench_launches"]
