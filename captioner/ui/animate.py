"""The caption as it is written: an animation with one frame per word, the attention moving over the photo.

Each frame is the photo with that word's attention drawn over it by `visualize.overlay` (the overlay the
figures and the app use), and below it the sentence so far with the current word marked. The last frame
holds a little longer. `caption_animation` returns the file's bytes (animated GIF or WebP), what the app
offers for download and `captioner-caption --animate DIR` writes per photo.
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING

from PIL import Image, ImageDraw, ImageFont

from .visualize import overlay, word_beta

if TYPE_CHECKING:
    from ..decoding.captions import Caption

SIDE = 480  # the longer side of the photo in a frame: sized for a page
FRAME_MS = 700  # how long each word stays
LAST_MS = 2000  # the finished caption stays longer
FORMATS = {"gif": "GIF", "webp": "WEBP"}


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1: a scalable default font
    except TypeError:
        return ImageFont.load_default()


def _text_lines(draw: ImageDraw.ImageDraw, words: list[str], font, width: int) -> list[list[int]]:
    """Word indices wrapped into lines no wider than `width` pixels."""
    lines: list[list[int]] = [[]]
    for i, w in enumerate(words):
        trial = " ".join(words[j] for j in lines[-1] + [i])
        if lines[-1] and draw.textlength(trial, font=font) > width:
            lines.append([])
        lines[-1].append(i)
    return lines


def frame(image: Image.Image, caption: "Caption", k: int, opacity: float = 1.0, side: int = SIDE) -> Image.Image:
    """The frame of word k: the photo (longer side `side`) with word k's attention over it, and below it the
    words 1..k of the caption, word k in bold colour, the rest of the sentence not yet written."""
    photo = image.convert("RGB")
    photo.thumbnail((side, side), Image.Resampling.BICUBIC)
    if max(photo.size) < side // 4:  # a tiny photo: enlarged so the frame is readable
        scale = side / max(photo.size)
        photo = photo.resize((max(1, round(photo.width * scale)), max(1, round(photo.height * scale))),
                             Image.Resampling.NEAREST)
    shown = overlay(photo, caption.alphas[k], opacity, beta=word_beta(caption, k))  # as the figures draw it
    font = _font(max(14, photo.width // 26))
    width = max(photo.width, 240)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    lines = _text_lines(probe, caption.words, font, width - 16)
    line_h = font.size + 6 if hasattr(font, "size") else 18
    out = Image.new("RGB", (width, photo.height + 12 + line_h * len(lines)), (255, 255, 255))
    out.paste(shown, ((width - photo.width) // 2, 0))
    draw = ImageDraw.Draw(out)
    y = photo.height + 6
    for line in lines:
        x = 8
        for i in line:
            if i <= k:  # said so far; the current word marked
                draw.text((x, y), caption.words[i], font=font, fill=(200, 30, 30) if i == k else (20, 20, 20))
            x += draw.textlength(caption.words[i] + " ", font=font)
        y += line_h
    return out


def caption_animation(image: Image.Image, caption: "Caption", fmt: str = "gif", opacity: float = 1.0,
                      side: int = SIDE, frame_ms: int = FRAME_MS) -> bytes:
    """The animation's bytes: one frame per caption word (an empty caption: one frame of the photo)."""
    if fmt not in FORMATS:
        raise ValueError(f"animation format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not caption.words:
        frames = [image.convert("RGB")]
        frames[0].thumbnail((side, side))
    else:
        frames = [frame(image, caption, k, opacity, side) for k in range(len(caption.words))]
    size = (max(f.width for f in frames), max(f.height for f in frames))
    frames = [_padded(f, size) for f in frames]
    durations = [frame_ms] * (len(frames) - 1) + [LAST_MS]
    if fmt == "gif":  # each frame its own 256 colours, undithered: Pillow's fixed web palette banded the photo
        frames = [f.quantize(256, Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE) for f in frames]
    buf = io.BytesIO()
    frames[0].save(buf, FORMATS[fmt], save_all=True, append_images=frames[1:], duration=durations, loop=0)
    return buf.getvalue()


def _padded(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    if img.size == size:
        return img
    out = Image.new("RGB", size, (255, 255, 255))
    out.paste(img, (0, 0))
    return out
