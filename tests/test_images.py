"""Robustness of image loading: every input gives an upright RGB image (and a caption) or an
ImageError with a clear message; never a crash, a hang or an unbounded allocation.

All inputs are generated here with PIL/numpy; nothing is downloaded or read from ../shared.
"""
from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import captioner
from captioner import images as images_mod
from captioner.images import ImageError, load_image

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- making broken and odd images

def enc(img: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def noise(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bomb(w: int, h: int, rows: int = 4) -> bytes:
    """A few hundred bytes of PNG whose header declares w x h RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (1 + 3 * min(w, 4096)) * rows)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def png_palette_zeros(w: int, h: int) -> bytes:
    """A valid palette PNG of w x h pixels (all index 0), compressed row by row (small memory)."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 3, 0, 0, 0)
    plte = bytes([200, 30, 30]) + bytes(765)
    z = zlib.compressobj(9)
    row = b"\x00" * (1 + w)
    idat = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"PLTE", plte)
            + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b""))


def patch_jpeg_size(data: bytes, w: int, h: int) -> bytes:
    """Rewrite the frame header (SOF0) of a baseline JPEG to declare w x h."""
    i = data.index(b"\xff\xc0")
    return data[:i + 5] + struct.pack(">HH", h, w) + data[i + 9:]


def assert_rgb(img: Image.Image, max_side: int = 1024) -> None:
    assert isinstance(img, Image.Image)
    assert img.mode == "RGB"
    assert 1 <= min(img.size) and max(img.size) <= max_side


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cap(tiny_model) -> captioner.Captioner:
    """The module's tiny random captioner (tests/conftest.py: no pretrained weights, no download), only asked
    for captions."""
    return tiny_model


def assert_caption(c) -> None:
    assert isinstance(c, captioner.Caption)
    assert isinstance(c.text, str) and c.text == " ".join(c.words)
    assert np.isfinite(c.log_prob)
    assert c.alphas.shape[0] == len(c.words)


# ----------------------------------------------------------------------------- inputs that must fail

BAD_INPUTS = {
    "empty bytes": (b"", "empty"),
    "random bytes": (np.random.RandomState(1).bytes(3000), "not an image"),
    "text": (b"hello, this is a caption and not a photo\n" * 20, "not an image"),
    "truncated jpeg": (enc(noise(160, 120), "JPEG")[:1500], "truncated"),
    "truncated png": (enc(noise(160, 120), "PNG")[:4000], "truncated"),
    "jpeg header only": (enc(noise(160, 120), "JPEG")[:12], "image"),
    "png signature only": (b"\x89PNG\r\n\x1a\n", "not an image"),
    "eps (would run ghostscript)": (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n%%EndComments\n",
                                    "not an image"),
}


@pytest.mark.parametrize("key", list(BAD_INPUTS))
def test_bad_bytes_give_image_error(key, cap):
    data, words = BAD_INPUTS[key]
    t0 = time.perf_counter()
    with pytest.raises(ImageError, match=words):
        load_image(data)
    with pytest.raises(ImageError, match=words):
        cap.caption(data, beam_size=2, max_len=5)
    assert time.perf_counter() - t0 < 5


def test_image_error_is_a_value_error():
    assert issubclass(ImageError, ValueError)
    assert captioner.ImageError is ImageError


def test_text_file_named_jpg(tmp_path, cap):
    p = tmp_path / "photo.jpg"
    p.write_text("this is not a JPEG\n")
    with pytest.raises(ImageError, match=r"photo\.jpg: not an image"):
        load_image(p)
    with pytest.raises(ImageError, match=r"photo\.jpg"):
        cap.caption(str(p), beam_size=2, max_len=5)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.png"
    p.write_bytes(b"")
    with pytest.raises(ImageError, match="empty"):
        load_image(p)


