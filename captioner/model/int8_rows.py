"""The "int8" precision: the decoder step's large products in int8, each row of activations with its own scale.

    y = x W^T + b      W ~ diag(s) Q: Q int8 in [-127, 127], s_o = max_k |W_ok| / 127 (per output channel, at load)
                       x_n ~ t_n p_n: p_n int8, t_n = max_k |x_nk| / 127 (each row its own scale, at each call)
    y_no ~ t_n s_o (sum_k p_nk Q_ok) + b_o                                   (the sums in int32: torch._int_mm)

The layers: W_h (attention), W_hh, L_h, L_z, L_o (the step's products) and W_z (its per-image table), the
weights a beam step reads at every word. With a beam's few rows a product's cost is reading its weight, and int8
weights are a quarter of float32's bytes. L_o's outputs are the words' logits, and the beam's choices are made
among each row's largest ones, where rounding flips close calls: so each row's EXACT_TOP largest int8 logits are
computed again from the float32 weight (Int8Logits: a (EXACT_TOP, E) slice of L_o per row), and only the
normalizer's tail keeps int8's rounding.

Why this form: the integer sums are exact and a row's scale is its own, so a row's result never depends on the
other rows or on the thread count: a photo's caption is the same alone, in a batch and at any thread count, as
in float32 (tests/test_int8_rows.py). torch's dynamic int8 (one activation scale per tensor) makes a photo's
caption depend on the photos batched with it. Why not the encoder's 1x1 convolutions: they have thousands of rows
per photo, and quantizing the rows at each call costs about what the int8 product saves (docs/performance.md).

Where it applies: without autograd, on a CPU, in float32, where this torch's `torch._int_mm` runs on a CPU
(`available`, probed once). Elsewhere (training, a GPU, bfloat16, `plain=True`) a layer is the float32 product
of packed_linear.Linear: each keeps its float32 weight and bias, so its state dict and a saved file are unchanged.
`quantize(decoder)` swaps the six layers of a model a Captioner owns (api.Captioner: the caller's model is never
changed); the int8 copy of a weight is made once per version and address, as the packed copies.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from .packed_linear import Linear, derived

STEP_LAYERS = ("attention.hidden_proj", "gates_hidden", "out_hidden", "out_context", "out_vocab", "gates_context")
EXACT_TOP = 16  # each row's largest logits recomputed in float32 (at least twice the beam's candidates per row)
_int8 = WeakIdKeyDictionary()  # weight -> ((version, address), Q^T (in, out) int8, s (out,))
_available: bool | None = None  # whether this torch runs torch._int_mm on a CPU (probed once)


def available() -> bool:
    """Whether this build of torch multiplies int8 matrices into int32 sums on a CPU (torch._int_mm), checked
    once against the exact integer product on small matrices of a beam's shape (5 rows)."""
    global _available
    if _available is None:
        a = torch.arange(-60, 60, dtype=torch.int8)[:40].view(5, 8)  # (5, 8)
        b = torch.arange(-64, 64, 2, dtype=torch.int8)[:32].view(8, 4)  # (8, 4)
        try:
            got = torch._int_mm(a, b)
        except (RuntimeError, AttributeError, NotImplementedError):
            got = None
        _available = got is not None and torch.equal(got, a.int() @ b.int())
    return _available


def int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) -> (Q^T (in, out) int8, s (out,) float32) with w ~ diag(s) Q: made once per version and address."""
    def make():
        w2 = w.detach().float()  # (out, in)
        s = (w2.abs().amax(1) / 127).clamp_min(1e-12)  # (out,): a zero row keeps a finite scale
        q = torch.round(w2 / s[:, None]).to(torch.int8)  # (out, in)
        return q.t(), s

    return derived(_int8, w, None, make)  # type: ignore[return-value]


def applies(x: torch.Tensor, w: torch.Tensor, plain: bool = False) -> bool:
    """The rule: whether x's product with w runs in int8 (else the float32 product of packed_linear.linear)."""
    return not (plain or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32
                or w.dtype != torch.float32 or x.numel() == 0 or not available())


def rows_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) -> (..., out): the int8 product of the module docstring, each row of x quantized by itself."""
    q_t, s = int8_weight(w)  # (in, out), (out,)
    rows = x.reshape(-1, x.shape[-1])  # (N, in)
    t = rows.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127  # (N, 1): each row its own scale
    p = torch.round(rows / t).to(torch.int8)  # (N, in)
    y = torch._int_mm(p, q_t).float() * (t * s)  # (N, out): exact int32 sums, scaled back
    return (y if bias is None else y + bias).view(*x.shape[:-1], w.shape[0])


class Int8Linear(Linear):
    """A step layer in the "int8" precision: rows_product where `applies`, else Linear's float32 product; the same
    parameters and state dict as nn.Linear."""

    def forward(self, x: torch.Tensor, plain: bool = False) -> torch.Tensor:
        if not applies(x, self.weight, plain):
            return super().forward(x, plain)
        return rows_product(x, self.weight, self.bias)


class Int8Logits(Int8Linear):
    """L_o in the "int8" precision: Int8Linear, with each row's EXACT_TOP largest outputs computed again from the
    float32 weight, so the words a beam chooses among carry float32's logits."""

    def forward(self, x: torch.Tensor, plain: bool = False) -> torch.Tensor:
        if not applies(x, self.weight, plain):
            return super().forward(x, plain)
        y = rows_product(x, self.weight, self.bias)  # (..., V)
        rows, flat = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])  # (N, E), (N, V): views
        top = flat.topk(min(EXACT_TOP, flat.shape[-1]), -1).indices  # (N, K)
        exact = (self.weight[top] * rows[:, None, :]).sum(-1)  # (N, K): each row's own sums, in one order
        flat.scatter_(1, top, exact if self.bias is None else exact + self.bias[top])
        return y


def swap(decoder: nn.Module, name: str, cls: type[Linear]) -> Linear:
    """In place: the decoder's layer `name` as a `cls` (Linear, Int8Linear or Int8Logits) unless it is one already,
    with its own weight and bias tensors (not copies) -> the layer now there."""
    parent_name, _, attr = name.rpartition(".")
    parent = decoder.get_submodule(parent_name)
    layer = getattr(parent, attr)
    if type(layer) is not cls:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = layer.in_features, layer.out_features
        new.weight, new.bias = layer.weight, layer.bias
        setattr(parent, attr, new.train(layer.training))
    return getattr(parent, attr)


def quantize(decoder: nn.Module, on: bool = True) -> None:
    """In place: the decoder's STEP_LAYERS as Int8Linear (L_o as Int8Logits), their int8 weights made now (not in
    the first caption); on=False: back to Linear (float32 products). For a model its caller owns (api.Captioner
    copies one it was given)."""
    for name in STEP_LAYERS:
        layer = swap(decoder, name, (Int8Logits if name == "out_vocab" else Int8Linear) if on else Linear)
        if on and available() and layer.weight.device.type == "cpu":
            int8_weight(layer.weight)


def precision_of(decoder: nn.Module) -> str:
    """"int8" when the decoder's step layers are Int8Linear (quantize), else its parameters' dtype name."""
    if all(isinstance(decoder.get_submodule(n), Int8Linear) for n in STEP_LAYERS):
        return "int8"
    return str(next(decoder.parameters()).dtype).removeprefix("torch.")
