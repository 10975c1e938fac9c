"""Turning whatever a user hands us into a safe RGB image, and images into network input.

Everything that is not a usable picture becomes an ImageError (a ValueError) whose message a
person can act on. Decoding is bounded: only common photo formats are parsed (no plugin that
shells out, e.g. EPS -> Ghostscript), the pixel count is checked from the header before any pixel
is decoded (decompression bombs), big JPEGs are decoded at reduced scale, and other big images are
shrunk in their native mode right after decoding, so the rest of the pipeline never holds a huge
array.
"""
from __future__ import annotations

import io
import math
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Union

import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

if TYPE_CHECKING:
    import torch

ImageInput = Union[str, os.PathLike, bytes, bytearray, memoryview, BinaryIO, Image.Image]

MAX_PIXELS = 100_000_000  # decoded pixel count above which we refuse (checked from the header, before decoding)
MAX_FILE_BYTES = 50 * 1024 * 1024
WORKING_SIDE = 1024  # images are downscaled so the longer side is at most this
SMALL_PHOTO = 0.5  # a photo whose shorter side is below this share of the model's input side gets a note
# a photo whose pixels spread less than this (standard deviation, 0-255, in every channel) is one flat colour: a
# flat colour saved as JPEG spreads 0-1; the flattest of 2,697 Flickr8k photos (every third) spreads 19.6
FLAT_STD = 4.0
# Formats we parse (Pillow's name -> the name people read, the file extensions an uploader accepts): the one
# list behind the parser, the error messages and the app's uploader (format_names, file_extensions).
# Everything else is refused before any plugin-specific code runs: Pillow also knows EPS (runs
# Ghostscript), FITS, SPIDER, TGA (no magic number: random bytes can "be" a TGA) ...
FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "JPEG": ("JPEG", ("jpg", "jpeg", "jpe", "jfif")),
    "PNG": ("PNG", ("png",)),
    "WEBP": ("WebP", ("webp",)),
    "GIF": ("GIF", ("gif",)),
    "BMP": ("BMP", ("bmp",)),
    "TIFF": ("TIFF", ("tif", "tiff")),
    "PPM": ("PPM", ("ppm", "pgm", "pbm", "pnm")),
    "AVIF": ("AVIF", ("avif",)),  # only where Pillow was built with it
}
_JPEG = ("JPEG", "MPO")  # MPO: multi-picture JPEGs that many phones and cameras write
_ORIENTATION = 0x0112
_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}
_SIDEWAYS = {5, 6, 7, 8}  # orientations that swap width and height


class ImageError(ValueError):
    """The input is not a usable image. The message says why and what to do."""


def _formats() -> list[str]:
    Image.init()
    return [f for f in FORMATS if f in Image.OPEN]  # AVIF only where Pillow was built with it


def format_names(last: str = ", ") -> str:
    """The formats load_image reads here, as people name them: "JPEG, PNG, WebP, GIF, BMP, TIFF, PPM, AVIF"
    (`last` joins the final two, e.g. " or ")."""
    names = [FORMATS[f][0] for f in _formats()]
    return ", ".join(names[:-1]) + last + names[-1] if len(names) > 1 else "".join(names)


def file_extensions() -> list[str]:
    """The file extensions of the formats load_image reads here (no dot): what an uploader should accept."""
    return [ext for f in _formats() for ext in FORMATS[f][1]]


def _too_large(name: str, size: tuple[int, int] | None = None, pixels: int | None = None) -> ImageError:
    """The one message for an image with too many pixels, whoever noticed (our limit or Pillow's bomb check)."""
    what = f"{size[0]}x{size[1]} pixels" if size else f"{pixels:,} pixels" if pixels else "the image"
    return ImageError(f"{name}: {what} is too large to decode safely (limit {MAX_PIXELS:,} pixels)")


def _declared_size(data: bytes) -> tuple[int, int] | None:
    """The width and height the file's header declares, read by the plugin that recognises it (the header
    only, without Pillow's decompression-bomb check); None when no plugin reads it."""
    for fmt in _formats():
        factory, accept = Image.OPEN[fmt]
        try:
            ok = accept(data[:16]) if accept else True
            if not ok or isinstance(ok, str):
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                w, h = factory(io.BytesIO(data), "").size
            return int(w), int(h)
        except Exception:  # noqa: BLE001 - not this plugin's file, or its own bomb check: try the next
            continue
    return None


def _bomb_error(name: str, e: Exception, data: bytes | None = None, size: tuple[int, int] | None = None) -> ImageError:
    """Pillow's DecompressionBombError ("... could be decompression bomb DOS attack") in our words."""
    size = size or (_declared_size(data) if data is not None else None)
    found = re.search(r"\((\d+) pixels\)", str(e))
    return _too_large(name, size, int(found.group(1)) if found else None)


