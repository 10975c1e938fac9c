"""A linear layer applied to a few rows, computed the way this CPU runs it fastest.

MKL's fp32 product of a (K, in) matrix by nn.Linear's (out, in) weight is slow for K ~ 5 rows (a beam
step, a photo's caption); y^T = W x^T + b, the same product with the operands swapped, is faster there and
no slower for 1 or 81 rows (measured: docs/performance.md). No weight is copied or cached: the result is a
transposed view.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

FEW_ROWS = (2, 16)  # rows for which `linear` swaps the operands (CPU)


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for x (N, in) -> (N, out); for FEW_ROWS rows on CPU computed as (W x^T + b)^T."""
    if x.dim() != 2 or not FEW_ROWS[0] <= x.shape[0] <= FEW_ROWS[1] or x.device.type != "cpu":
        return F.linear(x, layer.weight, layer.bias)
    if layer.bias is None:
        return torch.mm(layer.weight, x.t()).t()  # (N, out)
    return torch.addmm(layer.bias.unsqueeze(1), layer.weight, x.t()).t()  # (N, out)
