"""A linear layer without autograd on a CPU, computed the way this CPU runs it fastest.

Three ways give layer(x) = x W^T + b, equal to float rounding (tests/test_fast_decoding.py):
- plain:   F.linear, PyTorch's default product;
- swapped: (W x^T + b)^T, the same product with the operands swapped (faster for a few rows on some CPUs);
- packed:  oneDNN's product with W reordered once into its blocked layout (the product inductor's frozen
           graphs use on a CPU). The reordered copy is kept beside the weight, not in the module (it cannot be
           copied or saved), and made again when the weight changes (an optimiser step bumps its version) or moves.

Which is fastest depends on the CPU and on how many rows x has (the measurements: docs/performance.md), so
nothing here is tuned to one machine: the first call for a (weight shape, row class) times the three on that
call's input and keeps the fastest for the rest of the process. One choice per process means one input always
gives the same numbers within a process. Row classes: one row (a caption's first step, explain's recurrence),
a few (a photo's beam rows), many (batched beams, the W_z a_i table; timed on their first MANY_TIMED rows).

With autograd, off the CPU or in another dtype, `linear` is F.linear.
`prepare(module, beam)` makes the choices and the packed copies of a module's layers when a model is loaded
(api.Captioner), so the first caption does not pay for them; `chosen()` says what was chosen.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

FEW_ROWS = 16  # up to this many rows a product is "few"; beyond, "many"
MANY_TIMED = 64  # rows the "many" class is timed on
REPEATS = 3  # timed calls per way (after one untimed), the fastest counts

Key = tuple[int, int, bool, str]  # (out, in, has bias, row class)
_chosen: dict[Key, str] = {}  # the way chosen for each key, in this process
_packed = WeakIdKeyDictionary()  # weight -> ((version, address), its oneDNN-reordered copy)
_lock = threading.Lock()


def _plain(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _swapped(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if layer.bias is None:
        return torch.mm(layer.weight, x.t()).t()  # (N, out)
    return torch.addmm(layer.bias.unsqueeze(1), layer.weight, x.t()).t()  # (N, out)


def _packed_product(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed_weight(layer.weight), layer.bias, "none", [],
                                              "")  # (N, out)


WAYS: dict[str, Callable[[nn.Linear, torch.Tensor], torch.Tensor]] = {
    "plain": _plain, "swapped": _swapped, "packed": _packed_product}


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    """w (out, in) reordered for oneDNN's product, made once per weight version and address."""
    key = (w._version, w.data_ptr())
    hit = _packed.get(w)
    if hit is None or hit[0] != key:
        hit = key, torch.ops.mkldnn._reorder_linear_weight(w.detach())
        _packed[w] = hit
    return hit[1]


def row_class(rows: int) -> str:
    return "one" if rows == 1 else "few" if rows <= FEW_ROWS else "many"


def linear(layer: nn.Linear, x: torch.Tensor, plain: bool = False) -> torch.Tensor:
    """layer(x) for x (..., in) -> (..., out), the fastest way on this CPU without autograd (chosen once per
    process for each weight shape and row class; leading dimensions are rows). plain: F.linear (the oracle)."""
    w = layer.weight
    if (plain or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32
            or x.numel() == 0):
        return F.linear(x, w, layer.bias)
    if x.dim() != 2:
        return linear(layer, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], w.shape[0])
    key = (w.shape[0], w.shape[1], layer.bias is not None, row_class(x.shape[0]))
    way = _chosen.get(key)
    if way is None:
        way = _choose(layer, x, key)
    return WAYS[way](layer, x)


def _choose(layer: nn.Linear, x: torch.Tensor, key: Key) -> str:
    """Time every way on x (its first MANY_TIMED rows) and keep the fastest for `key`. A way this torch
    lacks (packed needs oneDNN, which PyTorch has on x86 and some ARM builds) is left out."""
    with _lock:
        if key in _chosen:
            return _chosen[key]
        probe = x[:MANY_TIMED]
        best, best_t = "plain", float("inf")
        for name, way in WAYS.items():
            try:
                way(layer, probe)  # untimed: makes the packed copy, warms the caches
            except (RuntimeError, AttributeError, NotImplementedError):  # not in this build of torch
                continue
            t = min(_seconds(way, layer, probe) for _ in range(REPEATS))
            if t < best_t:
                best, best_t = name, t
        _chosen[key] = best
        return best


def _seconds(way: Callable, layer: nn.Linear, x: torch.Tensor) -> float:
    start = time.perf_counter()
    way(layer, x)
    return time.perf_counter() - start


@torch.no_grad()
def prepare(module: nn.Module, beam: int) -> None:
    """Choose the way of every linear layer in `module` for one row, `beam` rows and many rows, and make the
    packed copies, when it sits on a CPU in float32 (a no-op elsewhere): done at load, not in the first caption."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear) and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32:
            for rows in sorted({1, max(beam, 2), MANY_TIMED}):
                linear(layer, layer.weight.new_zeros(rows, layer.in_features))


def chosen() -> dict[str, str]:
    """What this process chose so far: "out x in [+ bias], row class" -> way (the benchmark prints it)."""
    return {f"{o}x{i}{' + bias' if b else ''}, {c}": way for (o, i, b, c), way in sorted(_chosen.items())}
