"""Study (issue: a caption at the encoder's pace on any CPU): would the int8 precision's per-row product pay in the
encoder's 1x1 convolutions? For each pointwise convolution of one read photo (its rows: the pixels, its width: the
channels), the packed float32 product against torch._int_mm of int8 rows and the quantizing of the rows it needs
(each pixel's own scale), one thread, ms per call (mean of 5 after one warm-up), summed over the convolutions.
Run from the repository root: .venv/bin/python docs/studies/int8_pointwise.py (under a minute)."""
import time
from pathlib import Path

import torch

import captioner
import captioner.model.encoder as encoder
from captioner.model import packed_linear

PHOTO = Path(captioner.DEFAULT_CHECKPOINT).parent / "examples" / "cat.jpg"


def ms(fn, n: int = 5) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1000


def main() -> None:
    torch.set_num_threads(1)
    m = captioner.load()
    shapes, real = [], encoder.pointwise

    def spy(conv, x, bn=None, relu6=False, plain=False):  # (rows, in, out) of each pointwise convolution
        shapes.append((x.shape[0] * x.shape[2] * x.shape[3], x.shape[1], conv.weight.shape[0]))
        return real(conv, x, bn, relu6, plain)

    encoder.pointwise = spy
    m.read(PHOTO)
    encoder.pointwise = real
    total = {"float32 packed": 0.0, "int8 product": 0.0, "quantizing the rows": 0.0}
    for rows, c_in, c_out in shapes:
        x, w = torch.randn(rows, c_in), torch.randn(c_out, c_in)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        q_t = torch.randint(-127, 128, (c_out, c_in), dtype=torch.int8).t()

        def quantize():
            return torch.round(x / (x.abs().amax(1, keepdim=True) / 127)).to(torch.int8)

        p = quantize()
        total["float32 packed"] += ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        total["int8 product"] += ms(lambda: torch._int_mm(p, q_t))
        total["quantizing the rows"] += ms(quantize)
    print(f"{len(shapes)} pointwise convolutions:", ", ".join(f"{k} {v:.1f} ms" for k, v in total.items()))


if __name__ == "__main__":
    main()
