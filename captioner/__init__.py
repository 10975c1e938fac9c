"""captioner: Show, Attend and Tell (Xu et al. 2015) image captioning with soft attention."""
from .api import (DEFAULT_CHECKPOINT, Caption, Captioner, NoWordsError, Photo, available_devices, check_device, default_device,
                  load, preferred_dtype)
from .checkpoint import CheckpointError
from .images import ImageError

__version__ = "0.1.0"
__all__ = ["load", "preferred_dtype", "default_device", "Captioner", "Photo", "Caption", "ImageError", "CheckpointError", "NoWordsError", "DEFAULT_CHECKPOINT",
           "check_device", "available_devices", "__version__"]
