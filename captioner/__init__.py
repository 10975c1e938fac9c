"""captioner: Show, Attend and Tell (Xu et al. 2015) image captioning with soft attention.

The public names are imported on first use (PEP 562), not with the package: `import captioner.cli.train` then
does not wait for torch, so a command installs its Ctrl-C handler before the heavy imports
(a Ctrl-C during them ends in one line, not a traceback)."""
from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import (DEFAULT_CHECKPOINT, Caption, Captioner, NoWordsError, Photo, available_devices, check_device,
                      default_device, load, preferred_dtype)
    from .checkpoint import CheckpointError
    from .images import ImageError

__version__ = "0.1.0"
__all__ = ["load", "preferred_dtype", "default_device", "Captioner", "Photo", "Caption", "ImageError", "CheckpointError", "NoWordsError", "DEFAULT_CHECKPOINT",
           "check_device", "available_devices", "__version__"]
_HOME = {"CheckpointError": ".checkpoint", "ImageError": ".images"}  # the rest live in api.py


def __getattr__(name: str) -> Any:
    if name not in __all__:  # a submodule read as an attribute (captioner.api.DTYPES) before anything imported it
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'captioner' has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(_HOME.get(name, ".api"), __name__), name)
    globals()[name] = value  # once: later reads are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
