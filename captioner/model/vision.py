"""torchvision, imported in one place: a torch / torchvision pair that does not belong together is one line.

torchvision's compiled operators are built against one torch release. A pair from two indexes (pip falling
back to PyPI where the CPU wheel index is unreachable: torch 2.13.0+cpu with torchvision 0.28.0) fails inside
`import torchvision` with "RuntimeError: operator torchvision::nms does not exist", a traceback that names
neither version. import_torchvision turns that into a TorchvisionMismatch naming both and the fix;
torchvision_problem says it without raising (the app and the command-line programs print it and stop).
"""
from __future__ import annotations

from importlib import metadata
from types import ModuleType

import torch

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


class TorchvisionMismatch(RuntimeError):
    """torchvision cannot be imported with this torch; the message says both versions and what to reinstall."""


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def import_torchvision() -> ModuleType:
    """`import torchvision`, or a TorchvisionMismatch naming both versions and the reinstall command."""
    try:
        import torchvision
    except (RuntimeError, ImportError, AttributeError) as e:
        stop = _stop_behind(e)
        if stop is not None:  # a Ctrl-C arrived mid-import and left a broken import behind it: the stop, not a mismatch
            raise stop from None
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise TorchvisionMismatch(
            f"torch {torch.__version__} and torchvision {_installed('torchvision')} do not work together "
            f"({reason}); reinstall the pair from one index, e.g. .venv/bin/pip install --force-reinstall "
            f"torch torchvision --index-url {CPU_INDEX}") from None
    return torchvision


def _stop_behind(error: BaseException) -> BaseException | None:
    """The stop request (a BaseException that is no Exception: KeyboardInterrupt, a training stop) among the
    exceptions `error` was raised while handling, if any."""
    seen, e = 0, error.__context__ or error.__cause__
    while e is not None and seen < 100:
        if not isinstance(e, Exception):
            return e
        e, seen = e.__context__ or e.__cause__, seen + 1
    return None


def torchvision_note() -> str | None:
    """None when torchvision imports; else one line for work that does not need it (the bundled model's encoder):
    the pair named, that the work goes on, and the fix from the index pip reached (the plain install)."""
    try:
        import_torchvision()
    except TorchvisionMismatch:
        return (f"torch {torch.__version__} and torchvision {_installed('torchvision')} do not work together; this "
                "model does not use torchvision, so it works on (a ResNet model file or training would stop): to "
                "mend the pair, .venv/bin/pip install --force-reinstall torch torchvision")
    return None


def torchvision_problem() -> str | None:
    """None when torchvision imports; else the one line that says what is wrong and what to do."""
    try:
        import_torchvision()
    except TorchvisionMismatch as e:
        return str(e)
    return None
