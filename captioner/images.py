"""Turning whatever a user hands us into a safe RGB image, and images into network input.

Everything that is not a usable picture becomes an ImageError (a ValueError) whose message a
person can act on. Decoding is bounded: pixel count is checked from the header before any pixel
is decoded (decompression bombs), big JPEGs are decoded at reduced scale, and the result is
downscaled so the rest of the pipeline never holds a huge array.
"""
from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Union

import torch
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

ImageInput = Union[str, os.PathLike, bytes, bytearray, Image.Image]

MAX_PIXELS = 100_000_000  # header-declared pixel count above which we refuse to decode
MAX_FILE_BYTES = 50 * 1024 * 1024
WORKING_SIDE = 1024  # images are downscaled so the longer side is at most this


class ImageError(ValueError):
    """The input is not a usable image. The message says why and what to do."""


def load_image(src: ImageInput, max_side: int = WORKING_SIDE) -> Image.Image:
    """PIL image, path or bytes -> upright RGB PIL image, longer side <= max_side."""
    ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated file is an error, not a half-grey picture
    name = "image"
    if isinstance(src, Image.Image):
        img = src
    else:
        if isinstance(src, (bytes, bytearray)):
            data = bytes(src)
        elif isinstance(src, (str, os.PathLike)):
            path = Path(src)
            name = str(path)
            if not path.is_file():
                raise ImageError(f"{name}: no such file")
            if path.stat().st_size > MAX_FILE_BYTES:
                raise ImageError(f"{name}: file is larger than {MAX_FILE_BYTES // 2**20} MB; use a smaller image")
            data = path.read_bytes()
        else:
            raise ImageError(f"expected a PIL image, a path or bytes, got {type(src).__name__}")
        if not data:
            raise ImageError(f"{name}: the file is empty")
        if len(data) > MAX_FILE_BYTES:
            raise ImageError(f"{name}: larger than {MAX_FILE_BYTES // 2**20} MB; use a smaller image")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            if isinstance(e, UnidentifiedImageError):
                raise ImageError(f"{name}: not an image file PIL can read (JPEG, PNG, WebP, GIF, BMP ...)") from None
            raise ImageError(f"{name}: image is too large to decode safely") from None
        except Exception as e:  # noqa: BLE001 - any decoder failure is a bad file, not a crash
            raise ImageError(f"{name}: cannot read image ({e})") from None
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"{name}: image has no pixels ({w}x{h})")
    if w * h > MAX_PIXELS:
        raise ImageError(f"{name}: {w}x{h} pixels is too large to decode safely (limit {MAX_PIXELS:,} pixels)")
    try:
        if getattr(img, "is_animated", False):
            img.seek(0)  # first frame of an animation
        if img.format == "JPEG":
            img.draft("RGB", (max_side, max_side))  # decode big JPEGs at reduced scale: fast and small
        img.load()
        img = ImageOps.exif_transpose(img)  # caption the picture the way it is meant to be seen
        img = _to_rgb(img)
    except ImageError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ImageError(f"{name}: the image data is corrupt or truncated ({e})") from None
    if max(img.size) > max_side:
        img.thumbnail((max_side, max_side), Image.BICUBIC)
    return img


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit grey: scale to 8 bit instead of clipping to white
        arr = torch.from_numpy(__import__("numpy").asarray(img, dtype="float32"))
        hi = float(arr.max()) or 1.0
        img = Image.fromarray((arr / hi * 255).clamp(0, 255).byte().numpy(), mode="L")
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(img.convert("RGBA"), mask=img.convert("RGBA").getchannel("A"))
        return background
    return img.convert("RGB")


def preprocess(img: Image.Image, image_size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """Whole image -> (3, S, S) normalised tensor. No crop: the attention grid covers the full picture
    (a non-square photo is resized anisotropically; overlays stretch the grid back onto it)."""
    img = img.resize((image_size, image_size), Image.BILINEAR, reducing_gap=None)
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(image_size, image_size, 3)
    x = x.permute(2, 0, 1).float().div_(255.0)  # (3, S, S)
    m = torch.tensor(mean).view(3, 1, 1)
    s = torch.tensor(std).view(3, 1, 1)
    return (x - m) / s
