"""Linear layers and 1x1 convolutions without autograd on a CPU: oneDNN's product with the weight packed once.

layer(x) = x W^T + b is computed by a fixed rule, never by timing:
- on a CPU, in float32, without autograd, where this torch has oneDNN: oneDNN's product with W reordered once
  into its blocked layout (the product inductor's frozen CPU graphs call). The reordered copy is kept beside the
  weight, not in the module (it cannot be copied or saved), and made again when the weight changes (an optimiser
  step bumps its version) or moves;
- everywhere else (autograd, a GPU, bf16, a torch without oneDNN, `plain=True`): F.linear.

A pointwise convolution (1x1 kernel, stride 1, ungrouped, no padding: the encoder's expand, project and head
convolutions) is the same product on rows: every pixel of x (B, C, h, w) is a row of C numbers. `pointwise(conv, x,
bn, relu6)` computes it by the same rule, with an eval-mode batch norm after it folded into the packed weight and
bias and relu6 as oneDNN's clamp of the result (elsewhere: F.conv2d, the batch norm, relu6). oneDNN's own
convolution is not used there because it splits its sums over channels by thread count and batch size; the packed
product sums every row in the same order at any thread count and in any batch, and with the batch norms folded in
it is no slower (model/encoder.py; the measurements: docs/performance.md).

A fixed rule means every process computes the same numbers: the same photo gives bit-identical captions,
log-probs and choice scores in every process and at any thread count (tests/test_fast_decoding.py). The packed
product pays at the beam's few rows and not at one row (the figures: docs/performance.md).
`prepare(module, pointwise_layers)` makes the packed copies of a module's linear layers and of the encoder's
pointwise convolutions (batch norms folded in) when a model is loaded (api.Captioner), so the first caption does not
pay for them; `way()` names the rule's pick on this torch.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

_packed = WeakIdKeyDictionary()  # weight -> ((version, address), its oneDNN-reordered copy)
_folded = WeakIdKeyDictionary()  # a convolution's weight -> ((versions, addresses), weight and bias with bn folded in)
_has_onednn: bool | None = None  # whether this torch runs the packed product (probed once)


def has_onednn() -> bool:
    """Whether this build of torch runs oneDNN's packed product in both forms used here (x86 and some ARM builds
    do): the plain product and the clamped one (relu6), each with a bias. The ops are private (torch.ops.mkldnn),
    so both forms are tried once on a small product with known results; where either fails or differs, every
    product here is F.linear (or F.conv2d)."""
    global _has_onednn
    if _has_onednn is None:
        _has_onednn = torch.backends.mkldnn.is_available() and _probe()
    return _has_onednn


def _probe() -> bool:
    """Both forms of the private ops as `linear` and `pointwise` call them, checked against F.linear exactly."""
    x, w, b = torch.tensor([[1.0, -2.0]]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0.5, 12.0])
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        plain = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        clamped = torch.ops.mkldnn._linear_pointwise(x, packed, b, "hardtanh", [0.0, 6.0], "")
    except (RuntimeError, AttributeError, NotImplementedError, TypeError):  # not in this build of torch
        return False
    want = F.linear(x, w, b)  # [[-2.5, 7.0]]: the clamp moves both ends
    return torch.equal(plain, want) and torch.equal(clamped, want.clamp(0.0, 6.0))


def way() -> str:
    """How a float32 CPU product without autograd runs on this torch: "packed" (oneDNN) or "plain" (F.linear)."""
    return "packed" if has_onednn() else "plain"


def _fold(w: torch.Tensor, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, ...) and the eval-mode batch norm after its product or convolution -> (w', b') with
    bn(x w^T) = x w'^T + b' (and bn(conv(x, w)) = conv(x, w') + b')."""
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # (out,)
    return w * scale.view(-1, *[1] * (w.dim() - 1)), bn.bias - bn.running_mean * scale


def key(w: torch.Tensor, bn: nn.BatchNorm2d | None) -> tuple:
    """What a copy made from w (and bn) is valid for: each tensor's version and address."""
    tensors = (w,) if bn is None else (w, bn.weight, bn.bias, bn.running_mean, bn.running_var)
    return tuple((t._version, t.data_ptr()) for t in tensors)


def derived(cache: WeakIdKeyDictionary, w: torch.Tensor, bn: nn.BatchNorm2d | None,
            make: Callable[[], tuple[torch.Tensor | None, ...]]) -> tuple[torch.Tensor | None, ...]:
    """The tensors `make()` derives from w (and bn), kept in `cache` beside w (not in the module: they cannot be
    copied or saved): made again when any of their tensors' version or address has changed (`key`)."""
    k = key(w, bn)
    hit = cache.get(w)
    if hit is None or hit[0] != k:
        hit = k, *make()
        cache[w] = hit
    return hit[1:]