def test_truncated_files_on_disk(tmp_path):
    for fmt, ext in (("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp"), ("GIF", "gif")):
        data = enc(noise(120, 90), fmt)
        p = tmp_path / f"cut.{ext}"
        p.write_bytes(data[: len(data) * 2 // 3])
        with pytest.raises(ImageError, match=rf"cut\.{ext}"):
            load_image(p)


def test_missing_path(tmp_path, cap):
    p = tmp_path / "nope.jpg"
    with pytest.raises(ImageError, match="no such file"):
        load_image(p)
    with pytest.raises(ImageError, match="no such file"):
        load_image(str(p))
    with pytest.raises(ImageError, match="no such file"):
        cap.caption(str(p), beam_size=2, max_len=5)


def test_directory(tmp_path):
    with pytest.raises(ImageError, match="directory"):
        load_image(tmp_path)
    with pytest.raises(ImageError, match="directory"):
        load_image("")  # "" is the current directory, not an image


def test_unreadable_path_names():
    with pytest.raises(ImageError):
        load_image("x" * 5000 + ".jpg")  # ENAMETOOLONG is an OSError, not "no such file"
    with pytest.raises(ImageError):
        load_image("bad\x00name.jpg")


@pytest.mark.parametrize("value", [5, 3.5, None, [1, 2], {"a": 1}, np.zeros((4, 4, 3), np.uint8), object()])
def test_non_image_types(value, cap):
    with pytest.raises(ImageError, match="expected a PIL image, a path or bytes"):
        load_image(value)
    with pytest.raises(ImageError):
        cap.caption(value, beam_size=2, max_len=5)


def test_text_mode_file_object(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("hello")
    with open(p) as f, pytest.raises(ImageError, match="binary"):
        load_image(f)


def test_decompression_bomb_png_is_refused_quickly():
    data = png_bomb(30000, 30000)
    assert len(data) < 2000
    t0 = time.perf_counter()
    with pytest.raises(ImageError, match="too large"):
        load_image(data)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("size", [(12000, 9000), (40000, 40000), (30000, 30000)])
def test_too_many_pixels_is_one_message_whoever_noticed(size):
    """12000x9000 (108 Mpx) met our limit and got the project's message; 40000x40000 met Pillow's bomb check
    first (from 2 x 89 Mpx) and got "could be decompression bomb DOS attack". Both now read the same way."""
    w, h = size
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning (or any other) escapes either
        with pytest.raises(ImageError) as e:
            load_image(png_bomb(w, h))
    assert str(e.value) == f"image: {w}x{h} pixels is too large to decode safely (limit 100,000,000 pixels)"
    assert "bomb" not in str(e.value) and "DOS" not in str(e.value)


def test_the_formats_named_are_the_formats_read():
    """The error listed TIFF and PPM, which the app's uploader refused (and left out AVIF, which it reads):
    the message, the extensions an uploader accepts and the parser are one list (images.FORMATS)."""
    read = images_mod._formats()
    with pytest.raises(ImageError) as e:
        load_image(b"not a picture at all" * 10)
    assert str(e.value).endswith(f"({images_mod.format_names()})")
    assert images_mod.format_names().split(", ") == [images_mod.FORMATS[f][0] for f in read]
    Image.init()
    assert {Image.EXTENSION["." + ext] for ext in images_mod.file_extensions()} == set(read)
    for fmt in read:  # every format named is read
        kw = {"quality": 80} if fmt in ("AVIF", "WEBP", "JPEG") else {}
        assert load_image(enc(noise(32, 24), fmt, **kw)).size == (32, 24), fmt
    assert images_mod.format_names(" or ").endswith(" or " + images_mod.FORMATS[read[-1]][0])


@pytest.mark.parametrize("fmt", ["JPEG", "BMP", "GIF"])
def test_header_bombs_of_other_formats(fmt):
    small = noise(16, 16)
    if fmt == "JPEG":
        data = patch_jpeg_size(enc(small, "JPEG"), 30000, 30000)
    elif fmt == "BMP":
        data = bytearray(enc(small, "BMP"))
        data[18:26] = struct.pack("<ii", 30000, 30000)
        data = bytes(data)
    else:
        data = bytearray(enc(small.convert("P"), "GIF"))
        data[6:10] = struct.pack("<HH", 30000, 30000)
        data = bytes(data)
    t0 = time.perf_counter()
    with pytest.raises(ImageError):
        load_image(data)
    assert time.perf_counter() - t0 < 2.0


def test_pixel_limit_is_on_decoded_size(monkeypatch):
    """JPEGs are decoded at reduced scale, so their limit applies after draft; other formats are
    refused from the header."""
    monkeypatch.setattr(images_mod, "MAX_PIXELS", 4_000_000)  # JPEG 4000x3000 drafts to 2000x1500
    jpeg = enc(noise(40, 30).resize((4000, 3000)), "JPEG", quality=70)  # 12 Mpx declared
    img = load_image(jpeg)
    assert_rgb(img)
    assert img.size == (1024, 768)
    with pytest.raises(ImageError, match=r"4000x3000 pixels is too large"):
        load_image(png_palette_zeros(4000, 3000))


BOMB_SCRIPT = r"""
import io, json, resource, struct, sys, time, zlib
sys.path.insert(0, sys.argv[1])
from test_images import png_bomb, png_palette_zeros, patch_jpeg_size, enc, noise
from captioner.images import load_image, ImageError

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20

cases = {
    "png 30000x30000": png_bomb(30000, 30000),
    "jpeg 30000x30000": patch_jpeg_size(enc(noise(16, 16), "JPEG"), 30000, 30000),
    "png 40000x1": png_bomb(40000, 1),
    "valid palette png 9000x9000": png_palette_zeros(9000, 9000),
}
# measure in a forked child: its peak RSS starts at its current RSS, so a one-off peak of the
# imports above (e.g. compiling .pyc files in a fresh environment) does not count
import os
pid = os.fork()
if pid:
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
out = {}
before = rss_mb()
for name, data in cases.items():
    t0 = time.perf_counter()
    try:
        img = load_image(data)
        res = "ok %dx%d %s" % (img.size[0], img.size[1], img.mode)
    except ImageError as e:
        res = "ImageError: %s" % e
    out[name] = [res, time.perf_counter() - t0]
out["peak_delta_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
print(json.dumps(out), flush=True)
os._exit(0)
"""


@pytest.mark.slow
def test_bombs_bounded_memory_and_time():
    """In a fresh process (peak RSS is per process): bombs are refused without allocating, and a
    valid but huge palette image (10 kB file, 81 Mpx) is shrunk before any RGB conversion."""
    r = subprocess.run([sys.executable, "-c", BOMB_SCRIPT, str(Path(__file__).parent)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["png 30000x30000"][0].startswith("ImageError") and "too large" in out["png 30000x30000"][0]
    assert out["jpeg 30000x30000"][0].startswith("ImageError")
    assert out["valid palette png 9000x9000"][0] == "ok 1024x1024 RGB", out
    for name, value in out.items():
        if name != "peak_delta_mb":
            assert value[1] < 5, (name, value)
    # the 9000x9000 palette image needs 81 MB decoded; converting it to RGB first would take 1.3 GB
    assert out["peak_delta_mb"] < 300, out


# ----------------------------------------------------------------------------- inputs that must work

@pytest.fixture(scope="module")
def big_jpeg() -> bytes:
    img = noise(80, 60, seed=3).resize((8000, 6000), Image.BILINEAR)
    return enc(img, "JPEG", quality=80)


def test_very_large_jpeg_is_downscaled_fast(big_jpeg, cap):
    t0 = time.perf_counter()
    img = load_image(big_jpeg)
    assert time.perf_counter() - t0 < 3.0
    assert_rgb(img)
    assert img.size == (1024, 768)
    t0 = time.perf_counter()
    assert_caption(cap.caption(big_jpeg, beam_size=2, max_len=5))
    assert time.perf_counter() - t0 < 5.0


def test_very_large_mpo_is_decoded_at_reduced_scale(monkeypatch):
    """Many phones write multi-picture JPEGs (Pillow: format MPO); they must be drafted like JPEGs."""
    from PIL import JpegImagePlugin

    big = noise(80, 60, seed=4).resize((8000, 6000), Image.BILINEAR)
    data = enc(big, "MPO", save_all=True, append_images=[noise(80, 60)])
    del big
    assert Image.open(io.BytesIO(data)).format == "MPO"
    drafted = []
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        result = original(self, mode, size)
        drafted.append(self.size)
        return result

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    t0 = time.perf_counter()
    img = load_image(data)
    assert time.perf_counter() - t0 < 3.0
    assert drafted == [(2000, 1500)]  # decoded at 1/4 scale (smallest >= 1024 px), not 48 Mpx
    assert_rgb(img)
    assert img.size == (1024, 768)


def test_large_png_is_downscaled():
    data = png_palette_zeros(5000, 2500)
    img = load_image(data)
    assert_rgb(img)
    assert img.size == (1024, 512)
    assert img.getpixel((10, 10)) == (200, 30, 30)


def test_max_side_argument():
    img = load_image(enc(noise(300, 200), "PNG"), max_side=100)
    assert img.size == (100, 67)


@pytest.mark.parametrize("size", [(4000, 10), (10, 4000), (100000, 1), (1, 1), (2, 1)])
def test_extreme_shapes(size, cap):
    data = enc(Image.new("RGB", size, (10, 200, 30)), "PNG")
    img = load_image(data)
    assert_rgb(img)
    w, h = size
    if max(size) > 1024:
        assert max(img.size) == 1024
        assert (img.size[0] > img.size[1]) == (w > h)
    else:
        assert img.size == size
    assert img.getpixel((0, 0)) == (10, 200, 30)
    assert_caption(cap.caption(data, beam_size=2, max_len=5))


def _mode_image(mode: str) -> Image.Image:
    base = noise(48, 32, seed=5)
    if mode == "I;16":
        ramp = (np.arange(48 * 32, dtype=np.uint16).reshape(32, 48) * 2).astype(np.uint16)  # 0 .. 3070 of 65535
        return Image.fromarray(ramp)
    return base.convert(mode)


@pytest.mark.parametrize("mode,fmt", [
    ("L", "PNG"), ("P", "PNG"), ("RGBA", "PNG"), ("LA", "PNG"), ("1", "PNG"), ("I;16", "PNG"),
    ("CMYK", "JPEG"), ("L", "JPEG"), ("RGB", "WEBP"), ("RGBA", "WEBP"), ("RGB", "BMP"), ("P", "BMP"),
    ("RGB", "TIFF"), ("CMYK", "TIFF"), ("I;16", "TIFF"), ("RGB", "PPM"), ("P", "GIF"),
])
def test_modes_and_formats(mode, fmt, cap):
    data = enc(_mode_image(mode), fmt)
    img = load_image(data)
    assert_rgb(img)
    assert img.size == (48, 32)
    assert_caption(cap.caption(data, beam_size=2, max_len=5))


def test_pil_image_inputs_of_every_mode():
    for mode in ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "YCbCr", "LAB", "HSV", "I", "I;16", "F"):
        img = load_image(Image.new(mode, (20, 10)))
        assert_rgb(img)
        assert img.size == (20, 10)


def test_16bit_png_is_not_white():
    img = load_image(enc(_mode_image("I;16"), "PNG"))
    a = np.asarray(img).astype(int)
    assert a.min() < 10 and a.max() > 240  # scaled to the full 8-bit range, not clipped to 255
    assert a[0, 0].tolist() == [0, 0, 0]
    assert (np.diff(a[:, :, 0].ravel()) >= 0).all()  # the ramp stays a ramp


def test_float_image_in_0_1_is_not_black():
    f = Image.fromarray(np.linspace(0, 1, 200, dtype=np.float32).reshape(10, 20))
    a = np.asarray(load_image(f))
    assert a.max() == 255 and a.min() == 0


def test_cmyk_colours():
    img = load_image(enc(Image.new("CMYK", (32, 32), (255, 0, 0, 0)), "JPEG", quality=95))
    r, g, b = img.getpixel((16, 16))
    assert r < 30 and g > 225 and b > 225  # cyan, not inverted


def test_transparency_goes_on_white():
    assert load_image(enc(Image.new("RGBA", (8, 8), (255, 0, 0, 0)), "PNG")).getpixel((4, 4)) == (255, 255, 255)
    assert load_image(enc(Image.new("RGBA", (8, 8), (255, 0, 0, 255)), "PNG")).getpixel((4, 4)) == (255, 0, 0)
    p = Image.new("P", (8, 8), 0)
    p.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    assert load_image(enc(p, "GIF", transparency=0)).getpixel((4, 4)) == (255, 255, 255)


def test_animated_gif_first_frame(cap):
    frames = [Image.new("RGB", (30, 20), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    data = enc(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 3
    img = load_image(data)
    assert_rgb(img)
    assert img.getpixel((5, 5)) == (255, 0, 0)
    assert_caption(cap.caption(data, beam_size=2, max_len=5))


def test_animated_webp_first_frame():
    frames = [Image.new("RGB", (30, 20), c) for c in [(0, 0, 255), (0, 255, 0)]]
    data = enc(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    assert load_image(data).getpixel((5, 5)) == (0, 0, 255)


def test_webp_and_bmp_content():
    src = noise(40, 30, seed=9)
    for fmt, kw in (("WEBP", {"lossless": True}), ("BMP", {}), ("PNG", {}), ("TIFF", {}), ("PPM", {})):
        img = load_image(enc(src, fmt, **kw))
        assert np.array_equal(np.asarray(img), np.asarray(src)), fmt


def _marker(w: int, h: int) -> Image.Image:
    """Black image; red block at the stored top-left, blue block at the stored top-right."""
    a = np.zeros((h, w, 3), np.uint8)
    s = max(min(w, h) // 4, 16)
    a[:s, :s] = (255, 0, 0)
    a[:s, -s:] = (0, 0, 255)
    return Image.fromarray(a)


def _colour(img: Image.Image, fx: float, fy: float) -> str:
    r, g, b = img.getpixel((int(fx * (img.width - 1)), int(fy * (img.height - 1))))
    if r > 180 and g < 80 and b < 80:
        return "red"
    if b > 180 and r < 80 and g < 80:
        return "blue"
    if max(r, g, b) < 60:
        return "black"
    return f"{r},{g},{b}"


@pytest.mark.parametrize("size", [(64, 48), (8000, 6000)])
def test_exif_rotated_jpeg_comes_out_upright(size, cap):
    """Orientation 6 = the camera was turned 90 degrees clockwise: the stored top edge is the
    displayed right edge. So stored top-left (red) -> displayed top-right, stored top-right
    (blue) -> displayed bottom-right."""
    src = _marker(*size)
    exif = src.getexif()
    exif[0x0112] = 6
    data = enc(src, "JPEG", exif=exif.tobytes(), quality=92)
    t0 = time.perf_counter()
    img = load_image(data)
    assert time.perf_counter() - t0 < 3.0
    assert_rgb(img)
    w, h = size
    if max(size) <= 1024:
        assert img.size == (h, w)
    else:
        assert img.size == (768, 1024)  # portrait now
    assert _colour(img, 0.97, 0.02) == "red"
    assert _colour(img, 0.97, 0.98) == "blue"
    assert _colour(img, 0.03, 0.02) == "black"
    assert _colour(img, 0.03, 0.98) == "black"
    assert_caption(cap.caption(data, beam_size=2, max_len=5))


def test_loading_twice_does_not_rotate_twice(cap):
    """The CLI decodes a file with load_image, then Captioner.caption calls load_image on the
    result again: the EXIF orientation must be applied exactly once."""
    src = _marker(64, 48)
    exif = src.getexif()
    exif[0x0112] = 6
    data = enc(src, "JPEG", exif=exif.tobytes(), quality=92)
    once = load_image(data)
    twice = load_image(once)
    assert twice.size == once.size == (48, 64)
    assert np.array_equal(np.asarray(twice), np.asarray(once))
    a, b = cap.caption(data, beam_size=2, max_len=5), cap.caption(once, beam_size=2, max_len=5)
    assert a.words == b.words and a.log_prob == pytest.approx(b.log_prob, abs=1e-5)


@pytest.mark.parametrize("orientation,expect", [
    (1, {"tl": "red", "tr": "blue"}), (2, {"tr": "red", "tl": "blue"}), (3, {"br": "red", "bl": "blue"}),
    (8, {"bl": "red", "tl": "blue"}),
])
def test_exif_orientations(orientation, expect):
    src = _marker(64, 48)
    exif = src.getexif()
    exif[0x0112] = orientation
    img = load_image(enc(src, "JPEG", exif=exif.tobytes(), quality=92))
    where = {"tl": (0.02, 0.02), "tr": (0.98, 0.02), "bl": (0.02, 0.98), "br": (0.98, 0.98)}
    for corner, colour in expect.items():
        assert _colour(img, *where[corner]) == colour, (orientation, corner)


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns about the broken EXIF block
def test_corrupt_exif_does_not_reject_good_pixels():
    data = enc(noise(60, 40), "JPEG", exif=b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\x00\x05\x01\x12\x00\x03\xff\xff")
    img = load_image(data)
    assert img.size == (60, 40)


def test_path_bytes_fileobj_and_pil_inputs_agree(tmp_path):
    src = noise(50, 40, seed=11)
    data = enc(src, "PNG")
    p = tmp_path / "a.png"
    p.write_bytes(data)
    ref = np.asarray(src)
    for x in (p, str(p), data, bytearray(data), memoryview(data), io.BytesIO(data), Image.open(io.BytesIO(data)), src):
        assert np.array_equal(np.asarray(load_image(x)), ref), type(x)
    with open(p, "rb") as f:
        assert np.array_equal(np.asarray(load_image(f)), ref)


def test_pil_input_is_not_modified():
    src = Image.new("RGBA", (20, 10), (1, 2, 3, 4))
    load_image(src)
    assert src.mode == "RGBA" and src.size == (20, 10)


def test_file_size_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(images_mod, "MAX_FILE_BYTES", 1000)
    data = enc(noise(64, 64), "PNG")
    assert len(data) > 1000
    p = tmp_path / "big.png"
    p.write_bytes(data)
    for x in (data, p, io.BytesIO(data)):
        with pytest.raises(ImageError, match="larger than"):
            load_image(x)


def test_caption_batch_names_the_bad_image(cap, tmp_path):
    good = enc(noise(40, 30), "PNG")
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 nope")
    with pytest.raises(ImageError, match="broken.jpg"):
        cap.caption_batch([good, bad], beam_size=2, max_len=5)
    caps = cap.caption_batch([good, enc(noise(10, 300), "JPEG")], beam_size=2, max_len=5)
    assert len(caps) == 2
    for c in caps:
        assert_caption(c)


# ----------------------------------------------------------------------------- property-based fuzzing

MODES = ["RGB", "RGBA", "L", "LA", "P", "1", "I;16", "CMYK"]
FORMATS = {"PNG": ["RGB", "RGBA", "L", "LA", "P", "1", "I;16"], "JPEG": ["RGB", "L", "CMYK"],
           "GIF": ["P", "L"], "WEBP": ["RGB", "RGBA"], "BMP": ["RGB", "L", "P", "1"],
           "TIFF": ["RGB", "L", "CMYK", "I;16", "P"]}


@st.composite
def image_bytes(draw):
    kind = draw(st.sampled_from(["random", "valid", "truncated", "flipped", "truncated+flipped"]))
    if kind == "random":
        return draw(st.binary(min_size=0, max_size=4096))
    fmt = draw(st.sampled_from(sorted(FORMATS)))
    mode = draw(st.sampled_from(FORMATS[fmt]))
    w, h = draw(st.integers(1, 64)), draw(st.integers(1, 64))
    seed = draw(st.integers(0, 2**16))
    arr = np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)
    img = Image.fromarray(arr)
    img = Image.fromarray(arr[:, :, 0].astype(np.uint16) * 257) if mode == "I;16" else img.convert(mode)
    data = bytearray(enc(img, fmt))
    if "truncated" in kind:
        data = data[: draw(st.integers(0, len(data)))]
    if "flipped" in kind and data:
        for pos, bit in draw(st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 7)),
                                      min_size=1, max_size=8)):
            data[pos] ^= 1 << bit
    return bytes(data)


@settings(max_examples=40, deadline=5000, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=image_bytes())
def test_fuzz_load_image(data):
    t0 = time.perf_counter()
    try:
        img = load_image(data)
    except ImageError as e:
        assert str(e)
    else:
        assert_rgb(img)
    assert time.perf_counter() - t0 < 5


@settings(max_examples=40, deadline=5000, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=image_bytes())
def test_fuzz_caption(data, cap):
    t0 = time.perf_counter()
    try:
        c = cap.caption(data, beam_size=2, max_len=5)
    except ImageError as e:
        assert str(e)
    else:
        assert_caption(c)
    assert time.perf_counter() - t0 < 5
