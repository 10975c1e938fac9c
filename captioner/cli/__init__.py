"""Command-line programs; scripts/*.py and the console entry points call their main().

Importing this package asks MKL for sums in one order (model/blas.py) before any command's first product: the same
photo gives the same numbers at any thread count."""
from captioner.model.blas import sum_in_one_order

sum_in_one_order()


def numpy_before_torch() -> None:
    """Import numpy before torch, in a command whose stop handler is in place: torch's C extension imports numpy
    from C and clears any error raised there, so a Ctrl-C landing in that import (Interrupted) was swallowed,
    numpy stayed half-imported and the command went on, to fail later ("module 'numpy' has no attribute
    'matrix'"). Imported from Python first, a stop there ends the command in its one line, as anywhere else."""
    import numpy  # noqa: F401


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
