"""Study (issue: a caption at the encoder's pace on any CPU): what torch.compile of the decoder step buys a single
photo's caption() on a CPU, at the stored settings, float32. The step's small operations (about 230 a word at beam
5: the attention's softmax, the LSTM cell's gates, the output's tanh) are fused by inductor into C++ loops; the
step's products go to inductor's own packed oneDNN calls (options freezing=True: the weights become constants),
since this package's packed product (model/packed_linear.py) is not a graph constant inductor can lower.
Measured: caption() of 24 coco-paired val photos eager, then compiled (`recur`, then `recur` and `output`), the
first compiled pass (compiling) timed apart; captions and confidences against eager's; the compiled step's captions
at 1 and 2 threads. Run from the repository root: .venv/bin/python docs/studies/compiled_step.py (about 3 minutes;
needs a C++ compiler)."""
import statistics
import time
from pathlib import Path

import torch

import captioner
from captioner.model import packed_linear

DATA = Path("../shared/data/coco-paired")


def p50(m, paths) -> float:
    ts = []
    for p in paths:
        a = time.perf_counter()
        m.caption(p)
        ts.append(time.perf_counter() - a)
    return 1000 * statistics.median(ts)


def agree(a, b) -> str:
    """How many captions are the same words, how many also the same confidence, and the largest confidence gap."""
    words = sum(x[0] == y[0] for x, y in zip(a, b))
    exact = sum(x == y for x, y in zip(a, b))
    gap = max((abs(x[1] - y[1]) for x, y in zip(a, b) if x[1] is not None and y[1] is not None), default=0.0)
    return f"words {words}/{len(a)}, confidence too {exact}/{len(a)} (largest gap {gap:.1e})"


def outputs(m, paths) -> list[tuple[str, float | None]]:
    return [(c.text, c.confidence) for c in (m.caption(p) for p in paths)]


def main() -> None:
    torch.set_num_threads(1)
    paths = [DATA / "images" / line.strip() for line in open(DATA / "split_val.txt")][:24]
    plain_packs = packed_linear.packs  # while inductor traces, F.linear: it packs the (frozen) weights itself
    packed_linear.packs = lambda x, w, plain=False: not torch.compiler.is_compiling() and plain_packs(x, w, plain)
    m = captioner.load(dtype="float32")
    eager = outputs(m, paths)
    print(f"eager: caption() p50 {p50(m, paths):.1f}, {p50(m, paths):.1f} ms")
    d = m.model.decoder
    for label, names in (("recur", ("recur",)), ("recur and output", ("output",))):
        for name in names:
            setattr(d, name, torch.compile(getattr(d, name), options={"freezing": True}))
        a = time.perf_counter()
        got = outputs(m, paths)
        first = time.perf_counter() - a
        print(f"compiled {label}: first pass {first:.1f} s; caption() p50 {p50(m, paths):.1f}, {p50(m, paths):.1f} ms;"
              f" against eager: {agree(got, eager)}")
    torch.set_num_threads(2)
    two = outputs(m, paths)
    print(f"compiled, 2 threads against 1: {agree(two, got)}")


if __name__ == "__main__":
    main()
