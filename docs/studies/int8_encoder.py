"""Study (issue: a caption at the encoder's pace on any CPU): the encoder (EfficientNet-Lite2) in static int8.
Post-training quantization by hand with torch's quantized convolutions (oneDNN engine: the x86/fbgemm one runs
stride-2 and dilated depthwise convolutions 50-250x slower here): the batch norms folded, weights per output channel,
each activation (every convolution's output and residual sum) one fixed scale and zero point from its range on 48
Flickr8k train and 48 coco-paired train photos, relu6 as the uint8 range [0, 6]; the features dequantized for the
attention. Prints the features' relative error, one read's p50 at one thread (float32: the library's folded and
packed encoder) and CIDEr (pycocoevalcap, Python tokens) with captions changed on coco-paired val and coco-mini.
Run from the repository root: .venv/bin/python docs/studies/int8_encoder.py (about five minutes)."""
import math
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from pycocoevalcap.cider.cider import Cider

import captioner
from captioner.model.packed_linear import _fold
from int8_step import DATA, references  # this folder is on the path

warnings.filterwarnings("ignore")  # torch's quantized tensors say they are deprecated: part of the finding
CALIBRATION = 48


def same_pad(conv, h: int, w: int) -> list[int]:
    """TensorFlow's SAME padding of `conv` for an h x w input: [left, right, top, bottom] (encoder.SameConv2d)."""
    (kh, kw), (sh, sw) = conv.weight.shape[-2:], conv.stride
    kh, kw = (kh - 1) * conv.dilation[0] + 1, (kw - 1) * conv.dilation[1] + 1
    ph, pw = max((math.ceil(h / sh) - 1) * sh + kh - h, 0), max((math.ceil(w / sw) - 1) * sw + kw - w, 0)
    return [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2]


def layers(net):
    """(name, conv, bn, relu6) of the stem, each block's expand, depthwise and project, and the head, in order."""
    out = [("stem", net._conv_stem, net._bn0, True)]
    for i, b in enumerate(net._blocks):
        out += [(f"b{i}.expand", b._expand_conv, b._bn0, True)] if b.has_expand else []
        out += [(f"b{i}.dw", b._depthwise_conv, b._bn1, True), (f"b{i}.project", b._project_conv, b._bn2, False)]
    return out + [("head", net._conv_head, net._bn1, True)]


def run(net, x, conv, add):
    """The encoder's dataflow with `conv(name, x)` and `add(name, x, y)` (a float or an int8 pass)."""
    x = conv("stem", x)
    for i, b in enumerate(net._blocks):
        y = conv(f"b{i}.expand", x) if b.has_expand else x
        y = conv(f"b{i}.project", conv(f"b{i}.dw", y))
        x = add(f"b{i}.add", x, y) if b.residual else y
    return conv("head", x)


@torch.no_grad()
def ranges(net, batches) -> dict:
    """Each activation's (scale, zero point) from its least and largest value over the calibration photos."""
    spec, seen = {n: (c, bn, relu) for n, c, bn, relu in layers(net)}, {}

    def note(name, y):
        lo, hi = seen.get(name, (0.0, 0.0))
        seen[name] = min(lo, float(y.min())), max(hi, float(y.max()))
        return y

    def conv(name, x):
        c, bn, relu = spec[name]
        y = F.conv2d(F.pad(x, same_pad(c, *x.shape[-2:])), *_fold(c.weight, bn), c.stride, 0, c.dilation, c.groups)
        return note(name, F.relu6(y) if relu else y)

    for x in batches:
        note("input", x)
        run(net, x, conv, lambda name, a, b: note(name, a + b))
    return {n: ((hi - lo) / 255, int(round(-lo / ((hi - lo) / 255)))) for n, (lo, hi) in seen.items()}


def int8_encoder(net, qp: dict):
    """x (B, 3, S, S) float -> the feature map (B, 1280, h, w) float, computed in int8 between input and output."""
    packed = {}
    for name, c, bn, relu in layers(net):
        w, b = (t.detach() for t in _fold(c.weight, bn))
        scale = (w.abs().flatten(1).amax(1) / 127).clamp_min(1e-12).double()  # (out,)
        q = torch.quantize_per_channel(w.contiguous(), scale, torch.zeros(len(w), dtype=torch.long), 0, torch.qint8)
        packed[name] = c, torch.ops.quantized.conv2d_prepack(q, b, list(c.stride), [0, 0], list(c.dilation), c.groups), relu

    def conv(name, q):
        c, p, relu = packed[name]
        pad = same_pad(c, *q.shape[-2:])
        q = F.pad(q, pad) if any(pad) else q
        return (torch.ops.quantized.conv2d_relu if relu else torch.ops.quantized.conv2d)(q, p, *qp[name])

    @torch.no_grad()
    def features(x):
        q = torch.quantize_per_tensor(x.contiguous(memory_format=torch.channels_last), *qp["input"], torch.quint8)
        return run(net, q, conv, lambda name, a, b: torch.ops.quantized.add(a, b, *qp[name])).dequantize()
    return features


def main() -> None:
    torch.set_num_threads(1)
    torch.backends.quantized.engine = "onednn"
    m = captioner.load()
    net, float_features = m.model.encoder.backbone, m.model.encoder.backbone.features
    cal = [DATA / "flickr8k/Images" / n.strip() for n in open(DATA / "flickr8k/Flickr_8k.trainImages.txt")][:CALIBRATION]
    cal += [DATA / "coco-paired/images" / n.strip() for n in open(DATA / "coco-paired/split_train.txt")][:CALIBRATION]
    qp = ranges(net, [torch.stack([m.preprocess(p) for p in cal[k:k + 16]]) for k in range(0, len(cal), 16)])
    fast = int8_encoder(net, qp)
    refs, val = references(), [n.strip() for n in open(DATA / "coco-paired/split_val.txt")]
    xs = [m.preprocess(DATA / "coco-paired/images" / n)[None].contiguous(memory_format=torch.channels_last) for n in val[:24]]
    times: dict = {"float32": [], "int8": []}
    with torch.no_grad():
        err = [float((fast(x) - float_features(x)).norm() / float_features(x).norm()) for x in xs]
        for _ in range(3):
            for x in xs:
                for mode, f in (("float32", float_features), ("int8", fast)):
                    t = time.perf_counter()
                    f(x)
                    times[mode].append(time.perf_counter() - t)
    print(f"features' relative error: median {statistics.median(err):.3f}, max {max(err):.3f}; one read p50",
          ", ".join(f"{k} {1000 * statistics.median(v):.1f} ms" for k, v in times.items()))
    torch.set_num_threads(2)
    for name, folder, names in (("coco-paired val", DATA / "coco-paired/images", val),
                                ("coco-mini", DATA / "coco-mini/train2017", sorted(refs["coco-mini"]))):
        texts = {}
        for mode, f in (("float32", float_features), ("int8", fast)):
            net.features = f
            texts[mode] = {n: c.text for k in range(0, len(names), 16)
                           for n, c in zip(names[k:k + 16], m.caption_batch([folder / n for n in names[k:k + 16]]))}
            score, _ = Cider().compute_score({n: refs[name][n] for n in names}, {n: [texts[mode][n]] for n in names})
            print(f"{name}: {mode} encoder CIDEr {score:.4f}")
        print(f"{name}: captions changed {sum(texts['float32'][n] != texts['int8'][n] for n in names)} of {len(names)}")
        net.features = float_features


if __name__ == "__main__":
    main()
