"""A linear layer without autograd on a CPU: oneDNN's product with the weight packed once.

layer(x) = x W^T + b is computed by a fixed rule, never by timing:
- on a CPU, in float32, without autograd, where this torch has oneDNN: oneDNN's product with W reordered once
  into its blocked layout (the product inductor's frozen CPU graphs call). The reordered copy is kept beside the
  weight, not in the module (it cannot be copied or saved), and made again when the weight changes (an optimiser
  step bumps its version) or moves;
- everywhere else (autograd, a GPU, bf16, a torch without oneDNN, `plain=True`): F.linear.

A fixed rule means every process computes the same numbers: the same photo gives bit-identical captions,
log-probs and choice scores in every process and at any thread count (tests/test_fast_decoding.py). The packed
product pays at the beam's few rows and not at one row (the figures: docs/performance.md). `prepare(module)` makes the packed copies of a module's layers when a model is loaded
(api.Captioner), so the first caption does not pay for them; `way()` names the rule's pick on this torch.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

_packed = WeakIdKeyDictionary()  # weight -> ((version, address), its oneDNN-reordered copy)
_has_onednn: bool | None = None  # whether this torch runs the packed product (probed once)


def has_onednn() -> bool:
    """Whether this build of torch has oneDNN's packed product (x86 and some ARM builds do)."""
    global _has_onednn
    if _has_onednn is None:
        try:
            w = torch.ones(2, 2)
            torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), torch.ops.mkldnn._reorder_linear_weight(w), None,
                                               "none", [], "")
            _has_onednn = torch.backends.mkldnn.is_available()
        except (RuntimeError, AttributeError, NotImplementedError):  # not in this build of torch
            _has_onednn = False
    return _has_onednn


def way() -> str:
    """How a float32 CPU product without autograd runs on this torch: "packed" (oneDNN) or "plain" (F.linear)."""
    return "packed" if has_onednn() else "plain"


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    """w (out, in) reordered for oneDNN's product, made once per weight version and address."""
    key = (w._version, w.data_ptr())
    hit = _packed.get(w)
    if hit is None or hit[0] != key:
        hit = key, torch.ops.mkldnn._reorder_linear_weight(w.detach())
        _packed[w] = hit
    return hit[1]


def linear(layer: nn.Linear, x: torch.Tensor, plain: bool = False) -> torch.Tensor:
    """layer(x) for x (..., in) -> (..., out); leading dimensions are rows. plain: F.linear (the oracle)."""
    w = layer.weight
    if (plain or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32
            or w.dtype != torch.float32 or x.numel() == 0 or not has_onednn()):
        return F.linear(x, w, layer.bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (N, in)
    y = torch.ops.mkldnn._linear_pointwise(rows, packed_weight(w), layer.bias, "none", [], "")  # (N, out)
    return y.view(*x.shape[:-1], w.shape[0])


@torch.no_grad()
def prepare(module: nn.Module) -> None:
    """Make the packed copy of every linear layer in `module` that sits on a CPU in float32 (a no-op elsewhere or
    without oneDNN): done at load, not in the first caption."""
    if not has_onednn():
        return
    for layer in module.modules():
        if isinstance(layer, nn.Linear) and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32:
            packed_weight(layer.weight)