def packed_weight(w: torch.Tensor, bn: nn.BatchNorm2d | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w (out, in), or a pointwise convolution's (out, in, 1, 1), reordered for oneDNN's product, with the bias of
    the batch norm `bn` folded in (None without one): made once per version and address of w and bn's tensors."""
    def make():
        w2, bias = w.detach().flatten(1), None  # (out, in)
        if bn is not None:
            w2, bias = (t.detach() for t in _fold(w2, bn))
        return torch.ops.mkldnn._reorder_linear_weight(w2), bias

    return derived(_packed, w, bn, make)  # type: ignore[return-value]


def folded_weight(w: torch.Tensor, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """A convolution's weight (out, in/groups, k, k) and the eval-mode batch norm after it -> (w', b') with
    bn(conv(x, w)) = conv(x, w') + b' (the encoder's stem and depthwise convolutions): made once per version and
    address of the five tensors, as the packed copies."""
    def make():
        return tuple(t.detach().contiguous() for t in _fold(w.detach(), bn))

    return derived(_folded, w, bn, make)  # type: ignore[return-value]


def packs(x: torch.Tensor, w: torch.Tensor, plain: bool = False) -> bool:
    """The rule: whether x's product with the weight w runs as oneDNN's packed product."""
    return not (plain or torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32
                or w.dtype != torch.float32 or x.numel() == 0 or not has_onednn())


def _rows_product(rows: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows (N, in) -> (N, out) by oneDNN's packed product: each row summed in one order, whatever N or threads."""
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed_weight(w)[0], bias, "none", [], "")


def linear(layer: nn.Linear, x: torch.Tensor, plain: bool = False) -> torch.Tensor:
    """layer(x) for x (..., in) -> (..., out); leading dimensions are rows. plain: F.linear (the oracle)."""
    w = layer.weight
    if not packs(x, w, plain):
        return F.linear(x, w, layer.bias)
    y = _rows_product(x.reshape(-1, x.shape[-1]), w, layer.bias)  # (N, out)
    return y.view(*x.shape[:-1], w.shape[0])


class Linear(nn.Linear):
    """nn.Linear whose product follows the rule (`linear`): the decoder's and attention's layers, so the step reads
    `self.out_vocab(h)`; the same parameters and state dict as nn.Linear. plain=True: F.linear (the oracle)."""

    def forward(self, x: torch.Tensor, plain: bool = False) -> torch.Tensor:
        return linear(self, x, plain)


def is_pointwise(conv: nn.Module) -> bool:
    """A convolution that is a linear layer on each pixel: 1x1 kernel, stride 1, ungrouped, no padding."""
    return (isinstance(conv, nn.Conv2d) and conv.kernel_size == (1, 1) and conv.stride == (1, 1)
            and conv.groups == 1 and conv.padding in ((0, 0), "valid"))


def folds(bn: nn.BatchNorm2d | None) -> bool:
    """Whether a batch norm can be folded into the product before it: in eval mode, with its scale and statistics."""
    return bn is None or (not bn.training and bn.affine and bn.running_var is not None)


def pointwise(conv: nn.Conv2d, x: torch.Tensor, bn: nn.BatchNorm2d | None = None, relu6: bool = False,
              plain: bool = False) -> torch.Tensor:
    """relu6(bn(conv(x))) for a pointwise convolution (is_pointwise), bn and relu6 when given: x (B, C, h, w) ->
    (B, out, h, w), each pixel a row. By the rule one product: the eval-mode batch norm folded into the packed
    weight and bias, relu6 as oneDNN's clamp of the result. A channels-last x needs no copy; the result is
    channels-last. Elsewhere, and with plain=True (the oracle), the three layers as written."""
    if not (packs(x, conv.weight, plain) and folds(bn)) or (bn is not None and conv.bias is not None):
        y = F.conv2d(x, conv.weight, conv.bias)
        y = y if bn is None else bn(y)
        return F.relu6(y) if relu6 else y
    b, c, h, w = x.shape
    rows = x.permute(0, 2, 3, 1).reshape(b * h * w, c)  # (B*h*w, C): a view when x is channels-last
    weight, bias = packed_weight(conv.weight, bn)
    clamp = ("hardtanh", [0.0, 6.0]) if relu6 else ("none", [])
    y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, conv.bias if bn is None else bias, *clamp, "")
    return y.view(b, h, w, -1).permute(0, 3, 1, 2)  # (B, out, h, w), channels-last (B*h*w rows of out)


@torch.no_grad()
def prepare(module: nn.Module, pointwise_layers: Iterable[tuple[nn.Conv2d, nn.BatchNorm2d | None]] = ()) -> None:
    """Make the packed copy of every linear layer in `module`, and of each (pointwise convolution, batch norm after
    it or None) in `pointwise_layers`, that sits on a CPU in float32 (a no-op elsewhere or without oneDNN): done
    at load, not in the first caption."""
    if not has_onednn():
        return
    pairs = [(layer, None) for layer in module.modules() if isinstance(layer, nn.Linear)] + list(pointwise_layers)
    for layer, bn in pairs:
        if layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32 and folds(bn):
            packed_weight(layer.weight, bn)
