"""Command-line programs; scripts/*.py and the console entry points call their main().

Importing this package asks MKL for sums in one order (sum_in_one_order): every command imports it before its
first product, and so the same photo gives the same numbers at any thread count."""
import os

MKL_STRICT = "AUTO,STRICT"  # MKL's strict conditional numerical reproducibility, on the CPU's own code branch


def sum_in_one_order() -> None:
    """Ask MKL, unless the user chose otherwise, for its strict reproducible mode (MKL_CBWR=AUTO,STRICT): its
    matrix products, which are the products that do not run on oneDNN's packed product (model/packed_linear.py:
    the attention's batched products, autograd's), then sum in the same order at any thread count. Without it
    MKL splits a product such as the attention's context (5 beams x 81 locations x 1280) differently at 1 and 2
    threads (up to 5.7e-6 apart, on an AMD EPYC too). MKL reads the setting at its first product and cannot
    change it later, so the commands and the app call this before they load a model; a Python program that
    imports captioner sets MKL_CBWR in its environment instead (docs/performance.md)."""
    os.environ.setdefault("MKL_CBWR", MKL_STRICT)


sum_in_one_order()


def torchvision_refused() -> bool:
    """Whether torch and torchvision do not work together (model/vision.py); if so, says so and what to
    reinstall in one line on stderr, no traceback (the command then exits with 2)."""
    import sys

    from captioner.model.vision import torchvision_problem

    problem = torchvision_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
    return problem is not None


def device_refused(device: str | None) -> bool:
    """Whether --device names a device this machine lacks, or torch and torchvision do not work together
    (torchvision_refused); if so, says so in one line on stderr (the command then exits with 2). None (the
    command's default) is never refused."""
    import sys

    from captioner.api import check_device

    if torchvision_refused():
        return True
    try:
        if device is not None:
            check_device(device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return True
    return False
