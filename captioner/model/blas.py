"""MKL's sums in one order: the products that do not run on oneDNN's packed product (model/packed_linear.py) run
on MKL, the attention's batched products (the context sum_i alpha_ti a_i, its W_z table, the evidence map: 5 beams
x 61-81 rows) and autograd's. MKL's default splits their sums differently at 1 and 2 threads (5 x 81 x 1280: up to
5.7e-6 apart on an AMD EPYC); its strict reproducible mode sums them in one order at any thread count on its AVX2
and AVX-512 branches. MKL reads the mode once, at its first product, and cannot change it later: so the commands
(captioner/cli) and the app (before they load a model) call sum_in_one_order, and a Python program that imports
captioner sets MKL_CBWR in its environment before it starts (docs/performance.md). Only the standard library here:
the commands call it before torch is imported."""
from __future__ import annotations

import os

MKL_STRICT = "AUTO,STRICT"  # MKL_CBWR: the CPU's own code branch, in strict mode (the same sums at any thread count)


def sum_in_one_order() -> None:
    """Ask MKL for its strict reproducible mode (MKL_CBWR=AUTO,STRICT) unless the user chose a mode: it takes effect
    where no MKL product has run yet in this process."""
    os.environ.setdefault("MKL_CBWR", MKL_STRICT)