def _read_path(path: Path) -> bytes:
    name = str(path)
    try:
        if not path.exists():
            raise ImageError(f"{name}: no such file")
        if path.is_dir():
            raise ImageError(f"{name}: is a directory, not an image file")
        if not path.is_file():
            raise ImageError(f"{name}: not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # never more than the limit, even if the file grows meanwhile
    except OSError as e:
        raise ImageError(f"{name}: cannot read the file ({e.strerror or e})") from None
    return data


def _read_input(src: ImageInput) -> tuple[bytes, str]:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(src), "image"
    if isinstance(src, (str, os.PathLike)):
        try:
            path = Path(src)
        except TypeError:
            raise ImageError(f"expected a PIL image, a path or bytes, got {type(src).__name__}") from None
        return _read_path(path), str(path)
    if hasattr(src, "read"):  # an open binary file, an upload ...
        name = str(getattr(src, "name", "image"))
        try:
            data = src.read(MAX_FILE_BYTES + 1)
        except (OSError, ValueError) as e:
            raise ImageError(f"{name}: cannot read the file ({e})") from None
        if not isinstance(data, (bytes, bytearray)):
            raise ImageError(f"{name}: the file object gave {type(data).__name__}, not bytes; open it in binary mode")
        return bytes(data), name
    raise ImageError(f"expected a PIL image, a path or bytes, got {type(src).__name__}")


def _open(data: bytes, name: str) -> Image.Image:
    if not data:
        raise ImageError(f"{name}: the file is empty")
    if len(data) > MAX_FILE_BYTES:
        raise ImageError(f"{name}: file is larger than {MAX_FILE_BYTES // 2**20} MB; use a smaller image")
    try:
        with warnings.catch_warnings():
            # Pillow warns from ~89 Mpx; we apply our own limit in load_image (MAX_PIXELS, after JPEG draft)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            warnings.simplefilter("ignore", UserWarning)  # "Corrupt EXIF data" ...: broken files end as ImageError
            return Image.open(io.BytesIO(data), formats=_formats())
    except UnidentifiedImageError:
        raise ImageError(f"{name}: not an image file that can be read ({format_names()})") from None
    except Image.DecompressionBombError as e:  # Pillow's check (from 2 x 89 Mpx) said it first: our words
        raise _bomb_error(name, e, data=data) from None
    except Exception as e:  # noqa: BLE001 - any parser failure is a bad file, not a crash
        raise ImageError(f"{name}: cannot read image ({type(e).__name__}: {e})") from None


def load_image(src: ImageInput, max_side: int = WORKING_SIDE) -> Image.Image:
    """PIL image, path, bytes or binary file -> upright RGB PIL image, longer side <= max_side."""
    ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated file is an error, not a half-grey picture
    if isinstance(src, Image.Image):
        img, name = src, "image"
    else:
        data, name = _read_input(src)
        img = _open(data, name)
    try:
        w, h = img.size
        if w < 1 or h < 1:
            raise ImageError(f"{name}: image has no pixels ({w}x{h})")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our limit, MAX_PIXELS, decides
            warnings.simplefilter("ignore", UserWarning)
            if getattr(img, "is_animated", False):
                img.seek(0)  # first frame of an animation
            if img.format in _JPEG:
                img.draft("RGB", (max_side, max_side))  # decode big JPEGs at 1/2 .. 1/8 scale: fast and small
            dw, dh = img.size
            if dw * dh > MAX_PIXELS:
                raise _too_large(name, (w, h))
            img.load()
        orientation = _orientation(img)
        img = _shrink(img, max_side)
        clear = fully_transparent(img)
        if orientation in _TRANSPOSE:  # caption the picture the way it is meant to be seen
            img = img.transpose(_TRANSPOSE[orientation])
        img = _to_rgb(img)
    except ImageError:
        raise
    except Image.DecompressionBombError as e:  # a frame or tile Pillow checks itself (GIF, TIFF ...)
        raise _bomb_error(name, e, size=img.size) from None
    except MemoryError:
        raise ImageError(f"{name}: not enough memory to decode this image; use a smaller one") from None
    except Exception as e:  # noqa: BLE001
        cut = "truncated" in str(e).lower()  # Pillow's own words ("image file is truncated (1 bytes not processed)")
        raise ImageError(f"{name}: the image file is truncated (an incomplete download or copy?): copy it again"
                         if cut else f"{name}: the image data is corrupt or truncated ({type(e).__name__}: {e})"
                         ) from None
    if max(img.size) > max_side:
        img.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
    upright = (h, w) if orientation in _SIDEWAYS else (w, h)
    # a fresh upright picture: no EXIF orientation left to apply twice (load_image(load_image(x))); the size
    # the file had (upright) is kept, so a page can say a 12000x12000 upload was shrunk (original_size)
    img.info = {"original_size": original_size(src) if isinstance(src, Image.Image) else upright,
                "transparent": clear or was_transparent(src)}
    return img


def fully_transparent(img: Image.Image) -> bool:
    """Whether every pixel of an image with an alpha channel (or a transparent palette colour) is fully
    transparent: such a file holds no picture, and on its white background the caption is of a blank image."""
    if img.mode == "P" and "transparency" in img.info or img.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        alpha = img.convert("RGBA").getchannel("A") if img.mode not in ("RGBA", "LA") else img.getchannel("A")
        return alpha.getextrema()[1] == 0
    return False


def was_transparent(img: Image.Image) -> bool:
    """Whether a load_image result came from a fully transparent file (fully_transparent, before its white
    background was put in): a photo read twice (the app's, then the Captioner's) keeps the fact."""
    return isinstance(img, Image.Image) and isinstance(img.info, dict) and bool(img.info.get("transparent"))


def flat_colour(img: Image.Image) -> bool:
    """Whether a photo is one flat colour (every channel's pixel standard deviation below FLAT_STD of 255): a
    plain orange square has nothing to caption, and the model still says "a person sitting in a blue sky".
    Measured on the whole picture as read (at most WORKING_SIDE a side), so fine detail is never averaged away."""
    from PIL import ImageStat

    return max(ImageStat.Stat(img.convert("RGB")).stddev) < FLAT_STD


def original_size(img: Image.Image) -> tuple[int, int]:
    """(width, height) of the file a load_image result came from, upright (its own size otherwise): larger
    than img.size when the photo was shrunk to the working side."""
    size = img.info.get("original_size") if isinstance(img.info, dict) else None
    return (int(size[0]), int(size[1])) if size else img.size


def _orientation(img: Image.Image) -> int:
    """EXIF orientation (1..8); 1 when absent or unreadable (a broken EXIF block is not a broken picture)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = img.getexif().get(_ORIENTATION, 1)
        return int(value) if isinstance(value, int) else 1
    except Exception:  # noqa: BLE001
        return 1


def _shrink(img: Image.Image, max_side: int) -> Image.Image:
    """Cheap early downscale of a big decoded image to between 1x and 2x max_side, before any
    mode conversion multiplies its memory. Box filter where Pillow supports it, nearest otherwise."""
    factor = max(img.size) // max_side
    if factor < 2:
        return img
    if img.mode in ("RGB", "RGBA", "L", "LA", "I", "F", "CMYK", "YCbCr", "RGBX", "La", "RGBa"):
        return img.reduce(factor)
    w, h = img.size
    f = max(factor // 2, 1)  # nearest (palette, 1-bit, 16-bit): stop at ~2x the target, finish with a real filter
    if f < 2:
        return img
    return img.resize((max(1, math.ceil(w / f)), max(1, math.ceil(h / f))), Image.Resampling.NEAREST)


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        # 16/32-bit or float grey: scale to 8 bit instead of clipping to white
        arr = np.asarray(img, dtype=np.float32)
        hi = float(arr.max()) if arr.size else 0.0
        if not math.isfinite(hi) or hi <= 0:
            hi = 1.0
        arr = np.nan_to_num(arr, nan=0.0, posinf=hi, neginf=0.0)
        img = Image.fromarray(np.clip(arr * (255.0 / hi), 0, 255).astype(np.uint8), mode="L")
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = img.convert("RGBA")
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")


def preprocess(img: Image.Image, image_size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """Whole image -> (3, S, S) normalised tensor. No crop: the attention grid covers the full picture
    (a non-square photo is resized anisotropically; overlays stretch the grid back onto it)."""
    import torch  # here, not at the top: a command checks its image files without waiting for torch to load

    img = img.resize((image_size, image_size), Image.BILINEAR, reducing_gap=None)
    x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float().div_(255.0)  # (3, S, S)
    return x.sub_(torch.tensor(mean).view(3, 1, 1)).div_(torch.tensor(std).view(3, 1, 1))  # in place, same numbers


def photo_notes(size: tuple[int, int] | None, input_side: int | None, file_size: tuple[int, int] | None = None,
                transparent: bool = False, flat: bool = False) -> list[str]:
    """Remarks on a photo for a person (a Photo's and each of its Captions' notes): a fully transparent file, one
    flat colour, a shorter side below SMALL_PHOTO x the model's input side (a file shrunk on reading is named by
    its own size, `file_size`)."""
    out = ["The image is fully transparent: it holds no picture, so the caption describes an empty white "
           "image."] if transparent else []
    if flat and not transparent:
        out.append("The photo is a single flat colour: there is nothing in it to caption, so the caption is the "
                   "model's guess at an empty picture, not a description.")
    if not size or not input_side or min(size) >= SMALL_PHOTO * input_side:
        return out
    (w, h), times = size, input_side / min(size)
    if file_size and tuple(file_size) != tuple(size):
        said = (f"The photo is {file_size[0]}x{file_size[1]} pixels, read at {w}x{h} (its longer side brought to "
                f"{max(size)}): its shorter side is far smaller than the model's {input_side}x{input_side} input, ")
    else:
        said = f"The photo is only {w}x{h} pixels, far smaller than the model's {input_side}x{input_side} input: it is "
    return out + [said + f"enlarged {times:.0f}x, so the caption rests on very little detail."]
